// A linear layer's product for a few input rows on CPU (linear_cpu.py documents the op and when it runs):
//
//   few_rows_linear(input [..., K], weight [N, K], bias [N] or None) -> [..., N], all float32 or all bfloat16
//     out[m, n] = input[m] . weight[n] (+ bias[n]), accumulated in float32
//
// Why: a decode step multiplies each weight by one row per sequence. BLAS runs such a product far below its rate
// (it packs the weight, or streams it once per few rows), so the weights, read once per step, take longer than the
// cache. Here each weight row is read once for all the input's rows (up to 8 at a time; more rows go in blocks of
// 8): one vector of two weight rows against one vector of each input row, one float32 accumulator vector per (row,
// weight row) pair, 16 of the 32 registers, reduced to 16 sums at the end by one transpose-add tree (cpu_kernels.h's
// sum16). The weight is read in place, in nn.Linear's layout: nothing is packed or copied. A vector is 16 float32
// channels (multiplied and added by vfmadd) or 32 bfloat16 channels (vdpbf16ps: each float32 lane adds the products
// of a pair of channels, exactly, as BLAS's bfloat16 products accumulate in float32); a bfloat16 result is rounded
// to nearest even once, from the float32 sum.
//
// The op registers itself as the CPU kernel of evictlayers::few_rows_linear (schema in linear_cpu.py). Built
// without AVX-512 (linear_cpu.py then never routes a layer here), it computes at::linear; bfloat16 needs AVX512-BF16
// as well (``bfloat16()`` says whether it was built with it).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>

#include "cpu_kernels.h"

#if EVICTLAYERS_AVX512 && defined(__AVX512BF16__)
#define EVICTLAYERS_AVX512_BF16 1
#else
#define EVICTLAYERS_AVX512_BF16 0
#endif

namespace {

#if EVICTLAYERS_AVX512
// The element types the loops read: a vector's channels, its loads (all lanes, or the first n of the last step of
// a width that is not a whole number of vectors: masked loads throughout ran 1.3x as long at one row) and the
// multiply-add into a float32 accumulator.
struct Float32 {
  using T = float;
  using Reg = __m512;
  static constexpr int64_t width = 16;
  static Reg load(const T* at) { return _mm512_loadu_ps(at); }
  static Reg load_first(const T* at, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), at);
  }
  static __m512 multiply_add(__m512 acc, Reg x, Reg w) { return _mm512_fmadd_ps(x, w, acc); }
};

#if EVICTLAYERS_AVX512_BF16
struct BFloat16 {
  using T = c10::BFloat16;
  using Reg = __m512bh;
  static constexpr int64_t width = 32;
  static Reg load(const T* at) { return (Reg)_mm512_loadu_si512(at); }  // the same 512 bits, as 32 bfloat16
  static Reg load_first(const T* at, int64_t n) {
    return (Reg)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), at);
  }
  static __m512 multiply_add(__m512 acc, Reg x, Reg w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

// One vector of channels from k of weight rows rows[0 .. NB) against input rows 0 .. MB, into the accumulators
// (the first `tail` channels only, when not 0). Always inlined: called through a function, the accumulators would
// live in memory.
template <class E, int MB, int NB>
__attribute__((always_inline)) inline void step(const typename E::T* x, int64_t K, const typename E::T* rows,
                                                int64_t k, int64_t tail, __m512* acc) {
  auto load = [tail](const typename E::T* at) { return tail ? E::load_first(at, tail) : E::load(at); };
  typename E::Reg weights[NB];
  for (int j = 0; j < NB; ++j) weights[j] = load(rows + j * K + k);
  // The weight rows two tiles ahead are asked for now, into L2 (a prefetch never faults past the weight's end):
  // with the hardware prefetcher alone the loop waited on memory (1.4x the time at one row, 2x at 8), and
  // prefetched into L1 they evicted the input rows (1.55x at 8 rows against L2).
  for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(rows + (2 * NB + j) * K + k), _MM_HINT_T1);
  for (int i = 0; i < MB; ++i) {
    const typename E::Reg input = load(x + i * K + k);
    for (int j = 0; j < NB; ++j) acc[i * NB + j] = E::multiply_add(acc[i * NB + j], input, weights[j]);
  }
}

