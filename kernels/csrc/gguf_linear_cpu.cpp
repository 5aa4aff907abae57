// Linears on GGUF-quantized weights (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), kept quantized: x @ W.T with W as the
// file stores it, repacked once at load (runtime/model/quant/gguf_blocks.py `pack`; the unit's
// layout: gguf_units.h).
//
// Which arithmetic a call gets depends on x's dtype and the CPU only, never on the row count:
// - bfloat16 x on a CPU with AMX-BF16: the weights dequantized on the fly to bfloat16 tiles and
//   multiplied by TDPBF16PS (gguf_amx_bf16.h): the dequantized bf16 path's arithmetic, for every
//   row count from 1.
// - float32 or float16 x, or bfloat16 x on a CPU without AMX-BF16: the integer arithmetic below.
//
// Integer arithmetic: each 32-input block of an activation row is quantized to 16 bits with one float
// scale, dx = max|x| / 32512 and q = round(x / dx) (1/128 of a bf16 rounding at the block's largest
// input), held as two int8 planes q = 256 * hi + lo for VPDPBUSD; a weight block is d * (u - z)
// (+ m for Q4_1, Q4_K, Q5_K) with u unsigned (gguf_units.h: z = 8 for Q4_0, 128 for Q8_0 stored as
// q ^ 0x80, 32 for Q6_K, else 0; d and m fp16, or the K-quants' exact float32). For each output
// element and each block, in ascending block order from 0.f:
//     isum = sum_i u_i * q_i - z * sum_i q_i              (int32: exact, in any order)
//     acc  = fma(float(isum), d * dx, acc)
//     acc  = fma(m, sx, acc)                              (with m only; sx = the block's float sum of x)
// Q6_K has a scale per 16 inputs: isum0 and isum1 over inputs 0-15 and 16-31 (each with its own
// z * sum q), acc = fma(float(isum0), d0 * dx, acc) then acc = fma(float(isum1), d1 * dx, acc).
// then the bias added in float32 and the sum rounded once to x's dtype (or kept in float32). The
// integer part is exact and the float part is one fixed sequence per element, computed by one
// thread: a row gets the same bits alone, in any batch, at any thread count, on any path (AMX-INT8
// tiles for 4 rows and more, AVX-512 VNNI, or the portable loop: the same bits on a CPU that has them).
// The kernels meet every type's weights as 8 x 64 unsigned bytes u (gguf_units.h expand_u), so a type
// differs only in its scales: fp16 or the K-quants' float32, a min, or Q6_K's two halves.
// (llama.cpp quantizes activations to 8 bits instead: 256 times coarser, which moved this model's
// logprobs 5x farther from the dequantized fp32 path than bf16 rounding does.)
// A lane of VPDPBUSD is a feature; its 4 bytes meet 4 consecutive inputs of one activation row.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "amx_common.h"
#include "cpu_dtype.h"
#include "gguf_amx_bf16.h"
#include "gguf_units.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TANDEM_GGUF_VNNI 1
#if defined(TANDEM_AMX) && defined(__AMX_INT8__)
#define TANDEM_GGUF_AMX 1
#endif
#endif

