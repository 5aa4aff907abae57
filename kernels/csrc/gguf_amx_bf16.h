// The bfloat16-activation GGUF linear on AMX-BF16: each weight unit is dequantized on the fly into
// the bfloat16 tile TDPBF16PS takes as B, and multiplied against the bfloat16 rows of x as A.
//
// Arithmetic: a weight is rounded once to bfloat16 from its float32 value as gguf's numpy dequantize
// computes it: d * (u - z) (a product of an fp16 and an integer under 2^8, or Q6_K's exact float32
// d_h and u - 32: exact) or fma(d, u, m) for Q4_1, Q4_K and Q5_K (one rounding, as numpy's d * q + m
// or d * q - dm with d * q exact; gguf_units.h), so the tile holds the dequantized bf16 weight (`--quantization
// none` in bf16) bit for bit. Every output element is then one fixed reduction: TDPBF16PS over K in
// ascending steps of 32 into one float32 tile register from zero, the bias (or zero) added in
// float32, then one round-to-nearest-even to bfloat16 (or the float32 kept). That is the sequence
// amx_linear_cpu.cpp computes on the same bf16 weight. Which rows are tiled together, how many
// there are and the thread count never change it: a row gets the same bits alone, in any batch.
//
// Blocking (how rows and features are grouped, never what an element sums): up to 16 rows, a task
// runs four 16-feature blocks at once, their C tiles held over all of K, each step's four units
// dequantized into L1 just before TDPBF16PS reads them. 17 to kChunkRows rows: a task owns pairs of
// feature blocks; it runs every 32-row tile pair over a pair's K units dequantized once, while
// dequantizing the next pair's units a few between tile steps. More rows: a panel of pairs (<= 1 MiB
// of bf16 tiles, in L2) is dequantized once for the whole call and every 32-row block runs through it.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "amx_common.h"
#include "gguf_units.h"

#if defined(TANDEM_AMX) && defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__F16C__)
#define TANDEM_GGUF_AMX_BF16 1
#endif

namespace tandem_cpu::gguf {

inline bool amx_bf16_available() {
#ifdef TANDEM_GGUF_AMX_BF16
  static const bool ok = __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512vbmi") &&
                         tandem_cpu::amx::usable();
  return ok;
#else
  return false;
#endif
}

#ifdef TANDEM_GGUF_AMX_BF16
namespace bf16_tiles {

constexpr int64_t kTileRows = 16;    // rows of an A or C tile; feature columns of a B tile
constexpr int64_t kTileElems = 512;  // bf16 values of a B tile: 16 input pairs x 16 features x 2
constexpr int64_t kChunkRows = 256;  // rows of x held in L2 during a pass over a pair's dequantized tiles

// A B-tile row p (inputs 2p, 2p + 1) is built as two float32 vectors, features 0-7 then 8-15: lane
// 2f + j of half h comes from byte 4 (8h + f) + 2s + j of a 64-byte data vector (s = p % 2, see
// gguf_units.h), moved by vpermb into byte `at` of the lane (the other bytes zeroed or kept).
template <int at>
struct LaneIndex {
  alignas(64) int8_t b[2][2][64];  // [s][h]
  constexpr LaneIndex() : b{} {
    for (int s = 0; s < 2; ++s)
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 16; ++l) b[s][h][4 * l + at] = static_cast<int8_t>(4 * (8 * h + l / 2) + 2 * s + (l & 1));
  }
};
inline constexpr LaneIndex<0> kToLowByte{};
inline constexpr LaneIndex<1> kToByte1{};
inline constexpr LaneIndex<2> kToByte2{};

// The unit's per-feature float32 pair (scale, offset) spread over the lanes of the two halves
struct Spread {
  __m512 d_lo, d_hi, c_lo, c_hi;
  Spread(__m512 d, __m512 c) {
    const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    d_lo = _mm512_permutexvar_ps(lo, d), d_hi = _mm512_permutexvar_ps(hi, d);
    c_lo = _mm512_permutexvar_ps(lo, c), c_hi = _mm512_permutexvar_ps(hi, c);
  }
};

inline void store_pair_row(__m512 lo, __m512 hi, uint16_t* dst) {
  const __m512bh r = _mm512_cvtne2ps_pbh(hi, lo);  // words 0-15 from lo, 16-31 from hi
  _mm512_store_si512(dst, reinterpret_cast<const __m512i&>(r));
}

// row p from the unsigned integers u in src's bytes: fma(float(u), d, c)
inline void row_from_ints(__m512i src, int s, const Spread& w, uint16_t* dst) {
  constexpr __mmask64 kLowBytes = 0x1111111111111111ULL;
  const __m512i idx_lo = _mm512_load_si512(kToLowByte.b[s][0]), idx_hi = _mm512_load_si512(kToLowByte.b[s][1]);
  store_pair_row(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(kLowBytes, idx_lo, src)), w.d_lo, w.c_lo),
                 _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(kLowBytes, idx_hi, src)), w.d_hi, w.c_hi),
                 dst);
}

