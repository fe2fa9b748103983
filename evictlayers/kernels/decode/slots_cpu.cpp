// Decode attention's two matmuls over dense KV slots on CPU, for the query rows of a GQA group at once
// (slots_cpu.py documents the ops; naive.py's matmul_logits and matmul_values compute the same with torch.matmul):
//
//   slot_logits(query [B,H,G,D] f32, keys [B,H,C,D])      -> [B,H,G,C] f32   logit[g,c] = q[g] . k[c]
//   slot_values(probs [B,H,G,C] f32, values [B,H,C,Dv])   -> [B,H,G,Dv] f32  out[g] = sum_c p[g,c] v[c]
//   slot_softmax(logits [B,H,G,C] f32, query_pos [B], key_pos [B,H,C], ...) -> probs, lse, mass
//                                                          (naive.py's slot_softmax and reduce_group in one op)
//   first_free_slot(pos [B,H,N] i64)                     -> [B,H] i64       where the decode's new token goes
//
// keys and values are float32, bfloat16 or float16 (converted to float32 in registers); any strides whose last
// dimension is contiguous. The ops register themselves as the CPU kernels of evictlayers::slot_logits and
// evictlayers::slot_values (schemas defined in slots_cpu.py), so a call goes from the dispatcher straight here.
//
// Loops (AVX2 + FMA): QK walks the slots in tiles of 8, each slot's key read once for up to 4 query rows, the
// tile's 8 vectors of partial sums per row reduced to one vector over the tile by a tree of hadd. PV walks the
// slots in tiles of about 16 KB and, per block of up to 3 query rows and 32 output channels, keeps the 12
// accumulators in registers across the tile. On a machine with AVX-512 the same loops run 16 floats wide where
// they can: QK in tiles of 16 slots (head dims 64 and 128, each row's query held in registers; the 16 vectors of
// partial sums per row reduced by sum16), PV wherever the head dim is a multiple of 16 (blocks of up to 4 rows
// and 64 channels). Head dims that are not a multiple of 8, or a machine without AVX2, FMA and F16C, take the
// scalar loops, which compute the same sums. The vector loops ask for the slots they will read next into L2, a few
// dozen slots ahead (QK_PREFETCH_SLOTS, PV_PREFETCH_SLOTS): one thread's reads alone keep too few in flight.
#include <torch/extension.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "cpu_kernels.h"

namespace {

using evictlayers::Rows;

template <typename kv_t>
void logits_scalar(const float* q, const kv_t* keys, Rows kr, float* out, int64_t b, int64_t h, int64_t C,
                   int64_t D, int64_t G) {
  for (int64_t c = 0; c < C; ++c) {
    const kv_t* k = keys + kr.at(b, h, c);
    for (int64_t g = 0; g < G; ++g) {
      float total = 0;
      for (int64_t d = 0; d < D; ++d) total += q[g * D + d] * static_cast<float>(k[d]);
      out[g * C + c] = total;
    }
  }
}

template <typename kv_t>
void values_scalar(const float* probs, const int64_t* ps, const kv_t* values, Rows vr, float* out, int64_t b,
                   int64_t h, int64_t C, int64_t Dv, int64_t G) {
  std::fill(out, out + G * Dv, 0.f);
  for (int64_t c = 0; c < C; ++c) {
    const kv_t* v = values + vr.at(b, h, c);
    for (int64_t g = 0; g < G; ++g) {
      const float weight = probs[g * ps[2] + c * ps[3]];
      for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] += weight * static_cast<float>(v[d]);
    }
  }
}

#if EVICTLAYERS_AVX2
using evictlayers::load8;
using evictlayers::QK_ROWS;
using evictlayers::QK_TILE;

// rows g0 .. g0 + R of one tile of n <= 8 slots: partial sums per (row, slot), then one vector per row
template <int64_t R, typename kv_t>
void logits_tile(const float* q, const kv_t* const* slot, int64_t n, int64_t D, int64_t g0, float* partial,
                 float* out, int64_t C, int64_t c0) {
  for (int64_t t = 0; t < QK_TILE; ++t) {
    __m256 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    if (t < n)
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 k = load8(slot[t] + d);
        for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g0 + r) * D + d), k, acc[r]);
      }
    for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(partial + (r * QK_TILE + t) * 8, acc[r]);
  }
  evictlayers::logits_store<R>(partial, n, g0, out, C, c0);
}

