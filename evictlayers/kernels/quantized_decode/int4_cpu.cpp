// Decode attention's two matmuls straight from int4 codes on CPU (int4_cpu.py documents the ops, their layout and
// the PyTorch references). No dequantised copy of the cache is made: with AVX-512 both products dequantise each
// slot in registers; with AVX2 QK does, PV dequantises a tile of ~16 KB of slots at a time into L1 for the dense
// slot ops' loop (cpu_kernels.h).
//
// Layout (PackedKV): a slot's P bytes hold 2P codes, channel 2p in byte p's low nibble and 2p+1 in its high
// one; group k of the slot's channels has one scale and zero point, so byte p (both nibbles) is in group
// p / run with run = P / K. Both ops work in the codes' channel order: the P low nibbles, then the P high.
//
//   int4_logits(query [B,H,G,2P] f32, codes [B,H,C,P] u8, scale/zero [B,H,C,K])  -> [B,H,G,C] f32
//     logit[g,c] = q[g] . (codes[c] * scale[c] + zero[c])
//   int4_values(probs [B,H,G,C] f32, codes, scale, zero)                          -> [B,H,G,2P] f32
//     out[g] = sum_c probs[g,c] * (codes[c] * scale[c] + zero[c])
//
// The ops register themselves as the CPU kernels of evictlayers::int4_logits and evictlayers::int4_values
// (schemas defined in int4_cpu.py), so a call goes from the dispatcher straight here.
//
// The AVX-512 path needs run % 16 == 0 (groups of a multiple of 32 channels) and head dims of 32, 64, 128 or 256;
// the AVX2 path run % 8 == 0 (groups of a multiple of 16 channels): 8 bytes are widened to 32-bit lanes in one
// instruction, split into their two nibbles there (a mask, a shift), converted and scaled by one FMA. Any other
// even group, or a machine without AVX2, FMA and F16C, dequantises with scalar loops and multiplies them the same
// way.
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

using evictlayers::Rows;

// One (b, h) row of the cache's codes, scales and zero points, addressed by their strides.
template <typename scale_t>
struct Codes {
  const uint8_t* codes;
  Rows cr;
  const scale_t* scale;
  Rows sr;
  const scale_t* zero;
  Rows zr;
  int64_t b, h, P, K;

  const uint8_t* bytes(int64_t c) const { return codes + cr.at(b, h, c); }
  // group k of slot c's scale and zero point, as float
  float scale_of(int64_t c, int64_t k) const { return static_cast<float>(scale[sr.at(b, h, c) + k * sr.strides[3]]); }
  float zero_of(int64_t c, int64_t k) const { return static_cast<float>(zero[zr.at(b, h, c) + k * zr.strides[3]]); }
};

// slot c's 2P dequantised values, in codes order, into row (scalar: any group that holds whole bytes)
template <typename scale_t>
void dequantize_scalar(const Codes<scale_t>& x, int64_t c, float* row) {
  const uint8_t* bytes = x.bytes(c);
  const int64_t run = x.P / x.K;
  for (int64_t p = 0; p < x.P; ++p) {
    const float s = x.scale_of(c, p / run), z = x.zero_of(c, p / run);
    row[p] = static_cast<float>(bytes[p] & 15) * s + z;
    row[x.P + p] = static_cast<float>(bytes[p] >> 4) * s + z;
  }
}

// out[g * ldo + c] for the C slots
template <typename scale_t>
void logits_scalar(const float* q, const Codes<scale_t>& x, float* out, int64_t C, int64_t G, int64_t ldo) {
  std::vector<float> row(2 * x.P);
  for (int64_t c = 0; c < C; ++c) {
    dequantize_scalar(x, c, row.data());
    for (int64_t g = 0; g < G; ++g) {
      float total = 0;
      for (int64_t d = 0; d < 2 * x.P; ++d) total += q[g * 2 * x.P + d] * row[d];
      out[g * ldo + c] = total;
    }
  }
}

template <typename scale_t>
void values_scalar(const float* probs, const int64_t* ps, const Codes<scale_t>& x, float* out, int64_t C, int64_t G) {
  std::vector<float> row(2 * x.P);
  std::fill(out, out + G * 2 * x.P, 0.f);
  for (int64_t c = 0; c < C; ++c) {
    dequantize_scalar(x, c, row.data());
    for (int64_t g = 0; g < G; ++g) {
      const float weight = probs[g * ps[2] + c * ps[3]];
      for (int64_t d = 0; d < 2 * x.P; ++d) out[g * 2 * x.P + d] += weight * row[d];
    }
  }
}

