// What both decode attention paths (decode_attention_cpu.cpp, decode_attention_avx512.h) share:
// prefetching a slot's rows and the softmax of a sequence's scores.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace tandem_cpu::attn {

// every head of one slot: its rows are contiguous, one cache line at a time (kLevel: 3 = L1, 2 = L2, 1 = L3)
template <int kLevel = 3, typename kv_t>
inline void prefetch_slot(const kv_t* pool, int64_t slot, int64_t row_elems) {
  const char* row = reinterpret_cast<const char*>(pool + slot * row_elems);
  for (int64_t byte = 0; byte < row_elems * int64_t(sizeof(kv_t)); byte += 64) __builtin_prefetch(row + byte, 0, kLevel);
}

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
}  // namespace tandem_cpu::attn
