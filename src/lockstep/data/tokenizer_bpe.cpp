#include "lockstep/data/tokenizer_bpe.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

#include "lockstep/core/error.h"
#include "lockstep/data/unicode.h"

namespace lockstep {
namespace {

std::atomic<uint64_t> next_serial{1};  // BpeTokenizer::serial_

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581 LOWER ONE EIGHTH BLOCK "▁"

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other 68 bytes for the
// code points 256, 257, ... in byte order, so that every token is printable text.
std::vector<char32_t> byte_to_codepoint() {
  std::vector<char32_t> map(256);
  char32_t extra = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    map[b] = printable ? static_cast<char32_t>(b) : extra++;
  }
  return map;
}

std::string byte_token(int b) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "<0x%02X>", b);
  return buf;
}

}  // namespace

BpeTokenizer::BpeTokenizer(BpeSpec spec, std::string name)
    : kind_(spec.kind),
      split_(spec.split),
      add_prefix_space_(spec.add_prefix_space),
      metaspace_(spec.metaspace),
      prepend_metaspace_(spec.prepend_metaspace),
      split_metaspace_(spec.split_metaspace),
      ignore_merges_(spec.ignore_merges),
      byte_fallback_(spec.byte_fallback),
      fuse_unk_(spec.fuse_unk),
      serial_(next_serial++) {
  name_ = std::move(name);
  const std::string& src = spec.source;
  int32_t max_id = -1;
  for (const auto& [tok, id] : spec.vocab) {
    if (id < 0) user_error(src, ": token '", tok, "' has negative id ", id);
    ids_.emplace(tok, id);
    max_id = std::max(max_id, id);
  }
  for (const auto& [tok, id] : spec.added) {
    if (id < 0) user_error(src, ": added token '", tok, "' has negative id ", id);
    ids_.emplace(tok, id);
    max_id = std::max(max_id, id);
  }
  if (max_id < 0) user_error(src, ": the vocabulary is empty");
  decoded_.resize(static_cast<size_t>(max_id) + 1);
  is_byte_token_.assign(decoded_.size(), false);

  const std::vector<char32_t> b2c = byte_to_codepoint();
  std::unordered_map<char32_t, uint8_t> c2b;
  for (int b = 0; b < 256; ++b) c2b[b2c[b]] = static_cast<uint8_t>(b);
  for (const auto& [tok, id] : spec.vocab) {
    std::string& out = decoded_[id];
    out.clear();
    if (kind_ == BpeSpec::Kind::byte_level) {
      for (size_t i = 0; i < tok.size();) {
        const unicode::Decoded d = unicode::decode(tok, i);
        const auto it = c2b.find(d.cp);
        if (d.valid && it != c2b.end())
          out += static_cast<char>(it->second);
        else
          out.append(tok, i, static_cast<size_t>(d.len));
        i += d.len;
      }
    } else if (tok.size() == 6 && tok.compare(0, 3, "<0x") == 0 && tok[5] == '>' && byte_fallback_) {
      out = static_cast<char>(std::stoi(tok.substr(3, 2), nullptr, 16));
      is_byte_token_[id] = true;
    } else {
      for (size_t i = 0; i < tok.size();) {
        if (metaspace_ && tok.compare(i, kMetaspace.size(), kMetaspace) == 0) {
          out += ' ';
          i += kMetaspace.size();
        } else {
          out += tok[i++];
        }
      }
    }
  }
  for (const auto& [tok, id] : spec.added) {
    decoded_[id] = tok;
    is_byte_token_[id] = false;
    added_.emplace_back(tok, id);
    if (!tok.empty()) added_first_byte_[static_cast<uint8_t>(tok[0])] = true;
  }
  // Longest first, so that an added token that extends another wins where both match.
  std::stable_sort(added_.begin(), added_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  added_.erase(std::remove_if(added_.begin(), added_.end(), [](const auto& a) { return a.first.empty(); }),
               added_.end());

  for (size_t r = 0; r < spec.merges.size(); ++r) {
    const auto& [a, b] = spec.merges[r];
    const int32_t ia = find(a), ib = find(b), iab = find(a + b);
    if (ia < 0 || ib < 0 || iab < 0)
      user_error(src, ": merge ", r + 1, " '", a, " ", b, "' uses a token missing from the vocabulary ('",
                 ia < 0   ? a
                 : ib < 0 ? b
                          : a + b,
                 "')");
    merges_.emplace((static_cast<uint64_t>(ia) << 32) | static_cast<uint32_t>(ib),
                    std::make_pair(static_cast<int32_t>(r), iab));  // a repeated pair keeps its first rank
  }

  if (kind_ == BpeSpec::Kind::byte_level) {
    byte_ids_.resize(256);
    for (int b = 0; b < 256; ++b) {
      std::string c;
      unicode::append_utf8(c, b2c[b]);
      byte_ids_[b] = find(c);
      if (byte_ids_[b] < 0)
        user_error(src, ": byte-level vocabulary lacks the token for byte 0x", std::hex, b, " ('", c, "')");
    }
  } else if (byte_fallback_) {
    byte_ids_.resize(256);
    for (int b = 0; b < 256; ++b) {
      byte_ids_[b] = find(byte_token(b));
      if (byte_ids_[b] < 0) user_error(src, ": byte_fallback is on but the vocabulary lacks '", byte_token(b), "'");
    }
  }
  if (!spec.unk_token.empty()) {
    unk_ = find(spec.unk_token);
    if (unk_ < 0) user_error(src, ": unk_token '", spec.unk_token, "' is not in the vocabulary");
  }
  eod_ = spec.eod_token.empty() ? -1 : find(spec.eod_token);
  bos_ = spec.bos_token.empty() ? -1 : find(spec.bos_token);
  pad_ = spec.pad_token.empty() ? -1 : find(spec.pad_token);
}

int32_t BpeTokenizer::find(const std::string& token) const {
  const auto it = ids_.find(token);
  return it == ids_.end() ? -1 : it->second;
}

void BpeTokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    if (added_first_byte_[static_cast<uint8_t>(text[i])]) {
      const auto hit = std::find_if(added_.begin(), added_.end(),
                                    [&](const auto& a) { return text.compare(i, a.first.size(), a.first) == 0; });
      if (hit != added_.end()) {
        encode_normal(text.substr(start, i - start), start == 0, out);
        out.push_back(hit->second);
        i += hit->first.size();
        start = i;
        continue;
      }
    }
    ++i;
  }
  encode_normal(text.substr(start), start == 0, out);
}