#if EVICTLAYERS_AVX2
using evictlayers::QK_ROWS;
using evictlayers::QK_TILE;

// the 16 values of bytes 8j .. 8j + 7 dequantised in registers: lo the low nibbles (codes-order channels 8j ..),
// hi the high ones (P + 8j ..). The bytes are widened to 32-bit lanes first (one instruction), where the low
// nibble is lane & 15 and the high one lane >> 4.
inline void dequantize16(const uint8_t* bytes, __m256 scale, __m256 zero, __m256& lo, __m256& hi) {
  const __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(15))), scale, zero);
  hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lanes, 4)), scale, zero);
}

// slots c0 .. c0 + n dequantised into rows of 2P floats (codes order) at tile, slot[t] pointing at slot c0 + t's
template <typename scale_t>
void dequantize_tile(const Codes<scale_t>& x, int64_t c0, int64_t n, float* tile, const float** slot) {
  const int64_t P = x.P, per_group = P / x.K / 8;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t c = c0 + t;
    const uint8_t* bytes = x.bytes(c);
    float* row = tile + t * 2 * P;
    slot[t] = row;
    for (int64_t k = 0; k < x.K; ++k) {
      const __m256 s = _mm256_set1_ps(x.scale_of(c, k)), z = _mm256_set1_ps(x.zero_of(c, k));
      for (int64_t j = k * per_group; j < (k + 1) * per_group; ++j) {
        __m256 lo, hi;
        dequantize16(bytes + 8 * j, s, z, lo, hi);
        _mm256_storeu_ps(row + 8 * j, lo);
        _mm256_storeu_ps(row + P + 8 * j, hi);
      }
    }
  }
}

// rows g0 .. g0 + R of one tile of n <= 8 slots: each slot's codes dequantised in registers once for the R rows,
// two vectors of partial sums per row (low and high nibbles: two shorter FMA chains), then one vector per row
template <int64_t R, typename scale_t>
void logits_tile(const float* q, const Codes<scale_t>& x, int64_t c0, int64_t n, int64_t g0, float* partial,
                 float* out, int64_t ldo) {
  const int64_t P = x.P, per_group = P / x.K / 8;  // 8-byte chunks per group
  for (int64_t t = 0; t < QK_TILE; ++t) {
    __m256 lo_acc[R], hi_acc[R];
    for (int64_t r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
    if (t < n) {
      const int64_t c = c0 + t;
      const uint8_t* bytes = x.bytes(c);
      for (int64_t k = 0; k < x.K; ++k) {
        const __m256 s = _mm256_set1_ps(x.scale_of(c, k)), z = _mm256_set1_ps(x.zero_of(c, k));
        for (int64_t j = k * per_group; j < (k + 1) * per_group; ++j) {
          __m256 lo, hi;
          dequantize16(bytes + 8 * j, s, z, lo, hi);
          for (int64_t r = 0; r < R; ++r) {
            const float* qr = q + (g0 + r) * 2 * P;
            lo_acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * j), lo, lo_acc[r]);
            hi_acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + P + 8 * j), hi, hi_acc[r]);
          }
        }
      }
    }
    for (int64_t r = 0; r < R; ++r)
      _mm256_storeu_ps(partial + (r * QK_TILE + t) * 8, _mm256_add_ps(lo_acc[r], hi_acc[r]));
  }
  evictlayers::logits_store<R>(partial, n, g0, out, ldo, c0);
}

// out[g * ldo + c] for the C slots
template <typename scale_t>
void logits_avx2(const float* q, const Codes<scale_t>& x, float* out, int64_t C, int64_t G, int64_t ldo) {
  // Dequantising in registers beat dequantising a tile into L1 for the dense loops (1.27x at SmolLM2's shape).
  alignas(32) float partial[QK_ROWS * QK_TILE * 8];
  for (int64_t c0 = 0; c0 < C; c0 += QK_TILE) {
    const int64_t n = std::min(QK_TILE, C - c0);
    for (int64_t g0 = 0; g0 < G; g0 += QK_ROWS) {
      switch (std::min(QK_ROWS, G - g0)) {
        case 4: logits_tile<4>(q, x, c0, n, g0, partial, out, ldo); break;
        case 3: logits_tile<3>(q, x, c0, n, g0, partial, out, ldo); break;
        case 2: logits_tile<2>(q, x, c0, n, g0, partial, out, ldo); break;
        default: logits_tile<1>(q, x, c0, n, g0, partial, out, ldo); break;
      }
    }
  }
}

