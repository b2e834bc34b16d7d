#include "lockstep/data/synthetic_corpus.h"

#include <array>
#include <string_view>

#include "lockstep/core/philox.h"

namespace lockstep {

namespace {

constexpr std::array<std::string_view, 12> kAdjectives = {"red",  "small",  "old",  "quick", "quiet", "happy",
                                                          "dark", "bright", "lazy", "tall",  "green", "cold"};
constexpr std::array<std::string_view, 16> kNouns = {"fox",    "dog",   "cat",   "bird",  "child", "teacher",
                                                     "farmer", "river", "tree",  "house", "robot", "king",
                                                     "horse",  "ship",  "baker", "city"};
constexpr std::array<std::string_view, 12> kVerbs = {"sees",   "likes", "follows", "finds", "helps", "watches",
                                                     "paints", "calls", "visits",  "knows", "feeds", "greets"};
constexpr std::array<std::string_view, 8> kNames = {"ann", "bob", "eve", "tom", "mia", "sam", "zoe", "max"};

class Draws {
 public:
  Draws(uint64_t seed, const std::string& split) : rng_(seed, purpose_id("corpus/" + split)) {}
  uint32_t below(uint32_t n) { return static_cast<uint32_t>((static_cast<uint64_t>(rng_.bits(next_++)) * n) >> 32); }
  template <size_t N>
  std::string_view pick(const std::array<std::string_view, N>& words) {
    return words[below(N)];
  }

 private:
  RandomStream rng_;
  uint64_t next_ = 0;
};

void append(std::vector<uint8_t>& out, std::string_view s) { out.insert(out.end(), s.begin(), s.end()); }
void append(std::vector<uint8_t>& out, uint32_t n) { append(out, std::to_string(n)); }

void sentence(Draws& d, std::vector<uint8_t>& out) {
  append(out, "the ");
  append(out, d.pick(kAdjectives));
  append(out, " ");
  append(out, d.pick(kNouns));
  append(out, " ");
  append(out, d.pick(kVerbs));
  append(out, " the ");
  append(out, d.pick(kAdjectives));
  append(out, " ");
  append(out, d.pick(kNouns));
  append(out, ".\n");
}

void counting(Draws& d, std::vector<uint8_t>& out) {
  const uint32_t start = d.below(90), len = 3 + d.below(6);
  append(out, "count ");
  append(out, start);
  append(out, ":");
  for (uint32_t i = 0; i < len; ++i) {
    append(out, " ");
    append(out, start + i);
  }
  append(out, ".\n");
}

void addition(Draws& d, std::vector<uint8_t>& out) {
  const uint32_t x = d.below(100), y = d.below(100);
  append(out, x);
  append(out, " + ");
  append(out, y);
  append(out, " = ");
  append(out, x + y);
  append(out, ".\n");
}

void copy(Draws& d, std::vector<uint8_t>& out) {
  std::string w(3 + d.below(6), 'a');
  for (char& c : w) c = static_cast<char>('a' + d.below(26));
  append(out, "copy ");
  append(out, w);
  append(out, ": ");
  append(out, w);
  append(out, ".\n");
}

void recall(Draws& d, std::vector<uint8_t>& out) {
  const std::string fact = std::string(d.pick(kNames)) + " has " + std::to_string(2 + d.below(8)) + " " +
                           std::string(d.pick(kAdjectives)) + " " + std::string(d.pick(kNouns)) + "s.";
  append(out, fact);
  append(out, " ");
  append(out, fact);
  append(out, "\n");
}

}  // namespace

std::vector<uint8_t> synthetic_corpus(uint64_t seed, const std::string& split, int64_t bytes) {
  Draws d(seed, split);
  std::vector<uint8_t> out;
  out.reserve(static_cast<size_t>(bytes) + 128);
  while (static_cast<int64_t>(out.size()) < bytes) {
    switch (d.below(5)) {
      case 0:
        sentence(d, out);
        break;
      case 1:
        counting(d, out);
        break;
      case 2:
        addition(d, out);
        break;
      case 3:
        copy(d, out);
        break;
      default:
        recall(d, out);
        break;
    }
  }
  out.resize(static_cast<size_t>(bytes));
  return out;
}

}  // namespace lockstep
