// Corpus -> indexed dataset (`lockstep preprocess`): read documents, tokenize them on N worker
// threads, write PREFIX.bin / PREFIX.idx (indexed_dataset.h), one sequence per document.
//
// Input, streamed (memory stays bounded by a few chunks per worker, whatever the corpus size):
//   JSONL (json_key set, or a .jsonl/.json file): one JSON object per line, the document is the
//     string under json_key. A line that is not a JSON object with that string key is an error
//     naming the file and line; blank lines are skipped.
//   text: one document per paragraph: lines up to the next blank (empty or whitespace-only)
//     line, joined with "\n". A document that is not valid UTF-8 is skipped and counted.
// Empty documents are skipped and counted. The output is the same bytes for any worker count:
// documents are cut into chunks in input order, and chunks are written in that order.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace lockstep {

struct PreprocessOptions {
  std::vector<std::string> inputs;
  std::string json_key;  // non-empty: every input is JSONL
  std::string tokenizer = "byte";
  std::string output_prefix;
  bool append_eod = false;
  int workers = 1;
  int64_t chunk_bytes = 1 << 20;  // text per chunk handed to a worker
  std::FILE* progress = nullptr;  // a live progress line goes here when it is a terminal
};

struct PreprocessSummary {
  int64_t documents = 0, tokens = 0, input_bytes = 0;
  int64_t skipped_empty = 0, skipped_invalid_utf8 = 0;
  std::string first_invalid_utf8;  // "FILE:LINE" of the first skipped non-UTF-8 document
  int64_t vocab_size = 0;
  std::string dtype;
  double seconds = 0;
};

// Throws UserError (missing input, malformed line, no documents at all, ...); nothing is left
// under the output names then.
PreprocessSummary preprocess(const PreprocessOptions& options);

}  // namespace lockstep
