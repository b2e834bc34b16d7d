#include "lockstep/core/float_formats.h"

namespace lockstep {

std::string_view elem_format_name(ElemFormat f) {
  switch (f) {
    case ElemFormat::e4m3:
      return "e4m3";
    case ElemFormat::e5m2:
      return "e5m2";
    case ElemFormat::e2m1:
      break;
  }
  return "e2m1";
}

namespace {
std::array<float, 256> make_table(ElemFormat f) {
  std::array<float, 256> t{};
  for (uint32_t code = 0; code < 256; ++code) t[code] = decode(f, static_cast<uint8_t>(code));
  return t;
}
}  // namespace

const std::array<float, 256>& decode_table(ElemFormat f) {
  static const std::array<float, 256> e4m3 = make_table(ElemFormat::e4m3);
  static const std::array<float, 256> e5m2 = make_table(ElemFormat::e5m2);
  static const std::array<float, 256> e2m1 = make_table(ElemFormat::e2m1);
  return f == ElemFormat::e4m3 ? e4m3 : f == ElemFormat::e5m2 ? e5m2 : e2m1;
}

}  // namespace lockstep
