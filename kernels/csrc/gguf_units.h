// The packed GGUF weight's unit (runtime/model/quant/gguf_blocks.py `pack`), shared by the
// kernels that read it (gguf_linear_cpu.cpp, gguf_amx_bf16.h).
//
// Packed layout: [N/16, K/32, U] bytes; a unit (16 features x 32 inputs) holds the 16 features'
// fp16 scales d (32 bytes), for Q4_1 their fp16 mins m (32 bytes), then the data:
//   Q4_0/Q4_1 (U = 288 / 320): 4 x 64 bytes; byte 4f + i of the t-th 64 holds the file's qs byte
//     4t + i of feature f: low nibble = input 4t + i, high nibble = input 16 + 4t + i.
//   Q8_0 (U = 544): 8 x 64 bytes; byte 4f + i of the g-th 64 = (q of input 4g + i) ^ 0x80.
// A weight is d * (u - z) (+ m for Q4_1) with u the unsigned stored value: z = 8 for Q4_0, 128 for
// Q8_0, 0 for Q4_1. Rows of features past N (N % 16 != 0) are zeros, never stored.
#pragma once
#include <cstdint>

namespace tandem_cpu::gguf {

constexpr int64_t kFeat = 16;   // features in a unit
constexpr int64_t kBlock = 32;  // inputs in a block

enum QType : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

constexpr int64_t unit_bytes(QType t) { return t == kQ4_0 ? 288 : t == kQ4_1 ? 320 : 544; }
constexpr int64_t data_offset(QType t) { return t == kQ4_1 ? 64 : 32; }
constexpr int32_t zero_point(QType t) { return t == kQ4_0 ? 8 : t == kQ8_0 ? 128 : 0; }

}  // namespace tandem_cpu::gguf