void BpeTokenizer::encode_normal(std::string_view text, bool at_start, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  thread_local std::vector<std::string_view> pieces;
  thread_local std::string normalized;
  pieces.clear();
  if (kind_ == BpeSpec::Kind::byte_level) {
    if (add_prefix_space_ && at_start && text[0] != ' ') {
      normalized.assign(" ");
      normalized.append(text);
      text = normalized;
    }
    pre_tokenize(split_, text, pieces);
  } else {
    normalized.clear();
    if (prepend_metaspace_ && at_start) normalized.append(kMetaspace);
    for (char c : text) {
      if (c == ' ' && metaspace_)
        normalized.append(kMetaspace);
      else
        normalized += c;
    }
    const std::string_view n = normalized;
    if (!split_metaspace_) {
      pieces.push_back(n);
    } else {
      // Metaspace split: each "▁" begins a new piece.
      size_t begin = 0;
      for (size_t p = n.find(kMetaspace, 1); p != std::string_view::npos; p = n.find(kMetaspace, p + 1)) {
        if (p > begin) pieces.push_back(n.substr(begin, p - begin));
        begin = p;
      }
      pieces.push_back(n.substr(begin));
    }
  }
  // encode_piece does not touch `pieces` or `normalized`, which the views point into.
  for (std::string_view p : pieces) encode_piece(p, out);
}

