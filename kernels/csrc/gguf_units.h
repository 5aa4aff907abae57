// The packed GGUF weight's unit (runtime/model/quant/gguf_blocks.py `pack`), shared by the
// kernels that read it (gguf_linear_cpu.cpp, gguf_amx_bf16.h).
//
// Packed layout: [N/16, K/32, U] bytes; a unit (16 features x 32 inputs) holds the 16 features'
// scales, then the data. A weight is d * (u - z) (+ m) with u the unsigned stored value.
//   Q4_0 / Q4_1 (U = 288 / 320): fp16 d (32 bytes), for Q4_1 fp16 m (32 bytes), then 4 x 64 bytes
//     of nibbles: byte 4f + i of the t-th 64 holds the file's qs byte 4t + i of feature f: low
//     nibble = input 4t + i, high nibble = input 16 + 4t + i. z = 8 for Q4_0, 0 for Q4_1.
//   Q8_0 (U = 544): fp16 d, then 8 x 64 bytes; byte 4f + i of the g-th 64 = (q of input 4g + i) ^ 0x80
//     (the "byte layout"); z = 128.
// The K-quants (256-input super-blocks in the file) are repacked per 32-input block into the exact
// float32 scales gguf's numpy dequantize computes (products of an fp16 and a 6- or 8-bit integer:
// exact in float32), so that every weight is the file's, bit for bit:
//   Q4_K (U = 384): float32 D = d * sc_j (64 bytes), float32 M = -(dmin * min_j) (64 bytes), then
//     the nibbles of u (0..15) in Q4_0's layout. Weight = fma(D, u, M): numpy's d * q - dm (d * q
//     is exact, so one rounding either way).
//   Q5_K (U = 448): D and M as Q4_K's; the low 4 bits of u (0..31) as Q4_K's nibbles, then 64 bytes
//     of high bits: bit g of byte 4f + i = bit 4 of u of input 4g + i. Weight = fma(D, u, M).
//   Q6_K (U = 640): float32 D0 (inputs 0-15) and D1 (inputs 16-31), D_h = d * sc (64 bytes each),
//     then u (0..63) in the byte layout (inputs 0-15 are groups 0-3); z = 32. Weight = D_h * (u - 32),
//     exact in float32 (an fp16 times an integer of 8 bits times one of 6).
// Rows of features past N (N % 16 != 0) are zeros, never stored.
#pragma once
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace tandem_cpu::gguf {

constexpr int64_t kFeat = 16;   // features in a unit
constexpr int64_t kBlock = 32;  // inputs in a block

enum QType : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5 };

constexpr bool is_k(QType t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }
// unit bytes: distinct for every type (gguf_linear_cpu.cpp's qtype_of reads the type off them)
constexpr int64_t unit_bytes(QType t) {
  return t == kQ4_0 ? 288 : t == kQ4_1 ? 320 : t == kQ8_0 ? 544 : t == kQ4_K ? 384 : t == kQ5_K ? 448 : 640;
}
constexpr int64_t data_offset(QType t) { return is_k(t) ? 128 : t == kQ4_1 ? 64 : 32; }
constexpr int32_t zero_point(QType t) { return t == kQ4_0 ? 8 : t == kQ8_0 ? 128 : t == kQ6_K ? 32 : 0; }
constexpr bool has_min(QType t) { return t == kQ4_1 || t == kQ4_K || t == kQ5_K; }  // weight = d u + m
constexpr bool byte_data(QType t) { return t == kQ8_0 || t == kQ6_K; }  // else nibbles (+ Q5_K's high bits)

// u of feature f, input i (0..31); data: the unit's data (unit + data_offset)
inline int32_t unit_u(QType t, const uint8_t* data, int64_t f, int64_t i) {
  if (byte_data(t)) return data[(i / 4) * 64 + f * 4 + i % 4];
  const int64_t j = i % 16;
  const uint8_t byte = data[(j / 4) * 64 + f * 4 + j % 4];
  int32_t u = i < 16 ? byte & 15 : byte >> 4;
  if (t == kQ5_K) u |= ((data[256 + f * 4 + i % 4] >> (i / 4)) & 1) << 4;
  return u;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The unit's u as 8 x 64 unsigned bytes in the byte layout: byte 4f + i of w[g] = u of input 4g + i
template <QType T>
inline void expand_u(const uint8_t* unit, __m512i* w) {
  const uint8_t* data = unit + data_offset(T);
  if constexpr (byte_data(T)) {
    for (int g = 0; g < 8; ++g) w[g] = _mm512_loadu_si512(data + g * 64);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(data + g * 64);
      w[g] = _mm512_and_si512(v, low);
      w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if constexpr (T == kQ5_K) {
      // bit g of each high-bits byte moved to bit 4 (16-bit shifts by <= 4: no bit crosses into the
      // other byte's bit 4), then or-ed in: (w & ~0) | (h & 0x10), one ternary-logic op
      const __m512i h = _mm512_loadu_si512(data + 256), bit4 = _mm512_set1_epi8(0x10);
      w[0] = _mm512_ternarylogic_epi32(w[0], _mm512_slli_epi16(h, 4), bit4, 0xF8);
      w[1] = _mm512_ternarylogic_epi32(w[1], _mm512_slli_epi16(h, 3), bit4, 0xF8);
      w[2] = _mm512_ternarylogic_epi32(w[2], _mm512_slli_epi16(h, 2), bit4, 0xF8);
      w[3] = _mm512_ternarylogic_epi32(w[3], _mm512_slli_epi16(h, 1), bit4, 0xF8);
      w[4] = _mm512_ternarylogic_epi32(w[4], h, bit4, 0xF8);
      w[5] = _mm512_ternarylogic_epi32(w[5], _mm512_srli_epi16(h, 1), bit4, 0xF8);
      w[6] = _mm512_ternarylogic_epi32(w[6], _mm512_srli_epi16(h, 2), bit4, 0xF8);
      w[7] = _mm512_ternarylogic_epi32(w[7], _mm512_srli_epi16(h, 3), bit4, 0xF8);
    }
  }
}
#endif

}  // namespace tandem_cpu::gguf
