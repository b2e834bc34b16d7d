#include "lockstep/train/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "lockstep/core/error.h"
#include "lockstep/train/run_diff.h"

namespace lockstep {

namespace {

namespace fs = std::filesystem;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A run's metrics.jsonl: every number by key and step (null, a non-finite value, as NaN; a step
// written twice counts with its last line).
struct RunMetrics {
  std::string dir;
  std::map<std::string, std::map<int64_t, double>> series;
  std::set<int64_t> steps;
  std::vector<int64_t> moe_layers;  // the layers with moe.<layer>.imbalance, in order

  const std::map<int64_t, double>* find(const std::string& key) const {
    const auto it = series.find(key);
    return it == series.end() ? nullptr : &it->second;
  }
  // The value at the run's last step where it is finite; NaN when there is none.
  double last(const std::string& key) const {
    if (const auto* s = find(key))
      for (auto it = s->rbegin(); it != s->rend(); ++it)
        if (std::isfinite(it->second)) return it->second;
    return kNaN;
  }
  // The median of the finite values after the first step (the first includes start-up).
  double median(const std::string& key) const {
    std::vector<double> v;
    if (const auto* s = find(key))
      for (const auto& [step, x] : *s)
        if (step != *steps.begin() && std::isfinite(x)) v.push_back(x);
    if (v.empty()) return last(key);
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }
};

RunMetrics read_run_metrics(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    user_error(
        "'", dir, "': ",
        fs::exists(dir, ec) ? "not a directory (lockstep report takes run directories)" : "no such run directory");
  const std::string path = dir + "/metrics.jsonl";
  std::ifstream in(path);
  if (!in) user_error("'", path, "': no such file (not a lockstep run directory?)");
  RunMetrics run;
  run.dir = dir;
  std::string text;
  int64_t number = 0;
  while (std::getline(in, text)) {
    ++number;
    const bool torn = in.eof();  // the last line has no newline: the run was killed mid-write
    const nlohmann::ordered_json line = nlohmann::ordered_json::parse(text, nullptr, false);
    if (!line.is_object() || !line.contains("step") || !line["step"].is_number_integer()) {
      if (torn) break;
      user_error("'", path, "' line ", number, ": not a metrics line (a JSON object with an integer \"step\")");
    }
    const int64_t step = line["step"].get<int64_t>();
    run.steps.insert(step);
    for (const auto& [key, value] : line.items()) {
      if (key == "step" || !(value.is_number() || value.is_null())) continue;
      run.series[key][step] = value.is_null() ? kNaN : value.get<double>();
    }
  }
  if (run.steps.empty()) user_error("'", path, "' has no steps");
  for (const auto& [key, values] : run.series) {
    int64_t layer = -1;
    char rest[32] = {};
    if (std::sscanf(key.c_str(), "moe.%ld.%31s", &layer, rest) == 2 && std::string(rest) == "imbalance")
      run.moe_layers.push_back(layer);
  }
  std::sort(run.moe_layers.begin(), run.moe_layers.end());
  return run;
}

std::string escaped(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string number(double v, const char* format = "%.6g") {
  if (!std::isfinite(v)) return "-";
  char buf[48];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Colours of the runs, in order (then again).
const char* const kRunColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
const char* colour_of(size_t run) { return kRunColours[run % std::size(kRunColours)]; }

// Ticks at 1, 2 or 5 x 10^k over [lo, hi], about `count` of them.
std::vector<double> nice_ticks(double lo, double hi, int count) {
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / count;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / p < 1.5 ? p : raw / p < 3.5 ? 2 * p : raw / p < 7.5 ? 5 * p : 10 * p;
  std::vector<double> ticks;
  for (double k = std::ceil(lo / step); k * step <= hi + step * 1e-9; ++k) ticks.push_back(k * step);
  return ticks;
}

// A plot's area inside its SVG and the map from (step, value) to it.
struct Frame {
  static constexpr double kWidth = 960, kLeft = 76, kRight = 16, kTop = 44, kBottom = 34;
  double height = 280;
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;  // the steps and values at the area's edges

  double left() const { return kLeft; }
  double right() const { return kWidth - kRight; }
  double top() const { return kTop; }
  double bottom() const { return height - kBottom; }
  double x(double step) const { return left() + (step - x0) / (x1 - x0) * (right() - left()); }
  double y(double v) const { return bottom() - (v - y0) / (y1 - y0) * (bottom() - top()); }
};

std::string svg_open(const char* cls, const std::string& title, double height) {
  return str("<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"", cls, "\" width=\"", Frame::kWidth, "\" height=\"",
             height, "\" viewBox=\"0 0 ", Frame::kWidth, " ", height, "\" role=\"img\" aria-label=\"", escaped(title),
             "\">\n<text class=\"title\" x=\"", Frame::kLeft, "\" y=\"18\">", escaped(title), "</text>\n");
}

// The step axis under the frame: ticks, labels and grid lines.
std::string step_axis(const Frame& f) {
  std::string s;
  for (double t : nice_ticks(f.x0, f.x1, 8)) {
    if (t != std::floor(t)) continue;  // steps are integers
    const double x = f.x(t);
    s += str("<line class=\"grid\" x1=\"", x, "\" y1=\"", f.top(), "\" x2=\"", x, "\" y2=\"", f.bottom(), "\"/>");
    s += str("<text class=\"tick\" x=\"", x, "\" y=\"", f.bottom() + 16, "\" text-anchor=\"middle\">", number(t),
             "</text>\n");
  }
  s += str("<text class=\"tick\" x=\"", f.right(), "\" y=\"", f.bottom() + 30, "\" text-anchor=\"end\">step</text>\n");
  return s;
}

// The legend in a row above the frame: (colour, dashed, text) entries.
struct LegendEntry {
  std::string colour;
  bool dashed = false;
  std::string text;
};
std::string legend(const std::vector<LegendEntry>& entries) {
  std::string s = "<g class=\"legend\">";
  double x = Frame::kLeft;
  for (const LegendEntry& e : entries) {
    s += str("<line class=\"series\" x1=\"", x, "\" y1=\"32\" x2=\"", x + 20, "\" y2=\"32\" stroke=\"", e.colour, "\"",
             e.dashed ? " stroke-dasharray=\"5 3\"" : "", "/><text x=\"", x + 25, "\" y=\"36\">", escaped(e.text),
             "</text>");
    x += 40 + 6.5 * static_cast<double>(e.text.size());
  }
  return s + "</g>\n";
}

struct Curve {
  std::string run, colour;
  bool dashed = false, markers = false;
  std::vector<std::pair<double, double>> points;  // (step, value) in step order; NaN values break the line
};

// At most about two points per pixel column: each column's lowest and highest value in step order, a
// NaN where the column has one (so that spikes and gaps survive).
std::vector<std::pair<double, double>> thinned(const std::vector<std::pair<double, double>>& points, const Frame& f) {
  const auto columns = static_cast<size_t>(f.right() - f.left());
  if (points.size() <= 2 * columns) return points;
  std::vector<std::pair<double, double>> out;
  size_t i = 0;
  while (i < points.size()) {
    const auto column = static_cast<int64_t>(f.x(points[i].first));
    std::optional<std::pair<double, double>> lo, hi, gap;
    for (; i < points.size() && static_cast<int64_t>(f.x(points[i].first)) == column; ++i) {
      const auto& p = points[i];
      if (!std::isfinite(p.second)) {
        if (!gap) gap = p;
        continue;
      }
      if (!lo || p.second < lo->second) lo = p;
      if (!hi || p.second > hi->second) hi = p;
    }
    std::vector<std::pair<double, double>> kept;
    if (lo) kept.push_back(*lo);
    if (hi && hi->first != lo->first) kept.push_back(*hi);
    if (gap) kept.push_back(*gap);
    std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    out.insert(out.end(), kept.begin(), kept.end());
  }
  return out;
}

// A line plot of curves over the steps, with the legend; the first divergent step as a vertical line.
std::string line_plot(const std::string& title, const std::vector<Curve>& curves,
                      const std::vector<LegendEntry>& legend_entries, std::optional<int64_t> divergence) {
  Frame f;
  double lo = INFINITY, hi = -INFINITY, first = INFINITY, last = -INFINITY;
  for (const Curve& c : curves)
    for (const auto& [step, v] : c.points) {
      first = std::min(first, step), last = std::max(last, step);
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
    }
  std::string s = svg_open("plot", title, f.height) + legend(legend_entries);
  if (!(lo <= hi)) return s + str("<text x=\"", Frame::kLeft, "\" y=\"80\">no values</text>\n</svg>\n");
  const double pad = hi > lo ? 0.04 * (hi - lo) : std::max(std::abs(hi) * 0.05, 1e-12);
  f.y0 = lo - pad, f.y1 = hi + pad;
  f.x0 = first, f.x1 = last > first ? last : first + 1;
  s += str("<rect class=\"frame\" x=\"", f.left(), "\" y=\"", f.top(), "\" width=\"", f.right() - f.left(),
           "\" height=\"", f.bottom() - f.top(), "\"/>\n");
  for (double t : nice_ticks(f.y0, f.y1, 5)) {
    const double y = f.y(t);
    s += str("<line class=\"grid\" x1=\"", f.left(), "\" y1=\"", y, "\" x2=\"", f.right(), "\" y2=\"", y,
             "\"/><text class=\"tick\" x=\"", f.left() - 6, "\" y=\"", y + 4, "\" text-anchor=\"end\">", number(t),
             "</text>\n");
  }
  s += step_axis(f);
  for (const Curve& c : curves) {
    std::string d, dots;
    bool pen_down = false;
    for (const auto& [step, v] : thinned(c.points, f)) {
      if (!std::isfinite(v)) {
        pen_down = false;
        continue;
      }
      const std::string xy = number(f.x(step), "%.1f") + "," + number(f.y(v), "%.1f");
      d += (pen_down ? "L" : "M") + xy;
      pen_down = true;
      if (c.markers || c.points.size() == 1)
        dots +=
            str("<circle cx=\"", number(f.x(step), "%.1f"), "\" cy=\"", number(f.y(v), "%.1f"), "\" r=\"3\" fill=\"",
                c.colour, "\"><title>", escaped(c.run), ", step ", step, ": ", number(v), "</title></circle>");
    }
    s += str("<path class=\"series\" d=\"", d, "\" stroke=\"", c.colour, "\"",
             c.dashed ? " stroke-dasharray=\"5 3\"" : "", "><title>", escaped(c.run), "</title></path>", dots, "\n");
  }
  if (divergence && *divergence >= f.x0 && *divergence <= f.x1) {
    const double x = f.x(static_cast<double>(*divergence));
    s += str("<line class=\"divergence\" x1=\"", x, "\" y1=\"", f.top(), "\" x2=\"", x, "\" y2=\"", f.bottom(),
             "\"><title>first divergent step: ", *divergence, "</title></line><text class=\"divergence-label\" x=\"",
             x + 4, "\" y=\"", f.top() + 12, "\">step ", *divergence, "</text>\n");
  }
  return s + "</svg>\n";
}

// Yellow (balanced) through orange to dark red (t = 1).
std::string heat_colour(double t) {
  static const double stops[3][3] = {{255, 255, 204}, {253, 141, 60}, {189, 0, 38}};
  t = std::clamp(t, 0.0, 1.0) * 2;
  const int i = std::min(static_cast<int>(t), 1);
  const double u = t - i;
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x",
                static_cast<int>(std::lround(stops[i][0] + u * (stops[i + 1][0] - stops[i][0]))),
                static_cast<int>(std::lround(stops[i][1] + u * (stops[i + 1][1] - stops[i][1]))),
                static_cast<int>(std::lround(stops[i][2] + u * (stops[i + 1][2] - stops[i][2]))));
  return buf;
}

// Heatmap columns: one per step up to this many, else each a range of steps.
constexpr size_t kMaxColumns = 600;

// An MoE run's load imbalance (max / mean tokens per expert): a row per MoE layer, a column per step
// (or range of steps: its largest value), coloured from 1 (balanced) to `top`.
std::string heatmap(const RunMetrics& run, size_t index, double top) {
  const std::vector<int64_t> steps(run.steps.begin(), run.steps.end());
  const size_t columns = std::min(steps.size(), kMaxColumns);
  const double row = std::clamp(240.0 / static_cast<double>(run.moe_layers.size()), 12.0, 28.0);
  Frame f;
  f.height = Frame::kTop + row * static_cast<double>(run.moe_layers.size()) + Frame::kBottom;
  f.x0 = 0, f.x1 = static_cast<double>(columns);  // columns, not steps, across
  const std::string title = "Expert load, " + run.dir + ": max / mean tokens per expert";
  std::string s = svg_open("heatmap", title, f.height);
  // The colour scale in the legend row.
  s += "<defs><linearGradient id=\"heat" + std::to_string(index) + "\">";
  for (int k = 0; k <= 4; ++k) s += str("<stop offset=\"", k * 25, "%\" stop-color=\"", heat_colour(k / 4.0), "\"/>");
  s += str("</linearGradient></defs><g class=\"legend\"><text x=\"", Frame::kLeft, "\" y=\"36\">1.0</text><rect x=\"",
           Frame::kLeft + 26, "\" y=\"27\" width=\"160\" height=\"10\" fill=\"url(#heat", index, ")\"/><text x=\"",
           Frame::kLeft + 192, "\" y=\"36\">", number(top, "%.3g"), "</text><text x=\"", Frame::kLeft + 240,
           "\" y=\"36\">(1 = balanced: every expert gets the mean; grey: no value)</text></g>\n");
  const double width = (f.right() - f.left()) / static_cast<double>(columns);
  for (size_t li = 0; li < run.moe_layers.size(); ++li) {
    const std::string key = "moe." + std::to_string(run.moe_layers[li]) + ".";
    const auto* imbalance = run.find(key + "imbalance");
    const auto *tmin = run.find(key + "tokens_min"), *tmax = run.find(key + "tokens_max");
    const double y = f.top() + row * static_cast<double>(li);
    s += str("<text class=\"tick\" x=\"", f.left() - 6, "\" y=\"", y + row / 2 + 4, "\" text-anchor=\"end\">layer ",
             run.moe_layers[li], "</text>\n");
    for (size_t c = 0; c < columns; ++c) {
      const size_t begin = c * steps.size() / columns, end = (c + 1) * steps.size() / columns;
      double worst = kNaN;
      for (size_t i = begin; i < end; ++i) {
        const auto it = imbalance->find(steps[i]);
        if (it != imbalance->end() && std::isfinite(it->second) && !(it->second <= worst)) worst = it->second;
      }
      std::string tip = str("layer ", run.moe_layers[li], ", step ", steps[begin]);
      if (end - begin > 1) tip = str("layer ", run.moe_layers[li], ", steps ", steps[begin], "..", steps[end - 1]);
      tip += ": max/mean " + number(worst, "%.4g");
      if (end - begin == 1 && tmin && tmax && tmin->count(steps[begin]) && tmax->count(steps[begin]))
        tip += str(", tokens per expert ", number(tmin->at(steps[begin])), "..", number(tmax->at(steps[begin])));
      const std::string fill = std::isfinite(worst) ? heat_colour((worst - 1) / (top - 1)) : "#dddddd";
      s += str("<rect class=\"cell\" x=\"", number(f.left() + width * static_cast<double>(c), "%.2f"), "\" y=\"", y,
               "\" width=\"", number(width, "%.2f"), "\" height=\"", row, "\" fill=\"", fill, "\"><title>", tip,
               "</title></rect>");
    }
    s += "\n";
  }
  // Step labels at the columns of the axis' ticks.
  for (double t : nice_ticks(static_cast<double>(steps.front()), static_cast<double>(steps.back()), 8)) {
    const auto at = std::lower_bound(steps.begin(), steps.end(), static_cast<int64_t>(t));
    if (at == steps.end() || t != std::floor(t)) continue;
    const double column =
        static_cast<double>(at - steps.begin()) * static_cast<double>(columns) / static_cast<double>(steps.size());
    s += str("<text class=\"tick\" x=\"", number(f.x(column) + width / 2, "%.1f"), "\" y=\"", f.bottom() + 16,
             "\" text-anchor=\"middle\">", *at, "</text>");
  }
  s +=
      str("\n<text class=\"tick\" x=\"", f.right(), "\" y=\"", f.bottom() + 30, "\" text-anchor=\"end\">step</text>\n");
  return s + "</svg>\n";
}

std::vector<std::pair<double, double>> points_of(const RunMetrics& run, const std::string& key) {
  std::vector<std::pair<double, double>> p;
  if (const auto* s = run.find(key))
    for (const auto& [step, v] : *s) p.emplace_back(static_cast<double>(step), v);
  return p;
}

std::string summary_table(const std::vector<RunMetrics>& runs) {
  std::string s =
      "<table>\n<tr><th>run</th><th>steps</th><th>last loss</th><th>last eval loss</th><th>median tokens/s</th>"
      "<th>median MFU</th></tr>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunMetrics& r = runs[i];
    s += str("<tr><td><span class=\"swatch\" style=\"background:", colour_of(i), "\"></span>", escaped(r.dir),
             "</td><td>", *r.steps.begin(), "..", *r.steps.rbegin(), "</td><td>", number(r.last("loss"), "%.4f"),
             "</td><td>", number(r.last("eval_loss"), "%.4f"), "</td><td>", number(r.median("tokens_per_s"), "%.0f"),
             "</td><td>", number(100 * r.median("mfu"), "%.1f"), "%</td></tr>\n");
  }
  return s + "</table>\n";
}

const char* const kStyle =
    "body{font-family:sans-serif;margin:24px;color:#222;max-width:1000px}"
    "h1{font-size:22px}h2{font-size:17px;margin-top:28px}"
    "table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #ddd;padding:4px 10px;text-align:left}"
    ".swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:middle}"
    "pre{background:#f6f6f6;padding:8px;font-size:12px;overflow-x:auto}"
    "svg{display:block;margin:6px 0 18px;font-size:12px}"
    "svg .title{font-size:14px;font-weight:bold}svg .tick{fill:#555;font-size:11px}"
    "svg .frame{fill:none;stroke:#999}svg .grid{stroke:#eee}"
    "svg .series{fill:none;stroke-width:1.6}"
    "svg .divergence{stroke:#000;stroke-width:1.2;stroke-dasharray:3 3}svg .divergence-label{font-size:11px}";

}  // namespace

std::string report_html(const std::vector<std::string>& dirs) {
  std::vector<RunMetrics> runs;
  for (const std::string& d : dirs) runs.push_back(read_run_metrics(d));

  std::optional<int64_t> divergence;
  std::string comparison;
  if (runs.size() == 2) {
    // The report shows the curves even when the fingerprints cannot be compared, and says why.
    try {
      const RunDiff diff = diff_runs(dirs[0], dirs[1]);
      if (diff.first_step >= 0) divergence = diff.first_step;
      comparison = str("<h2>Comparison (lockstep diff)</h2>\n<p>",
                       divergence ? str("First divergent step: <b>", *divergence, "</b>, marked on the curves.")
                                  : std::string("No step differs in the fingerprints."),
                       "</p>\n<pre>", escaped(diff.report), "</pre>\n");
    } catch (const UserError& e) {
      comparison = str("<h2>Comparison</h2>\n<p>The fingerprints were not compared: ", escaped(e.what()), "</p>\n");
    }
  }

  std::vector<LegendEntry> runs_legend;
  for (size_t i = 0; i < runs.size(); ++i) runs_legend.push_back({colour_of(i), false, runs[i].dir});
  auto with_divergence = [&](std::vector<LegendEntry> entries) {
    if (divergence) entries.push_back({"#000", true, str("first divergent step (", *divergence, ")")});
    return entries;
  };
  auto curves_of = [&](const std::string& key) {
    std::vector<Curve> curves;
    for (size_t i = 0; i < runs.size(); ++i)
      curves.push_back({runs[i].dir, colour_of(i), false, false, points_of(runs[i], key)});
    return curves;
  };

  std::string title = "lockstep report: ";
  for (size_t i = 0; i < runs.size(); ++i) title += (i ? ", " : "") + runs[i].dir;
  std::string html = str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>",
                         escaped(title), "</title>\n<style>", kStyle, "</style>\n</head>\n<body>\n<h1>", escaped(title),
                         "</h1>\n", summary_table(runs), comparison, "<h2>Training</h2>\n");

