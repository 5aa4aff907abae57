// A bfloat16 linear on AMX whose every output element is one fixed reduction: the dot product of
// an input row and a weight row summed by TDPBF16PS over K in ascending steps of 32, in one tile
// register, from zero, then the bias added in float32 and rounded once to bfloat16. How many rows
// the call has, where a row sits among them, and how many threads run it change which tiles are
// loaded together, never that sum: a row gets the same bits alone, in any batch, at any thread
// count. oneDNN's bf16 kernels change their blocking with the row count (past 32 rows, and again
// past ~70 or ~500 depending on the shape), and with it the last bits of a row.
//
// The weight is packed once into TDPBF16PS's B layout: for each block of 16 output features and
// each step of 32 inputs, a 16 x 64-byte tile whose row p holds, for each of the 16 features, the
// input pair (2p, 2p + 1) of that step: [N / 16, K / 32, 16, 32] bfloat16. Shapes need N % 16 ==
// 0 and K % 32 == 0 (packed_linear.py keeps oneDNN for any other).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "amx_common.h"

namespace {

constexpr int64_t kTileRows = 16;  // rows of an A or C tile, and feature columns of a B tile
constexpr int64_t kStepK = 32;     // bfloat16 inputs one TDPBF16PS reduces
constexpr int64_t kFewRows = 64;  // up to this many rows, each weight pair is read once for all of them
constexpr int64_t kPanelBytes = 1 << 20;  // weight a prefill pass holds in L2 while rows stream through it

using tandem_cpu::amx::usable;

at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight: [out, in] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kTileRows == 0 && k % kStepK == 0, "weight: out % 16 == 0 and in % 32 == 0, got [", n, ", ", k, "]");
  // [n/16, 16 features, k/32, 16 pairs, 2] -> [n/16, k/32, 16 pairs, 16 features, 2]
  return weight.contiguous().view({n / kTileRows, kTileRows, k / kStepK, kStepK / 2, 2})
      .permute({0, 2, 3, 1, 4}).contiguous().view({n / kTileRows, k / kStepK, kStepK / 2, kTileRows * 2});
}

#ifdef TANDEM_AMX
// tmm0-3: C (a 2 x 2 block of 16 x 16 float32), tmm4-5: A (rows of x), tmm6-7: B (weight tiles)
void configure(int64_t rows0, int64_t rows1) {
  tandem_cpu::amx::TileConfig cfg;
  const int64_t rows[4] = {rows0, rows0, rows1, rows1};
  for (int t = 0; t < 4; ++t) cfg.set(t, rows[t], 64);
  cfg.set(4, rows0, 64);
  cfg.set(5, rows1, 64);
  cfg.set(6, kStepK / 2, 64);
  cfg.set(7, kStepK / 2, 64);
  cfg.load();
}

// c: a stored 16 x 16 float32 tile; rows of out get c (+ bias), rounded once to bfloat16 or kept
inline void store_row(__m512 v, at::BFloat16* out) {
  const __m256bh r = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<const __m256i&>(r));
}
inline void store_row(__m512 v, float* out) { _mm512_storeu_ps(out, v); }

template <typename out_t>
inline void epilogue(const float* c, int64_t rows, const float* bias, out_t* out, int64_t out_stride) {
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) store_row(_mm512_add_ps(_mm512_loadu_ps(c + r * kTileRows), b), out + r * out_stride);
}

// What one call computes: x [m, k], the packed weight, bias (or null), out [m, n].
template <typename out_t>
struct Problem {
  const at::BFloat16 *x, *packed;
  const float* bias;
  out_t* out;
  int64_t m, n, k;
  int64_t steps() const { return k / kStepK; }
};

// Lines to prefetch into L2 while a block computes: `count` 64-byte lines from `first`.
struct Prefetch {
  const char* first = nullptr;
  int64_t count = 0;
};

