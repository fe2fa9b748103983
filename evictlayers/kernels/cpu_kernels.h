// What the C++ CPU kernels share (decode/slots_cpu.cpp, quantized_decode/int4_cpu.cpp, linear_cpu.cpp): addressing
// a slot row by strides, the decode's softmax over one query row with the mass it adds up, and, on AVX2 machines,
// how the decode's QK reduces and stores a tile of logits (sum16 with AVX-512, which int4_cpu.cpp's and
// linear_cpu.cpp's loops also reduce by) and the PV loops over a tile of float slots (slots_cpu.cpp runs them on the
// cache's own rows, int4_cpu.cpp's AVX2 path on rows it has just dequantised into L1).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EVICTLAYERS_AVX2 1
#else
#define EVICTLAYERS_AVX2 0
#endif
// AVX-512 loops where the machine has it and the head dim is a multiple of 16: a slot row of 64 floats is 4 vector
// loads instead of 8 (PV here, QK in decode/slots_cpu.cpp; int4_cpu.cpp's and linear_cpu.cpp's loops)
#if EVICTLAYERS_AVX2 && defined(__AVX512F__)
#define EVICTLAYERS_AVX512 1
#else
#define EVICTLAYERS_AVX512 0
#endif
// ATen's vector types (the softmax) are vector code only where the capability is named before their header (else a
// scalar fallback: the softmax's exp took ten times as long); 16 floats wide the softmax op takes 0.8x the time of 8
#if EVICTLAYERS_AVX512 && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif EVICTLAYERS_AVX2
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>  // vec_reduce_all, which vec.h brings in only with AVX2
#include <torch/extension.h>

#include <optional>