// PV: a tile of ~16 KB of slots (it stays in L1) dequantised, then the dense loops' register-blocked accumulation
// (cpu_kernels.h) over it. Dequantising in registers there would redo it per block of rows and channels.
constexpr int64_t PV_TILE_BYTES = 16384;

template <typename scale_t>
void values_avx2(const float* probs, const int64_t* ps, const Codes<scale_t>& x, float* out, int64_t C, int64_t G) {
  std::fill(out, out + G * 2 * x.P, 0.f);
  const int64_t slots = std::max<int64_t>(8, PV_TILE_BYTES / (2 * x.P * static_cast<int64_t>(sizeof(float))));
  std::vector<float> tile(slots * 2 * x.P);
  std::vector<const float*> slot(slots);
  for (int64_t c0 = 0; c0 < C; c0 += slots) {
    const int64_t n = std::min(slots, C - c0);
    dequantize_tile(x, c0, n, tile.data(), slot.data());
    evictlayers::values_tile(probs, ps, slot.data(), out, c0, n, 2 * x.P, G);
  }
}
#endif

#if EVICTLAYERS_AVX512
// AVX-512, for groups of a multiple of 32 channels (a group holds whole 16-byte loads) and P = 16 * NJ bytes per
// slot (head dims 32, 64, 128, 256): each 16-byte load is widened to 16 32-bit lanes in one instruction, split
// there into its two nibbles, converted and scaled. Both products dequantise in registers, where the AVX2 PV
// writes a tile of floats to L1 and reads it back; QK's instruction stream is half the AVX2 one's. At SmolLM2's
// shapes the two ops take 0.58-0.69x the dense slot ops' time (0.49-0.58x before those asked for their slots
// ahead), where the AVX2 loops took 1.03-1.11x (python -m benchmarks --only cpu_kernel). They are bound by the
// vector units, not by memory: per slot and query row four FMAs and a share of the tile's reduction, per slot
// the unpacking, which a CPU that splits 512-bit operations in two (AMD Zen 4) runs at the 256-bit rate.

// the 32 values of bytes 16j .. 16j + 15 dequantised in registers: lo the low nibbles (codes-order channels
// 16j ..), hi the high ones (P + 16j ..)
inline void dequantize32(const uint8_t* bytes, __m512 scale, __m512 zero, __m512& lo, __m512& hi) {
  const __m512i lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(15))), scale, zero);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(lanes, 4)), scale, zero);
}

// One (b, h) row of codes as the wide loops read it: base pointers and steps in registers (Codes reads its strides
// through a pointer, which every vector store to the stack could alias, so they were reloaded per slot), and each
// 16-byte load's group offset computed once (a division per load cost more than the load's arithmetic)
template <int64_t NJ, typename scale_t>
struct WideRow {
  const uint8_t* codes;
  const scale_t *scale, *zero;
  int64_t code_step, scale_step, zero_step, scale_at[NJ], zero_at[NJ];

  explicit WideRow(const Codes<scale_t>& x)
      : codes(x.bytes(0)), scale(x.scale + x.sr.at(x.b, x.h, 0)), zero(x.zero + x.zr.at(x.b, x.h, 0)),
        code_step(x.cr.strides[2]), scale_step(x.sr.strides[2]), zero_step(x.zr.strides[2]) {
    const int64_t run = x.P / x.K;
    for (int64_t j = 0; j < NJ; ++j) {
      scale_at[j] = 16 * j / run * x.sr.strides[3];
      zero_at[j] = 16 * j / run * x.zr.strides[3];
    }
  }
  // slot c's 16-byte load j dequantised into lo, hi
  void dequantize(int64_t c, int64_t j, __m512& lo, __m512& hi) const {
    const float s = static_cast<float>(scale[c * scale_step + scale_at[j]]);
    const float z = static_cast<float>(zero[c * zero_step + zero_at[j]]);
    dequantize32(codes + c * code_step + 16 * j, _mm512_set1_ps(s), _mm512_set1_ps(z), lo, hi);
  }
};

// rows per block: a block's query vectors (QK) or accumulators (PV), R x 2NJ, take at most 16 of the 32 registers
template <int64_t NJ>
constexpr int64_t ROWS512 = NJ <= 2 ? 4 : (NJ >= 8 ? 1 : 8 / NJ);