template <typename kv_t>
void logits_avx2(const float* q, const kv_t* keys, Rows kr, float* out, int64_t b, int64_t h, int64_t C, int64_t D,
                 int64_t G) {
  // Slots outer, query rows inner: a tile's keys (8 x D elements) stay in L1 while every row block reads them.
  alignas(32) float partial[QK_ROWS * QK_TILE * 8];
  const kv_t* slot[QK_TILE];
  for (int64_t c0 = 0; c0 < C; c0 += QK_TILE) {
    const int64_t n = std::min(QK_TILE, C - c0);
    for (int64_t t = 0; t < n; ++t) slot[t] = keys + kr.at(b, h, c0 + t);
    for (int64_t g0 = 0; g0 < G; g0 += QK_ROWS) {
      switch (std::min(QK_ROWS, G - g0)) {
        case 4: logits_tile<4>(q, slot, n, D, g0, partial, out, C, c0); break;
        case 3: logits_tile<3>(q, slot, n, D, g0, partial, out, C, c0); break;
        case 2: logits_tile<2>(q, slot, n, D, g0, partial, out, C, c0); break;
        default: logits_tile<1>(q, slot, n, D, g0, partial, out, C, c0); break;
      }
    }
  }
}

#if EVICTLAYERS_AVX512
using evictlayers::load16;

// The key 96 slots ahead (24 KB at head dim 64 in float32) is asked for into L2 as each slot is read: on one thread
// the hardware prefetcher alone left QK at ~80% of a plain read's rate, and this ran it 0.90-0.93x as long, timed
// in blocks alternating with the loop without it (batch 8, 3 KV heads of 3 rows, 819 and 1,638 slots, a different
// layer's cache each call). Into L1, or 32 slots ahead, it gained nothing; 64-192 slots ahead gained alike.
constexpr int64_t QK_PREFETCH_SLOTS = 96;

// rows g0 .. g0 + R of one tile of n <= 16 slots, 16-wide: each slot's key read once for the R rows, their vectors
// of partial sums reduced to one vector of 16 logits per row by sum16. K = D / 16 is known at compile time, so the
// rows' query stays in registers (R * K <= 24 of the 32) where a loop over D would reload it from L1 per slot.
template <int64_t R, int64_t K, typename kv_t>
void logits_tile16(const float* q, const kv_t* keys, Rows kr, int64_t b, int64_t h, int64_t c0, int64_t n,
                   int64_t g0, __m512* partial, float* out, int64_t C) {
  constexpr int64_t D = 16 * K;
  __m512 resident[R][K];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < K; ++j) resident[r][j] = _mm512_loadu_ps(q + (g0 + r) * D + 16 * j);
  for (int64_t t = 0; t < 16; ++t) {
    __m512 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    if (t < n) {
      const kv_t* k = keys + kr.at(b, h, c0 + t);
      // a prefetch never faults, past the slots' end too
      const char* ahead = reinterpret_cast<const char*>(keys + kr.at(b, h, c0 + t + QK_PREFETCH_SLOTS));
      for (int64_t j = 0; j < D * static_cast<int64_t>(sizeof(kv_t)); j += 64) _mm_prefetch(ahead + j, _MM_HINT_T1);
      for (int64_t j = 0; j < K; ++j) {
        const __m512 key = load16(k + 16 * j);
        for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(resident[r][j], key, acc[r]);
      }
    }
    for (int64_t r = 0; r < R; ++r) partial[r * 16 + evictlayers::sum16_place(t)] = acc[r];
  }
  const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(out + (g0 + r) * C + c0, lanes, evictlayers::sum16(partial + r * 16));
}

// every row of one (b, h) of head dim 16 * K in blocks of up to ROWS rows (ROWS * K <= 24)
template <int64_t K, int64_t ROWS, typename kv_t>
void logits_avx512(const float* q, const kv_t* keys, Rows kr, float* out, int64_t b, int64_t h, int64_t C, int64_t G) {
  alignas(64) __m512 partial[ROWS * 16];
  for (int64_t c0 = 0; c0 < C; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, C - c0);
    for (int64_t g0 = 0; g0 < G; g0 += ROWS) {
      switch (std::min(ROWS, G - g0)) {  // case 4 never comes with ROWS = 3: it compiles as one row
        case 4: logits_tile16<ROWS >= 4 ? 4 : 1, K>(q, keys, kr, b, h, c0, n, g0, partial, out, C); break;
        case 3: logits_tile16<3, K>(q, keys, kr, b, h, c0, n, g0, partial, out, C); break;
        case 2: logits_tile16<2, K>(q, keys, kr, b, h, c0, n, g0, partial, out, C); break;
        default: logits_tile16<1, K>(q, keys, kr, b, h, c0, n, g0, partial, out, C); break;
      }
    }
  }
}
#endif

