// The small ops of a decoder layer, fused on CPU: RMSNorm (with the residual add), neox rotary
// embedding and SiLU-and-mul. Each reads and writes its tensors once in the model's dtype and
// rounds exactly where the torch reference (runtime/model/ops.py TorchOps) rounds, so results
// match it up to float summation order. Torch's bf16 path runs these as chains of separate ops
// with conversions in between: a third of a bf16 decode step and half of a bf16 prefill pass.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "cpu_dtype.h"

namespace {

using tandem_cpu::load;
using tandem_cpu::round_to;
using tandem_cpu::store;

constexpr int64_t kGrainElems = 16384;  // below this much work per task, threading costs more than it saves

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

at::Tensor rows_of(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, what, ": the last dim must be contiguous");
  return t.reshape({-1, t.size(-1)});
}

// residual (may be null): summed = round(x + residual) is written to res_out and normalized
template <typename scalar_t>
void rmsnorm_rows(const scalar_t* x, int64_t x_stride, const scalar_t* residual, int64_t r_stride,
                  const scalar_t* weight, scalar_t* out, scalar_t* res_out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * x_stride;
      scalar_t* o = out + r * n;
      float sum_sq = 0.f;
      if (residual != nullptr) {
        const scalar_t* rr = residual + r * r_stride;
        scalar_t* ro = res_out + r * n;
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < n; ++i) {
          const float s = round_to<scalar_t>(load(xr[i]) + load(rr[i]));
          store(ro + i, s);
          sum_sq += s * s;
        }
        xr = ro;
      } else {
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < n; ++i) sum_sq += load(xr[i]) * load(xr[i]);
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) store(o + i, round_to<scalar_t>(load(xr[i]) * inv_rms) * load(weight[i]));
    }
  });
}

std::vector<at::Tensor> add_rmsnorm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                    const at::Tensor& weight, double eps) {
  const at::Tensor x2 = rows_of(x, "x");
  const int64_t rows = x2.size(0), n = x2.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous(), "weight: [hidden] contiguous");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x dtypes differ");
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor res_out, r2;
  if (residual.has_value()) {
    r2 = rows_of(*residual, "residual");
    TORCH_CHECK(r2.sizes() == x2.sizes() && r2.scalar_type() == x.scalar_type(), "residual must match x");
    res_out = at::empty({rows, n}, x.options());
  }
  tandem_cpu::dispatch_float_types(x.scalar_type(), "rmsnorm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rmsnorm_rows<scalar_t>(x2.data_ptr<scalar_t>(), x2.stride(0), r2.defined() ? r2.data_ptr<scalar_t>() : nullptr,
                           r2.defined() ? r2.stride(0) : 0, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                           res_out.defined() ? res_out.data_ptr<scalar_t>() : nullptr, rows, n,
                           static_cast<float>(eps));
  });
  if (!res_out.defined()) return {out.view(x.sizes())};
  return {out.view(x.sizes()), res_out.view(x.sizes())};
}

// x [T, H, D] rotated in place: neox halves, cos/sin from row positions[t] of cos_sin [P, D]
template <typename scalar_t>
void rotate_heads(scalar_t* x, int64_t h_stride, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* xh = x + h * h_stride;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = load(xh[i]), x2 = load(xh[i + half]);
      store(xh + i, x1 * cos[i] - x2 * sin[i]);
      store(xh + i + half, x2 * cos[i] + x1 * sin[i]);
    }
  }
}

void rotary_(const at::Tensor& positions, at::Tensor q, at::Tensor k, const at::Tensor& cos_sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q [T, Hq, D] and k [T, Hkv, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k: contiguous head rows");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k dtypes differ");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.size(1) == q.size(2),
              "cos_sin: float32 [max_position, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.size(0) == q.size(0), "positions: int64 [T]");
  const at::Tensor pos = positions.contiguous();
  const int64_t tokens = q.size(0), d = q.size(2), half = d / 2, max_pos = cos_sin.size(0);
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "position ", p[t], " is past the rotary table (", max_pos, ")");
  }
  tandem_cpu::dispatch_float_types(q.scalar_type(), "rotary", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, grain_rows((q.size(1) + k.size(1)) * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cs = table + p[t] * d;
        rotate_heads(qp + t * q.stride(0), q.stride(1), q.size(1), d, cs, cs + half);
        rotate_heads(kp + t * k.stride(0), k.stride(1), k.size(1), d, cs, cs + half);
      }
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const at::Tensor x = rows_of(gate_up, "gate_up");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "gate_up: an even last dim");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  tandem_cpu::dispatch_float_types(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = in + r * stride;
        const scalar_t* u = g + n;
        scalar_t* orow = o + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const float gi = load(g[i]);
          store(orow + i, round_to<scalar_t>(gi / (1.f + std::exp(-gi))) * load(u[i]));
        }
      }
    });
  });
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("add_rmsnorm(Tensor x, Tensor? residual, Tensor weight, float eps) -> Tensor[]");
  m.def("rotary_(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("add_rmsnorm", &add_rmsnorm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
}
