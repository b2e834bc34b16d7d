// The built-in corpus: English-like text with structure a small model can learn quickly, generated
// from Philox(seed, "corpus/<split>") so it costs nothing to ship and is identical everywhere.
//
// One line per "document", of five kinds: templated sentences over small word lists (grammar),
// counting runs ("count 17: 17 18 19 20."), two-digit additions ("42 + 17 = 59."), copies of a random
// letter string ("copy qzkw: qzkw." - needs attention to the earlier tokens), and key-value recall
// ("ann has 3 red cups. ann has 3 red cups."). Byte tokens; the loss of a small model falls from
// ln 256 = 5.55 to around 1 within a few hundred steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {

std::vector<uint8_t> synthetic_corpus(uint64_t seed, const std::string& split, int64_t bytes);

}  // namespace lockstep