namespace evictlayers {

// Where one (b, h) row's slot c starts in a [B, H, C, X] tensor, by its strides.
struct Rows {
  const int64_t* strides;
  int64_t at(int64_t b, int64_t h, int64_t c) const { return b * strides[0] + h * strides[1] + c * strides[2]; }
};

// ---- the decode's softmax -----------------------------------------------------------------------------------------
//
// One (b, h): which slots the query sees goes into a row of 0 / -inf once (hidden), shared by the G query rows;
// each row is then three passes over its floats in L1 (scaled and masked logits with their max; exp and sum;
// normalise), and the rows' probabilities (or AhaKV's gained ones) are combined into each slot's mass. Inductor's
// code for the same steps compared the int64 positions anew in every pass of every row, at several times the cost.

using Vec = at::vec::Vectorized<float>;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
enum Reduce : int64_t { SUM = 0, MEAN = 1, MAX = 2 };  // gqa_reduce

// The softmax's options, checked as the ops take them (query_pos [B] int64, gain [B] or none, reduce, softcap);
// returns the gain as contiguous float32 (undefined without one).
inline at::Tensor checked_softmax_options(const at::Tensor& query_pos, int64_t B, const std::optional<at::Tensor>& gain,
                                          int64_t reduce, double softcap) {
  TORCH_CHECK(query_pos.dim() == 1 && query_pos.scalar_type() == at::kLong && query_pos.size(0) == B,
              "query_pos must be [B] int64 with B = ", B, ", got ", query_pos.sizes(), " ", query_pos.scalar_type());
  TORCH_CHECK(reduce == SUM || reduce == MEAN || reduce == MAX, "reduce must be 0 (sum), 1 (mean) or 2 (max), got ",
              reduce);
  TORCH_CHECK(softcap >= 0, "softcap must be positive, or 0 for none; got ", softcap);
  if (!gain.has_value()) return at::Tensor();
  TORCH_CHECK(gain->dim() == 1 && gain->size(0) == B, "gain must be [B] with B = ", B, ", got ", gain->sizes());
  return gain->contiguous().to(at::kFloat);
}

// 0 where a query at query_pos (-1: padding) sees the slot holding position at (-1: empty), else -inf; window < 0:
// no sliding window
inline float hidden(int64_t at, int64_t query_pos, int64_t window) {
  const bool seen = query_pos >= 0 && at >= 0 && at <= query_pos && (window < 0 || query_pos - at < window);
  return seen ? 0.0f : NEG_INF;
}

// out[c] = softmax over c of factor * cap(scale * x[c]) + hidden[c] (out may be x); returns the row's log-sum-exp
// (-inf, and a row of zeros, when it sees nothing). cap: softcap * tanh(y / softcap), none when softcap is 0.
inline float row_softmax(const float* x, const float* hidden, int64_t C, float scale, float softcap, float factor,
                         float* out) {
  const Vec vscale(scale), vfactor(factor), vcap(softcap), vinv_cap(softcap > 0 ? 1.0f / softcap : 0.0f);
  Vec best(NEG_INF);
  int64_t c = 0;
  for (; c + Vec::size() <= C; c += Vec::size()) {
    Vec y = Vec::loadu(x + c) * vscale;
    if (softcap > 0) y = (y * vinv_cap).tanh() * vcap;
    y = y * vfactor + Vec::loadu(hidden + c);
    y.store(out + c);
    best = at::vec::maximum(best, y);
  }
  float most = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
  for (; c < C; ++c) {
    float y = x[c] * scale;
    if (softcap > 0) y = std::tanh(y / softcap) * softcap;
    out[c] = y * factor + hidden[c];
    most = std::max(most, out[c]);
  }
  if (most == NEG_INF) {
    std::fill(out, out + C, 0.0f);
    return NEG_INF;
  }
  const Vec vmost(most);
  Vec total(0.0f);
  for (c = 0; c + Vec::size() <= C; c += Vec::size()) {
    const Vec e = (Vec::loadu(out + c) - vmost).exp_u20();
    e.store(out + c);
    total = total + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total);
  for (; c < C; ++c) {
    out[c] = std::exp(out[c] - most);
    sum += out[c];
  }
  const Vec vinv(1.0f / sum);
  for (c = 0; c + Vec::size() <= C; c += Vec::size()) (Vec::loadu(out + c) * vinv).store(out + c);
  for (; c < C; ++c) out[c] *= 1.0f / sum;
  return most + std::log(sum);
}

// mass[c] = how(mass[c], row[c]) (MEAN adds: the caller divides by G once), or row[c] for the group's first row
inline void combine(float* mass, const float* row, int64_t C, int64_t how, bool first) {
  if (first) {
    std::copy(row, row + C, mass);
    return;
  }
  int64_t c = 0;
  for (; c + Vec::size() <= C; c += Vec::size()) {
    const Vec a = Vec::loadu(mass + c), b = Vec::loadu(row + c);
    (how == MAX ? at::vec::maximum(a, b) : a + b).store(mass + c);
  }
  for (; c < C; ++c) mass[c] = how == MAX ? std::max(mass[c], row[c]) : mass[c] + row[c];
}

// The G rows of one (b, h): probs [G, C] the probabilities of logits [G, C] (both of row stride C; probs may be
// logits), lse[g] each row's log-sum-exp; with need_mass, mass [C] the rows' probabilities (with a gain, the
// gained ones; gained is C floats of scratch) reduced by how. hidden [C] as above.
inline void rows_softmax(const float* logits, float* probs, const float* hidden, int64_t G, int64_t C, float scale,
                         float softcap, const float* gain, int64_t how, bool need_mass, float* lse, float* mass,
                         float* gained) {
  for (int64_t g = 0; g < G; ++g) {
    const float* row = logits + g * C;
    if (need_mass && gain) {  // before the row's probabilities may overwrite its logits
      row_softmax(row, hidden, C, scale, softcap, *gain, gained);
      combine(mass, gained, C, how, g == 0);
    }
    lse[g] = row_softmax(row, hidden, C, scale, softcap, 1.0f, probs + g * C);
    if (need_mass && !gain) combine(mass, probs + g * C, C, how, g == 0);
  }
  if (need_mass && how == MEAN && G > 0) {
    const float inv = 1.0f / static_cast<float>(G);
    for (int64_t c = 0; c < C; ++c) mass[c] *= inv;
  }
}

#if EVICTLAYERS_AVX2
// the horizontal sums of 8 vectors (8 floats each, consecutive), in order, in one vector (one horizontal sum per
// vector costs ~4x as much)
inline __m256 sum8(const float* v) {
  auto at = [v](int i) { return _mm256_loadu_ps(v + 8 * i); };
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(at(0), at(1)), _mm256_hadd_ps(at(2), at(3)));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(at(4), at(5)), _mm256_hadd_ps(at(6), at(7)));
  // ab holds each of sums 0-3 as two partial sums, one per 128-bit lane; cd likewise for sums 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// 8 consecutive elements as 8 floats
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {  // a bfloat16 is the high half of a float32
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

// QK: the slots go in tiles of QK_TILE, each slot read once for up to QK_ROWS query rows, its dot product with
// a row kept as a vector of 8 partial sums in partial[r][t] (QK_ROWS * QK_TILE * 8 floats). logits_store reduces
// the tile's vectors of rows g0 .. g0 + R to one vector per row by sum8 and writes its n <= QK_TILE columns c0 ..
// c0 + n of out [G, C] (lanes past n sum partials of slots that do not exist: never stored).
constexpr int64_t QK_TILE = 8, QK_ROWS = 4;

template <int64_t R>
void logits_store(const float* partial, int64_t n, int64_t g0, float* out, int64_t C, int64_t c0) {
  for (int64_t r = 0; r < R; ++r) {
    const __m256 logits = sum8(partial + r * QK_TILE * 8);
    float* dest = out + (g0 + r) * C + c0;
    if (n == QK_TILE) {
      _mm256_storeu_ps(dest, logits);
    } else {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, logits);
      std::copy(lanes, lanes + n, dest);
    }
  }
}