namespace {

using namespace tandem_cpu::gguf;

constexpr int64_t kRowTile = 8;  // rows one pass over a unit's weights serves (accumulators in registers)
constexpr int64_t kRowTileAmx = 16;  // rows of an AMX tile
constexpr int64_t kAmxMinRows = 4;  // calls with fewer rows take the VNNI path (the same bits either way)
// Q6_K's AMX pass spends twice the tile ops on a feature block (its two halves): VNNI is faster below
// ~48 rows (one thread, 2048 x 2048: 16 rows 0.96 ms VNNI, 1.11 AMX; 64 rows 3.64, 3.38)
constexpr int64_t kAmxMinRowsQ6K = 48;
constexpr int64_t kChunkRows = 256;  // rows whose int8 activations stay in L2 during a pass over the weights

QType qtype_of(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed: gguf pack's contiguous [N/16, K/32, unit] uint8");
  switch (packed.size(2)) {
    case 288: return kQ4_0;
    case 320: return kQ4_1;
    case 544: return kQ8_0;
    case 384: return kQ4_K;
    case 448: return kQ5_K;
    case 640: return kQ6_K;
    default: TORCH_CHECK(false, "packed: unit of ", packed.size(2), " bytes is no GGUF type tandem packs");
  }
  return kQ4_0;
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// feature f's scale d and its min m (or, for Q6_K, the second half's scale): fp16, or the K-quants' float32
inline float unit_d(QType t, const uint8_t* unit, int64_t f) {
  return is_k(t) ? reinterpret_cast<const float*>(unit)[f] : half_to_float(reinterpret_cast<const uint16_t*>(unit)[f]);
}
inline float unit_m(QType t, const uint8_t* unit, int64_t f) {
  return is_k(t) ? reinterpret_cast<const float*>(unit + 64)[f]
                 : half_to_float(reinterpret_cast<const uint16_t*>(unit + 32)[f]);
}

// The activation rows, quantized per block to 16 bits held as two int8 planes, q = 256 * hi + lo
// (hi in [-127, 127], lo in [-128, 127]): hi, lo [KB][M][32] (block-major: a block of 16 consecutive rows is
// one 512-byte AMX tile); dx, sx, cq = z * sum(q), cq0 = z * sum(q) over inputs 0-15 (Q6_K's halves): [M, KB]
template <typename T>
struct Buffer {  // uninitialized (every element is written before it is read), with std::vector's data()
  std::unique_ptr<T[]> p;
  explicit Buffer(int64_t n) : p(new T[n]) {}
  T* data() { return p.get(); }
  const T* data() const { return p.get(); }
  T& operator[](int64_t i) { return p[i]; }
  const T& operator[](int64_t i) const { return p[i]; }
};

struct Acts {
  Buffer<int8_t> hi, lo;
  Buffer<float> dx, sx;
  Buffer<int32_t> cq, cq0;
  int64_t m = 0, k = 0, kb = 0;
  Acts(int64_t m_, int64_t k_, int64_t kb_)
      : hi(m_ * k_), lo(m_ * k_), dx(m_ * kb_), sx(m_ * kb_), cq(m_ * kb_), cq0(m_ * kb_), m(m_), k(k_), kb(kb_) {}
  int64_t at(int64_t row, int64_t b) const { return (b * m + row) * kBlock; }  // a row's block in the planes
};

constexpr float kQMax = 32512.f;  // 127 * 256: the largest |q|, so that hi stays within [-127, 127]

#ifdef TANDEM_GGUF_VNNI
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
#endif

// hi, lo: the row's first block in the planes, `stride` bytes between its blocks. The same code for
// every row (AVX-512 for float and bfloat16 rows where the CPU has it): a row's integers, dx and sx
// never depend on the other rows.
template <typename scalar_t>
__attribute__((noinline)) void quantize_row(const scalar_t* x, int64_t kb, int32_t z, int8_t* hi, int8_t* lo,
                                            int64_t stride, float* dx, float* sx, int32_t* cq, int32_t* cq0) {
  for (int64_t b = 0; b < kb; ++b, hi += stride, lo += stride) {
#ifdef TANDEM_GGUF_VNNI
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
      const __m512 v0 = load16(x + b * kBlock), v1 = load16(x + b * kBlock + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float id = amax > 0.f ? kQMax / amax : 0.f;
      const __m512i qmax = _mm512_set1_epi32(32512), qmin = _mm512_set1_epi32(-32512);
      __m512i q[2];
      q[0] = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id))), qmin), qmax);
      q[1] = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id))), qmin), qmax);
      for (int h = 0; h < 2; ++h) {
        const __m512i l = _mm512_srai_epi32(_mm512_slli_epi32(q[h], 24), 24);  // the sign-extended low byte
        _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16 * h), _mm512_cvtepi32_epi8(_mm512_srai_epi32(_mm512_sub_epi32(q[h], l), 8)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16 * h), _mm512_cvtepi32_epi8(l));
      }
      dx[b] = amax / kQMax;
      sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      cq[b] = z * _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
      cq0[b] = z * _mm512_reduce_add_epi32(q[0]);
      continue;
    }
#endif
    float v[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) v[i] = tandem_cpu::load(x[b * kBlock + i]);
    float amax = 0.f, sum = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    for (int64_t i = 0; i < kBlock; ++i) sum += v[i];  // the loop's order (vectorized or not, alike for every row)
    const float d = amax / kQMax, id = amax > 0.f ? kQMax / amax : 0.f;
    int32_t qsum = 0, qsum0 = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int32_t q = std::clamp(static_cast<int32_t>(std::nearbyint(v[i] * id)), -32512, 32512);  // half to even
      const int32_t l = static_cast<int8_t>(q & 0xFF);  // sign-extended low byte
      hi[i] = static_cast<int8_t>((q - l) / 256);
      lo[i] = static_cast<int8_t>(l);
      qsum += q;
      if (i < 16) qsum0 += q;
    }
    dx[b] = d;
    sx[b] = sum;
    cq[b] = z * qsum;
    cq0[b] = z * qsum0;
  }
}

template <typename out_t>
inline void store_out(const float* acc, const float* bias, int64_t count, out_t* out) {
  for (int64_t j = 0; j < count; ++j) tandem_cpu::store(out + j, bias != nullptr ? acc[j] + bias[j] : acc[j]);
}