// The full 32 x 32 block: every tile used, no branch in the loop. Each step also requests two of
// the block's output rows for writing (their lines arrive while the tiles compute) and up to two
// lines of `ahead`.
template <typename out_t>
inline void full_steps(const Problem<out_t>& p, const at::BFloat16* a0, const at::BFloat16* b0, const at::BFloat16* b1,
                       out_t* out0, Prefetch ahead) {
  const int64_t x_stride = p.k * 2;
  const at::BFloat16* a1 = a0 + kTileRows * p.k;
  for (int64_t s = 0; s < p.steps(); ++s) {
    _tile_loadd(4, a0 + s * kStepK, x_stride);
    _tile_loadd(6, b0 + s * kStepK * kTileRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + s * kStepK * kTileRows, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + s * kStepK, x_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    if (2 * s < 2 * kTileRows) {
      _m_prefetchw(out0 + 2 * s * p.n);
      _m_prefetchw(out0 + (2 * s + 1) * p.n);
    }
    for (int64_t l = 2 * s; l < std::min(ahead.count, 2 * s + 2); ++l) _mm_prefetch(ahead.first + 64 * l, _MM_HINT_T1);
  }
}

// out[m0 : m0 + rows0 + rows1, columns of blocks nb0 and nb1 (nb1 < 0: none)]
template <typename out_t>
void block(const Problem<out_t>& p, int64_t nb0, int64_t nb1, int64_t m0, int64_t rows0, int64_t rows1,
           Prefetch ahead = {}) {
  // a tile configured empty (no second row block) must not be touched: that is #UD
  _tile_zero(0);
  _tile_zero(1);
  if (rows1 > 0) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = p.k * 2, block_elems = p.steps() * kStepK * kTileRows;
  const at::BFloat16* b0 = p.packed + nb0 * block_elems;
  const at::BFloat16* b1 = p.packed + (nb1 < 0 ? nb0 : nb1) * block_elems;
  const at::BFloat16* a0 = p.x + m0 * p.k;
  const at::BFloat16* a1 = a0 + kTileRows * p.k;
  if (rows1 == kTileRows && nb1 >= 0) {
    full_steps(p, a0, b0, b1, p.out + m0 * p.n + nb0 * kTileRows, ahead);
  } else {
    for (int64_t s = 0; s < p.steps(); ++s) {
      _tile_loadd(4, a0 + s * kStepK, x_stride);
      _tile_loadd(6, b0 + s * kStepK * kTileRows, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (nb1 >= 0) {
        _tile_loadd(7, b1 + s * kStepK * kTileRows, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (rows1 > 0) {
        _tile_loadd(5, a1 + s * kStepK, x_stride);
        _tile_dpbf16ps(2, 5, 6);
        if (nb1 >= 0) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  alignas(64) float c[kTileRows * kTileRows];
  auto flush = [&](int64_t nb, int64_t row0, int64_t rows) {
    epilogue(c, rows, p.bias != nullptr ? p.bias + nb * kTileRows : nullptr, p.out + row0 * p.n + nb * kTileRows, p.n);
  };
  _tile_stored(0, c, 64);
  flush(nb0, m0, rows0);
  if (nb1 >= 0) {
    _tile_stored(1, c, 64);
    flush(nb1, m0, rows0);
  }
  if (rows1 > 0) {
    _tile_stored(2, c, 64);
    flush(nb0, m0 + kTileRows, rows1);
    if (nb1 >= 0) {
      _tile_stored(3, c, 64);
      flush(nb1, m0 + kTileRows, rows1);
    }
  }
}

// The tile configuration a thread has loaded: rows of the first and second row block.
struct Tiles {
  int64_t rows0 = -1, rows1 = -1;
  // the row block at m0: its two row counts, configured
  std::pair<int64_t, int64_t> at(int64_t m0, int64_t m) {
    const int64_t r0 = std::min(kTileRows, m - m0), r1 = std::max<int64_t>(0, std::min(kTileRows, m - m0 - kTileRows));
    if (r0 != rows0 || r1 != rows1) configure(r0, r1), rows0 = r0, rows1 = r1;
    return {r0, r1};
  }
  ~Tiles() {
    if (rows0 >= 0) _tile_release();
  }
};

// Pairs [begin, end) of feature blocks for every row. Few rows (decode): pair by pair, its weight
// tiles read once for all row blocks. Many rows (prefill): a panel of pairs whose weight stays in
// L2, every 32-row block (in L1) through the whole panel, the next block's rows fetched meanwhile.
template <typename out_t>
void run_pairs(const Problem<out_t>& p, int64_t begin, int64_t end) {
  const int64_t blocks = p.n / kTileRows;
  auto pair_block = [&](int64_t pair, int64_t m0, std::pair<int64_t, int64_t> rows, Prefetch ahead) {
    block(p, 2 * pair, 2 * pair + 1 < blocks ? 2 * pair + 1 : -1, m0, rows.first, rows.second, ahead);
  };
  Tiles tiles;
  if (p.m <= kFewRows) {
    for (int64_t pair = begin; pair < end; ++pair)
      for (int64_t m0 = 0; m0 < p.m; m0 += 2 * kTileRows) pair_block(pair, m0, tiles.at(m0, p.m), {});
    return;
  }
  const int64_t most = std::max<int64_t>(1, kPanelBytes / (p.k * 2 * 2 * kTileRows));
  const int64_t panels = (end - begin + most - 1) / most, panel = (end - begin + panels - 1) / panels;
  for (int64_t p0 = begin; p0 < end; p0 += panel) {
    const int64_t p1 = std::min(end, p0 + panel);
    for (int64_t m0 = 0; m0 < p.m; m0 += 2 * kTileRows) {
      const auto rows = tiles.at(m0, p.m);
      // the next row block's lines, a share per pair of the panel
      const int64_t next_rows = std::clamp<int64_t>(p.m - m0 - 2 * kTileRows, 0, 2 * kTileRows);
      const int64_t lines = next_rows * p.k * 2 / 64, share = (lines + p1 - p0 - 1) / (p1 - p0);
      const char* next = reinterpret_cast<const char*>(p.x + (m0 + 2 * kTileRows) * p.k);
      for (int64_t pair = p0; pair < p1; ++pair) {
        const int64_t first = (pair - p0) * share;
        pair_block(pair, m0, rows, {next + 64 * first, std::clamp<int64_t>(lines - first, 0, share)});
      }
    }
  }
}

template <typename out_t>
void run(const Problem<out_t>& p) {
  const int64_t pairs = (p.n / kTileRows + 1) / 2;
  // one task per pair of feature blocks, every row: an element's sum never leaves its thread
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) { run_pairs(p, begin, end); });
}
#endif

// out_fp32: the float32 sums (+ bias) as they are, unrounded (the LM head's fp32 logits)
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      bool out_fp32) {
  TORCH_CHECK(usable(), "amx_linear: this CPU or kernel does not give AMX to the process");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "x, packed: bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kStepK / 2 && packed.size(3) == 2 * kTileRows && packed.is_contiguous(),
              "packed: amx_pack's [out/16, in/32, 16, 32]");
  const int64_t n = packed.size(0) * kTileRows, k = packed.size(1) * kStepK;
  TORCH_CHECK(x.size(-1) == k, "x: ", k, " inputs, got ", x.size(-1));
  at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({m, n}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias: ", n, " values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (m == 0) return out.view(out_shape);
#ifdef TANDEM_AMX
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const at::BFloat16 *xp = x2.data_ptr<at::BFloat16>(), *pp = packed.data_ptr<at::BFloat16>();
  if (out_fp32) {
    run(Problem<float>{xp, pp, bp, out.data_ptr<float>(), m, n, k});
  } else {
    run(Problem<at::BFloat16>{xp, pp, bp, out.data_ptr<at::BFloat16>(), m, n, k});
  }
#endif
  return out.view(out_shape);
}

bool amx_available() { return usable(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("amx_available() -> bool");
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias=None, bool out_fp32=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CatchAll, m) { m.impl("amx_available", &amx_available); }

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
}
