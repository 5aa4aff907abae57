// Paged attention for bfloat16 queries over a bfloat16 KV pool on AMX, one arithmetic for decode
// and extend. A query row at length n (it attends over its row's first n slots) gets bits that
// depend only on itself and those keys and values, never on the rows computed beside it, the
// batch, or whether it came as a decode step, a prefill, a chunk or a speculative verify:
//
//   scores:  per block of 16 keys (from key 0 on), one tile from zero, TDPBF16PS over the head
//            dim in steps of 32, then times `scale`;
//   softmax: the row's max, exp (exp16, one polynomial) of each score minus it, their sum over
//            blocks of 16 in ascending order, the weights rounded once to bfloat16;
//   output:  per d-tile of 16 columns, TDPBF16PS over chunks of 32 keys (from key 0 on, weights
//            past n are zero), then times 1 / sum, rounded once to bfloat16.
//
// Keys past n only ever meet zero weights, which add nothing (a tile's sums are flushed, never
// denormal, so + 0 is exact): a row computed in a tile of longer rows equals the same row alone.
// The softmax and the epilogue are out-of-line (noinline) so decode and extend run one compiled
// copy of them: -ffast-math may contract or reorder inlined float code differently per call site.
//
// Keys and values are packed per KV head into TDPBF16PS's B layout: K per block of 16 keys a
// [head_dim / 32][16 pairs][16 keys] tile of element pairs, V per chunk of 32 keys a
// [head_dim / 16][16 key pairs][16 columns] tile. Decode packs a sequence's keys as it reads them
// (in cache, per thread); extend packs a request's keys once and shares them among its tokens.
#pragma once
#include "amx_common.h"
#include "decode_attention_avx512.h"
#include "decode_attention_common.h"

#ifdef TANDEM_AMX
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace tandem_cpu::amx_attn {

constexpr int64_t kBlock = 16;  // keys per score tile
constexpr int64_t kChunk = 32;  // keys per weighted-V step
constexpr int64_t kRows = 16;   // query rows per tile

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

// K rows of keys [k0, k0 + 16) (zero past `n`) as kD / 32 B tiles: tile c, row p, column j holds
// key j's elements (32c + 2p, 32c + 2p + 1)
template <int kD>
inline void pack_k_block(const at::BFloat16* pool, const int64_t* slots, int64_t k0, int64_t n, int64_t slot_elems,
                         int64_t head_offset, uint32_t* out) {
  const int64_t tn = std::min<int64_t>(kBlock, n - k0);
  for (int c = 0; c < kD / 32; ++c) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = j < tn ? _mm512_loadu_si512(pool + slots[k0 + j] * slot_elems + head_offset + 32 * c) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(out + (c * 16 + p) * 16, r[p]);
  }
}