// row p from bytes 0x80 | u << 3 (u < 16): each becomes byte 2 of the float 16.f (0x41800000), whose
// value is then 16 + u exactly; fma(16 + u, d, c) with c = offset - 16 d
inline void row_from_16_plus(__m512i src, int s, const Spread& w, uint16_t* dst) {
  constexpr __mmask64 kByte2 = 0x4444444444444444ULL;
  const __m512i sixteen = _mm512_set1_epi32(0x41800000);
  const __m512i idx_lo = _mm512_load_si512(kToByte2.b[s][0]), idx_hi = _mm512_load_si512(kToByte2.b[s][1]);
  store_pair_row(
      _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(sixteen, kByte2, idx_lo, src)), w.d_lo, w.c_lo),
      _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(sixteen, kByte2, idx_hi, src)), w.d_hi, w.c_hi),
      dst);
}

// row p from bytes u (any u < 256): each becomes byte 1 of the float 32768.f (0x47000000), whose value
// is then 32768 + u exactly; fma(32768 + u, d, c) with c = offset - 32768 d (exact for the caller's d, offset)
inline void row_from_32768_plus(__m512i src, int s, const Spread& w, uint16_t* dst) {
  constexpr __mmask64 kByte1 = 0x2222222222222222ULL;
  const __m512i base = _mm512_set1_epi32(0x47000000);
  const __m512i idx_lo = _mm512_load_si512(kToByte1.b[s][0]), idx_hi = _mm512_load_si512(kToByte1.b[s][1]);
  store_pair_row(
      _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(base, kByte1, idx_lo, src)), w.d_lo, w.c_lo),
      _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(base, kByte1, idx_hi, src)), w.d_hi, w.c_hi),
      dst);
}

// Whether m - 16 d is exact in float32 (then c = fma(d, -16, m) holds it, and fma(16 + u, d, c) =
// d u + m before its one rounding), judged from exponents alone: two values of at most 11 significant
// bits (fp16's) whose exponents differ by at most 12 have an exact float32 difference (it is a
// multiple of the smaller one's last bit under 2^(larger exponent + 2): at most 24 bits). A zero
// (exponent -inf) fails the test and takes the other formula, which is exact too.
inline bool exact_offset(__m512 m, __m512 d) {
  const __m512 gap = _mm512_sub_ps(_mm512_getexp_ps(m), _mm512_getexp_ps(_mm512_mul_ps(d, _mm512_set1_ps(16.f))));
  return _mm512_cmp_ps_mask(_mm512_abs_ps(gap), _mm512_set1_ps(12.f), _CMP_LE_OQ) == 0xFFFF;
}

