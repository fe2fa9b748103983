// Decode attention's two matmuls straight from int4 codes on CPU: the codes are dequantised in registers,
// never into a block buffer (int4_cpu.py documents the ops, their layout and the PyTorch reference).
//
// Layout (PackedKV): a slot's P bytes hold 2P codes, channel 2p in byte p's low nibble and 2p+1 in its high
// one; group k of the slot's channels has one scale and zero point, so byte p (both nibbles) is in group
// p / run with run = P / K. Both ops work in the codes' channel order: the P low nibbles, then the P high.
//
//   int4_logits(query [B,H,G,2P] f32, codes [B,H,C,P] u8, scale/zero [B,H,C,K], out [B,H,G,C] f32)
//     logit[g,c] = sum_k scale[c,k] * (q[g] . codes[c] over group k) + zero[c,k] * sum(q[g] over group k)
//   int4_values(probs [B,H,G,C] f32, codes, scale, zero, out [B,H,G,2P] f32)
//     out[g] = sum_c probs[g,c] * (codes[c] * scale[c] + zero[c])
//
// The AVX2 paths need run % 8 == 0 (groups of a multiple of 16 channels, 8 bytes per load), and the values'
// a head dim of 64, 128 or 256 (its output vectors held in registers, a compile-time count); any other
// shape, or a machine without AVX2, FMA and F16C, takes the scalar loops, which compute the same sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu_kernels.h"

namespace {

using evictlayers::Rows;

// A slot's K scales and zero points, as float, group k's at s[k * stride] and z[k * stride].
template <typename scale_t>
inline void load_scales(const scale_t* scale, const scale_t* zero, int64_t step_s, int64_t step_z, int64_t K,
                        float* s, float* z, int64_t stride = 1) {
  for (int64_t k = 0; k < K; ++k) {
    s[k * stride] = static_cast<float>(scale[k * step_s]);
    z[k * stride] = static_cast<float>(zero[k * step_z]);
  }
}

// sum over group k of the query's codes-order channels: the zero point's factor
void query_sums(const float* q, int64_t G, int64_t P, int64_t K, float* sums) {
  const int64_t run = P / K;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = 0; k < K; ++k) {
      float total = 0;
      for (int64_t p = k * run; p < (k + 1) * run; ++p) total += q[g * 2 * P + p] + q[g * 2 * P + P + p];
      sums[g * K + k] = total;
    }
}

template <typename scale_t>
void logits_scalar(const float* q, const uint8_t* codes, Rows cr, const scale_t* scale, Rows sr, const scale_t* zero,
                   Rows zr, float* out, int64_t b, int64_t h, int64_t C, int64_t P, int64_t G, int64_t K) {
  const int64_t run = P / K;
  std::vector<float> qsum(G * K), s(K), z(K);
  query_sums(q, G, P, K, qsum.data());
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* bytes = codes + cr.at(b, h, c);
    load_scales(scale + sr.at(b, h, c), zero + zr.at(b, h, c), sr.strides[3], zr.strides[3], K, s.data(), z.data());
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * 2 * P;
      float total = 0;
      for (int64_t k = 0; k < K; ++k) {
        float dot = 0;
        for (int64_t p = k * run; p < (k + 1) * run; ++p)
          dot += qg[p] * static_cast<float>(bytes[p] & 15) + qg[P + p] * static_cast<float>(bytes[p] >> 4);
        total += s[k] * dot + z[k] * qsum[g * K + k];
      }
      out[g * C + c] = total;
    }
  }
}