// V rows of keys [k0, k0 + 32) (zero past `n`) as kD / 16 B tiles: tile c, row p, column j holds
// element 16c + j of keys k0 + 2p and k0 + 2p + 1
template <int kD>
inline void pack_v_chunk(const at::BFloat16* pool, const int64_t* slots, int64_t k0, int64_t n, int64_t slot_elems,
                         int64_t head_offset, uint32_t* out) {
  alignas(64) static const int16_t kIdx[2][32] = {
      {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
      {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};
  const __m512i idx_lo = _mm512_load_si512(kIdx[0]), idx_hi = _mm512_load_si512(kIdx[1]);
  for (int p = 0; p < 16; ++p) {
    const int64_t a = k0 + 2 * p, b = a + 1;
    const at::BFloat16* ra = a < n ? pool + slots[a] * slot_elems + head_offset : nullptr;
    const at::BFloat16* rb = b < n ? pool + slots[b] * slot_elems + head_offset : nullptr;
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
  // blocks and one V chunk. One sweep over the slots, each slot's rows for every head together,
  // the slots kAhead chunks on prefetched (a request's slots are scattered in the pool).
  static void pack(const at::BFloat16* k, const at::BFloat16* v, const int64_t* slots, int64_t n, int64_t hkv,
                   uint32_t* out, int64_t first, int64_t last) {
    constexpr int64_t kAhead = 2;
    const int64_t slot_elems = hkv * kD, head_words = words(n), v_offset = k_words(n);
    for (int64_t c = first; c < last; ++c) {
      for (int64_t t = (c + kAhead) * kChunk; t < std::min(n, (c + kAhead + 1) * kChunk); ++t) {
        attn::prefetch_slot<2>(k, slots[t], slot_elems);
        attn::prefetch_slot<2>(v, slots[t], slot_elems);
      }
      for (int64_t h = 0; h < hkv; ++h) {
        uint32_t* head_out = out + h * head_words;
        for (int64_t k0 = c * kChunk; k0 < std::min(n, (c + 1) * kChunk); k0 += kBlock)
          pack_k_block<kD>(k, slots, k0, n, slot_elems, h * kD, head_out + k0 / kBlock * (kD / 32) * 256);
        pack_v_chunk<kD>(v, slots, c * kChunk, n, slot_elems, h * kD, head_out + v_offset + c * (kD / 16) * 256);
      }
    }
  }
};

// e^x for x <= 0 (below -87 it is 0): Cody-Waite reduction by ln 2, a degree-6 polynomial
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

// one row's softmax: scores s[0, n) (unscaled) -> weights w[0, n_pad) in bfloat16 (zero past n);
// returns 1 / sum
__attribute__((noinline)) inline float softmax_row(const float* s, int64_t n, int64_t n_pad, float scale,
                                                   at::BFloat16* w) {
  const __m512 sc = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv = neg_inf;
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
    mv = _mm512_max_ps(mv, _mm512_mask_mul_ps(neg_inf, m, _mm512_maskz_loadu_ps(m, s + t), sc));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n_pad; t += 16) {
    const int64_t left = std::max<int64_t>(0, n - t);
    const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), sc), mx);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(x));
    sum = _mm512_add_ps(sum, e);
    const __m256bh wb = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), reinterpret_cast<const __m256i&>(wb));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// a row of sums times 1 / sum, rounded to bfloat16
template <int kD>
__attribute__((noinline)) void finish_row(const float* o, float inv_sum, at::BFloat16* out) {
  for (int c = 0; c < kD; c += 16) {
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + c), _mm512_set1_ps(inv_sum)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), reinterpret_cast<const __m256i&>(r));
  }
}

// tmm0-3: output sums (4 x 16 columns), tmm4: scores, tmm5: A (queries or weights), tmm6-7: B
inline void configure(int64_t rows) {
  amx::TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.set(t, rows, 64);
  cfg.set(6, 16, 64);
  cfg.set(7, 16, 64);
  cfg.load();
}

// Per-thread buffers and the rows configured in the tiles.
struct Scratch {
  std::vector<float> scores, sums;
  std::vector<at::BFloat16> weights, q;
  std::vector<float> inv_sum;
  int64_t configured = -1;
  ~Scratch() {
    if (configured >= 0) _tile_release();
  }
};

