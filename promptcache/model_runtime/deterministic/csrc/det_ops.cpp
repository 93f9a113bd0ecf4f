// The row-wise ops of a Llama-style decoder layer in one fixed order per row (RMSNorm, the SiLU-gated
// product), and the module that binds the batch-invariant kernels (det_linear.cpp, det_attention.cpp).
// A row's result is computed from that row alone, by the same instructions whatever its place in the
// tensor: no op here splits a row between threads or sends some of its elements down a scalar path.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>

#include "det_common.h"

torch::Tensor det_pack(torch::Tensor w);
torch::Tensor det_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias);
void bind_attention(pybind11::module& m);

namespace {

// 8 elements of a row from `src` (fewer at its end: the rest read as 0), widened to fp32.
template <typename T>
__m256 load_part(const T* src, int64_t count) {
  if (count >= det::kLanes) return det::load8(src);
  alignas(32) float lanes[det::kLanes] = {};
  for (int64_t j = 0; j < count; ++j) lanes[j] = det::to_float(src[j]);
  return _mm256_load_ps(lanes);
}

template <typename T>
void store_part(T* dst, __m256 v, int64_t count) {
  alignas(32) float lanes[det::kLanes];
  _mm256_store_ps(lanes, v);
  for (int64_t j = 0; j < std::min(count, det::kLanes); ++j) det::store(dst + j, lanes[j]);
}

template <typename T>
__m256 round_to(__m256 v) {  // the value a tensor of T holds: bf16 rounds to nearest even, fp32 stays
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(32) float lanes[det::kLanes];
    _mm256_store_ps(lanes, v);
    for (float& x : lanes) x = static_cast<float>(at::BFloat16(x));
    return _mm256_load_ps(lanes);
  }
}

template <typename T>
void rms_norm_typed(const T* x, int64_t x_stride, const T* w, T* y, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      __m256 squares = _mm256_setzero_ps();
      for (int64_t j = 0; j < width; j += det::kLanes) {
        const __m256 v = load_part(xr + j, width - j);  // zeros past the end add +0
        squares = _mm256_fmadd_ps(v, v, squares);
      }
      const float variance = det::hsum(squares) / static_cast<float>(width);
      const __m256 inv_rms = _mm256_set1_ps(1.0f / std::sqrt(variance + eps));
      for (int64_t j = 0; j < width; j += det::kLanes) {
        const __m256 normed = round_to<T>(_mm256_mul_ps(load_part(xr + j, width - j), inv_rms));
        store_part(y + r * width + j, _mm256_mul_ps(load_part(w + j, width - j), normed), width - j);
      }
    }
  });
}

template <typename T>
void silu_mul_typed(const T* gu, int64_t gu_stride, T* y, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gu + r * gu_stride;
      const T* up = gate + width;
      for (int64_t j = 0; j < width; j += det::kLanes) {
        const __m256 g = load_part(gate + j, width - j);
        const __m256 e = det::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = round_to<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        store_part(y + r * width + j, _mm256_mul_ps(silu, load_part(up + j, width - j)), width - j);
      }
    }
  });
}

}  // namespace

// x [N, H], weight [H] (x's dtype) -> weight * round(x * (1 / sqrt(mean(x^2) + eps))), as LlamaRMSNorm.
torch::Tensor det_rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  det::check_float_rows(x, "x");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.numel() == width && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [H] of x's dtype");
  auto y = torch::empty({rows, width}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_typed(x.data_ptr<at::BFloat16>(), x.stride(0), weight.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
                   rows, width, static_cast<float>(eps));
  else
    rms_norm_typed(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), y.data_ptr<float>(), rows, width,
                   static_cast<float>(eps));
  return y;
}

// gate|up [N, 2I] -> round(silu(gate)) * up [N, I], silu(g) = g / (1 + e^-g).
torch::Tensor det_silu_mul(torch::Tensor gate_up) {
  det::check_float_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of features");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto y = torch::empty({rows, width}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_mul_typed(gate_up.data_ptr<at::BFloat16>(), gate_up.stride(0), y.data_ptr<at::BFloat16>(), rows, width);
  else
    silu_mul_typed(gate_up.data_ptr<float>(), gate_up.stride(0), y.data_ptr<float>(), rows, width);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &det_pack, "(w [N, K]) -> panels [ceil(N/16), K, 16]: det_linear's weight layout");
  m.def("linear", &det_linear, "(x [M, K], packed, N, bias or None) -> x W^T + b [M, N], each element one fixed "
        "fp32 FMA chain over K", pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"),
        pybind11::arg("bias") = pybind11::none());
  m.def("rms_norm", &det_rms_norm, "(x [N, H], weight [H], eps) -> LlamaRMSNorm, one fixed order per row");
  m.def("silu_mul", &det_silu_mul, "(gate_up [N, 2I]) -> silu(gate) * up");
  bind_attention(m);
}
