// The AVX-512 path of decode attention (decode_attention_cpu.cpp), for head dims of 64, 128 and 256.
// Per sequence: its scores 16 keys at a time, softmax, then weighted V with the sums in registers;
// while one sequence computes from cache, the next one's K and V are prefetched.
#pragma once
#if defined(__AVX512F__)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_dtype.h"
#include "decode_attention_common.h"

namespace tandem_cpu::attn {

// Prefetches `count` slots of `pool` (and of `pool2` when set, the two interleaved slot by slot:
// two streams at once read ~20% faster here than one after the other) spread evenly over `steps`
// calls of tick(), at locality 1 (which measured best of the hints), so a sequence's K and V
// arrive while the cores compute on what is already in cache.
template <typename kv_t>
struct SpreadPrefetch {
  const kv_t* pool;
  const kv_t* pool2;
  const int64_t* slots;
  int64_t count, steps, row_elems, done = 0, credit = 0;

  // Bresenham's stepping: no division on the per-token path
  void tick(int64_t units = 1) {
    for (credit += count * units; credit > 0 && done < count; credit -= steps) {
      prefetch_slot<1>(pool, slots[done], row_elems);
      if (pool2 != nullptr) prefetch_slot<1>(pool2, slots[done], row_elems);
      ++done;
    }
  }
};

// AVX-512 path. A K/V row loads as float32 vectors in a lane order of its dtype's choosing:
// float32 and float16 in element order; bfloat16 32 elements at a time as two vectors, the even
// elements then the odd ones (a shift and a mask, no shuffle). Queries are laid out in the same
// order, so dot products are unchanged, and outputs are put back in element order at the end.
template <typename kv_t>
struct Row;

// 16 elements a load (one vector), in element order
struct InOrder16 {
  static constexpr int kElems = 16;  // elements per load, giving kElems / 16 vectors
  static constexpr float kUnit = 1.f;  // what a loaded 1.0 stands for
  static int lane(int e) { return e; }
};

template <>
struct Row<float> : InOrder16 {
  static inline void load(const float* p, __m512* x) { x[0] = _mm512_loadu_ps(p); }
};

template <>
struct Row<at::Half> : InOrder16 {
  static inline void load(const at::Half* p, __m512* x) {
    x[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

template <>
struct Row<at::BFloat16> {
  static constexpr int kElems = 32;
  static constexpr float kUnit = 1.f;
  static int lane(int e) { return (e / 32) * 32 + (e % 2) * 16 + (e % 32) / 2; }
  static inline void load(const at::BFloat16* p, __m512* x) {
    const __m512i raw = _mm512_loadu_si512(p);
    x[0] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    x[1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
};

// fp8 e5m2 is the high byte of a float16: each byte zero-extended into a 16-bit lane, shifted
// into place, then widened like a float16
template <>
struct Row<at::Float8_e5m2> : InOrder16 {
  static inline void load(const at::Float8_e5m2* p, __m512* x) {
    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    x[0] = _mm512_cvtph_ps(_mm256_slli_epi16(words, 8));
  }
};

// fp8 e4m3fn: exponent and mantissa moved into a float16's (see cpu_dtype.h) and widened, which
// reads 2^8 too small; the scores' scale and the softmax's 1 / sum put the 2^8 back (exactly: a
// power of two). Sign-extending the byte to 16 bits copies its sign into bit 15; a shift puts the
// magnitude at bits 7-13 and the mask clears the sign's other copy at bit 14.
template <>
struct Row<at::Float8_e4m3fn> : InOrder16 {
  static constexpr float kUnit = 256.f;
  static inline void load(const at::Float8_e4m3fn* p, __m512* x) {
    const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    x[0] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(words, 7), _mm256_set1_epi16(int16_t(0xBF80))));
  }
};

// a row of kD elements as kD / 16 float32 vectors, in Row's lane order
template <typename kv_t, int kD>
inline void load_row(const kv_t* p, __m512* x) {
#pragma GCC unroll 8
  for (int c = 0; c < kD; c += Row<kv_t>::kElems) Row<kv_t>::load(p + c, x + c / 16);
}

// the block's accumulator for token j sits at index kSlot[j], so that the reduction below hands
// back token j's sum in lane j
constexpr int kSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// 16 vectors -> one whose lane 4j+k holds the sum of the lanes of v[4k+j]: 45 shuffles and adds
// for 16 horizontal sums (about three a sum instead of eight)
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {
    const __m512d lo = _mm512_castps_pd(b[2 * i]), hi = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

// Scores of every query head over one sequence's keys, scaled, 16 tokens at a time. Per KV head
// and block, the key rows are widened to float32 once (into an L1 scratch; float32 rows are read
// in place) and serve the whole GQA group. `on_block(kv_head, t0)` runs before each block (the
// caller's prefetching).
template <typename kv_t, int kD, typename OnBlock>
void compute_scores(const float* q_lanes, const kv_t* k, const int64_t* slots, int64_t n, int64_t stride,
                    int64_t hkv, int64_t group, int64_t slot_elems, float scale, float* scores, OnBlock&& on_block) {
  constexpr int kVec = kD / 16;
  alignas(64) float widened[16 * kD];
  const float* rows[16];
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      on_block(h, t0);
      const int64_t tn = std::min<int64_t>(16, n - t0);
      for (int j = 0; j < tn; ++j) {
        const kv_t* row = k + slots[t0 + j] * slot_elems + h * kD;
        if constexpr (std::is_same_v<kv_t, float>) {
          rows[j] = row;
        } else {
          __m512 x[kVec];
          load_row<kv_t, kD>(row, x);
          for (int u = 0; u < kVec; ++u) _mm512_store_ps(widened + j * kD + u * 16, x[u]);
          rows[j] = widened + j * kD;
        }
      }
      for (int64_t head = h * group; head < (h + 1) * group; ++head) {
        __m512 qv[kVec];
        for (int u = 0; u < kVec; ++u) qv[u] = _mm512_loadu_ps(q_lanes + head * kD + u * 16);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          __m512 s = _mm512_setzero_ps();
          if (j < tn) {
#pragma GCC unroll 16
            for (int u = 0; u < kVec; ++u) s = _mm512_fmadd_ps(_mm512_loadu_ps(rows[j] + u * 16), qv[u], s);
          }
          acc[kSlot[j]] = s;
        }
        _mm512_storeu_ps(scores + head * stride + t0, _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale)));
      }
    }
  }
}