// `rows` query rows (rows x kD bfloat16, contiguous) against one KV head's keys packed over
// [0, n_packed); row r attends over its first n[r] keys (n_max the largest); out[r] = out_rows[r]
template <int kD, typename Tick>
void attend(const at::BFloat16* q, int64_t rows, const int64_t* n, int64_t n_max, const uint32_t* packed,
            int64_t n_packed, float scale, at::BFloat16* const* out_rows, Scratch& s, Tick&& tick) {
  if (s.configured != rows) configure(rows), s.configured = rows;
  const int64_t n_pad = round_up(n_max, kChunk);
  s.scores.resize(rows * n_pad);
  s.weights.resize(rows * n_pad);
  s.sums.resize(rows * kD);
  s.inv_sum.resize(rows);
  const uint32_t* k_tiles = packed;
  const uint32_t* v_tiles = packed + Packed<kD>::k_words(n_packed);
  for (int64_t b = 0; b < round_up(n_max, kBlock) / kBlock; ++b) {
    _tile_zero(4);
    for (int c = 0; c < kD / 32; ++c) {
      _tile_loadd(5, q + 32 * c, kD * 2);
      _tile_loadd(6, k_tiles + (b * (kD / 32) + c) * 256, 64);
      _tile_dpbf16ps(4, 5, 6);
    }
    _tile_stored(4, s.scores.data() + b * kBlock, n_pad * 4);
    tick();
  }
  for (int64_t r = 0; r < rows; ++r)
    s.inv_sum[r] = softmax_row(s.scores.data() + r * n_pad, n[r], n_pad, scale, s.weights.data() + r * n_pad);
  for (int dg = 0; dg < kD / 64; ++dg) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < n_pad / kChunk; ++c) {
      const uint32_t* v = v_tiles + (c * (kD / 16) + dg * 4) * 256;
      _tile_loadd(5, s.weights.data() + c * kChunk, n_pad * 2);
      _tile_loadd(6, v, 64);
      _tile_dpbf16ps(0, 5, 6);
      _tile_loadd(7, v + 256, 64);
      _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(6, v + 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, v + 768, 64);
      _tile_dpbf16ps(3, 5, 7);
      tick();
    }
    float* o = s.sums.data() + dg * 64;
    _tile_stored(0, o, kD * 4);
    _tile_stored(1, o + 16, kD * 4);
    _tile_stored(2, o + 32, kD * 4);
    _tile_stored(3, o + 48, kD * 4);
  }
  for (int64_t r = 0; r < rows; ++r) finish_row<kD>(s.sums.data() + r * kD, s.inv_sum[r], out_rows[r]);
}

struct Args {
  const at::BFloat16* q;
  int64_t q_stride;
  const at::BFloat16 *k, *v;
  const int64_t* req_to_token;
  int64_t row_stride;
  const int64_t *rows, *seq_lens;
  at::BFloat16* out;
  int64_t bs, hq, hkv;
  float scale;
};

// A run: queries b .. b + len - 1 of one request at lengths n, n + 1, ... (an extend's tokens;
// a decode query is a run of one).
struct Run {
  int64_t first, len;
};

inline std::vector<Run> find_runs(const Args& a) {
  std::vector<Run> runs;
  for (int64_t b = 0; b < a.bs; ++b) {
    if (!runs.empty()) {
      Run& last = runs.back();
      const int64_t prev = last.first + last.len - 1;
      if (a.rows[b] == a.rows[prev] && a.seq_lens[b] == a.seq_lens[prev] + 1) {
        ++last.len;
        continue;
      }
    }
    runs.push_back({b, 1});
  }
  return runs;
}

// Queries [t0, t0 + tokens) of a run, heads [g0, g0 + heads) of KV head h's group, as one tile,
// over that head's keys packed for [0, n_packed).
template <int kD, typename Tick>
void attend_tile(const Args& a, const Run& run, int64_t h, int64_t t0, int64_t tokens, int64_t g0, int64_t heads,
                 const uint32_t* packed, int64_t n_packed, Scratch& s, Tick&& tick) {
  const int64_t group = a.hq / a.hkv, rows = tokens * heads;
  s.q.resize(rows * kD);
  int64_t n[kRows];
  at::BFloat16* out_rows[kRows];
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t g = 0; g < heads; ++g) {
      const int64_t b = run.first + t0 + i, head = h * group + g0 + g, r = i * heads + g;
      std::copy_n(a.q + b * a.q_stride + head * kD, kD, s.q.data() + r * kD);
      n[r] = a.seq_lens[b];
      out_rows[r] = a.out + (b * a.hq + head) * kD;
    }
  attend<kD>(s.q.data(), rows, n, a.seq_lens[run.first + t0 + tokens - 1], packed, n_packed, a.scale, out_rows, s,
             tick);
}

