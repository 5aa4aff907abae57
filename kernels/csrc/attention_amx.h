// Paged attention for bfloat16 queries over a bfloat16 KV pool on AMX, one arithmetic for decode
// and extend. A query row at length n (it attends over its row's first n slots) gets bits that
// depend only on itself and those keys and values, never on the rows computed beside it, the
// batch, or whether it came as a decode step, a prefill, a chunk or a speculative verify:
//
//   scores:  per block of 16 keys (from key 0 on), one tile from zero, TDPBF16PS over the head
//            dim in steps of 32, then times `scale`;
//   softmax: the row's max, exp (exp16, one polynomial) of each score minus it, their sum over
//            blocks of 16 in ascending order, the weights rounded once to bfloat16;
//   output:  per d-tile of 16 columns, TDPBF16PS over chunks of 32 keys (from key 0 on, weights
//            past n are zero), then times 1 / sum, rounded once to bfloat16.
//
// Keys past n only ever meet zero weights, which add nothing (a tile's sums are flushed, never
// denormal, so + 0 is exact): a row computed in a tile of longer rows equals the same row alone.
// The softmax and the epilogue are out-of-line (noinline) so decode and extend run one compiled
// copy of them: -ffast-math may contract or reorder inlined float code differently per call site.
//
// A sliding window (Args::window > 0: a query at length n attends to keys [n - window, n)) keeps
// that alignment: keys are packed from a multiple of 32 at or below the window's first key, those
// below it packed as zeros (never read), and masked out of the softmax. Blocks and chunks stay on
// the same key boundaries whatever the rows beside, and a leading chunk of all-zero weights adds
// exactly nothing, so decode and extend still agree bit for bit.
//
// Keys and values are packed per KV head into TDPBF16PS's B layout: K per block of 16 keys a
// [head_dim / 32][16 pairs][16 keys] tile of element pairs, V per chunk of 32 keys a
// [head_dim / 16][16 key pairs][16 columns] tile. Decode packs a sequence's values as it reads them
// (in cache, per thread) and takes its keys as they are (decode_scores: the same scores transposed);
// extend packs a request's keys once and shares them among its tokens.
#pragma once
#include "amx_common.h"
#include "attention_amx_pack.h"
#include "decode_attention_avx512.h"
#include "decode_attention_common.h"

#ifdef TANDEM_AMX
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace tandem_cpu::amx_attn {

constexpr int64_t kRows = 16;  // query rows per tile

// lanes i of a 16-key block at key t with lo <= t + i < n
inline __mmask16 lanes(int64_t t, int64_t lo, int64_t n) {
  const int64_t a = std::clamp<int64_t>(lo - t, 0, 16), b = std::clamp<int64_t>(n - t, 0, 16);
  return a >= b ? __mmask16(0) : __mmask16(((1u << b) - 1) & ~((1u << a) - 1));
}

// e^x for x <= 0 (below -87 it is 0): Cody-Waite reduction by ln 2, a degree-6 polynomial
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

// one row's softmax: scores s[lo, n) (unscaled) -> weights w[0, n_pad) in bfloat16 (zero below lo
// and past n); returns 1 / sum. s and w start on a multiple of 16 keys.
__attribute__((noinline)) inline float softmax_row(const float* s, int64_t lo, int64_t n, int64_t n_pad, float scale,
                                                   at::BFloat16* w) {
  const __m512 sc = _mm512_set1_ps(scale), neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv = neg_inf;
  for (int64_t t = lo / 16 * 16; t < n; t += 16) {
    const __mmask16 m = lanes(t, lo, n);
    mv = _mm512_max_ps(mv, _mm512_mask_mul_ps(neg_inf, m, _mm512_maskz_loadu_ps(m, s + t), sc));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();  // masked lanes add +0: the sums are those of the window alone
  for (int64_t t = 0; t < n_pad; t += 16) {
    const __mmask16 m = lanes(t, lo, n);
    const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), sc), mx);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(x));
    sum = _mm512_add_ps(sum, e);
    const __m256bh wb = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), reinterpret_cast<const __m256i&>(wb));
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// a row of sums times 1 / sum, rounded to bfloat16
template <int kD>
__attribute__((noinline)) void finish_row(const float* o, float inv_sum, at::BFloat16* out) {
  for (int c = 0; c < kD; c += 16) {
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + c), _mm512_set1_ps(inv_sum)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), reinterpret_cast<const __m256i&>(r));
  }
}

