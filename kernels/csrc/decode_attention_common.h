// What both decode attention paths (decode_attention_cpu.cpp, decode_attention_avx512.h) share:
// prefetching a slot's rows and the softmax of a sequence's scores.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

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
// fn(begin, end) over items [0, count) in one contiguous range per thread, the ranges cut where
// the summed cost(i) is even: an extend's queries grow along the prompt, and equal counts gave the
// last thread three quarters of a causal prefill. Where a range starts never changes what an item
// computes, only which thread computes it.
template <typename Cost, typename Fn>
void parallel_by_cost(int64_t count, Cost&& cost, Fn&& fn) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), count);
  if (parts <= 1) return fn(int64_t{0}, count);
  std::vector<int64_t> cut(parts + 1, count);
  cut[0] = 0;
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += cost(i);
  int64_t done = 0, part = 1;
  for (int64_t i = 0; i < count && part < parts; ++i) {
    done += cost(i);
    while (part < parts && done * parts >= total * part) cut[part++] = i + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      if (cut[p] < cut[p + 1]) fn(cut[p], cut[p + 1]);
  });
}

// queries [0, bs) split by their lengths (each query's cost)
template <typename Fn>
void parallel_by_length(const int64_t* seq_lens, int64_t bs, Fn&& fn) {
  parallel_by_cost(bs, [&](int64_t b) { return seq_lens[b]; }, std::forward<Fn>(fn));
}
}  // namespace tandem_cpu::attn