// Weight rows n0 .. n0 + NB against input rows 0 .. MB (MB * NB <= 16): out[m * ldo + n] for each pair.
template <class E, int MB, int NB>
void tile(const typename E::T* x, int64_t K, const typename E::T* w, const typename E::T* bias, int64_t n0,
          typename E::T* out, int64_t ldo) {
  __m512 acc[MB * NB];
  for (int t = 0; t < MB * NB; ++t) acc[t] = _mm512_setzero_ps();
  const typename E::T* rows = w + n0 * K;
  int64_t k = 0;
  for (; k + E::width <= K; k += E::width) step<E, MB, NB>(x, K, rows, k, 0, acc);
  if (k < K) step<E, MB, NB>(x, K, rows, k, K - k, acc);
  __m512 placed[16];
  for (int t = 0; t < 16; ++t)
    placed[evictlayers::sum16_place(t)] = t < MB * NB ? acc[t] : _mm512_setzero_ps();
  alignas(64) float sums[16];
  _mm512_store_ps(sums, evictlayers::sum16(placed));
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      out[i * ldo + n0 + j] = sums[i * NB + j] + (bias ? static_cast<float>(bias[n0 + j]) : 0.f);
}

// MB input rows against every weight row: NB = 16 / MB weight rows a tile (2 at 8 rows, 16 at one), the last
// N % NB weight rows one at a time
template <class E, int MB>
void block(const typename E::T* x, int64_t K, const typename E::T* w, const typename E::T* bias, int64_t N,
           typename E::T* out) {
  constexpr int NB = MB >= 8 ? 2 : 16 / MB;
  const int64_t tiles = N / NB;
  // a grain of 64 tiles: a thread's share of the weight is at least ~100 KB at SmolLM2's width
  at::parallel_for(0, tiles + (N % NB ? 1 : 0), 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (t < tiles) {
        tile<E, MB, NB>(x, K, w, bias, t * NB, out, N);
      } else {
        for (int64_t n = tiles * NB; n < N; ++n) tile<E, MB, 1>(x, K, w, bias, n, out, N);
      }
    }
  });
}

// Every block of up to 8 input rows of x [M, K] against w [N, K] into out [M, N].
template <class E>
void rows_against_weight(const typename E::T* x, int64_t M, int64_t K, const typename E::T* w,
                         const typename E::T* bias, int64_t N, typename E::T* out) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const typename E::T* xr = x + m0 * K;
    typename E::T* o = out + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 8: block<E, 8>(xr, K, w, bias, N, o); break;
      case 7: block<E, 7>(xr, K, w, bias, N, o); break;
      case 6: block<E, 6>(xr, K, w, bias, N, o); break;
      case 5: block<E, 5>(xr, K, w, bias, N, o); break;
      case 4: block<E, 4>(xr, K, w, bias, N, o); break;
      case 3: block<E, 3>(xr, K, w, bias, N, o); break;
      case 2: block<E, 2>(xr, K, w, bias, N, o); break;
      default: block<E, 1>(xr, K, w, bias, N, o); break;
    }
  }
}

template <class E>
void run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& out) {
  using T = typename E::T;
  rows_against_weight<E>(x.data_ptr<T>(), x.size(0), x.size(1), w.data_ptr<T>(),
                         b.defined() ? b.data_ptr<T>() : nullptr, w.size(0), out.data_ptr<T>());
}
#endif

at::Tensor few_rows_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "few_rows_linear: expected float32 or bfloat16 input and weight of the same dtype, got ", dtype, " and ",
              weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && input.size(-1) == weight.size(1), "few_rows_linear: input [..., ", input.size(-1),
              "] does not match weight ", weight.sizes());
  TORCH_CHECK(!bias || (bias->scalar_type() == dtype && bias->numel() == weight.size(0)),
              "few_rows_linear: expected a ", dtype, " bias of ", weight.size(0), " elements");
#if EVICTLAYERS_AVX512
  // a dtype without loops here (bfloat16 without AVX512-BF16) goes to at::linear before anything is copied
  if (dtype == at::kFloat || EVICTLAYERS_AVX512_BF16) {
    const int64_t K = weight.size(1), N = weight.size(0);
    const at::Tensor x = input.reshape({-1, K}).contiguous(), w = weight.contiguous();
    const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
    auto sizes = input.sizes().vec();
    sizes.back() = N;
    at::Tensor out = at::empty(sizes, input.options());
    if (dtype == at::kFloat) run<Float32>(x, w, b, out);
#if EVICTLAYERS_AVX512_BF16
    else run<BFloat16>(x, w, b, out);
#endif
    return out;
  }
#endif
  return at::linear(input, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(evictlayers, CPU, m) { m.impl("few_rows_linear", &few_rows_linear); }

// torch.utils.cpp_extension.load imports the build as a Python module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorised", [] { return static_cast<bool>(EVICTLAYERS_AVX512); },
        "whether the op runs its AVX-512 loops for float32 (else it computes at::linear)");
  m.def("bfloat16", [] { return static_cast<bool>(EVICTLAYERS_AVX512_BF16); },
        "whether the op runs its AVX512-BF16 loops for bfloat16 (else it computes at::linear)");
}
