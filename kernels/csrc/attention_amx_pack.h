// The AMX attention's packing (attention_amx.h): one KV head's keys and values in TDPBF16PS's B
// layout, K per block of 16 keys, V per chunk of 32, keys below `skip` and past `n` as zeros.
#pragma once
#include "amx_common.h"
#include "decode_attention_common.h"

#ifdef TANDEM_AMX
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace tandem_cpu::amx_attn {

constexpr int64_t kBlock = 16;  // keys per score tile
constexpr int64_t kChunk = 32;  // keys per weighted-V step

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// 16 x 16 dwords transposed in registers: r[i] holds row i in, column i out
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + e], 128-bit lane L: rows 4g .. 4g + 3 of column 4L + e
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g + 0], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g + 0], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  // column 4L + e: lane L of u[e], u[4 + e], u[8 + e], u[12 + e]
  auto gather = [&](auto lane) {
    constexpr int L = decltype(lane)::value;
    constexpr int same = L | (L << 2) | (L << 4) | (L << 6);
    for (int e = 0; e < 4; ++e) {
      const __m512i lo = _mm512_shuffle_i32x4(u[e], u[4 + e], same);
      const __m512i hi = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], same);
      r[4 * L + e] = _mm512_shuffle_i32x4(lo, hi, 0 | (2 << 2) | (0 << 4) | (2 << 6));
    }
  };
  gather(std::integral_constant<int, 0>{});
  gather(std::integral_constant<int, 1>{});
  gather(std::integral_constant<int, 2>{});
  gather(std::integral_constant<int, 3>{});
}

// K rows of keys [k0, k0 + 16) (zero below `skip` and past `n`) as kD / 32 B tiles: tile c, row p, column j holds
// key j's elements (32c + 2p, 32c + 2p + 1)
template <int kD>
inline void pack_k_block(const at::BFloat16* pool, const int64_t* slots, int64_t k0, int64_t n, int64_t skip,
                         int64_t slot_elems, int64_t head_offset, uint32_t* out) {
  const int64_t tn = std::min<int64_t>(kBlock, n - k0);
  for (int c = 0; c < kD / 32; ++c) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = j < tn && k0 + j >= skip ? _mm512_loadu_si512(pool + slots[k0 + j] * slot_elems + head_offset + 32 * c)
                                      : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(out + (c * 16 + p) * 16, r[p]);
  }
}

// V rows of keys [k0, k0 + 32) (zero below `skip` and past `n`) as kD / 16 B tiles: tile c, row p, column j holds
// element 16c + j of keys k0 + 2p and k0 + 2p + 1
template <int kD>
inline void pack_v_chunk(const at::BFloat16* pool, const int64_t* slots, int64_t k0, int64_t n, int64_t skip,
                         int64_t slot_elems, int64_t head_offset, uint32_t* out) {
  alignas(64) static const int16_t kIdx[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i idx_lo = _mm512_load_si512(kIdx[0]), idx_hi = _mm512_load_si512(kIdx[1]);
  for (int p = 0; p < 16; ++p) {
    const int64_t a = k0 + 2 * p, b = a + 1;
    const at::BFloat16* ra = a < n && a >= skip ? pool + slots[a] * slot_elems + head_offset : nullptr;
    const at::BFloat16* rb = b < n && b >= skip ? pool + slots[b] * slot_elems + head_offset : nullptr;
    for (int h = 0; h < kD / 32; ++h) {
      const __m512i va = ra != nullptr ? _mm512_loadu_si512(ra + 32 * h) : _mm512_setzero_si512();
      const __m512i vb = rb != nullptr ? _mm512_loadu_si512(rb + 32 * h) : _mm512_setzero_si512();
      _mm512_store_si512(out + ((2 * h) * 16 + p) * 16, _mm512_permutex2var_epi16(va, idx_lo, vb));
      _mm512_store_si512(out + ((2 * h + 1) * 16 + p) * 16, _mm512_permutex2var_epi16(va, idx_hi, vb));
    }
  }
}

// one KV head's keys [0, n) packed: K blocks then V chunks
template <int kD>
struct Packed {
  static int64_t k_words(int64_t n) { return round_up(n, kBlock) / kBlock * (kD / 32) * 256; }
  static int64_t v_words(int64_t n) { return round_up(n, kChunk) / kChunk * (kD / 16) * 256; }
  static int64_t words(int64_t n) { return k_words(n) + v_words(n); }

  // chunks [first, last) of 32 keys, every KV head (head h at out + h * words(n)): their two K
  // blocks (unless !with_k: left as they were) and one V chunk, keys below `skip` as zeros (unread). One sweep over the slots, each
  // slot's rows for every head together, the slots kAhead chunks on prefetched (a request's
  // slots are scattered in the pool).
  static void pack(const at::BFloat16* k, const at::BFloat16* v, const int64_t* slots, int64_t n, int64_t skip,
                   int64_t hkv, uint32_t* out, int64_t first, int64_t last, bool with_k = true) {
    constexpr int64_t kAhead = 2;
    const int64_t slot_elems = hkv * kD, head_words = words(n), v_offset = k_words(n);
    for (int64_t c = first; c < last; ++c) {
      for (int64_t t = std::max(skip, (c + kAhead) * kChunk); t < std::min(n, (c + kAhead + 1) * kChunk); ++t) {
        attn::prefetch_slot<2>(k, slots[t], slot_elems);
        attn::prefetch_slot<2>(v, slots[t], slot_elems);
      }
      for (int64_t h = 0; h < hkv; ++h) {
        uint32_t* head_out = out + h * head_words;
        for (int64_t k0 = c * kChunk; with_k && k0 < std::min(n, (c + 1) * kChunk); k0 += kBlock)
          pack_k_block<kD>(k, slots, k0, n, skip, slot_elems, h * kD, head_out + k0 / kBlock * (kD / 32) * 256);
        pack_v_chunk<kD>(v, slots, c * kChunk, n, skip, slot_elems, h * kD, head_out + v_offset + c * (kD / 16) * 256);
      }
    }
  }
};

}  // namespace tandem_cpu::amx_attn
#endif