// ---- portable: the same arithmetic element by element --------------------------------------------------------
__attribute__((noinline)) void unit_row_portable(QType t, const uint8_t* unit, const int8_t* hi, const int8_t* lo,
                                                 float dx, float sx, int32_t cq, int32_t cq0, float* acc) {
  const uint8_t* data = unit + data_offset(t);
  auto q = [&](int64_t i) { return 256 * int32_t(hi[i]) + int32_t(lo[i]); };
  for (int64_t f = 0; f < kFeat; ++f) {
    int32_t isum[2] = {0, 0};  // inputs 0-15, 16-31
    for (int64_t i = 0; i < kBlock; ++i) isum[i / 16] += unit_u(t, data, f, i) * q(i);
    if (t == kQ6_K) {  // a scale per half
      acc[f] = std::fma(static_cast<float>(isum[0] - cq0), unit_d(t, unit, f) * dx, acc[f]);
      acc[f] = std::fma(static_cast<float>(isum[1] - (cq - cq0)), unit_m(t, unit, f) * dx, acc[f]);
      continue;
    }
    acc[f] = std::fma(static_cast<float>(isum[0] + isum[1] - cq), unit_d(t, unit, f) * dx, acc[f]);
    if (has_min(t)) acc[f] = std::fma(unit_m(t, unit, f), sx, acc[f]);
  }
}

template <typename out_t>
void run_portable(QType t, const uint8_t* packed, int64_t nb, int64_t kb, int64_t n, const Acts& a, int64_t m,
                  const float* bias, out_t* out) {
  const int64_t ub = unit_bytes(t);
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t fb = begin; fb < end; ++fb) {
      const uint8_t* base = packed + fb * kb * ub;
      const int64_t count = std::min(kFeat, n - fb * kFeat);
      for (int64_t r = 0; r < m; ++r) {
        float acc[kFeat] = {};
        for (int64_t b = 0; b < kb; ++b)
          unit_row_portable(t, base + b * ub, a.hi.data() + a.at(r, b), a.lo.data() + a.at(r, b),
                            a.dx[r * kb + b], a.sx[r * kb + b], a.cq[r * kb + b], a.cq0[r * kb + b], acc);
        store_out(acc, bias != nullptr ? bias + fb * kFeat : nullptr, count, out + r * n + fb * kFeat);
      }
    }
  });
}

#ifdef TANDEM_GGUF_VNNI
// ---- AVX-512 VNNI --------------------------------------------------------------------------------------------
// R rows (<= kRowTile) of one feature block over every input block: a unit's weights are unpacked
// once a block and met by each row in turn. A row's ops are the same whatever R is: integer sums
// (exact in any order, split over two chains each for latency) then one fixed float sequence.
// the unit's scales d (and m, or Q6_K's second-half d) as 16 float32 lanes
template <QType T>
inline __m512 load_d(const uint8_t* unit) {
  if constexpr (is_k(T)) return _mm512_loadu_ps(reinterpret_cast<const float*>(unit));
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit)));
}
template <QType T>
inline __m512 load_m(const uint8_t* unit) {
  if constexpr (is_k(T)) return _mm512_loadu_ps(reinterpret_cast<const float*>(unit + 64));
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 32)));
}

