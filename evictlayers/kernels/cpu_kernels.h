// What the C++ CPU kernels share (decode/slots_cpu.cpp, quantized_decode/int4_cpu.cpp): addressing a slot row by
// strides, and on AVX2 machines the tree of hadd that reduces 8 vectors of partial sums to one vector.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EVICTLAYERS_AVX2 1
#else
#define EVICTLAYERS_AVX2 0
#endif

namespace evictlayers {

// Where one (b, h) row's slot c starts in a [B, H, C, X] tensor, by its strides.
struct Rows {
  const int64_t* strides;
  int64_t at(int64_t b, int64_t h, int64_t c) const { return b * strides[0] + h * strides[1] + c * strides[2]; }
};

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
#endif

}  // namespace evictlayers
