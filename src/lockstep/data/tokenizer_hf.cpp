// Hugging Face tokenizer.json with a BPE model. Supported, everything else refused by name:
//
//   model          BPE with vocab, merges ("a b" strings or ["a", "b"] pairs), byte_fallback,
//                  fuse_unk, unk_token, ignore_merges; no dropout, continuing_subword_prefix
//                  or end_of_word_suffix
//   normalizer     null, or a Sequence of Prepend("▁") and Replace(" " -> "▁") (Llama 2 style)
//   pre_tokenizer  null, ByteLevel (add_prefix_space; use_regex = the GPT-2 split), Split with
//                  one of the patterns in pretokenizer.h (behavior Isolated, not inverted),
//                  Metaspace ("▁", prepend_scheme first/always/never, split), or a Sequence of these
//   added_tokens   matched in the raw text before anything else (longest first); single_word,
//                  lstrip and rstrip are refused
//   decoder, post_processor, truncation, padding: not used. decode() follows from the model
//   kind; encode() adds no BOS/EOS (`lockstep preprocess --append-eod` adds the end of document).
//
// The kind is byte-level when a ByteLevel pre-tokenizer is present, otherwise byte-fallback
// (characters, with "▁" for spaces when the normalizer or a Metaspace pre-tokenizer says so).
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "lockstep/core/error.h"
#include "lockstep/data/tokenizer_bpe.h"

namespace lockstep {
namespace {

using nlohmann::json;

constexpr const char* kMetaspace = "\xE2\x96\x81";

struct Parser {
  std::string path;
  BpeSpec spec;
  bool byte_level = false;

  [[noreturn]] void unsupported(const std::string& what) const {
    user_error("tokenizer '", path, "': ", what, " is not supported");
  }
  static std::string type_of(const json& j) {
    return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "?";
  }
  static bool flag(const json& j, const char* key, bool dflt) {
    return j.contains(key) && j[key].is_boolean() ? j[key].get<bool>() : dflt;
  }

  void normalizer(const json& n) {
    if (n.is_null()) return;
    const std::string t = type_of(n);
    if (t == "Sequence") {
      for (const json& x : n.value("normalizers", json::array())) normalizer(x);
    } else if (t == "Prepend" && n.value("prepend", "") == kMetaspace) {
      spec.prepend_metaspace = true;
    } else if (t == "Replace" && n.contains("pattern") && n["pattern"].value("String", "") == " " &&
               n.value("content", "") == kMetaspace) {
      spec.metaspace = true;
    } else {
      unsupported(str("normalizer ", t, " (", n.dump(), ")"));
    }
  }

  void pre_tokenizer(const json& p) {
    if (p.is_null()) return;
    const std::string t = type_of(p);
    if (t == "Sequence") {
      for (const json& x : p.value("pretokenizers", json::array())) pre_tokenizer(x);
    } else if (t == "ByteLevel") {
      byte_level = true;
      spec.add_prefix_space = flag(p, "add_prefix_space", true);
      if (flag(p, "use_regex", true)) set_split(SplitPattern::gpt2);
    } else if (t == "Split") {
      if (p.value("behavior", "") != "Isolated") unsupported(str("Split behavior '", p.value("behavior", ""), "'"));
      if (flag(p, "invert", false)) unsupported("an inverted Split");
      const json& pat = p.value("pattern", json::object());
      const std::string regex =
          pat.contains("Regex") && pat["Regex"].is_string() ? pat["Regex"].get<std::string>() : "";
      const SplitPattern sp = split_pattern_from_regex(regex);
      if (sp == SplitPattern::none) unsupported(str("Split pattern ", pat.dump()));
      set_split(sp);
    } else if (t == "Metaspace") {
      if (p.value("replacement", kMetaspace) != std::string(kMetaspace))
        unsupported(str("Metaspace replacement '", p.value("replacement", ""), "'"));
      spec.metaspace = true;
      std::string scheme = p.contains("prepend_scheme") ? p.value("prepend_scheme", "always")
                                                        : (flag(p, "add_prefix_space", true) ? "always" : "never");
      // "first" and "always" differ only after added tokens; we prepend at the start of the text.
      if (scheme != "first" && scheme != "always" && scheme != "never")
        unsupported(str("Metaspace prepend_scheme '", scheme, "'"));
      spec.prepend_metaspace = scheme != "never";
      spec.split_metaspace = flag(p, "split", true);
    } else {
      unsupported(str("pre_tokenizer ", t));
    }
  }