// tmm0-3: output sums (4 x 16 columns), tmm4: scores, tmm5: A (queries or weights), tmm6-7: B.
// score_rows: tmm4's rows (decode's transposed scores: 16 keys).
inline void configure(int64_t rows, int64_t score_rows) {
  amx::TileConfig cfg;
  for (int t = 0; t < 6; ++t) cfg.set(t, rows, 64);
  cfg.set(4, score_rows, 64);
  cfg.set(6, 16, 64);
  cfg.set(7, 16, 64);
  cfg.load();
}

// Per-thread buffers and the rows configured in the tiles.
struct Scratch {
  std::vector<float> scores, sums;
  std::vector<at::BFloat16> weights, q;
  std::vector<float> inv_sum;
  int64_t configured = -1, configured_scores = -1;
  // decode: the queries' transposed pairs, then a block of 16 keys copied where not read in place
  alignas(64) uint32_t tiles[4 * 256 + 16 * 64];

  void configure_for(int64_t rows, int64_t score_rows) {
    if (configured != rows || configured_scores != score_rows) configure(rows, score_rows);
    configured = rows, configured_scores = score_rows;
  }
  ~Scratch() {
    if (configured >= 0) _tile_release();
  }
};

template <int kD, typename Tick>
void weigh(int64_t rows, const int64_t* lo, const int64_t* n, int64_t k0, int64_t n_pad, const uint32_t* v_tiles,
           float scale, at::BFloat16* const* out_rows, Scratch& s, Tick&& tick);

// `rows` query rows (rows x kD bfloat16, contiguous) against one KV head's keys packed over
// [0, n_packed); row r attends over keys [lo[r], n[r]) (n_max the largest n); out[r] = out_rows[r].
// Blocks and chunks start at k0, the lowest lo rounded down to a chunk: the ones before hold no
// row's key, and leaving them out changes no bit.
template <int kD, typename Tick>
void attend(const at::BFloat16* q, int64_t rows, const int64_t* lo, const int64_t* n, int64_t n_max,
            const uint32_t* packed, int64_t n_packed, float scale, at::BFloat16* const* out_rows, Scratch& s,
            Tick&& tick) {
  s.configure_for(rows, rows);
  const int64_t k0 = *std::min_element(lo, lo + rows) / kChunk * kChunk;
  const int64_t n_pad = round_up(n_max, kChunk), width = n_pad - k0;
  s.scores.resize(rows * width);
  s.weights.resize(rows * width);
  s.sums.resize(rows * kD);
  s.inv_sum.resize(rows);
  const uint32_t* k_tiles = packed;
  for (int64_t b = k0 / kBlock; b < round_up(n_max, kBlock) / kBlock; ++b) {
    _tile_zero(4);
    for (int c = 0; c < kD / 32; ++c) {
      _tile_loadd(5, q + 32 * c, kD * 2);
      _tile_loadd(6, k_tiles + (b * (kD / 32) + c) * 256, 64);
      _tile_dpbf16ps(4, 5, 6);
    }
    _tile_stored(4, s.scores.data() + b * kBlock - k0, width * 4);
    tick();
  }
  weigh<kD>(rows, lo, n, k0, n_pad, packed + Packed<kD>::k_words(n_packed), scale, out_rows, s, tick);
}