constexpr int64_t PV_TILE_BYTES = 16384;
// PV asks for the value 64 slots ahead into L2 as it reads each slot (values_tile's prefetch; 0.93-1.0x the time
// on the shapes QK_PREFETCH_SLOTS was measured on). Asked for a whole tile at a time, the same prefetches made it
// 1.5x as slow.
constexpr int64_t PV_PREFETCH_SLOTS = 64;

template <typename kv_t>
void values_avx2(const float* probs, const int64_t* ps, const kv_t* values, Rows vr, float* out, int64_t b, int64_t h,
                 int64_t C, int64_t Dv, int64_t G) {
  // The output is the accumulator: each block loads its vectors once per tile of slots, not once per slot.
  std::fill(out, out + G * Dv, 0.f);
  const int64_t tile = std::max<int64_t>(8, PV_TILE_BYTES / (Dv * static_cast<int64_t>(sizeof(kv_t))));
  std::vector<const kv_t*> slot(tile);
  for (int64_t c0 = 0; c0 < C; c0 += tile) {
    const int64_t n = std::min(tile, C - c0);
    for (int64_t t = 0; t < n; ++t) slot[t] = values + vr.at(b, h, c0 + t);
    evictlayers::values_tile(probs, ps, slot.data(), out, c0, n, Dv, G,
                             PV_PREFETCH_SLOTS * vr.strides[2] * static_cast<int64_t>(sizeof(kv_t)));
  }
}
#endif

void check(const at::Tensor& rows, const char* rows_name, const at::Tensor& slots, const char* slots_name) {
  TORCH_CHECK(rows.device().is_cpu() && slots.device().is_cpu(), "evictlayers slot ops on CPU take CPU tensors");
  TORCH_CHECK(rows.dim() == 4 && rows.scalar_type() == at::kFloat, rows_name, " must be [B, H, G, X] float32, got ",
              rows.sizes(), " ", rows.scalar_type());
  TORCH_CHECK(slots.dim() == 4 && slots.stride(3) == 1, slots_name,
              " must be [B, H, C, X] with a contiguous last dimension, got sizes ", slots.sizes(), " strides ",
              slots.strides());
  TORCH_CHECK(slots.scalar_type() == at::kFloat || slots.scalar_type() == at::kBFloat16 ||
                  slots.scalar_type() == at::kHalf,
              slots_name, " must be float32, bfloat16 or float16, got ", slots.scalar_type());
  TORCH_CHECK(rows.size(0) == slots.size(0) && rows.size(1) == slots.size(1), rows_name, " ", rows.sizes(),
              " and ", slots_name, " ", slots.sizes(), " must share [B, H]");
}

}  // namespace

