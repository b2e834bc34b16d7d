// Pipeline schedules: the order in which a pipeline rank runs the forward and backward of each
// micro-batch on each of its model chunks.
//
//   all_forward_all_backward  every forward, then every backward (GPipe): the reference;
//                             m micro-batches in flight on every stage.
//   1f1b                      stage s runs p - s - 1 warm-up forwards, then alternates one forward
//                             and one backward, then drains the backwards (PipeDream-Flush /
//                             Megatron's default): at most p - s micro-batches in flight.
//   interleaved 1f1b          v model chunks per rank (virtual stages; chunk c of rank r is model
//                             chunk c x p + r). Forwards go through the chunks in groups of p
//                             micro-batches, backwards through the chunks in reverse; warm-up
//                             (p - s - 1) x 2 + (v - 1) x p forwards (all of them when m = p).
//                             Needs m divisible by p (Megatron's rule).
//
// Every stage runs the micro-batches of a chunk in increasing order, forwards and backwards alike,
// so a micro-batch's numbers do not depend on the schedule: the schedules differ only in when
// things run and in how much activation memory they hold, never in the bits.
//
// Bubble (idle fraction of a stage, uniform forward and backward times over the stages): with p
// stages and m micro-batches, (p - 1) / (m + p - 1); interleaved with v chunks, (p - 1) / (v m + p - 1)
// (Narayanan et al. 2021: bubble / ideal time = (p - 1) / m, divided by v when interleaved).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {

struct PipelineAction {
  bool forward;   // else backward
  int chunk;      // this rank's model chunk, 0 .. v - 1
  int64_t micro;  // micro-batch, 0 .. m - 1
  // Interleaved steady state: this forward and the backward after it exchange their messages in one
  // batch (Megatron's send_forward_backward_recv_forward_backward); with one batch per action the
  // interleaved schedule's ranks would wait on each other in a cycle.
  bool with_next = false;
};

// The actions of pipeline rank `stage` of p, with v chunks per rank and m micro-batches.
// kind: "1f1b" (interleaved when v > 1) or "all_forward_all_backward" (v = 1). UserError naming
// parallel.virtual_pipeline and train.global_batch when m does not fit the interleaved schedule.
std::vector<PipelineAction> pipeline_schedule(const std::string& kind, int p, int v, int64_t m, int stage);

// The largest number of micro-batches a rank holds activations for at once (from its first forward
// of a micro-batch to its last backward of it), under `actions`.
int64_t max_in_flight(const std::vector<PipelineAction>& actions);

// The analytic bubble fraction (p - 1) / (v m + p - 1).
double analytic_bubble(int p, int v, int64_t m);

// Runs the schedules of all p ranks against each other with forward time tf and backward time tb
// per chunk (a chunk's forward on rank r needs the previous model chunk's forward, its backward
// the next one's backward); returns the idle fraction of the busiest-to-finish rank:
// 1 - (busy time) / (time until the last rank finishes).
double simulated_bubble(const std::string& kind, int p, int v, int64_t m, double tf, double tb);

}  // namespace lockstep
