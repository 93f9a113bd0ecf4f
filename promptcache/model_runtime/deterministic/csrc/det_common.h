// Shared pieces of the batch-invariant kernels (AVX2 + FMA): fp32 and bf16 loads, one horizontal sum, one
// exponential. Every result these kernels produce for a row is a fixed sequence of IEEE operations on that
// row's inputs alone; the helpers here are written once and used everywhere so that no two code paths can
// round differently. Built with -ffp-contract=off: the compiler fuses nothing the source does not.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>

namespace det {

constexpr int64_t kLanes = 8;  // fp32 lanes of a ymm register

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32 is exact: the bits shifted into the high half
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// fp32 -> the output type: bf16 rounds to nearest even (c10's conversion, as PyTorch rounds).
inline void store(float* p, float x) { *p = x; }
inline void store(at::BFloat16* p, float x) { *p = at::BFloat16(x); }

// The sum of a vector's 8 lanes in one fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float hsum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // i + (i+4)
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));                      // (0+4)+(2+6), ...
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps(quarter, quarter, 1)));
}

// e^x in fp32 within ~2 ulp, lane by lane (a lane's result never depends on the others): x = n ln2 + r,
// |r| <= ln2/2 (Cody-Waite), a degree-7 polynomial for e^r, 2^n built in the exponent bits. Inputs are
// clamped to [-87, 88]: e^x of a very negative x is ~1e-38, not 0 (callers skip what must count 0).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

inline void check_float_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), name,
              " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, features] with contiguous rows");
}

}  // namespace det
