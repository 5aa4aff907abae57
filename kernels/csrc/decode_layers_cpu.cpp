// Every decoder layer of one decode step, run from C++: the role CUDA graphs play for SGLang's
// decode on a GPU. The layers run the same ops, in the same order, on the same arguments as the
// Python modules (runtime/model/llama.py with the cpu attention backend), so logits are bit for
// bit the Python path's; only the ~17 Python calls a layer (5 ms of a 35 ms bf16 batch-64 step on
// a 2-core Xeon) are gone.
//
// The ops are called through the dispatcher: the linears are torch's (oneDNN's or MKL's packed
// ones, or the plain linear), the rest are tandem_cpu's own (elementwise_cpu.cpp and
// decode_attention_cpu.cpp).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// A layer's entries in `params`, in runtime/model/cpu_decode_step.py's LAYER_PARAMS order. A
// linear's `like` is set for packed weights that are no MKL-DNN tensor (MKL's fp32, AMX's bf16). qkv and gate_up take their bias
// inside the linear; o_bias and down_bias are added after it, as the modules do.
enum Param : int64_t {
  kInNorm, kQkv, kQkvLike, kQkvBias, kQNorm, kKNorm, kO, kOLike, kOBias,
  kPostNorm, kGateUp, kGateUpLike, kGateUpBias, kDown, kDownLike, kDownBias, kPerLayer
};

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view,
                                   c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
using MklLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t);
using AmxLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool);
using GgufLinear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&, bool, int64_t);
using AddRmsnorm = std::vector<at::Tensor>(const at::Tensor&, const OptTensor&, const at::Tensor&, double);
using Rotary = void(const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&);
using SiluAndMul = at::Tensor(const at::Tensor&);
using DecodeAttention = at::Tensor(const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, double, const OptTensor&, const OptTensor&, const OptTensor&,
                                   int64_t);

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

struct Ops {
  c10::TypedOperatorHandle<AddRmsnorm> add_rmsnorm = op<AddRmsnorm>("tandem_cpu::add_rmsnorm");
  c10::TypedOperatorHandle<Rotary> rotary = op<Rotary>("tandem_cpu::rotary_");
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul = op<SiluAndMul>("tandem_cpu::silu_and_mul");
  c10::TypedOperatorHandle<DecodeAttention> attention = op<DecodeAttention>("tandem_cpu::decode_attention");

  static const Ops& get() {
    static const Ops ops;  // looked up once: the schemas are all registered by the time a step runs
    return ops;
  }
};

// packed_linear.linear: x @ w.T (+ bias), on whichever layout the weight is held in. oneDNN
// computes `padded_rows` rows (zeros below x's), as packed_linear._onednn_linear does. The
// packed ops are looked up when first met: a torch without MKL never meets an MKL weight, a CPU
// without AMX never an AMX one (amx_linear_cpu.cpp's 4-D tile layout).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& like, const OptTensor& bias,
                  int64_t padded_rows) {
  if (w.dim() == 4) {
    static const auto amx_linear = op<AmxLinear>("tandem_cpu::amx_linear");
    return amx_linear.call(x, w, bias, false);
  }
  if (w.scalar_type() == at::kByte) {  // GGUF blocks (gguf_linear_cpu.cpp); like: [out, in]
    static const auto gguf_linear = op<GgufLinear>("tandem_cpu::gguf_linear");
    return gguf_linear.call(x, w, like->size(0), bias, false, 0);
  }
  if (like.has_value()) {  // before oneDNN's: MKL's packs are MKL-DNN tensors too
    static const auto mkl_linear = op<MklLinear>("mkl::_mkl_linear");
    return mkl_linear.call(x, w, *like, bias, x.size(0));
  }
  if (w.is_mkldnn()) {
    static const auto onednn_linear = op<LinearPointwise>("mkldnn::_linear_pointwise");
    const int64_t rows = x.size(0);
    if (padded_rows == rows) return onednn_linear.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
    const at::Tensor padded = at::constant_pad_nd(x, {0, 0, 0, padded_rows - rows}, 0);
    return onednn_linear.call(padded, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt).narrow(0, 0, rows);
  }
  return at::linear(x, w, bias);
}

at::Tensor add_bias(const at::Tensor& x, const OptTensor& bias) { return bias.has_value() ? x + *bias : x; }