// Weights times V rows for kH query heads of one KV head, their sums in registers, scaled by
// `inv_sum` and stored in Row's lane order. `weights` holds each head's row (stride `stride`);
// `on_token` runs before each token (the caller's prefetching).
template <typename kv_t, int kD, int kH, typename OnToken>
inline void weighted_v(const kv_t* v_head, const int64_t* slots, int64_t n, int64_t slot_elems, const float* weights,
                       int64_t stride, const float* inv_sum, float* out_lanes, OnToken&& on_token) {
  constexpr int kVec = kD / 16;
  __m512 acc[kH][kVec];
  for (int i = 0; i < kH; ++i)
    for (int u = 0; u < kVec; ++u) acc[i][u] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    on_token();
    __m512 x[kVec];
    load_row<kv_t, kD>(v_head + slots[t] * slot_elems, x);
#pragma GCC unroll 16
    for (int i = 0; i < kH; ++i) {
      const __m512 w = _mm512_set1_ps(weights[i * stride + t]);
#pragma GCC unroll 16
      for (int u = 0; u < kVec; ++u) acc[i][u] = _mm512_fmadd_ps(w, x[u], acc[i][u]);
    }
  }
  for (int i = 0; i < kH; ++i)
    for (int u = 0; u < kVec; ++u)
      _mm512_storeu_ps(out_lanes + i * kD + u * 16, _mm512_mul_ps(acc[i][u], _mm512_set1_ps(inv_sum[i])));
}

// weighted_v for `heads` (1..kMax) query heads, the count made a compile-time constant: with a
// runtime bound the compiler kept the sums on the stack, a load and a store around every FMA
// (the whole op 1.3x slower in cache)
template <typename kv_t, int kD, int kMax, typename... Args>
inline void weighted_v_heads(int64_t heads, Args&&... args) {
  switch (heads) {
    case 1: return weighted_v<kv_t, kD, 1>(std::forward<Args>(args)...);
    case 2: return weighted_v<kv_t, kD, std::min(2, kMax)>(std::forward<Args>(args)...);
    case 3: return weighted_v<kv_t, kD, std::min(3, kMax)>(std::forward<Args>(args)...);
    default: return weighted_v<kv_t, kD, kMax>(std::forward<Args>(args)...);
  }
}