// rows g0 .. g0 + R over all C slots in tiles of 16: the rows' query in registers for the whole pass, each slot
// dequantised once for the R rows, the tile's vectors of partial sums reduced to one vector of 16 logits per row
// by sum16 (cpu_kernels.h)
template <int64_t NJ, int64_t R, typename scale_t>
void logits_rows512(const float* q, const Codes<scale_t>& x, float* out, int64_t C, int64_t g0, int64_t ldo) {
  constexpr int64_t P = 16 * NJ;
  const WideRow<NJ, scale_t> row(x);
  __m512 query[R][2 * NJ];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * NJ; ++j) query[r][j] = _mm512_loadu_ps(q + (g0 + r) * 2 * P + 16 * j);
  alignas(64) __m512 partial[R * 16];
  for (int64_t c0 = 0; c0 < C; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, C - c0);
    for (int64_t t = 0; t < 16; ++t) {
      __m512 acc[R];
      for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
      if (t < n) {
        for (int64_t j = 0; j < NJ; ++j) {
          __m512 lo, hi;
          row.dequantize(c0 + t, j, lo, hi);
          for (int64_t r = 0; r < R; ++r) {
            acc[r] = _mm512_fmadd_ps(query[r][j], lo, acc[r]);
            acc[r] = _mm512_fmadd_ps(query[r][NJ + j], hi, acc[r]);
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) partial[r * 16 + evictlayers::sum16_place(t)] = acc[r];
    }
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(out + (g0 + r) * ldo + c0, lanes, evictlayers::sum16(partial + r * 16));
  }
}

// rows g0 .. g0 + R of out [G, 2P] = sum_c probs[g, c] * slot c: each slot dequantised in registers once for the
// R rows, their 2NJ vectors of accumulators each in registers across all C slots
template <int64_t NJ, int64_t R, typename scale_t>
void values_rows512(const float* probs, const int64_t* ps, const Codes<scale_t>& x, float* out, int64_t C,
                    int64_t g0) {
  constexpr int64_t P = 16 * NJ;
  const WideRow<NJ, scale_t> row(x);
  const int64_t prow = ps[2], pcol = ps[3];
  __m512 acc[R][2 * NJ];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * NJ; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512 weight[R];
    for (int64_t r = 0; r < R; ++r) weight[r] = _mm512_set1_ps(probs[(g0 + r) * prow + c * pcol]);
    for (int64_t j = 0; j < NJ; ++j) {
      __m512 lo, hi;
      row.dequantize(c, j, lo, hi);
      for (int64_t r = 0; r < R; ++r) {
        acc[r][j] = _mm512_fmadd_ps(weight[r], lo, acc[r][j]);
        acc[r][NJ + j] = _mm512_fmadd_ps(weight[r], hi, acc[r][NJ + j]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < 2 * NJ; ++j) _mm512_storeu_ps(out + (g0 + r) * 2 * P + 16 * j, acc[r][j]);
}

// every row of one (b, h) in blocks of up to ROWS512<NJ> rows; Pass is logits_rows512 or values_rows512's call
// with its block's row count R as a template argument
template <int64_t NJ, typename Pass>
void in_row_blocks(int64_t G, Pass pass) {
  constexpr int64_t ROWS = ROWS512<NJ>;
  for (int64_t g0 = 0; g0 < G; g0 += ROWS) {
    switch (std::min(ROWS, G - g0)) {  // cases past ROWS never come: they compile as one row
      case 4: pass(std::integral_constant<int64_t, ROWS >= 4 ? 4 : 1>(), g0); break;
      case 3: pass(std::integral_constant<int64_t, ROWS >= 3 ? 3 : 1>(), g0); break;
      case 2: pass(std::integral_constant<int64_t, ROWS >= 2 ? 2 : 1>(), g0); break;
      default: pass(std::integral_constant<int64_t, 1>(), g0); break;
    }
  }
}

// calls body(std::integral_constant<NJ>) for the slot's bytes P = 16 * NJ with NJ in 1, 2, 4, 8 (head dims 32,
// 64, 128, 256) and groups of a multiple of 32 channels; false (nothing run) for any other shape
template <typename Body>
bool with_wide_shape(int64_t P, int64_t K, Body body) {
  if ((P / K) % 16 != 0) return false;
  switch (P) {
    case 16: body(std::integral_constant<int64_t, 1>()); return true;
    case 32: body(std::integral_constant<int64_t, 2>()); return true;
    case 64: body(std::integral_constant<int64_t, 4>()); return true;
    case 128: body(std::integral_constant<int64_t, 8>()); return true;
    default: return false;
  }
}

template <typename scale_t>
bool logits_avx512(const float* q, const Codes<scale_t>& x, float* out, int64_t C, int64_t G, int64_t ldo) {
  return with_wide_shape(x.P, x.K, [&](auto nj) {
    constexpr int64_t NJ = decltype(nj)::value;
    in_row_blocks<NJ>(G, [&](auto rows, int64_t g0) {
      logits_rows512<NJ, decltype(rows)::value>(q, x, out, C, g0, ldo);
    });
  });
}

template <typename scale_t>
bool values_avx512(const float* probs, const int64_t* ps, const Codes<scale_t>& x, float* out, int64_t C,
                   int64_t G) {
  return with_wide_shape(x.P, x.K, [&](auto nj) {
    constexpr int64_t NJ = decltype(nj)::value;
    in_row_blocks<NJ>(G, [&](auto rows, int64_t g0) {
      values_rows512<NJ, decltype(rows)::value>(probs, ps, x, out, C, g0);
    });
  });
}
#endif

// the logits and values of one (b, h) by the widest loops its shape takes: AVX-512, AVX2 (chunked groups), scalar
template <typename scale_t>
void logits_any(const float* q, const Codes<scale_t>& x, float* out, int64_t C, int64_t G, int64_t ldo, bool chunked) {
#if EVICTLAYERS_AVX512
  if (logits_avx512(q, x, out, C, G, ldo)) return;
#endif
#if EVICTLAYERS_AVX2
  if (chunked) return logits_avx2(q, x, out, C, G, ldo);
#endif
  (void)chunked;
  logits_scalar(q, x, out, C, G, ldo);
}

template <typename scale_t>
void values_any(const float* probs, const int64_t* ps, const Codes<scale_t>& x, float* out, int64_t C, int64_t G,
                bool chunked) {
#if EVICTLAYERS_AVX512
  if (values_avx512(probs, ps, x, out, C, G)) return;
#endif
#if EVICTLAYERS_AVX2
  if (chunked) return values_avx2(probs, ps, x, out, C, G);
#endif
  (void)chunked;
  values_scalar(probs, ps, x, out, C, G);
}

// ---- the dense residual (the ring) ------------------------------------------------------------------------------

// q [D] . k [D], k in the ring's dtype
template <typename kv_t>
float dot(const float* q, const kv_t* k, int64_t D) {
  float total = 0;
  int64_t d = 0;
#if EVICTLAYERS_AVX2
  if (D % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), evictlayers::load8(k + d), acc);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    for (const float lane : lanes) total += lane;
  }
#endif
  for (; d < D; ++d) total += q[d] * static_cast<float>(k[d]);
  return total;
}

