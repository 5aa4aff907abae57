// Greedy sampling on CPU: each row's first maximum, read in the logits' own dtype. Widening
// bfloat16/float16 to float is exact and keeps order, so the id equals argmax of the float32
// logits, without the float32 copy of the [batch, vocab] logits that the sampler used to make
// (a batch-64 bfloat16 decode step spent ~3 ms there: the copy, then torch's max).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_dtype.h"

namespace {

using tandem_cpu::load;

constexpr int64_t kBlock = 512;  // one vectorized max per block; only the winning block is scanned again

template <typename scalar_t>
float block_max(const scalar_t* x, int64_t n) {
  float m = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, load(x[i]));
  return m;
}

// The first index of the row's maximum: the first block whose maximum beats every earlier
// block's (strictly), then the first element in it equal to that maximum. Nothing compares with
// infinity (the build has -ffast-math): a row of -inf never beats `lowest`, and gives 0, as
// torch's argmax does. NaN logits (a broken model) give an unspecified id.
template <typename scalar_t>
int64_t row_argmax(const scalar_t* x, int64_t n) {
  float best = std::numeric_limits<float>::lowest();
  int64_t best_block = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const float m = block_max(x + b, std::min(kBlock, n - b));
    if (m > best) {
      best = m;
      best_block = b;
    }
  }
  const int64_t end = std::min(best_block + kBlock, n);
  for (int64_t i = best_block; i < end; ++i) {
    if (load(x[i]) == best) return i;
  }
  return best_block;
}

at::Tensor greedy_ids(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits: [batch, vocab] with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0, "logits: an empty vocabulary");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  at::Tensor ids = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = ids.data_ptr<int64_t>();
  tandem_cpu::dispatch_float_types(logits.scalar_type(), "greedy_ids", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) out[r] = row_argmax(x + r * stride, vocab);
    });
  });
  return ids;
}

}  // namespace

// Each row's log(sum(exp(x))) over float32 logits, one thread a row, in one fixed order (the
// max, then the sum of exp(x - max) in 16 lanes added in a fixed tree): a row gets the same bits
// among any rows and at any thread count. torch's logsumexp splits a row across threads when
// there are few rows, so a decode step's logprobs changed with the batch size.
at::Tensor logsumexp_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits: [rows, vocab] float32");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0, "logits: an empty vocab");
  at::Tensor out = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  constexpr int64_t kLanes = 16;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * vocab;
      const float m = block_max(row, vocab);
      if (m == -std::numeric_limits<float>::infinity() || m == std::numeric_limits<float>::infinity()) {
        op[r] = m;  // every token masked (or an infinite logit): no finite sum to take
        continue;
      }
      float lanes[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= vocab; i += kLanes) {
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) lanes[l] += std::exp(row[i + l] - m);
      }
      for (int64_t l = 0; i < vocab; ++i, ++l) lanes[l] += std::exp(row[i] - m);
      for (int64_t width = kLanes / 2; width > 0; width /= 2)
        for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
      op[r] = m + std::log(lanes[0]);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("greedy_ids(Tensor logits) -> Tensor");
  m.def("logsumexp_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("greedy_ids", &greedy_ids);
  m.impl("logsumexp_rows", &logsumexp_rows);
}