// The rest of attend once s.scores holds the rows' scores over [k0, n_pad): softmax, weighted V
// (v_tiles: the head's V chunks from key 0), each row times 1 / sum into out_rows.
template <int kD, typename Tick>
void weigh(int64_t rows, const int64_t* lo, const int64_t* n, int64_t k0, int64_t n_pad, const uint32_t* v_tiles,
           float scale, at::BFloat16* const* out_rows, Scratch& s, Tick&& tick) {
  const int64_t width = n_pad - k0;
  for (int64_t r = 0; r < rows; ++r)
    s.inv_sum[r] = softmax_row(s.scores.data() + r * width, lo[r] - k0, n[r] - k0, width, scale,
                               s.weights.data() + r * width);
  for (int dg = 0; dg < kD / 64; ++dg) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = k0 / kChunk; c < n_pad / kChunk; ++c) {
      const uint32_t* v = v_tiles + (c * (kD / 16) + dg * 4) * 256;
      _tile_loadd(5, s.weights.data() + c * kChunk - k0, width * 2);
      _tile_loadd(6, v, 64);
      _tile_dpbf16ps(0, 5, 6);
      _tile_loadd(7, v + 256, 64);
      _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(6, v + 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, v + 768, 64);
      _tile_dpbf16ps(3, 5, 7);
      tick();
    }
    float* o = s.sums.data() + dg * 64;
    _tile_stored(0, o, kD * 4);
    _tile_stored(1, o + 16, kD * 4);
    _tile_stored(2, o + 32, kD * 4);
    _tile_stored(3, o + 48, kD * 4);
  }
  for (int64_t r = 0; r < rows; ++r) finish_row<kD>(s.sums.data() + r * kD, s.inv_sum[r], out_rows[r]);
}

// whether slots[0, 16) are 16 consecutive slots
inline bool consecutive16(const int64_t* slots) {
  const __m512i step = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0), first = _mm512_set1_epi64(slots[0]);
  const __m512i lo = _mm512_add_epi64(first, step), hi = _mm512_add_epi64(lo, _mm512_set1_epi64(8));
  return _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(slots), lo) == 0xff &&
         _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(slots + 8), hi) == 0xff;
}

// Decode's scores of `rows` query rows (rows x kD, contiguous) over one KV head's keys [lo, n) of
// `slots`, with K unpacked: per block of 16 keys the transposed tile K q^T, keys as A rows (read in
// place from the pool where their slots are consecutive, else copied; zero below lo and past n)
// and the queries' element pairs as B columns, from zero over the head dim in steps of 32. Each
// score is the same products summed in the same order as attend's q K^T tile; a row's scores go
// to s.scores (row stride round_up(n, kChunk)).
template <int kD, typename Tick>
void decode_scores(const at::BFloat16* q, int64_t rows, int64_t lo, int64_t n, const at::BFloat16* k_pool,
                   const int64_t* slots, int64_t slot_elems, int64_t head_offset, Scratch& s, Tick&& tick) {
  const int64_t width = round_up(n, kChunk);
  uint32_t* qt = s.tiles;  // tile c, row p, column j: row j's elements (32c + 2p, 32c + 2p + 1)
  const uint32_t* qw = reinterpret_cast<const uint32_t*>(q);
  for (int c = 0; c < kD / 32; ++c)
    for (int p = 0; p < 16; ++p)
      for (int j = 0; j < 16; ++j) qt[(c * 16 + p) * 16 + j] = j < rows ? qw[j * (kD / 2) + c * 16 + p] : 0;
  at::BFloat16* copied = reinterpret_cast<at::BFloat16*>(s.tiles + 4 * 256);  // 16 keys x kD
  alignas(64) float st[kBlock * 16];
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int64_t k0 = 0; k0 < n; k0 += kBlock) {
    const int64_t* sl = slots + k0;
    const at::BFloat16* keys;
    int64_t stride;
    if (k0 >= lo && k0 + kBlock <= n && consecutive16(sl)) {
      keys = k_pool + sl[0] * slot_elems + head_offset, stride = slot_elems * 2;
    } else {
      for (int64_t j = 0; j < kBlock; ++j) {
        const bool in = k0 + j >= lo && k0 + j < n;
        for (int e = 0; e < kD; e += 32)
          _mm512_storeu_si512(copied + j * kD + e, in ? _mm512_loadu_si512(k_pool + sl[j] * slot_elems + head_offset + e)
                                                       : _mm512_setzero_si512());
      }
      keys = copied, stride = kD * 2;
    }
    _tile_zero(4);
    for (int c = 0; c < kD / 32; ++c) {
      _tile_loadd(6, qt + c * 256, 64);
      _tile_loadd(7, keys + 32 * c, stride);
      _tile_dpbf16ps(4, 7, 6);
    }
    _tile_stored(4, st, 64);
    for (int64_t r = 0; r < rows; ++r)
      _mm512_storeu_ps(s.scores.data() + r * width + k0,
                       _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(int(r))), st, 4));
    tick();
  }
}