// the R ring entries' logits of q [G, D] (natural channel order) into out[g * ldo + r]
template <typename kv_t>
void residual_logits(const float* q, const kv_t* keys, Rows kr, int64_t b, int64_t h, int64_t R, int64_t D, int64_t G,
                 float* out, int64_t ldo) {
  for (int64_t r = 0; r < R; ++r) {
    const kv_t* k = keys + kr.at(b, h, r);
    for (int64_t g = 0; g < G; ++g) out[g * ldo + r] = dot(q + g * D, k, D);
  }
}

// out [G, Dv] += sum_r probs[g * ldp + r] * values[r] (natural channel order)
template <typename kv_t>
void residual_values(const float* probs, int64_t ldp, const kv_t* values, Rows vr, int64_t b, int64_t h, int64_t R,
                 int64_t Dv, int64_t G, float* out) {
  for (int64_t r = 0; r < R; ++r) {
    const kv_t* v = values + vr.at(b, h, r);
    for (int64_t g = 0; g < G; ++g) {
      const float weight = probs[g * ldp + r];
      if (weight == 0.0f) continue;  // a hidden entry (empty, or outside the window)
      for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] += weight * static_cast<float>(v[d]);
    }
  }
}

void check(const at::Tensor& rows, const char* rows_name, const at::Tensor& codes, const at::Tensor& scale,
           const at::Tensor& zero) {
  TORCH_CHECK(rows.device().is_cpu() && codes.device().is_cpu() && scale.device().is_cpu() && zero.device().is_cpu(),
              "int4 CPU ops take CPU tensors");
  TORCH_CHECK(rows.dim() == 4 && rows.scalar_type() == at::kFloat, rows_name, " must be [B, H, G, X] float32, got ",
              rows.sizes(), " ", rows.scalar_type());
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.stride(3) == 1,
              "codes must be [B, H, C, P] uint8 with contiguous bytes, got sizes ", codes.sizes(), " strides ",
              codes.strides(), " ", codes.scalar_type());
  TORCH_CHECK(scale.dim() == 4 && zero.sizes() == scale.sizes() && zero.scalar_type() == scale.scalar_type(),
              "scale and zero must be [B, H, C, K] of one dtype, got ", scale.sizes(), " ", scale.scalar_type(),
              " and ", zero.sizes(), " ", zero.scalar_type());
  TORCH_CHECK(scale.size(0) == codes.size(0) && scale.size(1) == codes.size(1) && scale.size(2) == codes.size(2) &&
                  scale.size(3) > 0 && codes.size(3) % scale.size(3) == 0,
              "scale ", scale.sizes(), " must match codes ", codes.sizes(), " as [B, H, C, K] with K dividing P");
  TORCH_CHECK(rows.size(0) == codes.size(0) && rows.size(1) == codes.size(1), rows_name, " ", rows.sizes(),
              " must match codes' [B, H] ", codes.sizes());
}

