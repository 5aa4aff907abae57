// Paged decode attention on CPU: each request's one query attends over its keys read straight
// from the KV pool through its req_to_token row. No gather into a padded batch: every K/V row
// is read once, in place, and each K/V head row once for its whole GQA group.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_dtype.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using tandem_cpu::load;

// every head of one slot: its rows are contiguous, one cache line at a time
template <typename kv_t>
inline void prefetch_slot(const kv_t* pool, int64_t slot, int64_t row_elems) {
  const char* row = reinterpret_cast<const char*>(pool + slot * row_elems);
  for (int64_t byte = 0; byte < row_elems * int64_t(sizeof(kv_t)); byte += 64) __builtin_prefetch(row + byte);
}

// kD > 0: the head dim known at compile time, so the per-token loops unroll and the GQA group's
// accumulators stay in registers; kD == 0: any head dim, read from `d_runtime`.
template <typename kv_t, int64_t kD>
void decode_attention_kernel(const float* q, const kv_t* k, const kv_t* v, const int64_t* req_to_token,
                             int64_t row_stride, const int64_t* rows, const int64_t* seq_lens, float* out,
                             int64_t bs, int64_t hq, int64_t hkv, int64_t d_runtime, float scale) {
  const int64_t d = kD > 0 ? kD : d_runtime;
  const int64_t group = hq / hkv;
  // one task per request, all its KV heads: a slot's K (or V) rows for every head are contiguous,
  // so each token costs one streak of cache lines, prefetched a few tokens ahead
  constexpr int64_t kPrefetch = 4;
  at::parallel_for(0, bs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(hq * d), kf(d), inv_sum(hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = seq_lens[b];
      const int64_t* slots = req_to_token + rows[b] * row_stride;
      const float* qb = q + b * hq * d;
      scores.resize(hq * n);
      for (int64_t t = 0; t < n; ++t) {
        if (t + kPrefetch < n) prefetch_slot(k, slots[t + kPrefetch], hkv * d);
        for (int64_t h = 0; h < hkv; ++h) {
          const kv_t* kt = k + (slots[t] * hkv + h) * d;
          for (int64_t i = 0; i < d; ++i) kf[i] = load(kt[i]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qb + (h * group + g) * d;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < d; ++i) s += qg[i] * kf[i];
            scores[(h * group + g) * n + t] = s * scale;
          }
        }
      }
      for (int64_t head = 0; head < hq; ++head) {
        float* sh = scores.data() + head * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sh[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sh[t] = std::exp(sh[t] - m);
          sum += sh[t];
        }
        inv_sum[head] = 1.f / sum;
      }
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
        float* oh = out + (b * hq + head) * d;
        for (int64_t i = 0; i < d; ++i) oh[i] = acc[head * d + i] * inv_sum[head];
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.dim() == 3, "q, k_buffer, v_buffer: 3 dims each");
  TORCH_CHECK(k_buffer.sizes() == v_buffer.sizes() && k_buffer.dtype() == v_buffer.dtype(),
              "k_buffer and v_buffer differ");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(q.size(2) == k_buffer.size(2), "head_dim of q and the pool differ");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_pool_indices.scalar_type() == at::kLong &&
              seq_lens.scalar_type() == at::kLong, "req_to_token, req_pool_indices, seq_lens: int64");
  TORCH_CHECK(req_to_token.stride(1) == 1, "req_to_token rows must be contiguous");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const at::Tensor rows = req_pool_indices.contiguous(), lens = seq_lens.contiguous();
  const int64_t bs = q.size(0), hq = q.size(1), hkv = k_buffer.size(1), d = q.size(2);
  TORCH_CHECK(rows.size(0) == bs && lens.size(0) == bs, "one row and one length per query");
  at::Tensor out = at::empty({bs, hq, d}, q.options().dtype(at::kFloat));
  tandem_cpu::dispatch_float_types(k_buffer.scalar_type(), "KV pool", [&](auto tag) {
    using kv_t = decltype(tag);
    auto kernel = d == 64 ? decode_attention_kernel<kv_t, 64>
                  : d == 128 ? decode_attention_kernel<kv_t, 128> : decode_attention_kernel<kv_t, 0>;
    kernel(qf.data_ptr<float>(), k_buffer.data_ptr<kv_t>(), v_buffer.data_ptr<kv_t>(),
                                  req_to_token.data_ptr<int64_t>(), req_to_token.stride(0), rows.data_ptr<int64_t>(),
                                  lens.data_ptr<int64_t>(), out.data_ptr<float>(), bs, hq, hkv, d,
                                  static_cast<float>(scale));
  });
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