// Natural text repeats its words (pieces) constantly: each thread keeps the ids of the short
// pieces it has encoded, for the tokenizer instance it last served (instances are told apart by
// a serial number, never by address, which a new instance may reuse).
namespace {
constexpr size_t kCachedPieceBytes = 48, kCacheEntries = 1 << 16;
struct PieceCache {
  uint64_t serial = 0;
  std::unordered_map<std::string, std::vector<int32_t>> ids;
};
}  // namespace

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  thread_local PieceCache cache;
  const bool cacheable = piece.size() <= kCachedPieceBytes;
  if (cacheable) {
    if (cache.serial != serial_ || cache.ids.size() >= kCacheEntries) {
      cache.ids.clear();
      cache.serial = serial_;
    }
    thread_local std::string key;
    key.assign(piece);
    const auto it = cache.ids.find(key);
    if (it != cache.ids.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
    const size_t before = out.size();
    encode_uncached(piece, out);
    cache.ids.emplace(key, std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(before), out.end()));
    return;
  }
  encode_uncached(piece, out);
}

void BpeTokenizer::encode_uncached(std::string_view piece, std::vector<int32_t>& out) const {
  thread_local std::vector<int32_t> symbols;
  thread_local std::string key;
  symbols.clear();
  if (kind_ == BpeSpec::Kind::byte_level) {
    if (ignore_merges_) {
      static const std::vector<char32_t> b2c = byte_to_codepoint();
      key.clear();
      for (char c : piece) unicode::append_utf8(key, b2c[static_cast<uint8_t>(c)]);
      if (const int32_t id = find(key); id >= 0) {
        out.push_back(id);
        return;
      }
    }
    for (char c : piece) symbols.push_back(byte_ids_[static_cast<uint8_t>(c)]);
  } else {
    if (ignore_merges_) {
      key.assign(piece);
      if (const int32_t id = find(key); id >= 0) {
        out.push_back(id);
        return;
      }
    }
    bool last_unk = false;
    for (size_t i = 0; i < piece.size();) {
      const unicode::Decoded d = unicode::decode(piece, i);
      key.assign(piece.substr(i, static_cast<size_t>(d.len)));
      const int32_t id = d.valid ? find(key) : -1;
      if (id >= 0) {
        symbols.push_back(id);
        last_unk = false;
      } else if (byte_fallback_) {
        for (char c : key) symbols.push_back(byte_ids_[static_cast<uint8_t>(c)]);
        last_unk = false;
      } else if (unk_ >= 0) {
        if (!(fuse_unk_ && last_unk)) symbols.push_back(unk_);
        last_unk = true;
      }
      i += d.len;
    }
  }
  merge(symbols);
  out.insert(out.end(), symbols.begin(), symbols.end());
}

void BpeTokenizer::merge(std::vector<int32_t>& sym) const {
  const auto n = static_cast<int32_t>(sym.size());
  if (n < 2) return;
  struct Candidate {
    int32_t rank, pos, left, right, merged;
    // std::*_heap keep the largest on top: "larger" = lower rank, then further left.
    bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<int32_t> next;
  thread_local std::vector<int32_t> prev;
  thread_local std::vector<Candidate> heap;
  prev.resize(n);
  next.resize(n);
  for (int32_t i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1;
  heap.clear();
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[pos] >= n) return;
    const auto it = merges_.find((static_cast<uint64_t>(sym[pos]) << 32) | static_cast<uint32_t>(sym[next[pos]]));
    if (it == merges_.end()) return;
    heap.push_back({it->second.first, pos, sym[pos], sym[next[pos]], it->second.second});
    std::push_heap(heap.begin(), heap.end());
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Candidate c = heap.back();
    heap.pop_back();
    // Stale candidates: the left symbol was merged away (-1) or either side changed since.
    if (sym[c.pos] != c.left || next[c.pos] >= n || sym[next[c.pos]] != c.right) continue;
    const int32_t r = next[c.pos];
    sym[c.pos] = c.merged;
    sym[r] = -1;
    next[c.pos] = next[r];
    if (next[r] < n) prev[next[r]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  sym.erase(std::remove(sym.begin(), sym.end(), -1), sym.end());
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size())
      user_error(name_, ": token id ", id, " is outside the vocabulary [0, ", vocab_size(), ")");
    out += decoded_[id];
  }
  if (kind_ == BpeSpec::Kind::byte_fallback && prepend_metaspace_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

}  // namespace lockstep
