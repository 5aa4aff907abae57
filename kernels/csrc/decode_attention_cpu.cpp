// Paged decode attention on CPU: each request's one query attends over its keys read straight
// from the KV pool through its req_to_token row. No gather into a padded batch: every K/V row
// is read from memory once, in place, and each K/V head row serves its whole GQA group.
//
// Three paths, tested against the same float64 reference: bf16 on AMX for head dims of 64 and 128
// (attention_amx.h: an extend's tokens of one request computed together, in decode's arithmetic),
// an AVX-512 one for the other dtypes at those head dims and for every dtype at 256 (Gemma 3's;
// decode_attention_avx512.h), and a
// portable one (below) for everything else and CPUs without AVX-512. The pool holds q's dtype or fp8 (e5m2 or e4m3,
// --kv-cache-dtype), widened to float32 as it is read.
// Given the step's new K/V and their slots, the op first stores them (as KVPool.set_kv would),
// which saves a decode step two index_put calls per layer.
// A sliding window (window > 0: a query at length n attends to keys [n - window, n) only, as
// transformers' sliding_window) is a start per query: the portable and AVX-512 paths read from that
// slot on, the AMX path masks below it (attention_amx.h). Keys before the window are never read.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "attention_amx.h"
#include "cpu_dtype.h"
#include "decode_attention_avx512.h"
#include "decode_attention_common.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using tandem_cpu::load;
using tandem_cpu::store;
using tandem_cpu::attn::prefetch_slot;
using tandem_cpu::attn::softmax_rows;

// Portable path. kD > 0: the head dim known at compile time, so the per-token loops unroll;
// kD == 0: any head dim, read from `d_runtime`.
template <typename q_t, typename kv_t, int64_t kD>
void decode_attention_portable(const q_t* q, int64_t q_stride, const kv_t* k, const kv_t* v, const int64_t* req_to_token,
                               int64_t row_stride, const int64_t* rows, const int64_t* seq_lens, const int64_t* first,
                               q_t* out, int64_t bs, int64_t hq, int64_t hkv, int64_t d_runtime, float scale) {
  const int64_t d = kD > 0 ? kD : d_runtime;
  const int64_t group = hq / hkv;
  // one task per request, all its KV heads: a slot's K (or V) rows for every head are contiguous,
  // so each token costs one streak of cache lines, prefetched a few tokens ahead
  constexpr int64_t kPrefetch = 4;
  tandem_cpu::attn::parallel_by_length(seq_lens, bs, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(hq * d), kf(d), qf(hq * d), inv_sum(hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = seq_lens[b];  // keys from the window's first (seq_lens holds the window's length)
      const int64_t* slots = req_to_token + rows[b] * row_stride + (first != nullptr ? first[b] : 0);
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
         const at::Tensor& rows, const at::Tensor& lens, at::Tensor& out, double scale, const NewKV& new_kv,
         int64_t window) {
  if (new_kv.k != nullptr) {  // before any read: each request's newest slot is among those it attends to
    store_rows<q_t, kv_t>(*new_kv.k, k_buffer, new_kv.loc->data_ptr<int64_t>());
    store_rows<q_t, kv_t>(*new_kv.v, v_buffer, new_kv.loc->data_ptr<int64_t>());
  }
  const int64_t bs = q.size(0), hq = q.size(1), hkv = k_buffer.size(1), d = q.size(2);
  const float s = static_cast<float>(scale);
#ifdef TANDEM_AMX
  if constexpr (std::is_same_v<q_t, at::BFloat16> && std::is_same_v<kv_t, at::BFloat16>) {
    if ((d == 64 || d == 128) && tandem_cpu::amx::usable()) {
      const tandem_cpu::amx_attn::Args a{q.data_ptr<q_t>(), q.stride(0), k_buffer.data_ptr<kv_t>(), v_buffer.data_ptr<kv_t>(),
                                         req_to_token.data_ptr<int64_t>(), req_to_token.stride(0), rows.data_ptr<int64_t>(),
                                         lens.data_ptr<int64_t>(), out.data_ptr<q_t>(), bs, hq, hkv, s, window};
      return d == 64 ? tandem_cpu::amx_attn::attention<64>(a) : tandem_cpu::amx_attn::attention<128>(a);
    }
  }
#endif
  // a window: each query's first key and the count from it
  std::vector<int64_t> first, counts;
  const int64_t* n = lens.data_ptr<int64_t>();
  if (window > 0) {
    first.resize(bs), counts.resize(bs);
    for (int64_t b = 0; b < bs; ++b) first[b] = std::max<int64_t>(0, n[b] - window), counts[b] = n[b] - first[b];
    n = counts.data();
  }
  auto args = std::make_tuple(q.data_ptr<q_t>(), q.stride(0), k_buffer.data_ptr<kv_t>(), v_buffer.data_ptr<kv_t>(),
                              req_to_token.data_ptr<int64_t>(), req_to_token.stride(0), rows.data_ptr<int64_t>(), n,
                              window > 0 ? static_cast<const int64_t*>(first.data()) : nullptr, out.data_ptr<q_t>(),
                              bs, hq, hkv);
#if defined(__AVX512F__)
  if (d == 64) return std::apply([&](auto... a) { tandem_cpu::attn::decode_attention_avx512<q_t, kv_t, 64>(a..., s); }, args);
  if (d == 128) return std::apply([&](auto... a) { tandem_cpu::attn::decode_attention_avx512<q_t, kv_t, 128>(a..., s); }, args);
  // Gemma 3's head dim (one V accumulator set at a time: kHeads is 1 there)
  if (d == 256) return std::apply([&](auto... a) { tandem_cpu::attn::decode_attention_avx512<q_t, kv_t, 256>(a..., s); }, args);
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
                            const c10::optional<at::Tensor>& v, const c10::optional<at::Tensor>& out_cache_loc,
                            int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.dim() == 3, "q, k_buffer, v_buffer: 3 dims each");
  TORCH_CHECK(k_buffer.sizes() == v_buffer.sizes() && k_buffer.dtype() == v_buffer.dtype(),
              "k_buffer and v_buffer differ");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(q.size(2) == k_buffer.size(2), "head_dim of q and the pool differ");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_pool_indices.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong, "req_to_token, req_pool_indices, seq_lens: int64");
  TORCH_CHECK(req_to_token.stride(1) == 1, "req_to_token rows must be contiguous");
  TORCH_CHECK(window >= 0, "window: 0 (every key) or the keys a query attends to, got ", window);
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
      return run<q_t, q_t>(qc, k_buffer, v_buffer, req_to_token, rows, lens, out, scale, new_kv, window);
    if (k_buffer.scalar_type() == at::kFloat8_e5m2)
      return run<q_t, at::Float8_e5m2>(qc, k_buffer, v_buffer, req_to_token, rows, lens, out, scale, new_kv, window);
    TORCH_CHECK(k_buffer.scalar_type() == at::kFloat8_e4m3fn, "the KV pool holds ", k_buffer.scalar_type(),
                ": it must hold q's dtype (", q.scalar_type(), "), float8_e5m2 or float8_e4m3fn");
    run<q_t, at::Float8_e4m3fn>(qc, k_buffer, v_buffer, req_to_token, rows, lens, out, scale, new_kv, window);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float scale, Tensor? k=None, Tensor? v=None, "
        "Tensor? out_cache_loc=None, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
