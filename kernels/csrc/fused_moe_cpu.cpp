// The mixture-of-experts MLP on CPU in one op: out[t] = sum_k w[t, k] * down(silu(gate x) * up x)
// over token t's experts ids[t, k]. The (token, k) pairs are grouped by expert once; then, in C++
// and not in Python, a loop over the experts that have tokens runs each expert's two GEMMs on its
// gathered pairs, every weight row read once for the whole group (a work item is an expert and a
// block of its output rows, the items spread over the threads by cost). No Python loop at all, and
// no per-token loop over experts.
//
// Batch invariance: every output element is one call of `dot` (noinline: one compiled copy, one
// summation order), so a pair's activations and outputs are the same bits whatever else is in the
// batch or on which thread; the k partial outputs of a token are summed in k order. So a token's
// output never depends on the batch (tests/kernels/test_fused_moe_cpu.py).
//
// Layout (runtime/model/moe.py): x [T, H]; w13 [E, 2I, H] each expert's [gate; up] rows; w2
// [E, H, I]; topk_weights [T, K] float32; topk_ids [T, K] int64. float32, bfloat16 or float16
// weights (x in the same dtype), accumulated in float32; the activations stay float32.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_dtype.h"
#include "decode_attention_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using tandem_cpu::load;
using tandem_cpu::store;

constexpr int64_t kGateRows = 8;  // intermediate rows (gate and up each) per work item of GEMM 1
constexpr int64_t kDownRows = 16;  // output rows per work item of GEMM 2

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// sum_i x[i] * w[i]: two 16-lane accumulators over blocks of 32, then the lanes, then the tail
template <typename w_t>
__attribute__((noinline)) float dot(const float* x, const w_t* w, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load16(w + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), load16(w + i + 16), a1);
  }
  if (i + 16 <= n) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load16(w + i), a0);
    i += 16;
  }
  s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s += x[i] * load(w[i]);
  return s;
}

struct Groups {
  std::vector<int64_t> start;  // expert e's pairs are order[start[e], start[e + 1])
  std::vector<int64_t> order;  // pair ids t * K + k, grouped by expert, ascending within one
  std::vector<int64_t> pos;    // pair id -> its place in `order`
};

Groups group_by_expert(const int64_t* ids, int64_t pairs, int64_t experts) {
  Groups g;
  g.start.assign(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "topk_ids: expert ", ids[p], " is outside [0, ", experts, ")");
    ++g.start[ids[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  g.order.resize(pairs);
  g.pos.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    g.pos[p] = fill[ids[p]]++;
    g.order[g.pos[p]] = p;
  }
  return g;
}

// (expert, first row) work items over `rows` output rows per expert in blocks of `block`, for
// the experts that have pairs; fn(expert, row begin, row end) runs them spread by cost
template <typename Fn>
void for_expert_blocks(const Groups& g, int64_t experts, int64_t rows, int64_t block, Fn&& fn) {
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t e = 0; e < experts; ++e)
    if (g.start[e + 1] > g.start[e])
      for (int64_t r = 0; r < rows; r += block) items.emplace_back(e, r);
  tandem_cpu::attn::parallel_by_cost(
      int64_t(items.size()), [&](int64_t i) { return g.start[items[i].first + 1] - g.start[items[i].first]; },
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          fn(items[i].first, items[i].second, std::min(rows, items[i].second + block));
      });
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
         const at::Tensor& topk_ids, at::Tensor& out) {
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1), experts = w13.size(0);
  const int64_t width = w13.size(1) / 2, pairs = tokens * top_k;
  const Groups g = group_by_expert(topk_ids.data_ptr<int64_t>(), pairs, experts);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // each row widened once, not once per expert row
  const float* xs = xf.data_ptr<float>();
  const scalar_t* w_gate_up = w13.data_ptr<scalar_t>();
  const scalar_t* w_down = w2.data_ptr<scalar_t>();
  std::vector<float> act(pairs * width), down(pairs * hidden);
  // GEMM 1 and the activation: row n of an expert's gate and row n of its up, for each of its pairs
  for_expert_blocks(g, experts, width, kGateRows, [&](int64_t e, int64_t n0, int64_t n1) {
    const scalar_t* we = w_gate_up + e * 2 * width * hidden;
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t q = g.start[e]; q < g.start[e + 1]; ++q) {
        const float* xr = xs + (g.order[q] / top_k) * hidden;
        const float gate = dot(xr, we + n * hidden, hidden), up = dot(xr, we + (width + n) * hidden, hidden);
        act[q * width + n] = gate / (1.f + std::exp(-gate)) * up;
      }
  });
  // GEMM 2: row h of an expert's down projection, for each of its pairs
  for_expert_blocks(g, experts, hidden, kDownRows, [&](int64_t e, int64_t h0, int64_t h1) {
    const scalar_t* we = w_down + e * hidden * width;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t q = g.start[e]; q < g.start[e + 1]; ++q)
        down[q * hidden + h] = dot(act.data() + q * width, we + h * width, width);
  });
  // each token's experts, weighted and summed in k order
  const float* weights = topk_weights.data_ptr<float>();
  scalar_t* o = out.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t k = 0; k < top_k; ++k) {
        const float w = weights[t * top_k + k];
        const float* y = down.data() + g.pos[t * top_k + k] * hidden;
        for (int64_t h = 0; h < hidden; ++h) sum[h] += w * y[h];
      }
      for (int64_t h = 0; h < hidden; ++h) store(o + t * hidden + h, sum[h]);
    }
  });
}

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]");
  const int64_t hidden = x.size(1), experts = w13.size(0), width = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) % 2 == 0 && w13.size(2) == hidden && w2.size(0) == experts && w2.size(1) == hidden &&
                  w2.size(2) == width,
              "w13 must be [E, 2I, ", hidden, "] and w2 [E, ", hidden, ", I]; got ", w13.sizes(), " and ", w2.sizes());
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && w2.scalar_type() == w13.scalar_type(),
              "x, w13 and w2 must share one dtype");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.scalar_type() == at::kFloat &&
                  topk_ids.dim() == 2 && topk_ids.sizes() == topk_weights.sizes() && topk_ids.size(0) == x.size(0),
              "topk_ids (int64) and topk_weights (float32) must both be [T, K]");
  const at::Tensor xc = x.contiguous(), w13c = w13.contiguous(), w2c = w2.contiguous();
  const at::Tensor ids = topk_ids.contiguous(), weights = topk_weights.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.size(0) == 0) return out;
  tandem_cpu::dispatch_float_types(x.scalar_type(), "x", [&](auto tag) {
    run<decltype(tag)>(xc, w13c, w2c, weights, ids, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("fused_moe", &fused_moe); }
