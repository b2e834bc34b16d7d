#include "lockstep/data/tokenizer.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "lockstep/core/error.h"
#include "lockstep/data/tokenizer_bpe.h"

namespace lockstep {

std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path);  // tokenizer_hf.cpp

namespace {

class ByteTokenizer : public Tokenizer {
 public:
  static constexpr const char* kSpecials[3] = {"<|endoftext|>", "<|bos|>", "<|pad|>"};
  ByteTokenizer() {
    name_ = "byte";
    eod_ = 256;
    bos_ = 257;
    pad_ = 258;
  }
  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    for (char c : text) out.push_back(static_cast<uint8_t>(c));
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_size())
        user_error("byte tokenizer: token id ", id, " is outside the vocabulary [0, 259)");
      if (id < 256)
        out += static_cast<char>(id);
      else
        out += kSpecials[id - 256];
    }
    return out;
  }
  int64_t vocab_size() const override { return 259; }
};

std::string slurp(const std::string& path, const std::string& what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) user_error(what, " '", path, "': cannot open: ", std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// GPT-2's files: vocab.json maps token -> id; merges.txt has "#version: ..." then "left right"
// per line in rank order.
std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const std::string& vocab_path, const std::string& merges_path) {
  BpeSpec spec;
  spec.kind = BpeSpec::Kind::byte_level;
  spec.source = vocab_path + " + " + merges_path;
  spec.split = SplitPattern::gpt2;
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(slurp(vocab_path, "GPT-2 vocabulary"));
  } catch (const nlohmann::json::exception& e) {
    user_error("GPT-2 vocabulary '", vocab_path, "': not valid JSON: ", e.what());
  }
  if (!vocab.is_object()) user_error("GPT-2 vocabulary '", vocab_path, "': expected a JSON object of token: id");
  for (const auto& [tok, id] : vocab.items()) {
    if (!id.is_number_integer())
      user_error("GPT-2 vocabulary '", vocab_path, "': the id of '", tok, "' is not an integer");
    spec.vocab.emplace_back(tok, id.get<int32_t>());
  }
  std::istringstream merges(slurp(merges_path, "GPT-2 merges"));
  std::string line;
  for (int64_t n = 1; std::getline(merges, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (n == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 == line.size() || line.find(' ', sp + 1) != std::string::npos)
      user_error("GPT-2 merges '", merges_path, "' line ", n, ": expected two tokens separated by one space, got '",
                 line, "'");
    spec.merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  spec.eod_token = "<|endoftext|>";
  return std::make_unique<BpeTokenizer>(std::move(spec), "gpt2");
}

}  // namespace

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  if (spec.rfind("gpt2:", 0) == 0) {
    const std::string files = spec.substr(5);
    const size_t comma = files.find(',');
    if (comma == std::string::npos || comma == 0 || comma + 1 == files.size())
      user_error("tokenizer '", spec, "': expected gpt2:VOCAB_JSON,MERGES_TXT");
    return make_gpt2_tokenizer(files.substr(0, comma), files.substr(comma + 1));
  }
  if (spec.rfind("hf:", 0) == 0 && spec.size() > 3) return make_hf_tokenizer(spec.substr(3));
  user_error("tokenizer '", spec, "': expected byte, gpt2:VOCAB_JSON,MERGES_TXT or hf:TOKENIZER_JSON");
}

}  // namespace lockstep