template <typename scale_t>
void values_scalar(const float* probs, const int64_t* ps, const uint8_t* codes, Rows cr, const scale_t* scale, Rows sr,
                   const scale_t* zero, Rows zr, float* out, int64_t b, int64_t h, int64_t C, int64_t P, int64_t G,
                   int64_t K) {
  const int64_t run = P / K;
  std::vector<float> zsum(G * K, 0.f), s(K), z(K);
  std::fill(out, out + G * 2 * P, 0.f);
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* bytes = codes + cr.at(b, h, c);
    load_scales(scale + sr.at(b, h, c), zero + zr.at(b, h, c), sr.strides[3], zr.strides[3], K, s.data(), z.data());
    for (int64_t g = 0; g < G; ++g) {
      const float weight = probs[g * ps[2] + c * ps[3]];
      float* og = out + g * 2 * P;
      for (int64_t k = 0; k < K; ++k) {
        const float w = weight * s[k];
        zsum[g * K + k] += weight * z[k];
        for (int64_t p = k * run; p < (k + 1) * run; ++p) {
          og[p] += w * static_cast<float>(bytes[p] & 15);
          og[P + p] += w * static_cast<float>(bytes[p] >> 4);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t p = k * run; p < (k + 1) * run; ++p) {
        out[g * 2 * P + p] += zsum[g * K + k];
        out[g * 2 * P + P + p] += zsum[g * K + k];
      }
}

#if EVICTLAYERS_AVX2
// 8 bytes -> 8 floats
inline __m256 to_float(__m128i eight) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight)); }

// a slot's P bytes -> its P low nibbles and P high nibbles as floats (an L1-resident scratch row)
inline void unpack(const uint8_t* bytes, int64_t chunks, float* lo, float* hi) {
  const __m128i mask = _mm_set1_epi8(15);
  for (int64_t j = 0; j < chunks; ++j) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * j));
    _mm256_storeu_ps(lo + 8 * j, to_float(_mm_and_si128(v, mask)));
    _mm256_storeu_ps(hi + 8 * j, to_float(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
  }
}

using evictlayers::sum8;

template <typename scale_t>
void logits_avx2(const float* q, const uint8_t* codes, Rows cr, const scale_t* scale, Rows sr, const scale_t* zero,
                 Rows zr, float* out, int64_t b, int64_t h, int64_t C, int64_t P, int64_t G, int64_t K) {
  // Slots go in tiles of 8, one per vector lane. Each slot's (g, k) dot product is a vector of 8 partial sums;
  // sum8 turns the tile's 8 vectors of one (g, k) into one vector over the tile's slots, so the scale, the
  // zero point and the store work on 8 slots at once.
  constexpr int64_t TILE = 8;
  const int64_t chunks = P / 8, per_group = chunks / K;
  std::vector<float> lo(P), hi(P), partial(G * K * TILE * 8), s(K * TILE, 0.f), z(K * TILE, 0.f), qsum(G * K),
      last(G * TILE);
  query_sums(q, G, P, K, qsum.data());
  for (int64_t c0 = 0; c0 < C; c0 += TILE) {
    const int64_t n = std::min(TILE, C - c0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t c = c0 + t;
      // [k][t]: a group's scales of the tile's slots are one vector
      load_scales(scale + sr.at(b, h, c), zero + zr.at(b, h, c), sr.strides[3], zr.strides[3], K, s.data() + t,
                  z.data() + t, TILE);
      unpack(codes + cr.at(b, h, c), chunks, lo.data(), hi.data());
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * 2 * P;
        for (int64_t k = 0; k < K; ++k) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t j = k * per_group; j < (k + 1) * per_group; ++j) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), _mm256_loadu_ps(lo.data() + 8 * j), acc);
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + P + 8 * j), _mm256_loadu_ps(hi.data() + 8 * j), acc);
          }
          _mm256_storeu_ps(partial.data() + ((g * K + k) * TILE + t) * 8, acc);  // [g][k][t][lane]
        }
      }
    }
    // a last tile of fewer slots computes lanes past n from stale partial sums: they are never stored
    float* dest = n == TILE ? out + c0 : last.data();
    const int64_t stride = n == TILE ? C : TILE;
    for (int64_t g = 0; g < G; ++g) {
      __m256 logit = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const __m256 dot = sum8(partial.data() + (g * K + k) * TILE * 8);
        logit = _mm256_fmadd_ps(_mm256_loadu_ps(s.data() + k * TILE), dot, logit);
        logit = _mm256_fmadd_ps(_mm256_loadu_ps(z.data() + k * TILE), _mm256_set1_ps(qsum[g * K + k]), logit);
      }
      _mm256_storeu_ps(dest + g * stride, logit);
    }
    if (n < TILE)
      for (int64_t g = 0; g < G; ++g) std::copy(last.data() + g * TILE, last.data() + g * TILE + n, out + g * C + c0);
  }
}