  std::vector<Curve> loss = curves_of("loss");
  bool any_eval = false;
  for (size_t i = 0; i < runs.size(); ++i) {
    std::vector<std::pair<double, double>> eval = points_of(runs[i], "eval_loss");
    any_eval = any_eval || !eval.empty();
    if (!eval.empty()) loss.push_back({runs[i].dir + " (eval)", colour_of(i), true, true, std::move(eval)});
  }
  std::vector<LegendEntry> loss_legend = runs_legend;
  if (any_eval) loss_legend.push_back({"#777", true, "eval loss"});
  html += line_plot("Loss (solid: train, dashed: eval)", loss, with_divergence(loss_legend), divergence);
  html += line_plot("Grad norm", curves_of("grad_norm"), with_divergence(runs_legend), divergence);
  html += line_plot("Learning rate", curves_of("lr"), with_divergence(runs_legend), divergence);
  html += line_plot("Tokens/s", curves_of("tokens_per_s"), with_divergence(runs_legend), divergence);
  html += line_plot("MFU (of the measured GEMM peak)", curves_of("mfu"), with_divergence(runs_legend), divergence);

  double top = 1;
  for (const RunMetrics& r : runs)
    for (int64_t layer : r.moe_layers)
      for (const auto& [step, v] : *r.find("moe." + std::to_string(layer) + ".imbalance"))
        if (std::isfinite(v)) top = std::max(top, v);
  if (top == 1) top = 2;  // a perfectly balanced run still gets a scale
  bool any_moe = false;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].moe_layers.empty()) continue;
    if (!any_moe) html += "<h2>Expert load</h2>\n";
    any_moe = true;
    html += heatmap(runs[i], i, top);
  }
  return html + "</body>\n</html>\n";
}

}  // namespace lockstep
