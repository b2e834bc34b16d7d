#include "lockstep/data/preprocess.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "lockstep/core/error.h"
#include "lockstep/data/indexed_dataset.h"
#include "lockstep/data/tokenizer.h"
#include "lockstep/data/unicode.h"

namespace lockstep {
namespace {

struct Chunk {
  int64_t index = 0;
  const std::string* file = nullptr;
  bool json = false;
  std::vector<std::string> docs;  // raw JSONL lines or paragraphs
  std::vector<int64_t> lines;     // first line number of each
  int64_t bytes = 0;
};

struct Result {
  std::vector<int32_t> tokens;
  std::vector<int64_t> lengths;
  int64_t empty = 0, invalid = 0, bytes = 0;
  std::string first_invalid, error;
};

bool is_blank(const std::string& line) {
  return std::all_of(line.begin(), line.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r'; });
}

bool is_json_file(const std::string& path) {
  const std::string ext = std::filesystem::path(path).extension().string();
  return ext == ".jsonl" || ext == ".json";
}

// Reads one input file into chunks, in order.
class Reader {
 public:
  // `path` outlives the chunks, which point to it (workers may still hold them after the reader).
  Reader(const std::string& path, bool json, int64_t chunk_bytes)
      : path_(path), json_(json), chunk_bytes_(chunk_bytes), in_(path, std::ios::binary) {
    if (!in_) user_error("preprocess: input '", path, "': cannot open: ", std::strerror(errno));
    in_.rdbuf()->pubsetbuf(buf_.data(), static_cast<std::streamsize>(buf_.size()));
  }
  // False at the end of the file.
  bool next(Chunk& c) {
    c.file = &path_;  // a reference to the caller's string
    c.json = json_;
    c.docs.clear();
    c.lines.clear();
    c.bytes = 0;
    std::string line;
    while (c.bytes < chunk_bytes_ && std::getline(in_, line)) {
      ++line_no_;
      c.bytes += static_cast<int64_t>(line.size()) + 1;
      if (json_) {
        if (is_blank(line)) continue;
        c.docs.push_back(std::move(line));
        c.lines.push_back(line_no_);
      } else if (is_blank(line)) {
        flush_paragraph(c);
      } else {
        if (para_.empty())
          para_line_ = line_no_;
        else
          para_ += '\n';
        para_ += line;
      }
    }
    if (in_.bad()) user_error("preprocess: input '", path_, "': read error: ", std::strerror(errno));
    if (!json_ && !in_) flush_paragraph(c);  // the last paragraph ends with the file
    return !c.docs.empty() || c.bytes > 0;
  }

 private:
  void flush_paragraph(Chunk& c) {
    if (para_.empty()) return;
    c.docs.push_back(std::move(para_));
    c.lines.push_back(para_line_);
    para_.clear();
  }
  const std::string& path_;
  bool json_;
  int64_t chunk_bytes_;
  std::vector<char> buf_ = std::vector<char>(1 << 20);
  std::ifstream in_;
  int64_t line_no_ = 0, para_line_ = 0;
  std::string para_;
};

void process(const Chunk& c, const Tokenizer& tok, const std::string& key, bool append_eod, Result& r) {
  r.bytes = c.bytes;
  std::string text;
  for (size_t i = 0; i < c.docs.size(); ++i) {
    const std::string where = *c.file + ":" + std::to_string(c.lines[i]);
    if (c.json) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(c.docs[i]);
      } catch (const nlohmann::json::exception& e) {
        r.error = str("preprocess: ", where, ": malformed JSON line (", e.what(), ")");
        return;
      }
      if (!j.is_object() || !j.contains(key) || !j[key].is_string()) {
        r.error = str("preprocess: ", where, ": expected a JSON object with a string \"", key, "\"");
        return;
      }
      text = j[key].get<std::string>();
    } else {
      if (!unicode::is_valid_utf8(c.docs[i])) {
        if (r.invalid++ == 0) r.first_invalid = where;
        continue;
      }
      text = c.docs[i];
    }
    if (text.empty()) {
      ++r.empty;
      continue;
    }
    const size_t before = r.tokens.size();
    tok.encode(text, r.tokens);
    if (append_eod) r.tokens.push_back(tok.eod());
    r.lengths.push_back(static_cast<int64_t>(r.tokens.size() - before));
  }
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

PreprocessSummary preprocess(const PreprocessOptions& o) {
  if (o.inputs.empty()) user_error("preprocess: no --input given");
  if (o.output_prefix.empty()) user_error("preprocess: no --output PREFIX given");
  if (o.workers < 1) user_error("preprocess: --workers = ", o.workers, ": must be at least 1");
  PreprocessSummary sum;
  for (const std::string& in : o.inputs) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(in, ec);
    if (ec) user_error("preprocess: input '", in, "': ", ec.message());
    sum.input_bytes += static_cast<int64_t>(size);
  }
  const std::unique_ptr<Tokenizer> tok = make_tokenizer(o.tokenizer);
  if (o.append_eod && tok->eod() < 0)
    user_error("preprocess: --append-eod: tokenizer '", o.tokenizer, "' has no end-of-document token");
  const std::string key = o.json_key.empty() ? "text" : o.json_key;
  sum.vocab_size = tok->vocab_size();
  const TokenDtype dtype = token_dtype_for_vocab(sum.vocab_size);
  sum.dtype = dtype_name(static_cast<uint8_t>(dtype));
  if (const auto parent = std::filesystem::path(o.output_prefix).parent_path(); !parent.empty())
    std::filesystem::create_directories(parent);
  IndexedDatasetWriter writer(o.output_prefix, dtype);