template <int64_t CHUNKS, typename scale_t>
void values_avx2(const float* probs, const int64_t* ps, const uint8_t* codes, Rows cr, const scale_t* scale, Rows sr,
                 const scale_t* zero, Rows zr, float* out, int64_t b, int64_t h, int64_t C, int64_t G, int64_t K) {
  // Slots go in tiles of 8: each slot unpacked once into an L1 row, its weights spread to one per 8 codes;
  // then per query row g the 2 * CHUNKS output vectors stay in registers over the tile (CHUNKS a constant so
  // the compiler can keep them there), and probs * zero is summed per group apart (added at the end).
  constexpr int64_t TILE = 8, P = 8 * CHUNKS;
  const int64_t per_group = CHUNKS / K;
  std::vector<float> lo(TILE * P), hi(TILE * P), acc(G * 2 * P, 0.f), zsum(G * K, 0.f), s(TILE * CHUNKS),
      z(TILE * K);
  for (int64_t c0 = 0; c0 < C; c0 += TILE) {
    const int64_t n = std::min(TILE, C - c0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t c = c0 + t;
      const scale_t* scale_c = scale + sr.at(b, h, c);
      const scale_t* zero_c = zero + zr.at(b, h, c);
      for (int64_t j = 0; j < CHUNKS; ++j)  // one scale per 8 codes: chunk j is in group j / per_group
        s[t * CHUNKS + j] = static_cast<float>(scale_c[(j / per_group) * sr.strides[3]]);
      for (int64_t k = 0; k < K; ++k) z[t * K + k] = static_cast<float>(zero_c[k * zr.strides[3]]);
      unpack(codes + cr.at(b, h, c), CHUNKS, lo.data() + t * P, hi.data() + t * P);
    }
    for (int64_t g = 0; g < G; ++g) {
      float* ag = acc.data() + g * 2 * P;
      __m256 a_lo[CHUNKS], a_hi[CHUNKS];
      for (int64_t j = 0; j < CHUNKS; ++j) {
        a_lo[j] = _mm256_loadu_ps(ag + 8 * j);
        a_hi[j] = _mm256_loadu_ps(ag + P + 8 * j);
      }
      for (int64_t t = 0; t < n; ++t) {
        const float weight = probs[g * ps[2] + (c0 + t) * ps[3]];
        for (int64_t k = 0; k < K; ++k) zsum[g * K + k] += weight * z[t * K + k];
        const float* lo_t = lo.data() + t * P;
        const float* hi_t = hi.data() + t * P;
        for (int64_t j = 0; j < CHUNKS; ++j) {
          const __m256 w = _mm256_set1_ps(weight * s[t * CHUNKS + j]);
          a_lo[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(lo_t + 8 * j), a_lo[j]);
          a_hi[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(hi_t + 8 * j), a_hi[j]);
        }
      }
      for (int64_t j = 0; j < CHUNKS; ++j) {
        _mm256_storeu_ps(ag + 8 * j, a_lo[j]);
        _mm256_storeu_ps(ag + P + 8 * j, a_hi[j]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < CHUNKS; ++j) {
      const __m256 zv = _mm256_set1_ps(zsum[g * K + j / per_group]);
      const float* ag = acc.data() + g * 2 * P;
      _mm256_storeu_ps(out + g * 2 * P + 8 * j, _mm256_add_ps(_mm256_loadu_ps(ag + 8 * j), zv));
      _mm256_storeu_ps(out + g * 2 * P + P + 8 * j, _mm256_add_ps(_mm256_loadu_ps(ag + P + 8 * j), zv));
    }
}
#endif

void check(const at::Tensor& rows, const char* rows_name, const at::Tensor& codes, const at::Tensor& scale,
           const at::Tensor& zero) {
  TORCH_CHECK(rows.device().is_cpu() && codes.device().is_cpu() && scale.device().is_cpu() && zero.device().is_cpu(),
              "int4 CPU ops take CPU tensors");
  TORCH_CHECK(rows.dim() == 4 && rows.scalar_type() == at::kFloat, rows_name, " must be [B, H, G, X] float32");
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.stride(3) == 1,
              "codes must be [B, H, C, P] uint8 with contiguous bytes");
  TORCH_CHECK(scale.dim() == 4 && zero.sizes() == scale.sizes() && zero.scalar_type() == scale.scalar_type(),
              "scale and zero must be [B, H, C, K] of one dtype");
  TORCH_CHECK(scale.size(0) == codes.size(0) && scale.size(1) == codes.size(1) && scale.size(2) == codes.size(2) &&
                  scale.size(3) > 0 && codes.size(3) % scale.size(3) == 0,
              "scale [B, H, C, K] must match codes [B, H, C, P] with K dividing P");
  TORCH_CHECK(rows.size(0) == codes.size(0) && rows.size(1) == codes.size(1), rows_name, " must match codes' [B, H]");
}

void check_out(const at::Tensor& out, at::IntArrayRef shape) {
  TORCH_CHECK(out.sizes() == shape && out.scalar_type() == at::kFloat && out.is_contiguous() && out.device().is_cpu(),
              "out must be a contiguous float32 CPU tensor of shape ", shape);
}

}  // namespace

void int4_logits(const at::Tensor& query_in, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                 const at::Tensor& out) {
  check(query_in, "query", codes, scale, zero);
  TORCH_CHECK(query_in.size(3) == 2 * codes.size(3), "query must have 2P channels");
  const at::Tensor query = query_in.contiguous();
  const int64_t B = codes.size(0), H = codes.size(1), C = codes.size(2), P = codes.size(3);
  const int64_t G = query.size(2), K = scale.size(3);
  check_out(out, {B, H, G, C});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scale.scalar_type(), "int4_logits", [&] {
    const Rows cr{codes.strides().data()}, sr{scale.strides().data()}, zr{zero.strides().data()};
    const float* q = query.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        const float* q_bh = q + bh * G * 2 * P;
        const uint8_t* c = codes.data_ptr<uint8_t>();
        const scalar_t *s = scale.data_ptr<scalar_t>(), *z = zero.data_ptr<scalar_t>();
        float* out_bh = o + bh * G * C;
#if EVICTLAYERS_AVX2
        if ((P / K) % 8 == 0) {
          logits_avx2<scalar_t>(q_bh, c, cr, s, sr, z, zr, out_bh, b, h, C, P, G, K);
          continue;
        }
#endif
        logits_scalar<scalar_t>(q_bh, c, cr, s, sr, z, zr, out_bh, b, h, C, P, G, K);
      }
    });
  });
}

