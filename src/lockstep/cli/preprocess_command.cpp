// lockstep preprocess --input FILE [--input FILE ...] --output PREFIX [--tokenizer SPEC]
//                     [--json-key KEY] [--append-eod] [--workers N]
//
// Tokenizes a corpus into a Megatron indexed dataset (data/preprocess.h has the input formats).
#include <algorithm>
#include <charconv>
#include <cstdio>

#include "lockstep/cli/commands.h"
#include "lockstep/core/error.h"
#include "lockstep/data/preprocess.h"

namespace lockstep::cli {

int preprocess_command(const std::vector<std::string>& args) {
  PreprocessOptions o;
  o.progress = stderr;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) user_error("command line: ", a, " needs a value");
      return args[++i];
    };
    if (a == "--input") {
      o.inputs.push_back(value());
    } else if (a == "--output") {
      o.output_prefix = value();
    } else if (a == "--tokenizer") {
      o.tokenizer = value();
    } else if (a == "--json-key") {
      o.json_key = value();
    } else if (a == "--append-eod") {
      o.append_eod = true;
    } else if (a == "--workers") {
      const std::string& v = value();
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), o.workers);
      if (ec != std::errc() || p != v.data() + v.size() || o.workers < 1)
        user_error("command line: --workers needs a positive number, got '", v, "'");
    } else {
      user_error("command line: unknown argument '", a, "' (see `lockstep help`)");
    }
  }
  const PreprocessSummary s = preprocess(o);
  std::printf(
      "preprocess: wrote %s.bin and %s.idx: %lld documents, %lld tokens (%s), vocabulary %lld "
      "(train with model.vocab_size >= %lld)\n",
      o.output_prefix.c_str(), o.output_prefix.c_str(), (long long)s.documents, (long long)s.tokens, s.dtype.c_str(),
      (long long)s.vocab_size, (long long)s.vocab_size);
  if (s.skipped_empty || s.skipped_invalid_utf8)
    std::printf("preprocess: skipped %lld empty documents and %lld that are not valid UTF-8%s%s\n",
                (long long)s.skipped_empty, (long long)s.skipped_invalid_utf8,
                s.first_invalid_utf8.empty() ? "" : " (first at ",
                s.first_invalid_utf8.empty() ? "" : (s.first_invalid_utf8 + ")").c_str());
  std::printf("preprocess: %.1f MB in %.2f s (%.1f MB/s, %d workers)\n", static_cast<double>(s.input_bytes) / 1e6,
              s.seconds, static_cast<double>(s.input_bytes) / 1e6 / std::max(1e-9, s.seconds), o.workers);
  return 0;
}

}  // namespace lockstep::cli