struct Args {
  const at::BFloat16* q;
  int64_t q_stride;
  const at::BFloat16 *k, *v;
  const int64_t* req_to_token;
  int64_t row_stride;
  const int64_t *rows, *seq_lens;
  at::BFloat16* out;
  int64_t bs, hq, hkv;
  float scale;
  int64_t window;  // 0: every key

  // the first key a query at length n attends to
  int64_t first_key(int64_t n) const { return window > 0 ? std::max<int64_t>(0, n - window) : 0; }
};

// A run: queries b .. b + len - 1 of one request at lengths n, n + 1, ... (an extend's tokens;
// a decode query is a run of one).
struct Run {
  int64_t first, len;
};

inline std::vector<Run> find_runs(const Args& a) {
  std::vector<Run> runs;
  for (int64_t b = 0; b < a.bs; ++b) {
    if (!runs.empty()) {
      Run& last = runs.back();
      const int64_t prev = last.first + last.len - 1;
      if (a.rows[b] == a.rows[prev] && a.seq_lens[b] == a.seq_lens[prev] + 1) {
        ++last.len;
        continue;
      }
    }
    runs.push_back({b, 1});
  }
  return runs;
}

// Queries [t0, t0 + tokens) of a run, heads [g0, g0 + heads) of KV head h's group, as one tile's
// rows: their queries into s.q, their keys [lo, n) counted from `base`, their output rows. Returns the row count.
template <int kD>
int64_t gather_rows(const Args& a, const Run& run, int64_t h, int64_t t0, int64_t tokens, int64_t g0, int64_t heads,
                    int64_t base, Scratch& s, int64_t* lo, int64_t* n, at::BFloat16** out_rows) {
  const int64_t group = a.hq / a.hkv, rows = tokens * heads;
  s.q.resize(rows * kD);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t g = 0; g < heads; ++g) {
      const int64_t b = run.first + t0 + i, head = h * group + g0 + g, r = i * heads + g;
      std::copy_n(a.q + b * a.q_stride + head * kD, kD, s.q.data() + r * kD);
      lo[r] = a.first_key(a.seq_lens[b]) - base;
      n[r] = a.seq_lens[b] - base;
      out_rows[r] = a.out + (b * a.hq + head) * kD;
    }
  return rows;
}

// The same tile over that head's keys packed for [base, base + n_packed) (base: a multiple of kChunk).
template <int kD, typename Tick>
void attend_tile(const Args& a, const Run& run, int64_t h, int64_t t0, int64_t tokens, int64_t g0, int64_t heads,
                 const uint32_t* packed, int64_t base, int64_t n_packed, Scratch& s, Tick&& tick) {
  int64_t lo[kRows], n[kRows];
  at::BFloat16* out_rows[kRows];
  const int64_t rows = gather_rows<kD>(a, run, h, t0, tokens, g0, heads, base, s, lo, n, out_rows);
  attend<kD>(s.q.data(), rows, lo, n, a.seq_lens[run.first + t0 + tokens - 1] - base, packed, n_packed, a.scale,
             out_rows, s, tick);
}