void int4_values(const at::Tensor& probs, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                 const at::Tensor& out) {
  check(probs, "probs", codes, scale, zero);
  TORCH_CHECK(probs.size(3) == codes.size(2), "probs must have one column per code slot");
  const int64_t B = codes.size(0), H = codes.size(1), C = codes.size(2), P = codes.size(3);
  const int64_t G = probs.size(2), K = scale.size(3);
  check_out(out, {B, H, G, 2 * P});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scale.scalar_type(), "int4_values", [&] {
    const Rows cr{codes.strides().data()}, sr{scale.strides().data()}, zr{zero.strides().data()};
    const int64_t* ps = probs.strides().data();
    const float* p = probs.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        const float* probs_bh = p + b * ps[0] + h * ps[1];
        const uint8_t* c = codes.data_ptr<uint8_t>();
        const scalar_t *s = scale.data_ptr<scalar_t>(), *z = zero.data_ptr<scalar_t>();
        float* out_bh = o + bh * G * 2 * P;
#if EVICTLAYERS_AVX2
        // head dims 64, 128 and 256 (groups of >= 16 channels): a row's output vectors are a compile-time count
        if ((P / K) % 8 == 0 && (P == 32 || P == 64 || P == 128)) {
          const auto kernel = P == 32 ? values_avx2<4, scalar_t> : P == 64 ? values_avx2<8, scalar_t>
                                                                           : values_avx2<16, scalar_t>;
          kernel(probs_bh, ps, c, cr, s, sr, z, zr, out_bh, b, h, C, G, K);
          continue;
        }
#endif
        values_scalar<scalar_t>(probs_bh, ps, c, cr, s, sr, z, zr, out_bh, b, h, C, P, G, K);
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_logits", &int4_logits, "int4 decode logits (int4_cpu.py)");
  m.def("int4_values", &int4_values, "int4 decode values (int4_cpu.py)");
}