template <QType T, int R>
__attribute__((noinline)) void tile_vnni(const uint8_t* base, const Acts& a, int64_t r0, __m512* out) {
  constexpr int64_t ub = unit_bytes(T);
  constexpr bool halves = T == kQ6_K;
  const int64_t kb = a.kb;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const float* dx0 = a.dx.data() + r0 * kb;
  const float* sx0 = a.sx.data() + r0 * kb;
  const int32_t* cq0 = a.cq.data() + r0 * kb;
  const int32_t* cqh0 = a.cq0.data() + r0 * kb;
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* unit = base + b * ub;
    for (int64_t line = 0; line < ub; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(unit + 8 * ub + line), _MM_HINT_T0);
    const __m512 d = load_d<T>(unit);
    __m512 mins = _mm512_setzero_ps();  // m, or Q6_K's second-half d
    if constexpr (has_min(T) || halves) mins = load_m<T>(unit);
    __m512i w[8];
    expand_u<T>(unit, w);
    for (int r = 0; r < R; ++r) {
      const int32_t* xh = reinterpret_cast<const int32_t*>(a.hi.data() + a.at(r0 + r, b));
      const int32_t* xl = reinterpret_cast<const int32_t*>(a.lo.data() + a.at(r0 + r, b));
      // chains 0 and 1: inputs 0-15 and 16-31 (Q6_K's halves)
      __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
      __m512i l0 = _mm512_setzero_si512(), l1 = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {
        h0 = _mm512_dpbusd_epi32(h0, w[g], _mm512_set1_epi32(xh[g]));
        l0 = _mm512_dpbusd_epi32(l0, w[g], _mm512_set1_epi32(xl[g]));
        h1 = _mm512_dpbusd_epi32(h1, w[g + 4], _mm512_set1_epi32(xh[g + 4]));
        l1 = _mm512_dpbusd_epi32(l1, w[g + 4], _mm512_set1_epi32(xl[g + 4]));
      }
      const __m512 dx = _mm512_set1_ps(dx0[r * kb + b]);
      if constexpr (halves) {
        const int32_t c0 = cqh0[r * kb + b], c1 = cq0[r * kb + b] - c0;
        const __m512i s0 = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h0, 8), l0), _mm512_set1_epi32(c0));
        const __m512i s1 = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(h1, 8), l1), _mm512_set1_epi32(c1));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(d, dx), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(mins, dx), acc[r]);
        continue;
      }
      __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
      if constexpr (zero_point(T) != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(cq0[r * kb + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, dx), acc[r]);
      if constexpr (has_min(T)) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(sx0[r * kb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <QType T>
void tile_rows(const uint8_t* base, const Acts& a, int64_t r0, int64_t rows, __m512* out) {
  switch (rows) {
    case 1: return tile_vnni<T, 1>(base, a, r0, out);
    case 2: return tile_vnni<T, 2>(base, a, r0, out);
    case 3: return tile_vnni<T, 3>(base, a, r0, out);
    case 4: return tile_vnni<T, 4>(base, a, r0, out);
    case 5: return tile_vnni<T, 5>(base, a, r0, out);
    case 6: return tile_vnni<T, 6>(base, a, r0, out);
    case 7: return tile_vnni<T, 7>(base, a, r0, out);
    default: return tile_vnni<T, 8>(base, a, r0, out);
  }
}

template <QType T, typename out_t>
void run_vnni(const uint8_t* packed, int64_t nb, int64_t kb, int64_t n, const Acts& a, int64_t m, const float* bias,
              out_t* out) {
  constexpr int64_t ub = unit_bytes(T);
  static_assert(kRowTile == 8, "tile_rows instantiates 1 to 8 rows");
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = 0; chunk < m; chunk += kChunkRows) {
      const int64_t chunk_end = std::min(m, chunk + kChunkRows);
      for (int64_t fb = begin; fb < end; ++fb) {
        const uint8_t* base = packed + fb * kb * ub;
        const int64_t count = std::min(kFeat, n - fb * kFeat);
        const float* fbias = bias != nullptr ? bias + fb * kFeat : nullptr;
        for (int64_t r0 = chunk; r0 < chunk_end; r0 += kRowTile) {
          const int64_t rows = std::min(kRowTile, chunk_end - r0);
          __m512 acc[kRowTile];
          tile_rows<T>(base, a, r0, rows, acc);
          for (int64_t r = 0; r < rows; ++r) {
            alignas(64) float sums[kFeat];
            _mm512_store_ps(sums, acc[r]);
            store_out(sums, fbias, count, out + (r0 + r) * n + fb * kFeat);
          }
        }
      }
    }
  });
}
#endif

#ifdef TANDEM_GGUF_AMX
// ---- AMX-INT8: the same integers, by tiles ------------------------------------------------------------------
// TDPBSSD sums a block's 32 products of (signed activation plane) x (signed weight u - z) exactly in
// int32: the VNNI path's isum, so with the same float sequence after it every element gets the
// VNNI path's bits. 16 rows x 2 feature blocks a pass: tmm0-3 C (hi, lo for each feature block),
// tmm4-5 A (the hi and lo planes of 16 rows, one block), tmm6-7 B (a block of each feature block's
// weights: 8 rows of 16 features x 4 inputs, spread from the units once per chunk of rows). A
// block's tiles are stored and the next block's issued before the stored ones are scaled: the
// vector epilogue of block b runs while the tiles compute block b + 1.
void amx_configure(int64_t rows) {
  tandem_cpu::amx::TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.set(t, rows, 64);
  cfg.set(4, rows, kBlock);
  cfg.set(5, rows, kBlock);
  cfg.set(6, 8, 64);
  cfg.set(7, 8, 64);
  cfg.load();
}

// the unit's weights as 8 rows of 64 signed bytes u - z (B's layout, as tile_vnni meets them); half
// 0 or 1 (Q6_K): only inputs 0-15 or 16-31, the other half's rows zeros
template <QType T>
inline void spread_b(const uint8_t* unit, int8_t* dst, int half = -1) {
  __m512i w[8];
  expand_u<T>(unit, w);
  const __m512i z = _mm512_set1_epi8(static_cast<char>(zero_point(T)));  // Q8_0: u - 128 = u ^ 0x80 in int8
  for (int g = 0; g < 8; ++g)
    _mm512_store_si512(dst + g * 64, half < 0 || g / 4 == half ? _mm512_sub_epi8(w[g], z) : _mm512_setzero_si512());
}

