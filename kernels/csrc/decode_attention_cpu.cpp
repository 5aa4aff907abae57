// Paged decode attention on CPU: each request's one query attends over its keys read straight
// from the KV pool through its req_to_token row. No gather into a padded batch: every K/V row
// is read from memory once, in place, and each K/V head row serves its whole GQA group.
//
// Two paths, tested against the same float64 reference: an AVX-512 one for head dims of 64 and
// 128 (the common ones), and a portable one for everything else and CPUs without AVX-512. The
// pool holds q's dtype or fp8 (e5m2 or e4m3, --kv-cache-dtype), widened to float32 as it is read.
// Given the step's new K/V and their slots, the op first stores them (as KVPool.set_kv would),
// which saves a decode step two index_put calls per layer.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_dtype.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using tandem_cpu::load;
using tandem_cpu::store;

// every head of one slot: its rows are contiguous, one cache line at a time (kLevel: 3 = L1, 2 = L2, 1 = L3)
template <int kLevel = 3, typename kv_t>
inline void prefetch_slot(const kv_t* pool, int64_t slot, int64_t row_elems) {
  const char* row = reinterpret_cast<const char*>(pool + slot * row_elems);
  for (int64_t byte = 0; byte < row_elems * int64_t(sizeof(kv_t)); byte += 64) __builtin_prefetch(row + byte, 0, kLevel);
}

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

// softmax of each head's scores in place (row stride `stride`); returns 1 / sum per head
inline void softmax_rows(float* scores, int64_t hq, int64_t n, int64_t stride, float* inv_sum) {
  for (int64_t head = 0; head < hq; ++head) {
    float* sh = scores + head * stride;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) m = std::max(m, sh[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      sh[t] = std::exp(sh[t] - m);
      sum += sh[t];
    }
    inv_sum[head] = 1.f / sum;
  }
}

// Portable path. kD > 0: the head dim known at compile time, so the per-token loops unroll;
// kD == 0: any head dim, read from `d_runtime`.
template <typename q_t, typename kv_t, int64_t kD>
void decode_attention_portable(const q_t* q, int64_t q_stride, const kv_t* k, const kv_t* v, const int64_t* req_to_token,
                               int64_t row_stride, const int64_t* rows, const int64_t* seq_lens, q_t* out,
                               int64_t bs, int64_t hq, int64_t hkv, int64_t d_runtime, float scale) {
  const int64_t d = kD > 0 ? kD : d_runtime;
  const int64_t group = hq / hkv;
  // one task per request, all its KV heads: a slot's K (or V) rows for every head are contiguous,
  // so each token costs one streak of cache lines, prefetched a few tokens ahead
  constexpr int64_t kPrefetch = 4;
  at::parallel_for(0, bs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(hq * d), kf(d), qf(hq * d), inv_sum(hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = seq_lens[b];
      const int64_t* slots = req_to_token + rows[b] * row_stride;
      for (int64_t i = 0; i < hq * d; ++i) qf[i] = load(q[b * q_stride + i]);
      scores.resize(hq * n);
      for (int64_t t = 0; t < n; ++t) {
        if (t + kPrefetch < n) prefetch_slot(k, slots[t + kPrefetch], hkv * d);
        for (int64_t h = 0; h < hkv; ++h) {
          const kv_t* kt = k + (slots[t] * hkv + h) * d;
          for (int64_t i = 0; i < d; ++i) kf[i] = load(kt[i]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + (h * group + g) * d;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < d; ++i) s += qg[i] * kf[i];
            scores[(h * group + g) * n + t] = s * scale;
          }
        }
      }
      softmax_rows(scores.data(), hq, n, n, inv_sum.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        if (t + kPrefetch < n) prefetch_slot(v, slots[t + kPrefetch], hkv * d);
        for (int64_t h = 0; h < hkv; ++h) {
          const kv_t* vt = v + (slots[t] * hkv + h) * d;
          for (int64_t i = 0; i < d; ++i) kf[i] = load(vt[i]);
          for (int64_t g = 0; g < group; ++g) {
            const float w = scores[(h * group + g) * n + t];
            float* ah = acc.data() + (h * group + g) * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ah[i] += w * kf[i];
          }
        }
      }
      for (int64_t head = 0; head < hq; ++head) {
        q_t* oh = out + (b * hq + head) * d;
        for (int64_t i = 0; i < d; ++i) store(oh + i, acc[head * d + i] * inv_sum[head]);
      }
    }
  });
}

#if defined(__AVX512F__)
// AVX-512 path. A K/V row loads as float32 vectors in a lane order of its dtype's choosing:
// float32 and float16 in element order; bfloat16 32 elements at a time as two vectors, the even
// elements then the odd ones (a shift and a mask, no shuffle). Queries are laid out in the same
// order, so dot products are unchanged, and outputs are put back in element order at the end.
template <typename kv_t>
struct Row;

template <>
struct Row<float> {
  static constexpr int kElems = 16;  // elements per load, giving kElems / 16 vectors
  static int lane(int e) { return e; }
  static inline void load(const float* p, __m512* x) { x[0] = _mm512_loadu_ps(p); }
};