#if EVICTLAYERS_AVX512
// 16 consecutive elements as 16 floats
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// The QK tile of 16 slots: where slot t's vector of partial sums goes in the 16 that sum16 reduces, so that the
// sums come out in slot order (sum16's tree leaves slot 4i + j in lane 4j + i: a 4 x 4 transpose, its own inverse)
inline int64_t sum16_place(int64_t t) { return (t & 3) * 4 + (t >> 2); }

// 16 vectors of 16 partial sums (placed by sum16_place) -> one vector of their 16 sums, in slot order: halves,
// then quarters, of pairs of vectors added by 128-bit lane shuffles, then the same within the lanes
inline __m512 sum16(const __m512* v) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = v[2 * i], y = v[2 * i + 1];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 x = halves[2 * i], y = halves[2 * i + 1];
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    const __m512 x = quarters[2 * i], y = quarters[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
}
#endif

// PV over one tile of n slots (slot[t] points at slot c0 + t's Dv channels, Dv % 8 == 0): acc [G, Dv] f32 +=
// sum_t probs[g, c0 + t] * slot[t], probs addressed by strides ps (its dims 2 and 3). Per block of up to
// Lanes::rows rows and PV_VECTORS vectors of channels the accumulators stay in registers across the tile, so they
// are loaded and stored once per tile rather than once per slot. Lanes: 8 floats a vector (AVX2: 3 rows x 4
// vectors of the 16 registers) or 16 (AVX-512, head dims that are a multiple of 16: 4 rows x 4 vectors of the 32,
// half the loads and broadcasts of the 8-wide loop and 1.5-1.6x as fast at head dim 64). prefetch: when not 0, the
// bytes from each slot to the one to ask for into L2 as the slot is read (slots in memory at a fixed stride; the
// dense slot ops pass it, the int4 loop's dequantised tiles do not).
constexpr int64_t PV_VECTORS = 4;