// c: a stored C tile pair (hi then lo, 16 x 16 int32 each), c1 Q6_K's second half's pair; acc: the
// rows' float accumulators [rows][16]: tile_vnni's float sequence on the same integers
template <QType T>
inline void amx_epilogue(const int32_t* c, const int32_t* c1, const uint8_t* unit, const float* dx, const float* sx,
                         int64_t kb, int64_t rows, float* acc) {
  const __m512 d = load_d<T>(unit);
  __m512 mins = _mm512_setzero_ps();
  if constexpr (has_min(T) || T == kQ6_K) mins = load_m<T>(unit);
  auto sum = [&](const int32_t* pair, int64_t r) {
    return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(pair + r * kFeat), 8),
                                               _mm512_load_si512(pair + (kRowTileAmx + r) * kFeat)));
  };
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 x = _mm512_set1_ps(dx[r * kb]);
    __m512 v = _mm512_fmadd_ps(sum(c, r), _mm512_mul_ps(d, x), _mm512_load_ps(acc + r * kFeat));
    if constexpr (T == kQ6_K) v = _mm512_fmadd_ps(sum(c1, r), _mm512_mul_ps(mins, x), v);
    if constexpr (has_min(T)) v = _mm512_fmadd_ps(mins, _mm512_set1_ps(sx[r * kb]), v);
    _mm512_store_ps(acc + r * kFeat, v);
  }
}

// A pass covers two feature blocks (tmm 0-1 and 2-3 their C pairs, tmm6 and 7 their B), or for Q6_K
// one feature block's two halves: B tiles of its inputs 0-15 and 16-31 (the rest zeros), whose C
// pairs are the two integer sums its two scales multiply.
template <QType T, typename out_t>
void run_amx(const uint8_t* packed, int64_t nb, int64_t kb, int64_t n, const Acts& a, int64_t m, const float* bias,
             out_t* out) {
  constexpr int64_t ub = unit_bytes(T);
  constexpr bool halves = T == kQ6_K;
  const int64_t pairs = halves ? nb : (nb + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    int8_t* spread = static_cast<int8_t*>(std::aligned_alloc(64, 2 * kb * 512));  // a pair's B tiles, [2][kb][512]
    alignas(64) int32_t c[2][2][2 * kRowTileAmx * kFeat];  // [block parity][feature block][hi; lo]
    alignas(64) float acc[2][kRowTileAmx * kFeat];
    int64_t configured = -1;
    for (int64_t chunk = 0; chunk < m; chunk += kChunkRows) {
      const int64_t chunk_end = std::min(m, chunk + kChunkRows);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t fbs[2] = {halves ? p : 2 * p, halves ? -1 : 2 * p + 1 < nb ? 2 * p + 1 : -1};
        const int64_t nfb = halves || fbs[1] >= 0 ? 2 : 1;  // B tiles a step
        for (int64_t j = 0; j < nfb; ++j)
          for (int64_t b = 0; b < kb; ++b) {
            int8_t* dst = spread + (j * kb + b) * 512;
            if constexpr (halves) spread_b<T>(packed + (fbs[0] * kb + b) * ub, dst, static_cast<int>(j));
            else spread_b<T>(packed + (fbs[j] * kb + b) * ub, dst);
          }
        for (int64_t r0 = chunk; r0 < chunk_end; r0 += kRowTileAmx) {
          const int64_t rows = std::min(kRowTileAmx, chunk_end - r0);
          if (rows != configured) {
            amx_configure(rows);
            configured = rows;
          }
          std::memset(acc, 0, sizeof(acc));
          const int64_t nout = halves ? 1 : nfb;  // feature blocks written
          auto epilogue = [&](int64_t b) {
            for (int64_t j = 0; j < nout; ++j)
              amx_epilogue<T>(c[b & 1][j], c[b & 1][1], packed + (fbs[j] * kb + b) * ub, a.dx.data() + r0 * kb + b,
                              a.sx.data() + r0 * kb + b, kb, rows, acc[j]);
          };
          for (int64_t b = 0; b < kb; ++b) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(4, a.hi.data() + a.at(r0, b), kBlock);
            _tile_loadd(5, a.lo.data() + a.at(r0, b), kBlock);
            _tile_loadd(6, spread + b * 512, 64);
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 5, 6);
            if (nfb == 2) {
              _tile_zero(2);
              _tile_zero(3);
              _tile_loadd(7, spread + (kb + b) * 512, 64);
              _tile_dpbssd(2, 4, 7);
              _tile_dpbssd(3, 5, 7);
            }
            if (b > 0) epilogue(b - 1);
            int32_t* cb = c[b & 1][0];
            _tile_stored(0, cb, 64);
            _tile_stored(1, cb + kRowTileAmx * kFeat, 64);
            if (nfb == 2) {
              _tile_stored(2, c[b & 1][1], 64);
              _tile_stored(3, c[b & 1][1] + kRowTileAmx * kFeat, 64);
            }
          }
          epilogue(kb - 1);
          for (int64_t j = 0; j < nout; ++j) {
            const int64_t count = std::min(kFeat, n - fbs[j] * kFeat);
            const float* fbias = bias != nullptr ? bias + fbs[j] * kFeat : nullptr;
            for (int64_t r = 0; r < rows; ++r)
              store_out(acc[j] + r * kFeat, fbias, count, out + (r0 + r) * n + fbs[j] * kFeat);
          }
        }
      }
    }
    if (configured >= 0) _tile_release();
    std::free(spread);
  });
}
#endif