// runs body(b, h, bh, x) for every (b, h) row over at::parallel_for, x that row's codes
template <typename scale_t, typename Body>
void each_row(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero, Body body) {
  const int64_t H = codes.size(1);
  const Rows cr{codes.strides().data()}, sr{scale.strides().data()}, zr{zero.strides().data()};
  at::parallel_for(0, codes.size(0) * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const Codes<scale_t> x{codes.data_ptr<uint8_t>(), cr, scale.data_ptr<scale_t>(), sr, zero.data_ptr<scale_t>(),
                             zr, bh / H, bh % H, codes.size(3), scale.size(3)};
      body(bh, x);
    }
  });
}

// groups of a multiple of 16 channels: whole 8-byte chunks per group
bool chunked(const at::Tensor& codes, const at::Tensor& scale) { return (codes.size(3) / scale.size(3)) % 8 == 0; }

}  // namespace

at::Tensor int4_logits(const at::Tensor& query_in, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& zero) {
  check(query_in, "query", codes, scale, zero);
  TORCH_CHECK(query_in.size(3) == 2 * codes.size(3), "query ", query_in.sizes(), " must have 2P channels for codes ",
              codes.sizes());
  const at::Tensor query = query_in.contiguous();
  const int64_t C = codes.size(2), P = codes.size(3), G = query.size(2);
  at::Tensor out = at::empty({codes.size(0), codes.size(1), G, C}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scale.scalar_type(), "int4_logits", [&] {
    const float* q = query.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const bool fast = chunked(codes, scale);
    each_row<scalar_t>(codes, scale, zero, [&](int64_t bh, const Codes<scalar_t>& x) {
      logits_any(q + bh * G * 2 * P, x, o + bh * G * C, C, G, C, fast);
    });
  });
  return out;
}

at::Tensor int4_values(const at::Tensor& probs, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& zero) {
  check(probs, "probs", codes, scale, zero);
  TORCH_CHECK(probs.size(3) == codes.size(2), "probs ", probs.sizes(), " must have one column per code slot of ",
              codes.sizes());
  const int64_t C = codes.size(2), P = codes.size(3), G = probs.size(2), H = codes.size(1);
  at::Tensor out = at::empty({codes.size(0), H, G, 2 * P}, probs.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scale.scalar_type(), "int4_values", [&] {
    const int64_t* ps = probs.strides().data();
    const float* p = probs.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const bool fast = chunked(codes, scale);
    each_row<scalar_t>(codes, scale, zero, [&](int64_t bh, const Codes<scalar_t>& x) {
      values_any(p + x.b * ps[0] + x.h * ps[1], ps, x, o + bh * G * 2 * P, C, G, fast);
    });
  });
  return out;
}

