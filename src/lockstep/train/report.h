// `lockstep report RUN [RUN ...]`: one self-contained HTML page of runs' metrics.jsonl (inline SVG and
// CSS; no script, no network): loss and eval loss, grad norm, learning rate, tokens/s and MFU over the
// steps, one curve per run; the expert load of each MoE run (max / mean tokens per expert of each MoE
// layer) as a heatmap over the steps; and for two runs the first step whose fingerprints differ
// (diff_runs, train/run_diff.h), marked on every curve. docs/observability.md shows one.
#pragma once

#include <string>
#include <vector>

namespace lockstep {

// UserError naming the path when a run directory or its metrics.jsonl is missing, or a line of it is
// not a metrics line (a torn last line, from a run killed mid-write, is left out).
std::string report_html(const std::vector<std::string>& runs);

}  // namespace lockstep
