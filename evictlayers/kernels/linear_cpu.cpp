// A linear layer's product for a few input rows on CPU (linear_cpu.py documents the op and when it runs):
//
//   few_rows_linear(input [..., K] f32, weight [N, K] f32, bias [N] f32 or None) -> [..., N] f32
//     out[m, n] = input[m] . weight[n] (+ bias[n])
//
// Why: a decode step multiplies each weight by one row per sequence. BLAS runs such a product far below its rate
// (it packs the weight, or streams it once per few rows), so the weights, read once per step, take longer than the
// cache. Here each weight row is read once for all the input's rows (up to 8 at a time; more rows go in blocks of
// 8): 16 floats of two weight rows against 16 floats of each input row, one accumulator vector per (row, weight
// row) pair, 16 of the 32 registers, reduced to 16 sums at the end by one transpose-add tree (cpu_kernels.h's
// sum16). The weight is read in place, in nn.Linear's layout: nothing is packed or copied.
//
// The op registers itself as the CPU kernel of evictlayers::few_rows_linear (schema in linear_cpu.py). Built
// without AVX-512 (linear_cpu.py then never routes a layer here), it computes at::linear.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>

#include "cpu_kernels.h"

namespace {

#if EVICTLAYERS_AVX512
// 16 channels from k of weight rows rows[0 .. NB) against input rows 0 .. MB, into the accumulators; the last step
// of a width that is not a multiple of 16 loads only its lanes (masked loads throughout ran 1.3x as long at one
// row). Always inlined: called through a function, the accumulators would live in memory.
template <int MB, int NB, bool MASKED>
__attribute__((always_inline)) inline void step(const float* x, int64_t K, const float* rows, int64_t k,
                                                __mmask16 lanes, __m512* acc) {
  auto load = [lanes](const float* at) { return MASKED ? _mm512_maskz_loadu_ps(lanes, at) : _mm512_loadu_ps(at); };
  __m512 weights[NB];
  for (int j = 0; j < NB; ++j) weights[j] = load(rows + j * K + k);
  // The weight rows two tiles ahead are asked for now, into L2 (a prefetch never faults past the weight's end):
  // with the hardware prefetcher alone the loop waited on memory (1.4x the time at one row, 2x at 8), and
  // prefetched into L1 they evicted the input rows (1.55x at 8 rows against L2).
  for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(rows + (2 * NB + j) * K + k), _MM_HINT_T1);
  for (int i = 0; i < MB; ++i) {
    const __m512 input = load(x + i * K + k);
    for (int j = 0; j < NB; ++j) acc[i * NB + j] = _mm512_fmadd_ps(input, weights[j], acc[i * NB + j]);
  }
}

// Weight rows n0 .. n0 + NB against input rows 0 .. MB (MB * NB <= 16): out[m * ldo + n] for each pair.
template <int MB, int NB>
void tile(const float* x, int64_t K, const float* w, const float* bias, int64_t n0, float* out, int64_t ldo) {
  __m512 acc[MB * NB];
  for (int t = 0; t < MB * NB; ++t) acc[t] = _mm512_setzero_ps();
  const float* rows = w + n0 * K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) step<MB, NB, false>(x, K, rows, k, 0xFFFF, acc);
  if (k < K) step<MB, NB, true>(x, K, rows, k, static_cast<__mmask16>((1u << (K - k)) - 1), acc);
  __m512 placed[16];
  for (int t = 0; t < 16; ++t)
    placed[evictlayers::sum16_place(t)] = t < MB * NB ? acc[t] : _mm512_setzero_ps();
  alignas(64) float sums[16];
  _mm512_store_ps(sums, evictlayers::sum16(placed));
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * ldo + n0 + j] = sums[i * NB + j] + (bias ? bias[n0 + j] : 0.f);
}

// MB input rows against every weight row: NB = 16 / MB weight rows a tile (2 at 8 rows, 16 at one), the last
// N % NB weight rows one at a time
template <int MB>
void block(const float* x, int64_t K, const float* w, const float* bias, int64_t N, float* out) {
  constexpr int NB = MB >= 8 ? 2 : 16 / MB;
  const int64_t tiles = N / NB;
  // a grain of 64 tiles: a thread's share of the weight is at least ~100 KB at SmolLM2's width
  at::parallel_for(0, tiles + (N % NB ? 1 : 0), 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (t < tiles) {
        tile<MB, NB>(x, K, w, bias, t * NB, out, N);
      } else {
        for (int64_t n = tiles * NB; n < N; ++n) tile<MB, 1>(x, K, w, bias, n, out, N);
      }
    }
  });
}
#endif

at::Tensor few_rows_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "few_rows_linear: expected float32 input and weight, got ", input.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && input.size(-1) == weight.size(1), "few_rows_linear: input [..., ", input.size(-1),
              "] does not match weight ", weight.sizes());
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == weight.size(0)),
              "few_rows_linear: expected a float32 bias of ", weight.size(0), " elements");
#if EVICTLAYERS_AVX512
  const int64_t K = weight.size(1), N = weight.size(0);
  const at::Tensor x = input.reshape({-1, K}).contiguous(), w = weight.contiguous();
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  auto sizes = input.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, input.options());
  const int64_t M = x.size(0);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *bp = bias ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xr = xp + m0 * K;
    float* o = op + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 8: block<8>(xr, K, wp, bp, N, o); break;
      case 7: block<7>(xr, K, wp, bp, N, o); break;
      case 6: block<6>(xr, K, wp, bp, N, o); break;
      case 5: block<5>(xr, K, wp, bp, N, o); break;
      case 4: block<4>(xr, K, wp, bp, N, o); break;
      case 3: block<3>(xr, K, wp, bp, N, o); break;
      case 2: block<2>(xr, K, wp, bp, N, o); break;
      default: block<1>(xr, K, wp, bp, N, o); break;
    }
  }
  return out;
#else
  return at::linear(input, weight, bias);
#endif
}

}  // namespace

TORCH_LIBRARY_IMPL(evictlayers, CPU, m) { m.impl("few_rows_linear", &few_rows_linear); }

// torch.utils.cpp_extension.load imports the build as a Python module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorised", [] { return static_cast<bool>(EVICTLAYERS_AVX512); },
        "whether the op runs its AVX-512 loops (else it computes at::linear)");
}