at::Tensor decode_layers(const at::Tensor& embedded, const at::Tensor& positions, const c10::List<OptTensor>& params,
                         at::TensorList k_buffers, at::TensorList v_buffers, const at::Tensor& req_to_token,
                         const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                         const at::Tensor& out_cache_loc, const at::Tensor& cos_sin, const at::Tensor& final_norm,
                         double eps, double scale, int64_t num_heads, int64_t padded_rows, at::IntArrayRef windows) {
  const int64_t layers = static_cast<int64_t>(k_buffers.size());
  TORCH_CHECK(static_cast<int64_t>(params.size()) == layers * kPerLayer && v_buffers.size() == k_buffers.size(),
              "params: ", kPerLayer, " per layer, one K and one V buffer per layer");
  TORCH_CHECK(embedded.dim() == 2 && padded_rows >= embedded.size(0), "embedded: [batch, hidden]; padded_rows >= batch");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == layers, "windows: none, or one per layer");
  const Ops& ops = Ops::get();
  const int64_t bs = embedded.size(0), hkv = k_buffers[0].size(1), d = k_buffers[0].size(2);
  const int64_t q_width = num_heads * d, kv_width = hkv * d;
  at::Tensor x = embedded, residual;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t base = layer * kPerLayer;
    auto param = [&](Param p) { return params.get(base + p); };
    std::vector<at::Tensor> normed = layer == 0 ? ops.add_rmsnorm.call(x, std::nullopt, *param(kInNorm), eps)
                                                : ops.add_rmsnorm.call(x, residual, *param(kInNorm), eps);
    residual = layer == 0 ? x : normed[1];
    const at::Tensor qkv = linear(normed[0], *param(kQkv), param(kQkvLike), param(kQkvBias), padded_rows);
    at::Tensor q = qkv.narrow(1, 0, q_width).view({bs, num_heads, d});
    at::Tensor k = qkv.narrow(1, q_width, kv_width).view({bs, hkv, d});
    const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({bs, hkv, d});
    if (param(kQNorm).has_value()) {
      q = ops.add_rmsnorm.call(q, std::nullopt, *param(kQNorm), eps)[0];
      k = ops.add_rmsnorm.call(k, std::nullopt, *param(kKNorm), eps)[0];
    }
    ops.rotary.call(positions, q, k, cos_sin);
    const at::Tensor attn = ops.attention.call(q, k_buffers[layer], v_buffers[layer], req_to_token, req_pool_indices,
                                               seq_lens, scale, k, v, out_cache_loc, windows.empty() ? 0 : windows[layer]);
    x = add_bias(linear(attn.reshape({bs, q_width}), *param(kO), param(kOLike), std::nullopt, padded_rows), param(kOBias));
    normed = ops.add_rmsnorm.call(x, residual, *param(kPostNorm), eps);
    residual = normed[1];
    const at::Tensor gate_up = linear(normed[0], *param(kGateUp), param(kGateUpLike), param(kGateUpBias), padded_rows);
    const at::Tensor act = ops.silu_and_mul.call(gate_up);
    x = add_bias(linear(act, *param(kDown), param(kDownLike), std::nullopt, padded_rows), param(kDownBias));
  }
  return ops.add_rmsnorm.call(x, residual, final_norm, eps)[0];
}

// The GEMM-only bound's pass (runtime/model/gemm_bound.py): each layer's four linears, (weight,
// like) pairs in `linears`, called back to back as decode_layers calls them, each fed the slice
// of its producer's output it takes: qkv and gate_up read x, o reads qkv, down reads gate_up.
void layer_matmuls(const at::Tensor& x, const c10::List<OptTensor>& linears, int64_t padded_rows) {
  TORCH_CHECK(linears.size() % 8 == 0, "linears: (weight, like) for qkv, o, gate_up and down, per layer");
  auto input_of = [](const at::Tensor& producer, const at::Tensor& w, const OptTensor& like) {
    return producer.narrow(1, 0, (like.has_value() ? *like : w).size(1)).contiguous();
  };
  for (size_t i = 0; i < linears.size(); i += 8) {
    const at::Tensor qkv = linear(x, *linears.get(i), linears.get(i + 1), std::nullopt, padded_rows);
    linear(input_of(qkv, *linears.get(i + 2), linears.get(i + 3)), *linears.get(i + 2), linears.get(i + 3),
           std::nullopt, padded_rows);
    const at::Tensor gate_up = linear(x, *linears.get(i + 4), linears.get(i + 5), std::nullopt, padded_rows);
    linear(input_of(gate_up, *linears.get(i + 6), linears.get(i + 7)), *linears.get(i + 6), linears.get(i + 7),
           std::nullopt, padded_rows);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("layer_matmuls(Tensor x, Tensor?[] linears, int padded_rows) -> ()");
  m.def("decode_layers(Tensor embedded, Tensor positions, Tensor?[] params, Tensor(a!)[] k_buffers, "
        "Tensor(b!)[] v_buffers, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "Tensor out_cache_loc, Tensor cos_sin, Tensor final_norm, float eps, float scale, int num_heads, "
        "int padded_rows, int[] windows=[]) -> Tensor");
}

// the dispatcher keys on every tensor argument: packed oneDNN weights make it MkldnnCPU
TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("layer_matmuls", &layer_matmuls);
}
TORCH_LIBRARY_IMPL(tandem_cpu, MkldnnCPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("layer_matmuls", &layer_matmuls);
}