// The unit's 16 x 32 weights as TDPBF16PS's B tile: row p holds, for each feature f, the bf16 of
// inputs 2p and 2p + 1 at words 2f and 2f + 1. dst: 1 KiB, 64-byte aligned. Each weight is
// RNE_bf16(d u + c) of its exact value d (u - z) (+ m), whichever of two equal formulas computes it.
template <QType T>
inline void dequantize_unit(const uint8_t* unit, uint16_t* dst) {
  if constexpr (is_k(T)) {  // float32 scales; u expanded to bytes (gguf_units.h), fma(u, d, c) per row
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(unit));
    const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(unit + 64));  // M, or Q6_K's second-half d
    __m512i u[8];
    expand_u<T>(unit, u);
    // Q6_K: fma(u, d_h, -32 d_h) = d_h (u - 32), exact; Q4_K, Q5_K: fma(u, d, m), rounded once
    const Spread w0(d, T == kQ6_K ? _mm512_mul_ps(d, _mm512_set1_ps(-32.f)) : m);
    const Spread w1 = T == kQ6_K ? Spread(m, _mm512_mul_ps(m, _mm512_set1_ps(-32.f))) : w0;
    for (int g = 0; g < 8; ++g) {
      row_from_ints(u[g], 0, g < 4 ? w0 : w1, dst + (2 * g) * 32);
      row_from_ints(u[g], 1, g < 4 ? w0 : w1, dst + (2 * g + 1) * 32);
    }
    return;
  }
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit)));
  const uint8_t* data = unit + data_offset(T);
  if constexpr (T == kQ8_0) {
    // d (32768 + u) - 32896 d = d (u - 128); 32896 d (9 bits times fp16's 11) is exact in float32
    const Spread w(d, _mm512_mul_ps(d, _mm512_set1_ps(-32896.f)));
    for (int g = 0; g < 8; ++g) {
      const __m512i v = _mm512_loadu_si512(data + g * 64);
      row_from_32768_plus(v, 0, w, dst + (2 * g) * 32);
      row_from_32768_plus(v, 1, w, dst + (2 * g + 1) * 32);
    }
    return;
  }
  __m512 c = _mm512_mul_ps(d, _mm512_set1_ps(-24.f));  // Q4_0: d (16 + u) - 24 d = d (u - 8), exact
  if constexpr (T == kQ4_1) {
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 32)));
    c = _mm512_fmadd_ps(d, _mm512_set1_ps(-16.f), m);  // rounded: m - 16 d
    if (!exact_offset(m, d)) {  // rare (|m| far from 16 |d|): fma(u, d, m), the same value by another route
      const Spread w(d, m);
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(data + t * 64);
        const __m512i nl = _mm512_and_si512(v, low), nh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        row_from_ints(nl, 0, w, dst + (2 * t) * 32);
        row_from_ints(nl, 1, w, dst + (2 * t + 1) * 32);
        row_from_ints(nh, 0, w, dst + (8 + 2 * t) * 32);
        row_from_ints(nh, 1, w, dst + (9 + 2 * t) * 32);
      }
      return;
    }
  }
  const Spread w(d, c);
  const __m512i bits = _mm512_set1_epi8(0x78), lead = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int t = 0; t < 4; ++t) {
    const __m512i v = _mm512_loadu_si512(data + t * 64);
    // 0x80 | u << 3 of the low and the high nibbles: (x & 0x78) | 0x80, one ternary-logic op each
    const __m512i nl = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), bits, lead, 0xEA);
    const __m512i nh = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), bits, lead, 0xEA);
    row_from_16_plus(nl, 0, w, dst + (2 * t) * 32);
    row_from_16_plus(nl, 1, w, dst + (2 * t + 1) * 32);
    row_from_16_plus(nh, 0, w, dst + (8 + 2 * t) * 32);
    row_from_16_plus(nh, 1, w, dst + (9 + 2 * t) * 32);
  }
}

// tmm0-3: C (rows0 or rows1 x 16 float32, for feature blocks 0 and 1), tmm4-5: A (rows of x), tmm6-7: B
inline void configure(int64_t rows0, int64_t rows1) {
  tandem_cpu::amx::TileConfig cfg;
  const int64_t rows[4] = {rows0, rows0, rows1, rows1};
  for (int t = 0; t < 4; ++t) cfg.set(t, rows[t], 64);
  cfg.set(4, rows0, 64);
  cfg.set(5, rows1, 64);
  cfg.set(6, kTileRows, 64);
  cfg.set(7, kTileRows, 64);
  cfg.load();
}