template <int kD>
void decode_runs(const Args& a, const std::vector<Run>& runs) {
  const int64_t group = a.hq / a.hkv, heads = std::min<int64_t>(group, kRows);
  attn::parallel_by_cost(int64_t(runs.size()), [&](int64_t i) { return a.seq_lens[runs[i].first]; },
                   [&](int64_t begin, int64_t end) {
    Scratch s;
    // grows to the longest sequence a thread has packed and stays: a fresh buffer per call was
    // allocated and zero-filled every layer of every step
    thread_local std::vector<uint32_t> packed;
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs[i];
      // keys packed from `base`, the window's first key rounded down to a chunk
      const int64_t first = a.first_key(a.seq_lens[run.first]), base = first / kChunk * kChunk;
      const int64_t n = a.seq_lens[run.first] - base;
      const int64_t* slots = a.req_to_token + a.rows[run.first] * a.row_stride + base;
      const int64_t words = Packed<kD>::words(n);
      if (int64_t(packed.size()) < a.hkv * words + 16) packed.resize(a.hkv * words + 16);
      uint32_t* aligned = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(packed.data()) + 63) & ~uintptr_t(63));
      Packed<kD>::pack(a.k, a.v, slots, n, first - base, a.hkv, aligned, 0, round_up(n, kChunk) / kChunk, false);
      // memory would idle while the heads compute from cache: the next query's keys and values
      // come meanwhile, spread evenly over the tiles' steps (a burst stalled on the fill buffers)
      const int64_t steps = a.hkv * ((group + heads - 1) / heads) * (round_up(n, kBlock) / kBlock + round_up(n, kChunk) / kChunk);
      attn::SpreadPrefetch<at::BFloat16> next{a.k, a.v, nullptr, 0, steps, a.hkv * kD};
      if (i + 1 < end) {
        const int64_t next_n = a.seq_lens[runs[i + 1].first], next_first = a.first_key(next_n);
        next.slots = a.req_to_token + a.rows[runs[i + 1].first] * a.row_stride + next_first;
        next.count = next_n - next_first;
      }
      int64_t lo[kRows], lens[kRows];
      at::BFloat16* out_rows[kRows];
      auto tick = [&] { next.tick(); };
      for (int64_t h = 0; h < a.hkv; ++h)
        for (int64_t g0 = 0; g0 < group; g0 += heads) {
          const int64_t rows = gather_rows<kD>(a, run, h, 0, 1, g0, std::min(heads, group - g0), base, s, lo, lens, out_rows);
          s.configure_for(rows, kBlock);
          s.scores.resize(rows * round_up(n, kChunk));
          s.weights.resize(rows * round_up(n, kChunk));
          s.sums.resize(rows * kD);
          s.inv_sum.resize(rows);
          decode_scores<kD>(s.q.data(), rows, first - base, n, a.k, slots, a.hkv * kD, h * kD, s, tick);
          weigh<kD>(rows, lo, lens, 0, round_up(n, kChunk), aligned + h * words + Packed<kD>::k_words(n), a.scale,
                    out_rows, s, tick);
        }
    }
  });
}

// one run of many queries: every KV head packed once (in parallel), then tiles of up to 16 rows
template <int kD>
void extend_run(const Args& a, const Run& run) {
  const int64_t group = a.hq / a.hkv, heads = std::min<int64_t>(group, kRows), tokens = kRows / heads;
  // keys packed from `base`, the first token's window start rounded down to a chunk (later tokens start later)
  const int64_t first = a.first_key(a.seq_lens[run.first]), base = first / kChunk * kChunk;
  const int64_t n = a.seq_lens[run.first + run.len - 1] - base, chunks = round_up(n, kChunk) / kChunk;
  const int64_t words = Packed<kD>::words(n);
  at::Tensor packed_t = at::empty({a.hkv * words + 16}, at::kInt);
  uint32_t* packed = reinterpret_cast<uint32_t*>(
      (reinterpret_cast<uintptr_t>(packed_t.data_ptr<int32_t>()) + 63) & ~uintptr_t(63));
  const int64_t* slots = a.req_to_token + a.rows[run.first] * a.row_stride + base;
  at::parallel_for(0, chunks, 4, [&](int64_t begin, int64_t end) {
    Packed<kD>::pack(a.k, a.v, slots, n, first - base, a.hkv, packed, begin, end);
  });
  // items: (token tile, KV head, head group), costed by the tile's last length
  const int64_t tiles = (run.len + tokens - 1) / tokens, head_tiles = (group + heads - 1) / heads;
  const int64_t per_tile = a.hkv * head_tiles;
  attn::parallel_by_cost(tiles * per_tile, [&](int64_t i) {
    const int64_t last = a.seq_lens[run.first + std::min(run.len, i / per_tile * tokens + tokens) - 1];
    return last - a.first_key(last);
  }, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t0 = i / per_tile * tokens, h = i % per_tile / head_tiles, g0 = i % head_tiles * heads;
      attend_tile<kD>(a, run, h, t0, std::min(tokens, run.len - t0), g0, std::min(heads, group - g0), packed + h * words,
                      base, n, s, [] {});
    }
  });
}

template <int kD>
void attention(const Args& a) {
  const std::vector<Run> runs = find_runs(a);
  std::vector<Run> single;
  for (const Run& run : runs)
    if (run.len == 1) single.push_back(run);
  if (!single.empty()) decode_runs<kD>(a, single);
  for (const Run& run : runs)
    if (run.len > 1) extend_run<kD>(a, run);
}

}  // namespace tandem_cpu::amx_attn
#endif
