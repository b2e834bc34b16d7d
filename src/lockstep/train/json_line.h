// One JSON object on one line, for metrics.jsonl and fingerprints/*.jsonl. Numbers are written
// with enough digits to round-trip; non-finite numbers become null (JSON has no NaN).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace lockstep {

class JsonLine {
 public:
  JsonLine& add(const char* key, const std::string& s) {
    field(key);
    out_ += '"';
    for (char c : s) {
      if (c == '"' || c == '\\') out_ += '\\';
      out_ += c;
    }
    out_ += '"';
    return *this;
  }
  JsonLine& add(const char* key, const char* s) { return add(key, std::string(s)); }
  JsonLine& add(const char* key, int64_t v) {
    field(key);
    out_ += std::to_string(v);
    return *this;
  }
  JsonLine& add(const char* key, int v) { return add(key, static_cast<int64_t>(v)); }
  JsonLine& add(const char* key, bool v) {
    field(key);
    out_ += v ? "true" : "false";
    return *this;
  }
  JsonLine& add(const char* key, double v, int digits = 17) {
    field(key);
    if (!std::isfinite(v)) {
      out_ += "null";
    } else {
      char buf[40];
      std::snprintf(buf, sizeof buf, "%.*g", digits, v);
      out_ += buf;
    }
    return *this;
  }
  JsonLine& add(const char* key, const std::vector<double>& v, int digits = 17) {
    field(key);
    out_ += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      char buf[40];
      if (std::isfinite(v[i]))
        std::snprintf(buf, sizeof buf, "%.*g", digits, v[i]);
      else
        std::snprintf(buf, sizeof buf, "null");
      out_ += (i ? "," : "");
      out_ += buf;
    }
    out_ += ']';
    return *this;
  }
  std::string str() const { return out_ + "}\n"; }

 private:
  void field(const char* key) {
    out_ += out_.size() == 1 ? "\"" : ",\"";
    out_ += key;
    out_ += "\":";
  }
  std::string out_ = "{";
};

}  // namespace lockstep