inline void store_row(__m512 v, __mmask16 mask, at::BFloat16* out) {
  const __m256bh r = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(out, mask, reinterpret_cast<const __m256i&>(r));
}
inline void store_row(__m512 v, __mmask16 mask, float* out) { _mm512_mask_storeu_ps(out, mask, v); }

// c: a stored tile of `rows` x 16 float32 sums; out: the first of its rows' outputs, `count` features
template <typename out_t>
inline void flush(const float* c, int64_t rows, const float* bias, int64_t count, out_t* out, int64_t out_stride) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) store_row(_mm512_add_ps(_mm512_loadu_ps(c + r * kTileRows), b), mask, out + r * out_stride);
}

// out[m0 : m0 + rows0 + rows1, feature blocks fb[0] and fb[1] (fb[1] < 0: none)]; w: the pair's B tiles [2][kb][512]
template <typename out_t, typename Hook>
void tile_block(const at::BFloat16* x, int64_t k, const uint16_t* w, int64_t kb, const int64_t* fb, int64_t m0,
                int64_t rows0, int64_t rows1, int64_t n, const float* bias, out_t* out, Hook&& between_steps) {
  const bool two = fb[1] >= 0;
  _tile_zero(0);
  if (two) _tile_zero(1);
  if (rows1 > 0) {
    _tile_zero(2);
    if (two) _tile_zero(3);
  }
  const int64_t stride = k * 2;
  const at::BFloat16* a0 = x + m0 * k;
  const at::BFloat16* a1 = a0 + kTileRows * k;
  const uint16_t* b1 = w + kb * kTileElems;
  for (int64_t s = 0; s < kb; ++s) {
    _tile_loadd(4, a0 + s * kBlock, stride);
    _tile_loadd(6, w + s * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
      _tile_loadd(7, b1 + s * kTileElems, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (rows1 > 0) {
      _tile_loadd(5, a1 + s * kBlock, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
    between_steps();
  }
  alignas(64) float c[kTileRows * kTileRows];
  auto out_of = [&](int j, int64_t row0, int64_t rows) {
    const int64_t count = std::min(kFeat, n - fb[j] * kFeat);
    flush(c, rows, bias != nullptr ? bias + fb[j] * kFeat : nullptr, count, out + row0 * n + fb[j] * kFeat, n);
  };
  _tile_stored(0, c, 64);
  out_of(0, m0, rows0);
  if (two) {
    _tile_stored(1, c, 64);
    out_of(1, m0, rows0);
  }
  if (rows1 > 0) {
    _tile_stored(2, c, 64);
    out_of(0, m0 + kTileRows, rows1);
    if (two) {
      _tile_stored(3, c, 64);
      out_of(1, m0 + kTileRows, rows1);
    }
  }
}

// m <= 16 rows: four feature blocks' C tiles (tmm0-3) stay in registers over all of K, A in tmm4,
// B in tmm5-7 (tmm5 again for the fourth); each step's four units are dequantized just before
// TDPBF16PS reads them, into a 4 KiB slot that stays in L1.
constexpr int64_t kAhead = 4;  // steps ahead a stream's next units are prefetched (L3 latency over a step's work)

template <QType T, typename out_t>
void few_rows(const at::BFloat16* x, const uint8_t* packed, int64_t nb, int64_t kb, int64_t n, int64_t m,
              const float* bias, out_t* out) {
  constexpr int64_t ub = unit_bytes(T);
  const int64_t stride = kb * kBlock * 2;
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t w[2][4][kTileElems];
    tandem_cpu::amx::TileConfig cfg;
    for (int t = 0; t < 4; ++t) cfg.set(t, m, 64);
    cfg.set(4, m, 64);
    for (int t = 5; t < 8; ++t) cfg.set(t, kTileRows, 64);
    cfg.load();
    for (int64_t fb0 = begin; fb0 < end; fb0 += 4) {
      const int64_t blocks = std::min<int64_t>(4, end - fb0);
      _tile_zero(0);
      if (blocks > 1) _tile_zero(1);
      if (blocks > 2) _tile_zero(2);
      if (blocks > 3) _tile_zero(3);
      for (int64_t s = 0; s < kb; ++s) {
        uint16_t(*slot)[kTileElems] = w[s & 1];
        // the unit this stream reads kAhead steps on: past K, the next group's block in the same slot
        const int64_t s_ahead = s + kAhead < kb ? s + kAhead : std::min(s + kAhead - kb, kb - 1);
        const int64_t fb_ahead = s + kAhead < kb ? fb0 : fb0 + 4;
        for (int64_t j = 0; j < blocks; ++j) {
          const uint8_t* unit = packed + ((fb0 + j) * kb + s) * ub;
          if (fb_ahead + j < end) {
            const uint8_t* ahead = packed + ((fb_ahead + j) * kb + s_ahead) * ub;
            for (int64_t line = 0; line < ub; line += 64)
              _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
          }
          dequantize_unit<T>(unit, slot[j]);
        }
        _tile_loadd(4, x + s * kBlock, stride);
        _tile_loadd(5, slot[0], 64);
        _tile_dpbf16ps(0, 4, 5);
        if (blocks > 1) {
          _tile_loadd(6, slot[1], 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (blocks > 2) {
          _tile_loadd(7, slot[2], 64);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (blocks > 3) {
          _tile_loadd(5, slot[3], 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      alignas(64) float c[kTileRows * kTileRows];
      for (int64_t j = 0; j < blocks; ++j) {
        switch (j) {
          case 0: _tile_stored(0, c, 64); break;
          case 1: _tile_stored(1, c, 64); break;
          case 2: _tile_stored(2, c, 64); break;
          default: _tile_stored(3, c, 64); break;
        }
        const int64_t fb = fb0 + j, count = std::min(kFeat, n - fb * kFeat);
        flush(c, m, bias != nullptr ? bias + fb * kFeat : nullptr, count, out + fb * kFeat, n);
      }
    }
    _tile_release();
  });
}

// More than kChunkRows rows: a task dequantizes a panel of feature-block pairs at a time (<= kPanelBytes
// of bf16 tiles, in L2) once for the whole call, and runs every 32-row block of x through the panel
// (the block's rows stay in L1/L2 across the panel's pairs).
constexpr int64_t kPanelBytes = 1 << 20;

template <QType T, typename out_t>
void many_rows(const at::BFloat16* x, const uint8_t* packed, int64_t nb, int64_t kb, int64_t n, int64_t m,
               const float* bias, out_t* out) {
  constexpr int64_t ub = unit_bytes(T);
  const int64_t k = kb * kBlock, pairs = (nb + 1) / 2, pair_elems = 2 * kb * kTileElems;
  const int64_t panel = std::max<int64_t>(1, kPanelBytes / (pair_elems * 2));
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    const int64_t held = std::min(panel, end - begin);
    uint16_t* buffer = static_cast<uint16_t*>(std::aligned_alloc(64, held * pair_elems * sizeof(uint16_t)));
    int64_t configured0 = -1, configured1 = -1;
    for (int64_t p0 = begin; p0 < end; p0 += held) {
      const int64_t p1 = std::min(end, p0 + held);
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t u = 0; u < 2 * kb && 2 * p + u / kb < nb; ++u) {
          const uint8_t* unit = packed + ((2 * p + u / kb) * kb + u % kb) * ub;
          for (int64_t line = 0; line < ub; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(unit + 8 * ub + line), _MM_HINT_T0);
          dequantize_unit<T>(unit, buffer + (p - p0) * pair_elems + u * kTileElems);
        }
      for (int64_t m0 = 0; m0 < m; m0 += 2 * kTileRows) {
        const int64_t rows0 = std::min(kTileRows, m - m0);
        const int64_t rows1 = std::max<int64_t>(0, std::min(kTileRows, m - m0 - kTileRows));
        if (rows0 != configured0 || rows1 != configured1) {
          configure(rows0, rows1);
          configured0 = rows0, configured1 = rows1;
        }
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t fb[2] = {2 * p, 2 * p + 1 < nb ? 2 * p + 1 : -1};
          tile_block(x, k, buffer + (p - p0) * pair_elems, kb, fb, m0, rows0, rows1, n, bias, out, [] {});
        }
      }
    }
    if (configured0 >= 0) _tile_release();
    std::free(buffer);
  });
}

}  // namespace bf16_tiles

// x [m, kb * 32] bfloat16 rows @ W.T (+ bias) -> out [m, n]; packed: [nb, kb, unit] (gguf_units.h)
template <QType T, typename out_t>
void linear_amx_bf16(const at::BFloat16* x, const uint8_t* packed, int64_t nb, int64_t kb, int64_t n, int64_t m,
                     const float* bias, out_t* out) {
  using namespace bf16_tiles;
  constexpr int64_t ub = unit_bytes(T);
  if (m <= kTileRows) return few_rows<T>(x, packed, nb, kb, n, m, bias, out);
  if (m > kChunkRows) return many_rows<T>(x, packed, nb, kb, n, m, bias, out);
  const int64_t k = kb * kBlock, pairs = (nb + 1) / 2, units = 2 * kb;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    uint16_t* buffers = static_cast<uint16_t*>(std::aligned_alloc(64, 2 * units * kTileElems * sizeof(uint16_t)));
    // units [from, to) of pair p's 2 x kb (feature block j = u / kb, step u % kb) into dst
    auto dequantize_pair = [&](int64_t p, uint16_t* dst, int64_t from, int64_t to) {
      for (int64_t u = from; u < to; ++u) {
        const int64_t fb = 2 * p + u / kb;
        if (fb >= nb) break;
        const uint8_t* unit = packed + (fb * kb + u % kb) * ub;
        for (int64_t line = 0; line < ub; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(unit + 8 * ub + line), _MM_HINT_T0);
        dequantize_unit<T>(unit, dst + u * kTileElems);
      }
    };
    int64_t configured0 = -1, configured1 = -1, cur = 0;
    bool ready = false;  // buffers[cur] holds the next pair to run
    for (int64_t chunk = 0; chunk < m; chunk += kChunkRows) {
      const int64_t chunk_end = std::min(m, chunk + kChunkRows);
      const int64_t tiles = (chunk_end - chunk + 2 * kTileRows - 1) / (2 * kTileRows);
      for (int64_t p = begin; p < end; ++p) {
        uint16_t* w = buffers + cur * units * kTileElems;
        if (!ready) dequantize_pair(p, w, 0, units);
        // the pair after this one (the first of the next chunk after the last) is dequantized
        // a few units between the tile steps of this one, so the vector work overlaps the tiles'
        const int64_t next = p + 1 < end ? p + 1 : chunk_end < m ? begin : -1;
        uint16_t* w_next = buffers + (cur ^ 1) * units * kTileElems;
        const int64_t per_step = next < 0 ? 0 : (units + tiles * kb - 1) / (tiles * kb);
        int64_t done = 0;
        auto between_steps = [&] {
          if (done < units && per_step > 0) {
            const int64_t to = std::min(units, done + per_step);
            dequantize_pair(next, w_next, done, to);
            done = to;
          }
        };
        const int64_t fb[2] = {2 * p, 2 * p + 1 < nb ? 2 * p + 1 : -1};
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += 2 * kTileRows) {
          const int64_t rows0 = std::min(kTileRows, chunk_end - m0);
          const int64_t rows1 = std::max<int64_t>(0, std::min(kTileRows, chunk_end - m0 - kTileRows));
          if (rows0 != configured0 || rows1 != configured1) {
            configure(rows0, rows1);
            configured0 = rows0, configured1 = rows1;
          }
          tile_block(x, k, w, kb, fb, m0, rows0, rows1, n, bias, out, between_steps);
        }
        if (next >= 0) dequantize_pair(next, w_next, done, units);
        ready = next >= 0;
        cur ^= 1;
      }
    }
    if (configured0 >= 0) _tile_release();
    std::free(buffers);
  });
}
#endif

}  // namespace tandem_cpu::gguf