template <>
struct Row<at::Half> {
  static constexpr int kElems = 16;
  static int lane(int e) { return e; }
  static inline void load(const at::Half* p, __m512* x) {
    x[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

template <>
struct Row<at::BFloat16> {
  static constexpr int kElems = 32;
  static int lane(int e) { return (e / 32) * 32 + (e % 2) * 16 + (e % 32) / 2; }
  static inline void load(const at::BFloat16* p, __m512* x) {
    const __m512i raw = _mm512_loadu_si512(p);
    x[0] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    x[1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
};

// fp8 e5m2 is the high byte of a float16: shifted into place, then widened like one
template <>
struct Row<at::Float8_e5m2> {
  static constexpr int kElems = 16;
  static int lane(int e) { return e; }
  static inline void load(const at::Float8_e5m2* p, __m512* x) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    x[0] = _mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8));
  }
};

// fp8 e4m3fn: exponent and mantissa moved into a float16's (see cpu_dtype.h), widened, scaled by 2^8
template <>
struct Row<at::Float8_e4m3fn> {
  static constexpr int kElems = 16;
  static int lane(int e) { return e; }
  static inline void load(const at::Float8_e4m3fn* p, __m512* x) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
    x[0] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)), _mm512_set1_ps(256.f));
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
void decode_attention_avx512(const q_t* q, int64_t q_stride, const kv_t* k, const kv_t* v, const int64_t* req_to_token,
                             int64_t row_stride, const int64_t* rows, const int64_t* seq_lens, q_t* out,
                             int64_t bs, int64_t hq, int64_t hkv, float scale) {
  using R = Row<kv_t>;
  constexpr int kVec = kD / 16;
  constexpr int kHeads = kVec >= 16 ? 1 : 16 / kVec;  // query heads whose V accumulators fit in registers
  constexpr int64_t kAhead = 32;  // tokens prefetched ahead while a sequence is first read
  const int64_t group = hq / hkv, slot_elems = hkv * kD;
  at::parallel_for(0, bs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_lanes(hq * kD), acc_lanes(hq * kD), scores, inv_sum(hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = seq_lens[b], stride = (n + 15) / 16 * 16;
      const int64_t* slots = req_to_token + rows[b] * row_stride;
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
        next_prefetch.slots = req_to_token + rows[b + 1] * row_stride;
        next_prefetch.count = seq_lens[b + 1];
      }
      SpreadPrefetch<kv_t> v_prefetch{v, nullptr, slots, b == begin ? n : 0, hkv * blocks, slot_elems};
      auto on_block = [&](int64_t kv_head, int64_t t0) {
        if (kv_head == 0 && b == begin)
          for (int64_t t = t0 + kAhead; t < std::min(t0 + kAhead + 16, n); ++t) prefetch_slot(k, slots[t], slot_elems);
        v_prefetch.tick();
        next_prefetch.tick(16);
      };
      compute_scores<kv_t, kD>(q_lanes.data(), k, slots, n, stride, hkv, group, slot_elems, scale, scores.data(), on_block);
      softmax_rows(scores.data(), hq, n, stride, inv_sum.data());
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
#endif

// src's rows [bs, heads, d] (any strides but the last) into pool slots loc[i], rounded to the
// pool's dtype exactly as KVPool.set_kv rounds (torch's conversions; e4m3, which has no
// infinities, clamped to +-448 first)
template <typename src_t, typename kv_t>
void store_rows(const at::Tensor& src, at::Tensor& pool, const int64_t* loc) {
  const int64_t bs = src.size(0), heads = src.size(1), d = src.size(2);
  const int64_t s0 = src.stride(0), s1 = src.stride(1), slot_elems = heads * d;
  const src_t* s = src.data_ptr<src_t>();
  kv_t* p = pool.data_ptr<kv_t>();
  at::parallel_for(0, bs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t h = 0; h < heads; ++h) {
        const src_t* row = s + i * s0 + h * s1;
        kv_t* dst = p + loc[i] * slot_elems + h * d;
        for (int64_t e = 0; e < d; ++e) {
          if constexpr (std::is_same_v<src_t, kv_t>) {
            dst[e] = row[e];
          } else if constexpr (std::is_same_v<kv_t, at::Float8_e4m3fn>) {
            dst[e] = kv_t(std::min(std::max(static_cast<float>(row[e]), -448.f), 448.f));
          } else {
            dst[e] = kv_t(static_cast<float>(row[e]));
          }
        }
      }
  });
}

struct NewKV {
  const at::Tensor *k, *v, *loc;
};