template <int kD>
void decode_runs(const Args& a, const std::vector<Run>& runs) {
  const int64_t group = a.hq / a.hkv, heads = std::min<int64_t>(group, kRows);
  attn::parallel_by_cost(int64_t(runs.size()), [&](int64_t i) { return a.seq_lens[runs[i].first]; },
                   [&](int64_t begin, int64_t end) {
    Scratch s;
    // grows to the longest sequence a thread has packed and stays: a fresh buffer per call was
    // allocated and zero-filled every layer of every step
    thread_local std::vector<uint32_t> packed;
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs[i];
      const int64_t n = a.seq_lens[run.first];
      const int64_t* slots = a.req_to_token + a.rows[run.first] * a.row_stride;
      const int64_t words = Packed<kD>::words(n);
      if (int64_t(packed.size()) < a.hkv * words + 16) packed.resize(a.hkv * words + 16);
      uint32_t* aligned = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(packed.data()) + 63) & ~uintptr_t(63));
      Packed<kD>::pack(a.k, a.v, slots, n, a.hkv, aligned, 0, round_up(n, kChunk) / kChunk);
      // memory would idle while the heads compute from cache: the next query's keys and values
      // come meanwhile, spread evenly over the tiles' steps (a burst stalled on the fill buffers)
      const int64_t steps = a.hkv * ((group + heads - 1) / heads) * (round_up(n, kBlock) / kBlock + round_up(n, kChunk) / kChunk);
      attn::SpreadPrefetch<at::BFloat16> next{a.k, a.v, nullptr, 0, steps, a.hkv * kD};
      if (i + 1 < end) {
        next.slots = a.req_to_token + a.rows[runs[i + 1].first] * a.row_stride;
        next.count = a.seq_lens[runs[i + 1].first];
      }
      for (int64_t h = 0; h < a.hkv; ++h)
        for (int64_t g0 = 0; g0 < group; g0 += heads)
          attend_tile<kD>(a, run, h, 0, 1, g0, std::min(heads, group - g0), aligned + h * words, n, s,
                          [&] { next.tick(); });
    }
  });
}

// one run of many queries: every KV head packed once (in parallel), then tiles of up to 16 rows
template <int kD>
void extend_run(const Args& a, const Run& run) {
  const int64_t group = a.hq / a.hkv, heads = std::min<int64_t>(group, kRows), tokens = kRows / heads;
  const int64_t n = a.seq_lens[run.first + run.len - 1], chunks = round_up(n, kChunk) / kChunk;
  const int64_t words = Packed<kD>::words(n);
  at::Tensor packed_t = at::empty({a.hkv * words + 16}, at::kInt);
  uint32_t* packed = reinterpret_cast<uint32_t*>(
      (reinterpret_cast<uintptr_t>(packed_t.data_ptr<int32_t>()) + 63) & ~uintptr_t(63));
  const int64_t* slots = a.req_to_token + a.rows[run.first] * a.row_stride;
  at::parallel_for(0, chunks, 4, [&](int64_t begin, int64_t end) {
    Packed<kD>::pack(a.k, a.v, slots, n, a.hkv, packed, begin, end);
  });
  // items: (token tile, KV head, head group), costed by the tile's last length
  const int64_t tiles = (run.len + tokens - 1) / tokens, head_tiles = (group + heads - 1) / heads;
  const int64_t per_tile = a.hkv * head_tiles;
  attn::parallel_by_cost(tiles * per_tile, [&](int64_t i) {
    const int64_t t0 = i / per_tile * tokens;
    return a.seq_lens[run.first + std::min(run.len, t0 + tokens) - 1];
  }, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t0 = i / per_tile * tokens, h = i % per_tile / head_tiles, g0 = i % head_tiles * heads;
      attend_tile<kD>(a, run, h, t0, std::min(tokens, run.len - t0), g0, std::min(heads, group - g0), packed + h * words,
                      n, s, [] {});
    }
  });
}

template <int kD>
void attention(const Args& a) {
  const std::vector<Run> runs = find_runs(a);
  std::vector<Run> single;
  for (const Run& run : runs)
    if (run.len == 1) single.push_back(run);
  if (!single.empty()) decode_runs<kD>(a, single);
  for (const Run& run : runs)
    if (run.len > 1) extend_run<kD>(a, run);
}

}  // namespace tandem_cpu::amx_attn
#endif