  // Workers take chunks from `todo` and leave results in `done`; this thread reads chunks and
  // writes results strictly in chunk order, with at most `max_in_flight` chunks held at once.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Chunk> todo;
  std::map<int64_t, Result> done;
  // Written results go back here with their buffers' capacity: a fresh multi-megabyte vector per
  // chunk would cost more in page faults than the tokenizing.
  std::vector<Result> spare;
  bool closing = false;
  std::vector<std::thread> workers;
  for (int w = 0; w < o.workers; ++w)
    workers.emplace_back([&] {
      for (;;) {
        Chunk c;
        {
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return closing || !todo.empty(); });
          if (todo.empty()) return;
          c = std::move(todo.front());
          todo.pop_front();
        }
        Result r;
        {
          std::lock_guard lock(mu);
          if (!spare.empty()) {
            r = std::move(spare.back());
            spare.pop_back();
          }
        }
        try {
          process(c, *tok, key, o.append_eod, r);
        } catch (const std::exception& e) {
          r.error = e.what();
        }
        {
          std::lock_guard lock(mu);
          done.emplace(c.index, std::move(r));
        }
        cv.notify_all();
      }
    });
  auto stop_workers = [&] {
    {
      std::lock_guard lock(mu);
      closing = true;
      todo.clear();
    }
    cv.notify_all();
    for (std::thread& t : workers) t.join();
    workers.clear();
  };

  const bool live = o.progress && isatty(fileno(o.progress));
  const double start = now_s();
  double last_print = 0;
  int64_t bytes_done = 0;
  int64_t next_write = 0, next_read = 0;
  const int64_t max_in_flight = 2 * o.workers + 1;
  auto write_ready = [&](bool wait_for_one) {
    for (;;) {
      Result r;
      {
        std::unique_lock lock(mu);
        if (wait_for_one) cv.wait(lock, [&] { return done.count(next_write) > 0; });
        const auto it = done.find(next_write);
        if (it == done.end()) return;
        r = std::move(it->second);
        done.erase(it);
      }
      wait_for_one = false;
      if (!r.error.empty()) user_error(r.error);
      int64_t off = 0;
      for (int64_t len : r.lengths) {
        writer.add_document(r.tokens.data() + off, len);
        off += len;
      }
      sum.skipped_empty += r.empty;
      if (r.invalid && sum.skipped_invalid_utf8 == 0) sum.first_invalid_utf8 = r.first_invalid;
      sum.skipped_invalid_utf8 += r.invalid;
      bytes_done += r.bytes;
      ++next_write;
      r.tokens.clear();
      r.lengths.clear();
      r.empty = r.invalid = r.bytes = 0;
      r.first_invalid.clear();
      {
        std::lock_guard lock(mu);
        spare.push_back(std::move(r));
      }
      if (live && now_s() - last_print > 0.25) {
        last_print = now_s();
        const double mb = static_cast<double>(bytes_done) / 1e6, total = static_cast<double>(sum.input_bytes) / 1e6;
        std::fprintf(o.progress, "\rpreprocess: %.1f / %.1f MB (%.0f%%), %.1f MB/s, %lld documents, %lld tokens   ", mb,
                     total, total > 0 ? 100 * mb / total : 100.0, mb / std::max(1e-9, last_print - start),
                     (long long)writer.documents(), (long long)writer.tokens());
        std::fflush(o.progress);
      }
    }
  };

  try {
    for (const std::string& in : o.inputs) {
      Reader reader(in, !o.json_key.empty() || is_json_file(in), std::max<int64_t>(1, o.chunk_bytes));
      for (;;) {
        Chunk c;
        if (!reader.next(c)) break;
        c.index = next_read++;
        {
          std::lock_guard lock(mu);
          todo.push_back(std::move(c));
        }
        cv.notify_all();
        write_ready(next_read - next_write >= max_in_flight);
      }
    }
    while (next_write < next_read) write_ready(true);
  } catch (...) {
    stop_workers();
    if (live) std::fputc('\n', o.progress);
    throw;
  }
  stop_workers();
  if (live) std::fputc('\n', o.progress);
  if (writer.documents() == 0)
    user_error("preprocess: no documents in the input (", sum.skipped_empty, " empty, ", sum.skipped_invalid_utf8,
               " not UTF-8 skipped); nothing written");
  writer.finish();
  sum.documents = writer.documents();
  sum.tokens = writer.tokens();
  sum.seconds = now_s() - start;
  return sum;
}

}  // namespace lockstep