template <typename q_t, typename kv_t>
void run(const at::Tensor& q, at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& req_to_token,
         const at::Tensor& rows, const at::Tensor& lens, at::Tensor& out, double scale, const NewKV& new_kv) {
  if (new_kv.k != nullptr) {  // before any read: each request's newest slot is among those it attends to
    store_rows<q_t, kv_t>(*new_kv.k, k_buffer, new_kv.loc->data_ptr<int64_t>());
    store_rows<q_t, kv_t>(*new_kv.v, v_buffer, new_kv.loc->data_ptr<int64_t>());
  }
  const int64_t bs = q.size(0), hq = q.size(1), hkv = k_buffer.size(1), d = q.size(2);
  auto args = std::make_tuple(q.data_ptr<q_t>(), q.stride(0), k_buffer.data_ptr<kv_t>(), v_buffer.data_ptr<kv_t>(),
                              req_to_token.data_ptr<int64_t>(), req_to_token.stride(0), rows.data_ptr<int64_t>(),
                              lens.data_ptr<int64_t>(), out.data_ptr<q_t>(), bs, hq, hkv);
  const float s = static_cast<float>(scale);
#if defined(__AVX512F__)
  if (d == 64) return std::apply([&](auto... a) { decode_attention_avx512<q_t, kv_t, 64>(a..., s); }, args);
  if (d == 128) return std::apply([&](auto... a) { decode_attention_avx512<q_t, kv_t, 128>(a..., s); }, args);
#endif
  if (d == 64) return std::apply([&](auto... a) { decode_attention_portable<q_t, kv_t, 64>(a..., d, s); }, args);
  if (d == 128) return std::apply([&](auto... a) { decode_attention_portable<q_t, kv_t, 128>(a..., d, s); }, args);
  std::apply([&](auto... a) { decode_attention_portable<q_t, kv_t, 0>(a..., d, s); }, args);
}

// the step's new K/V: k, v [bs, Hkv, D] in q's dtype (views into the qkv output are fine),
// out_cache_loc [bs] int64 slots inside the pool
NewKV check_new_kv(const at::Tensor& q, const at::Tensor& k_buffer, const c10::optional<at::Tensor>& k,
                   const c10::optional<at::Tensor>& v, const c10::optional<at::Tensor>& loc) {
  if (!k.has_value() && !v.has_value() && !loc.has_value()) return {nullptr, nullptr, nullptr};
  TORCH_CHECK(k.has_value() && v.has_value() && loc.has_value(), "k, v and out_cache_loc come together");
  for (const at::Tensor* t : {&*k, &*v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == q.size(0) && t->size(1) == k_buffer.size(1) &&
                t->size(2) == k_buffer.size(2) && t->stride(2) == 1, "k, v: [batch, kv_heads, head_dim], rows contiguous");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "k, v: q's dtype");
  }
  TORCH_CHECK(loc->scalar_type() == at::kLong && loc->dim() == 1 && loc->size(0) == q.size(0) && loc->is_contiguous(),
              "out_cache_loc: int64 [batch], contiguous");
  const int64_t* slots = loc->data_ptr<int64_t>();
  for (int64_t i = 0; i < loc->size(0); ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < k_buffer.size(0), "out_cache_loc: slot ", slots[i], " is outside the pool");
  return {&*k, &*v, &*loc};
}

at::Tensor decode_attention(const at::Tensor& q, at::Tensor k_buffer, at::Tensor v_buffer,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale, const c10::optional<at::Tensor>& k,
                            const c10::optional<at::Tensor>& v, const c10::optional<at::Tensor>& out_cache_loc) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.dim() == 3, "q, k_buffer, v_buffer: 3 dims each");
  TORCH_CHECK(k_buffer.sizes() == v_buffer.sizes() && k_buffer.dtype() == v_buffer.dtype(),
              "k_buffer and v_buffer differ");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(q.size(2) == k_buffer.size(2), "head_dim of q and the pool differ");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_pool_indices.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong, "req_to_token, req_pool_indices, seq_lens: int64");
  TORCH_CHECK(req_to_token.stride(1) == 1, "req_to_token rows must be contiguous");
  // q may be a view into the fused qkv output: only its heads must be packed rows
  const at::Tensor qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous();
  const at::Tensor rows = req_pool_indices.contiguous(), lens = seq_lens.contiguous();
  const int64_t bs = q.size(0);
  TORCH_CHECK(rows.size(0) == bs && lens.size(0) == bs, "one row and one length per query");
  const NewKV new_kv = check_new_kv(q, k_buffer, k, v, out_cache_loc);
  at::Tensor out = at::empty(q.sizes(), q.options());
  tandem_cpu::dispatch_float_types(q.scalar_type(), "q", [&](auto q_tag) {
    using q_t = decltype(q_tag);
    if (k_buffer.scalar_type() == q.scalar_type())
      return run<q_t, q_t>(qc, k_buffer, v_buffer, req_to_token, rows, lens, out, scale, new_kv);
    if (k_buffer.scalar_type() == at::kFloat8_e5m2)
      return run<q_t, at::Float8_e5m2>(qc, k_buffer, v_buffer, req_to_token, rows, lens, out, scale, new_kv);
    TORCH_CHECK(k_buffer.scalar_type() == at::kFloat8_e4m3fn, "the KV pool holds ", k_buffer.scalar_type(),
                ": it must hold q's dtype (", q.scalar_type(), "), float8_e5m2 or float8_e4m3fn");
    run<q_t, at::Float8_e4m3fn>(qc, k_buffer, v_buffer, req_to_token, rows, lens, out, scale, new_kv);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float scale, Tensor? k=None, Tensor? v=None, "
        "Tensor? out_cache_loc=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