  void set_split(SplitPattern sp) {
    if (spec.split != SplitPattern::none && spec.split != sp) unsupported("more than one splitting pre-tokenizer");
    spec.split = sp;
  }

  void model(const json& m) {
    if (type_of(m) != "BPE") unsupported(str("model type '", type_of(m), "' (only BPE)"));
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0) unsupported("BPE dropout");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(k) && !m[k].is_null() && !m[k].get<std::string>().empty()) unsupported(str("BPE ", k));
    spec.byte_fallback = flag(m, "byte_fallback", false);
    spec.fuse_unk = flag(m, "fuse_unk", false);
    spec.ignore_merges = flag(m, "ignore_merges", false);
    if (m.contains("unk_token") && m["unk_token"].is_string()) spec.unk_token = m["unk_token"].get<std::string>();
    const json& vocab = m.value("vocab", json::object());
    if (!vocab.is_object() || vocab.empty()) user_error("tokenizer '", path, "': model.vocab is missing or empty");
    for (const auto& [tok, id] : vocab.items()) spec.vocab.emplace_back(tok, id.get<int32_t>());
    const json& merges = m.value("merges", json::array());
    for (size_t r = 0; r < merges.size(); ++r) {
      const json& x = merges[r];
      if (x.is_string()) {
        const std::string s = x.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          user_error("tokenizer '", path, "': merge ", r + 1, " '", s, "' is not two tokens separated by one space");
        spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (x.is_array() && x.size() == 2 && x[0].is_string() && x[1].is_string()) {
        spec.merges.emplace_back(x[0].get<std::string>(), x[1].get<std::string>());
      } else {
        user_error("tokenizer '", path, "': merge ", r + 1, " is neither \"a b\" nor [\"a\", \"b\"]");
      }
    }
  }

  void added_tokens(const json& a) {
    for (const json& t : a) {
      const std::string content = t.value("content", "");
      for (const char* k : {"single_word", "lstrip", "rstrip"})
        if (flag(t, k, false)) unsupported(str("added token '", content, "' with ", k));
      spec.added.emplace_back(content, t.value("id", -1));
    }
  }
};

}  // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) user_error("tokenizer '", path, "': cannot open: ", std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  Parser p;
  p.path = path;
  p.spec.source = path;
  try {
    const json j = json::parse(ss.str());
    if (!j.is_object() || !j.contains("model"))
      user_error("tokenizer '", path, "': not a tokenizer.json (no \"model\")");
    p.model(j["model"]);
    p.normalizer(j.value("normalizer", json()));
    p.pre_tokenizer(j.value("pre_tokenizer", json()));
    p.added_tokens(j.value("added_tokens", json::array()));
  } catch (const json::exception& e) {
    user_error("tokenizer '", path, "': ", e.what());
  }
  BpeSpec& s = p.spec;
  s.kind = p.byte_level ? BpeSpec::Kind::byte_level : BpeSpec::Kind::byte_fallback;
  if (p.byte_level && (s.metaspace || s.byte_fallback))
    p.unsupported("a ByteLevel pre-tokenizer together with Metaspace or byte_fallback");
  auto first_present = [&](std::initializer_list<const char*> names) -> std::string {
    for (const char* n : names) {
      for (const auto& [tok, id] : s.added)
        if (tok == n) return n;
      for (const auto& [tok, id] : s.vocab)
        if (tok == n) return n;
    }
    return "";
  };
  s.eod_token = first_present({"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"});
  s.bos_token = first_present({"<|begin_of_text|>", "<s>", "<bos>"});
  s.pad_token = first_present({"<pad>", "<|pad|>", "<|finetune_right_pad_id|>"});
  return std::make_unique<BpeTokenizer>(std::move(s), "hf:" + path);
}

}  // namespace lockstep