// One decode step's attention over a layer's int4 code slots and its dense ring: the logits of both into one
// [G, C + R] scratch row per (b, h) (L1/L2, never written to memory), the softmax and mass in place
// (cpu_kernels.h), then PV over the codes (codes order, turned back to channel order) plus the ring. With
// ring_slot (the code slot each ring entry overlays, -1 for none) those slots' code rows are hidden and the
// entries' mass is added to theirs (mass [B, H, C]); without, the mass has C + R columns.
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_attention(
    const at::Tensor& query_codes_in, const at::Tensor& query_in, const at::Tensor& key_codes,
    const at::Tensor& key_scale, const at::Tensor& key_zero, const at::Tensor& value_codes,
    const at::Tensor& value_scale, const at::Tensor& value_zero, const at::Tensor& ring_keys,
    const at::Tensor& ring_values, const at::Tensor& key_pos_in, const at::Tensor& ring_pos_in,
    const std::optional<at::Tensor>& ring_slot_in, const at::Tensor& query_pos_in, double scale, double softcap,
    int64_t window,
    const std::optional<at::Tensor>& gain_in, int64_t reduce, bool need_mass) {
  check(query_codes_in, "query_codes", key_codes, key_scale, key_zero);
  check(query_codes_in, "query_codes", value_codes, value_scale, value_zero);
  const int64_t B = key_codes.size(0), H = key_codes.size(1), C = key_codes.size(2), P = key_codes.size(3),
                Pv = value_codes.size(3), G = query_codes_in.size(2), R = ring_keys.size(2), N = C + R;
  TORCH_CHECK(query_codes_in.size(3) == 2 * P && value_codes.size(2) == C && key_scale.scalar_type() ==
                  value_scale.scalar_type(),
              "query_codes ", query_codes_in.sizes(), " must have 2P channels for key codes ", key_codes.sizes(),
              ", value codes ", value_codes.sizes(), " the same slots, and both scales one dtype");
  TORCH_CHECK(query_in.dim() == 4 && query_in.scalar_type() == at::kFloat && query_in.size(0) == B &&
                  query_in.size(1) == H && query_in.size(2) == G && query_in.size(3) == 2 * P,
              "query must be [B, H, G, D] float32 like query_codes ", query_codes_in.sizes(), ", got ",
              query_in.sizes(), " ", query_in.scalar_type());
  for (const auto& [ring, name, dim] : {std::tuple(ring_keys, "ring_keys", 2 * P),
                                        std::tuple(ring_values, "ring_values", 2 * Pv)})
    TORCH_CHECK(ring.dim() == 4 && ring.size(0) == B && ring.size(1) == H && ring.size(2) == R &&
                    ring.size(3) == dim && ring.stride(3) == 1 && ring.scalar_type() == ring_keys.scalar_type() &&
                    (ring.scalar_type() == at::kFloat || ring.scalar_type() == at::kBFloat16 ||
                     ring.scalar_type() == at::kHalf),
                name, " must be [B, H, R, ", dim, "] float32, bfloat16 or float16 with contiguous channels (keys "
                "and values one dtype), got sizes ", ring.sizes(), " strides ", ring.strides(), " ",
                ring.scalar_type());
  for (const auto& [pos, name, slots] : {std::tuple(key_pos_in, "key_pos", C), std::tuple(ring_pos_in, "ring_pos", R)})
    TORCH_CHECK(pos.dim() == 3 && pos.scalar_type() == at::kLong && pos.size(0) == B && pos.size(1) == H &&
                    pos.size(2) == slots,
                name, " must be [B, H, ", slots, "] int64, got ", pos.sizes(), " ", pos.scalar_type());
  at::Tensor ring_slot;
  if (ring_slot_in.has_value()) {
    ring_slot = ring_slot_in->contiguous();
    TORCH_CHECK(ring_slot.dim() == 3 && ring_slot.scalar_type() == at::kLong && ring_slot.size(0) == B &&
                    ring_slot.size(1) == H && ring_slot.size(2) == R,
                "ring_slot must be [B, H, ", R, "] int64, got ", ring_slot.sizes(), " ", ring_slot.scalar_type());
  }
  const bool overlay = ring_slot.defined();  // the ring's entries overlay code slots: their mass goes there
  const int64_t mass_columns = overlay ? C : N;
  const at::Tensor gain = evictlayers::checked_softmax_options(query_pos_in, B, gain_in, reduce, softcap);
  const at::Tensor query_codes = query_codes_in.contiguous(), query = query_in.contiguous(),
                   key_pos = key_pos_in.contiguous(), ring_pos = ring_pos_in.contiguous(),
                   query_pos = query_pos_in.contiguous();
  at::Tensor out = at::empty({B, H, G, 2 * Pv}, query.options());
  at::Tensor lse = at::empty({B, H, G}, query.options());
  at::Tensor mass = at::empty({B, H, need_mass ? mass_columns : 0}, query.options());
  const bool fast = chunked(key_codes, key_scale) && chunked(value_codes, value_scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key_scale.scalar_type(), "int4_attention", [&] {
    using code_scale_t = scalar_t;
    AT_DISPATCH_V2(ring_keys.scalar_type(), "int4_attention_ring", AT_WRAP([&] {
      const Rows kcr{key_codes.strides().data()}, ksr{key_scale.strides().data()}, kzr{key_zero.strides().data()},
          vcr{value_codes.strides().data()}, vsr{value_scale.strides().data()}, vzr{value_zero.strides().data()},
          rkr{ring_keys.strides().data()}, rvr{ring_values.strides().data()};
      const int64_t probs_strides[4] = {0, 0, N, 1};
      const float* gains = gain.defined() ? gain.data_ptr<float>() : nullptr;
      at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> logits(G * N), hidden(N), gained(gains ? N : 0), codes_out(G * 2 * Pv),
            mass_row(overlay && need_mass ? N : 0);
        for (int64_t bh = begin; bh < end; ++bh) {
          const int64_t b = bh / H, h = bh % H, at_query = query_pos.data_ptr<int64_t>()[b];
          const Codes<code_scale_t> keys{key_codes.data_ptr<uint8_t>(), kcr, key_scale.data_ptr<code_scale_t>(), ksr,
                                         key_zero.data_ptr<code_scale_t>(), kzr, b, h, P, key_scale.size(3)};
          const Codes<code_scale_t> values{value_codes.data_ptr<uint8_t>(), vcr,
                                           value_scale.data_ptr<code_scale_t>(), vsr,
                                           value_zero.data_ptr<code_scale_t>(), vzr, b, h, Pv, value_scale.size(3)};
          const int64_t* code_pos = key_pos.data_ptr<int64_t>() + bh * C;
          const int64_t* entry_pos = ring_pos.data_ptr<int64_t>() + bh * R;
          for (int64_t c = 0; c < C; ++c) hidden[c] = evictlayers::hidden(code_pos[c], at_query, window);
          for (int64_t r = 0; r < R; ++r) hidden[C + r] = evictlayers::hidden(entry_pos[r], at_query, window);
          const int64_t* overlaid = overlay ? ring_slot.data_ptr<int64_t>() + bh * R : nullptr;
          if (overlay)  // a slot whose token is in the ring is attended there: its code row is stale
            for (int64_t r = 0; r < R; ++r)
              if (overlaid[r] >= 0 && overlaid[r] < C) hidden[overlaid[r]] = evictlayers::NEG_INF;
          const float* qc = query_codes.data_ptr<float>() + bh * G * 2 * P;
          logits_any(qc, keys, logits.data(), C, G, N, fast);
          residual_logits(query.data_ptr<float>() + bh * G * 2 * P, ring_keys.data_ptr<scalar_t>(), rkr, b, h, R, 2 * P,
                      G, logits.data() + C, N);
          float* mass_bh = mass.data_ptr<float>() + bh * mass_columns;
          evictlayers::rows_softmax(logits.data(), logits.data(), hidden.data(), G, N, scale, softcap,
                                    gains ? gains + b : nullptr, reduce, need_mass, lse.data_ptr<float>() + bh * G,
                                    overlay ? mass_row.data() : mass_bh, gained.data());
          if (overlay && need_mass) {
            std::copy(mass_row.begin(), mass_row.begin() + C, mass_bh);
            for (int64_t r = 0; r < R; ++r)
              if (overlaid[r] >= 0 && overlaid[r] < C) mass_bh[overlaid[r]] += mass_row[C + r];
          }
          values_any(logits.data(), probs_strides, values, codes_out.data(), C, G, fast);
          // codes order (the Pv low nibbles, channels 0, 2, ..; then the high ones) back to channel order
          float* o = out.data_ptr<float>() + bh * G * 2 * Pv;
          for (int64_t g = 0; g < G; ++g)
            for (int64_t p = 0; p < Pv; ++p) {
              o[g * 2 * Pv + 2 * p] = codes_out[g * 2 * Pv + p];
              o[g * 2 * Pv + 2 * p + 1] = codes_out[g * 2 * Pv + Pv + p];
            }
          residual_values(logits.data() + C, N, ring_values.data_ptr<scalar_t>(), rvr, b, h, R, 2 * Pv, G, o);
        }
      });
    }), at::kFloat, at::kBFloat16, at::kHalf);
  });
  return {out, lse, mass};
}

TORCH_LIBRARY_IMPL(evictlayers, CPU, m) {
  m.impl("int4_logits", &int4_logits);
  m.impl("int4_values", &int4_values);
  m.impl("int4_attention", &int4_attention);
}

// torch.utils.cpp_extension.load imports the build as a Python module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