bool vnni_available() {
#ifdef TANDEM_GGUF_VNNI
  static const bool ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return ok;
#else
  return false;
#endif
}

bool amx_int8_available() {
#ifdef TANDEM_GGUF_AMX
  static const bool ok = vnni_available() && __builtin_cpu_supports("amx-int8") && tandem_cpu::amx::usable();
  return ok;
#else
  return false;
#endif
}

// path (integer arithmetic): 0 the fastest here (AMX-INT8 from kAmxMinRows rows, kAmxMinRowsQ6K for Q6_K,
// else VNNI, else portable), 1 portable, 2 VNNI, 3 AMX; all give the same bits (a path this CPU lacks
// falls back to the next)
template <typename out_t>
void dispatch(QType t, int64_t path, const uint8_t* packed, int64_t nb, int64_t kb, int64_t n, const Acts& acts,
              int64_t m, const float* bias, out_t* out) {
#ifdef TANDEM_GGUF_AMX
  if ((path == 3 || (path == 0 && m >= (t == kQ6_K ? kAmxMinRowsQ6K : kAmxMinRows))) && amx_int8_available()) {
    switch (t) {
      case kQ4_0: return run_amx<kQ4_0>(packed, nb, kb, n, acts, m, bias, out);
      case kQ4_1: return run_amx<kQ4_1>(packed, nb, kb, n, acts, m, bias, out);
      case kQ8_0: return run_amx<kQ8_0>(packed, nb, kb, n, acts, m, bias, out);
      case kQ4_K: return run_amx<kQ4_K>(packed, nb, kb, n, acts, m, bias, out);
      case kQ5_K: return run_amx<kQ5_K>(packed, nb, kb, n, acts, m, bias, out);
      case kQ6_K: return run_amx<kQ6_K>(packed, nb, kb, n, acts, m, bias, out);
    }
  }
#endif
#ifdef TANDEM_GGUF_VNNI
  if (path != 1 && vnni_available()) {
    switch (t) {
      case kQ4_0: return run_vnni<kQ4_0>(packed, nb, kb, n, acts, m, bias, out);
      case kQ4_1: return run_vnni<kQ4_1>(packed, nb, kb, n, acts, m, bias, out);
      case kQ8_0: return run_vnni<kQ8_0>(packed, nb, kb, n, acts, m, bias, out);
      case kQ4_K: return run_vnni<kQ4_K>(packed, nb, kb, n, acts, m, bias, out);
      case kQ5_K: return run_vnni<kQ5_K>(packed, nb, kb, n, acts, m, bias, out);
      case kQ6_K: return run_vnni<kQ6_K>(packed, nb, kb, n, acts, m, bias, out);
    }
  }
#endif
  run_portable(t, packed, nb, kb, n, acts, m, bias, out);
}

constexpr int64_t kPathAmxBf16 = 4;  // the bf16-tile arithmetic (bfloat16 x, AMX-BF16 only)

// Whether the call takes the bf16-tile arithmetic: bfloat16 x under path 0 where the CPU has it, or path 4
bool bf16_tiles_take(const at::Tensor& x, int64_t path) {
  TORCH_CHECK(path >= 0 && path <= kPathAmxBf16, "path: ", path, " is not 0 to ", kPathAmxBf16);
  if (path == kPathAmxBf16) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "path amx_bf16: x must be bfloat16, got ", x.scalar_type());
    TORCH_CHECK(amx_bf16_available(), "path amx_bf16: this CPU (or kernel) gives no AMX-BF16 to the process");
    return true;
  }
  return path == 0 && x.scalar_type() == at::kBFloat16 && amx_bf16_available();
}