at::Tensor slot_logits(const at::Tensor& query_in, const at::Tensor& keys) {
  check(query_in, "query", keys, "keys");
  TORCH_CHECK(query_in.size(3) == keys.size(3), "query ", query_in.sizes(), " and keys ", keys.sizes(),
              " must have the same head dim");
  const at::Tensor query = query_in.contiguous();
  const int64_t B = keys.size(0), H = keys.size(1), C = keys.size(2), D = keys.size(3), G = query.size(2);
  at::Tensor out = at::empty({B, H, G, C}, query.options());
  AT_DISPATCH_V2(keys.scalar_type(), "slot_logits", AT_WRAP([&] {
    const Rows kr{keys.strides().data()};
    const float* q = query.data_ptr<float>();
    const scalar_t* k = keys.data_ptr<scalar_t>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
#if EVICTLAYERS_AVX512
        if (D == 64) {
          logits_avx512<4, 4, scalar_t>(q + bh * G * D, k, kr, o + bh * G * C, b, h, C, G);
          continue;
        }
        if (D == 128) {
          logits_avx512<8, 3, scalar_t>(q + bh * G * D, k, kr, o + bh * G * C, b, h, C, G);
          continue;
        }
#endif
#if EVICTLAYERS_AVX2
        if (D % 8 == 0) {
          logits_avx2<scalar_t>(q + bh * G * D, k, kr, o + bh * G * C, b, h, C, D, G);
          continue;
        }
#endif
        logits_scalar<scalar_t>(q + bh * G * D, k, kr, o + bh * G * C, b, h, C, D, G);
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

at::Tensor slot_values(const at::Tensor& probs, const at::Tensor& values) {
  check(probs, "probs", values, "values");
  TORCH_CHECK(probs.size(3) == values.size(2), "probs ", probs.sizes(), " must have one column per slot of values ",
              values.sizes());
  const int64_t B = values.size(0), H = values.size(1), C = values.size(2), Dv = values.size(3), G = probs.size(2);
  at::Tensor out = at::empty({B, H, G, Dv}, probs.options());
  AT_DISPATCH_V2(values.scalar_type(), "slot_values", AT_WRAP([&] {
    const Rows vr{values.strides().data()};
    const int64_t* ps = probs.strides().data();
    const float* p = probs.data_ptr<float>();
    const scalar_t* v = values.data_ptr<scalar_t>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / H, h = bh % H;
        const float* probs_bh = p + b * ps[0] + h * ps[1];
#if EVICTLAYERS_AVX2
        if (Dv % 8 == 0) {
          values_avx2<scalar_t>(probs_bh, ps, v, vr, o + bh * G * Dv, b, h, C, Dv, G);
          continue;
        }
#endif
        values_scalar<scalar_t>(probs_bh, ps, v, vr, o + bh * G * Dv, b, h, C, Dv, G);
      }
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> slot_softmax(
    const at::Tensor& logits_in, const at::Tensor& query_pos_in, const at::Tensor& key_pos_in, double scale,
    double softcap, int64_t window, const std::optional<at::Tensor>& gain_in, int64_t reduce, bool need_mass) {
  TORCH_CHECK(logits_in.device().is_cpu() && query_pos_in.device().is_cpu() && key_pos_in.device().is_cpu(),
              "evictlayers slot ops on CPU take CPU tensors");
  TORCH_CHECK(logits_in.dim() == 4 && logits_in.scalar_type() == at::kFloat,
              "logits must be [B, H, G, C] float32, got ", logits_in.sizes(), " ", logits_in.scalar_type());
  const int64_t B = logits_in.size(0), H = logits_in.size(1), G = logits_in.size(2), C = logits_in.size(3);
  TORCH_CHECK(key_pos_in.dim() == 3 && key_pos_in.scalar_type() == at::kLong && key_pos_in.size(0) == B &&
                  key_pos_in.size(1) == H && key_pos_in.size(2) == C,
              "key_pos must be [B, H, C] int64 matching logits ", logits_in.sizes(), ", got ", key_pos_in.sizes(), " ",
              key_pos_in.scalar_type());
  const at::Tensor gain = evictlayers::checked_softmax_options(query_pos_in, B, gain_in, reduce, softcap);
  const at::Tensor logits = logits_in.contiguous(), query_pos = query_pos_in.contiguous(),
                   key_pos = key_pos_in.contiguous();
  at::Tensor probs = at::empty({B, H, G, C}, logits.options());
  at::Tensor lse = at::empty({B, H, G}, logits.options());
  at::Tensor mass = at::empty({B, H, need_mass ? C : 0}, logits.options());
  const float* x = logits.data_ptr<float>();
  const int64_t* qp = query_pos.data_ptr<int64_t>();
  const int64_t* kp = key_pos.data_ptr<int64_t>();
  const float* gains = gain.defined() ? gain.data_ptr<float>() : nullptr;
  float* p = probs.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  float* m = mass.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> hidden(C), gained(gains ? C : 0);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, query = qp[b];
      const int64_t* slot_pos = kp + bh * C;
      for (int64_t c = 0; c < C; ++c) hidden[c] = evictlayers::hidden(slot_pos[c], query, window);
      evictlayers::rows_softmax(x + bh * G * C, p + bh * G * C, hidden.data(), G, C, scale, softcap,
                                gains ? gains + b : nullptr, reduce, need_mass, l + bh * G, m + bh * C, gained.data());
    }
  });
  return {probs, lse, mass};
}

at::Tensor first_free_slot(const at::Tensor& pos_in) {
  TORCH_CHECK(pos_in.device().is_cpu() && pos_in.dim() == 3 && pos_in.scalar_type() == at::kLong,
              "first_free_slot takes pos [B, H, N] int64 on CPU, got ", pos_in.sizes(), " ", pos_in.scalar_type());
  const at::Tensor pos = pos_in.contiguous();
  const int64_t B = pos.size(0), H = pos.size(1), C = pos.size(2);
  at::Tensor out = at::empty({B, H}, pos.options());
  const int64_t* ps = pos.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t* row = ps + bh * C;
      const int64_t* free = std::find_if(row, row + C, [](int64_t p) { return p < 0; });
      o[bh] = free == row + C ? 0 : free - row;  // none free: 0, as argmax of an all-false mask
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(evictlayers, CPU, m) {
  m.impl("slot_logits", &slot_logits);
  m.impl("slot_values", &slot_values);
  m.impl("slot_softmax", &slot_softmax);
  m.impl("first_free_slot", &first_free_slot);
}

// torch.utils.cpp_extension.load imports the build as a Python module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