template <typename q_t, typename kv_t, int kD>
// `first` (or null: key 0): query b's first key, its row's slots read from there on, seq_lens[b] of them
void decode_attention_avx512(const q_t* q, int64_t q_stride, const kv_t* k, const kv_t* v, const int64_t* req_to_token,
                             int64_t row_stride, const int64_t* rows, const int64_t* seq_lens, const int64_t* first,
                             q_t* out, int64_t bs, int64_t hq, int64_t hkv, float scale) {
  using R = Row<kv_t>;
  constexpr int kVec = kD / 16;
  constexpr int kHeads = kVec >= 16 ? 1 : 16 / kVec;  // query heads whose V accumulators fit in registers
  constexpr int64_t kAhead = 32;  // tokens prefetched ahead while a sequence is first read
  const int64_t group = hq / hkv, slot_elems = hkv * kD;
  parallel_by_length(seq_lens, bs, [&](int64_t begin, int64_t end) {
    std::vector<float> q_lanes(hq * kD), acc_lanes(hq * kD), scores, inv_sum(hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = seq_lens[b], stride = (n + 15) / 16 * 16;
      const int64_t* slots = req_to_token + rows[b] * row_stride + (first != nullptr ? first[b] : 0);
      for (int64_t head = 0; head < hq; ++head)
        for (int e = 0; e < kD; ++e) q_lanes[head * kD + R::lane(e)] = load(q[b * q_stride + head * kD + e]);
      scores.resize(hq * stride);
      // Memory and compute overlap across sequences: while this sequence's scores and weighted V
      // are computed from cache, the next one's K and V are prefetched, evenly over both phases
      // (a block of scores ticks once for its 16 tokens). A thread's first sequence has nothing in
      // cache: its K streams as it is read, its V is fetched during its scores.
      const int64_t blocks = stride / 16;
      const int64_t passes = hkv * ((group + kHeads - 1) / kHeads);
      SpreadPrefetch<kv_t> next_prefetch{k, v, nullptr, 0, hkv * blocks * 16 + passes * n, slot_elems};
      if (b + 1 < end) {
        next_prefetch.slots = req_to_token + rows[b + 1] * row_stride + (first != nullptr ? first[b + 1] : 0);
        next_prefetch.count = seq_lens[b + 1];
      }
      SpreadPrefetch<kv_t> v_prefetch{v, nullptr, slots, b == begin ? n : 0, hkv * blocks, slot_elems};
      auto on_block = [&](int64_t kv_head, int64_t t0) {
        if (kv_head == 0 && b == begin)
          for (int64_t t = t0 + kAhead; t < std::min(t0 + kAhead + 16, n); ++t) prefetch_slot(k, slots[t], slot_elems);
        v_prefetch.tick();
        next_prefetch.tick(16);
      };
      compute_scores<kv_t, kD>(q_lanes.data(), k, slots, n, stride, hkv, group, slot_elems, scale * R::kUnit,
                               scores.data(), on_block);
      softmax_rows(scores.data(), hq, n, stride, inv_sum.data());
      for (float& inv : inv_sum) inv *= R::kUnit;
      // weighted V, up to kHeads query heads of one KV head per pass with their sums in registers
      for (int64_t h = 0; h < hkv; ++h)
        for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
          const int64_t first = h * group + g0;
          weighted_v_heads<kv_t, kD, kHeads>(std::min<int64_t>(kHeads, group - g0), v + h * kD, slots, n, slot_elems,
                                             scores.data() + first * stride, stride, inv_sum.data() + first,
                                             acc_lanes.data() + first * kD, [&] { next_prefetch.tick(); });
        }
      for (int64_t head = 0; head < hq; ++head)
        for (int e = 0; e < kD; ++e) store(out + (b * hq + head) * kD + e, acc_lanes[head * kD + R::lane(e)]);
    }
  });
}
}  // namespace tandem_cpu::attn
#endif