struct Lanes8 {
  using reg = __m256;
  static constexpr int64_t width = 8, rows = 3;
  static reg loadu(const float* x) { return _mm256_loadu_ps(x); }
  template <typename kv_t>
  static reg load(const kv_t* x) { return load8(x); }
  static reg broadcast(float x) { return _mm256_set1_ps(x); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static void storeu(float* x, reg v) { _mm256_storeu_ps(x, v); }
};

#if EVICTLAYERS_AVX512
struct Lanes16 {
  using reg = __m512;
  static constexpr int64_t width = 16, rows = 4;
  static reg loadu(const float* x) { return _mm512_loadu_ps(x); }
  template <typename kv_t>
  static reg load(const kv_t* x) { return load16(x); }
  static reg broadcast(float x) { return _mm512_set1_ps(x); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static void storeu(float* x, reg v) { _mm512_storeu_ps(x, v); }
};
#endif

template <typename Lanes, int64_t R, int64_t V, typename kv_t>
void values_block(const float* probs, const int64_t* ps, const kv_t* const* slot, float* acc, int64_t c0, int64_t n,
                  int64_t Dv, int64_t g0, int64_t d0, int64_t prefetch) {
  constexpr int64_t W = Lanes::width;
  typename Lanes::reg a[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < V; ++j) a[r][j] = Lanes::loadu(acc + (g0 + r) * Dv + d0 + W * j);
  for (int64_t t = 0; t < n; ++t) {
    const kv_t* v = slot[t] + d0;
    if (prefetch)
      for (int64_t j = 0; j < W * V * static_cast<int64_t>(sizeof(kv_t)); j += 64)
        _mm_prefetch(reinterpret_cast<const char*>(v) + prefetch + j, _MM_HINT_T1);
    typename Lanes::reg w[R];
    for (int64_t r = 0; r < R; ++r) w[r] = Lanes::broadcast(probs[(g0 + r) * ps[2] + (c0 + t) * ps[3]]);
    for (int64_t j = 0; j < V; ++j) {
      const typename Lanes::reg x = Lanes::load(v + W * j);
      for (int64_t r = 0; r < R; ++r) a[r][j] = Lanes::fmadd(w[r], x, a[r][j]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < V; ++j) Lanes::storeu(acc + (g0 + r) * Dv + d0 + W * j, a[r][j]);
}

template <typename Lanes, int64_t R, typename kv_t>
void values_rows(const float* probs, const int64_t* ps, const kv_t* const* slot, float* acc, int64_t c0, int64_t n,
                 int64_t Dv, int64_t g0, int64_t prefetch) {
  constexpr int64_t W = Lanes::width;
  int64_t d0 = 0;
  for (; d0 + W * PV_VECTORS <= Dv; d0 += W * PV_VECTORS)
    values_block<Lanes, R, PV_VECTORS>(probs, ps, slot, acc, c0, n, Dv, g0, d0, prefetch);
  for (; d0 < Dv; d0 += W) values_block<Lanes, R, 1>(probs, ps, slot, acc, c0, n, Dv, g0, d0, prefetch);
}

template <typename Lanes, typename kv_t>
void values_tile_in(const float* probs, const int64_t* ps, const kv_t* const* slot, float* acc, int64_t c0, int64_t n,
                    int64_t Dv, int64_t G, int64_t prefetch) {
  for (int64_t g0 = 0; g0 < G; g0 += Lanes::rows) {
    switch (std::min(Lanes::rows, G - g0)) {
      case 4: values_rows<Lanes, Lanes::rows >= 4 ? 4 : 1>(probs, ps, slot, acc, c0, n, Dv, g0, prefetch); break;
      case 3: values_rows<Lanes, 3>(probs, ps, slot, acc, c0, n, Dv, g0, prefetch); break;
      case 2: values_rows<Lanes, 2>(probs, ps, slot, acc, c0, n, Dv, g0, prefetch); break;
      default: values_rows<Lanes, 1>(probs, ps, slot, acc, c0, n, Dv, g0, prefetch); break;
    }
  }
}

template <typename kv_t>
void values_tile(const float* probs, const int64_t* ps, const kv_t* const* slot, float* acc, int64_t c0, int64_t n,
                 int64_t Dv, int64_t G, int64_t prefetch = 0) {
#if EVICTLAYERS_AVX512
  if (Dv % 16 == 0) return values_tile_in<Lanes16>(probs, ps, slot, acc, c0, n, Dv, G, prefetch);
#endif
  values_tile_in<Lanes8>(probs, ps, slot, acc, c0, n, Dv, G, prefetch);
}
#endif

}  // namespace evictlayers
