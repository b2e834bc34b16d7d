// CRC-32C (Castagnoli: reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF), the
// checksum of TFRecord files (train/tensorboard.h) and iSCSI. Check value: crc32c("123456789") =
// 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lockstep {

// The CRC of n bytes at data; `crc` continues a previous result (crc32c(a + b) =
// crc32c(b, crc32c(a))), 0 starts afresh.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace lockstep