template <typename out_t>
void run_amx_bf16(QType t, const at::BFloat16* x, const uint8_t* packed, int64_t nb, int64_t kb, int64_t n, int64_t m,
                  const float* bias, out_t* out) {
#ifdef TANDEM_GGUF_AMX_BF16
  switch (t) {
    case kQ4_0: return linear_amx_bf16<kQ4_0>(x, packed, nb, kb, n, m, bias, out);
    case kQ4_1: return linear_amx_bf16<kQ4_1>(x, packed, nb, kb, n, m, bias, out);
    case kQ8_0: return linear_amx_bf16<kQ8_0>(x, packed, nb, kb, n, m, bias, out);
    case kQ4_K: return linear_amx_bf16<kQ4_K>(x, packed, nb, kb, n, m, bias, out);
    case kQ5_K: return linear_amx_bf16<kQ5_K>(x, packed, nb, kb, n, m, bias, out);
    case kQ6_K: return linear_amx_bf16<kQ6_K>(x, packed, nb, kb, n, m, bias, out);
  }
#endif
  TORCH_CHECK(false, "gguf_linear: built without AMX-BF16");
}

constexpr int64_t kGroupHeader = 64;  // gguf_blocks.group: int64 [parts, K/32, (features, unit bytes) per part]
constexpr int64_t kGroupAlign = 64;   // each part's bytes start on a 64-byte boundary past the header

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                       bool out_fp32, int64_t path);

// A group (a fused linear whose parts are of different types): each part's linear, its outputs side by
// side. A part's bits are its own linear's, so the group keeps every row's batch invariance.
at::Tensor gguf_linear_group(const at::Tensor& x, const at::Tensor& blob, int64_t n,
                             const c10::optional<at::Tensor>& bias, bool out_fp32, int64_t path) {
  TORCH_CHECK(blob.dim() == 1 && blob.scalar_type() == at::kByte && blob.is_contiguous() && blob.numel() >= kGroupHeader,
              "packed: a group is gguf_blocks.group's contiguous 1-D uint8");
  int64_t header[kGroupHeader / 8];
  std::memcpy(header, blob.data_ptr<uint8_t>(), kGroupHeader);
  const int64_t parts = header[0], kb = header[1];
  TORCH_CHECK(parts >= 2 && parts <= (kGroupHeader / 8 - 2) / 2 && kb > 0, "packed: no group header");
  std::vector<at::Tensor> outs;
  int64_t offset = kGroupHeader, n_done = 0;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t n_part = header[2 + 2 * p], unit = header[3 + 2 * p], nb = (n_part + kFeat - 1) / kFeat;
    const int64_t bytes = nb * kb * unit;
    TORCH_CHECK(n_part > 0 && offset + bytes <= blob.numel(), "packed: group part ", p, " runs past its bytes");
    const at::Tensor part = blob.narrow(0, offset, bytes).view({nb, kb, unit});
    const c10::optional<at::Tensor> part_bias =
        bias.has_value() ? c10::optional<at::Tensor>(bias->reshape({-1}).narrow(0, n_done, n_part)) : c10::nullopt;
    outs.push_back(gguf_linear(x, part, n_part, part_bias, out_fp32, path));
    offset += (bytes + kGroupAlign - 1) / kGroupAlign * kGroupAlign;
    n_done += n_part;
  }
  TORCH_CHECK(n_done == n, "n: ", n, " features, the group's parts hold ", n_done);
  TORCH_CHECK(!bias.has_value() || bias->numel() == n, "bias: ", n, " values");
  return at::cat(outs, -1);
}

// x [..., K] (float32 / bfloat16 / float16) -> [..., n] in x's dtype, or float32 with out_fp32
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                       bool out_fp32, int64_t path) {
  if (packed.dim() == 1) return gguf_linear_group(x, packed, n, bias, out_fp32, path);
  const QType t = qtype_of(packed);
  const int64_t nb = packed.size(0), kb = packed.size(1), k = kb * kBlock;
  TORCH_CHECK(n > (nb - 1) * kFeat && n <= nb * kFeat, "n: ", n, " features do not fill ", nb, " blocks of 16");
  TORCH_CHECK(x.size(-1) == k, "x: ", k, " inputs, got ", x.size(-1));
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty({m, n}, x.options().dtype(out_fp32 ? at::kFloat : x.scalar_type()));
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "bias: ", n, " values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (m == 0) return out.view(out_shape);
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  if (bf16_tiles_take(x2, path)) {
    const at::BFloat16* xp = x2.data_ptr<at::BFloat16>();
    if (out_fp32) {
      run_amx_bf16(t, xp, pp, nb, kb, n, m, bp, out.data_ptr<float>());
    } else {
      run_amx_bf16(t, xp, pp, nb, kb, n, m, bp, out.data_ptr<at::BFloat16>());
    }
    return out.view(out_shape);
  }
  Acts acts(m, k, kb);
  const int32_t z = zero_point(t);
  tandem_cpu::dispatch_float_types(x2.scalar_type(), "gguf_linear x", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = reinterpret_cast<const scalar_t*>(x2.data_ptr());
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        quantize_row(xp + r * k, kb, z, acts.hi.data() + acts.at(r, 0), acts.lo.data() + acts.at(r, 0), m * kBlock,
                     acts.dx.data() + r * kb, acts.sx.data() + r * kb, acts.cq.data() + r * kb,
                     acts.cq0.data() + r * kb);
    });
  });
  if (out_fp32) {
    dispatch(t, path, pp, nb, kb, n, acts, m, bp, out.data_ptr<float>());
  } else {
    tandem_cpu::dispatch_float_types(out.scalar_type(), "gguf_linear out", [&](auto tag) {
      using out_t = decltype(tag);
      dispatch(t, path, pp, nb, kb, n, acts, m, bp, reinterpret_cast<out_t*>(out.data_ptr()));
    });
  }
  return out.view(out_shape);
}

// rows `ids` of the weight, dequantized exactly as gguf's numpy dequantize does (d * q in float32,
// + m for Q4_1, fma(d, u, m) for Q4_K and Q5_K: one rounding of the exact d u + m as numpy's d * q - dm,
// Q6_K's d_h * (u - 32) exact): float32 [len(ids), K]. The embedding reads its rows so.
at::Tensor gguf_rows(const at::Tensor& packed, int64_t n, const at::Tensor& ids) {
  const QType t = qtype_of(packed);
  const int64_t kb = packed.size(1), k = kb * kBlock, ub = unit_bytes(t), off = data_offset(t);
  const int32_t z = zero_point(t);
  const at::Tensor idx = ids.to(at::kLong).contiguous().view({-1});
  const int64_t* ip = idx.data_ptr<int64_t>();
  at::Tensor out = at::empty({idx.numel(), k}, packed.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  for (int64_t r = 0; r < idx.numel(); ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "ids: ", ip[r], " is not in [0, ", n, ")");
  at::parallel_for(0, idx.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t fb = ip[r] / kFeat, f = ip[r] % kFeat;
      for (int64_t b = 0; b < kb; ++b) {
        const uint8_t* unit = pp + (fb * kb + b) * ub;
        const float d = unit_d(t, unit, f);
        const float mn = has_min(t) || t == kQ6_K ? unit_m(t, unit, f) : 0.f;  // or Q6_K's second-half d
        const uint8_t* data = unit + off;
        float* dst = op + r * k + b * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) {
          const int32_t u = unit_u(t, data, f, i);
          if (has_min(t)) dst[i] = std::fma(d, static_cast<float>(u), mn);
          else dst[i] = (t == kQ6_K && i >= 16 ? mn : d) * static_cast<float>(u - z);
        }
      }
    }
  });
  return out;
}

// Reads every byte of `buf` once (the bench's streaming bandwidth); returns a value that depends on them all.
int64_t stream_read(const at::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous(), "buf: contiguous");
  const uint8_t* p = static_cast<const uint8_t*>(buf.data_ptr());
  const int64_t bytes = buf.numel() * buf.element_size(), lines = bytes / 256;
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, lines, 4096, [&](int64_t begin, int64_t end) {
    uint64_t acc = 0;
#ifdef TANDEM_GGUF_VNNI
    __m512i a = _mm512_setzero_si512();
    for (int64_t l = begin; l < end; ++l) {
      const uint8_t* q = p + l * 256;
      a = _mm512_xor_si512(a, _mm512_loadu_si512(q));
      a = _mm512_xor_si512(a, _mm512_loadu_si512(q + 64));
      a = _mm512_xor_si512(a, _mm512_loadu_si512(q + 128));
      a = _mm512_xor_si512(a, _mm512_loadu_si512(q + 192));
    }
    acc = static_cast<uint64_t>(_mm512_reduce_add_epi64(a));
#else
    for (int64_t l = begin; l < end; ++l) {
      const uint64_t* q = reinterpret_cast<const uint64_t*>(p + l * 256);
      for (int i = 0; i < 32; ++i) acc ^= q[i];
    }
#endif
    total.fetch_xor(acc);
  });
  return static_cast<int64_t>(total.load() & 0x7fffffff);
}

std::string gguf_isa() {
  const std::string ints = amx_int8_available() ? "amx_int8+avx512_vnni" : vnni_available() ? "avx512_vnni" : "portable";
  return amx_bf16_available() ? "amx_bf16+" + ints : ints;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("gguf_isa() -> str");
  m.def("gguf_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, bool out_fp32=False, int path=0) -> Tensor");
  m.def("gguf_rows(Tensor packed, int n, Tensor ids) -> Tensor");
  m.def("stream_read(Tensor buf) -> int");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CatchAll, m) { m.impl("gguf_isa", &gguf_isa); }

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_rows", &gguf_rows);
  m.impl("stream_read", &stream_read);
}
