// The fused decoder layer's element-wise ops in fp32 on AVX2 + FMA, one call each instead of a handful of ATen ops
// (a decode step of a small model is bound by the calls, not the arithmetic): RMSNorm, the SiLU gate, RoPE of q and k.
// fp32 throughout, as the HF modules compute an fp32 model (sums in another order: a few ulps apart).
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, name,
              " must be float32 [N, width] with a contiguous last dim");
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace

// x [N, H] -> weight * (x * rsqrt(mean(x^2) + eps)), LlamaRMSNorm in fp32.
torch::Tensor rms_norm_f32(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(width % kLanes == 0 && weight.numel() == width && weight.is_contiguous() &&
              weight.scalar_type() == at::kFloat, "weight must be a contiguous float32 [H], H a multiple of 8");
  auto out = torch::empty({rows, width}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = xp + row * x_stride;
      __m256 squares = _mm256_setzero_ps();
      for (int64_t j = 0; j < width; j += kLanes) {
        const __m256 v = _mm256_loadu_ps(xr + j);
        squares = _mm256_fmadd_ps(v, v, squares);
      }
      const float variance = hsum(squares) / static_cast<float>(width);
      const __m256 inv_rms = _mm256_set1_ps(1.0f / std::sqrt(variance + static_cast<float>(eps)));
      for (int64_t j = 0; j < width; j += kLanes)
        _mm256_storeu_ps(op + row * width + j,
                         _mm256_mul_ps(_mm256_loadu_ps(wp + j), _mm256_mul_ps(_mm256_loadu_ps(xr + j), inv_rms)));
    }
  });
  return out;
}

// gate_up [N, 2I] (gate | up) -> [N, I]: silu(gate) * up.
torch::Tensor silu_mul_f32(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's width must be even");
  auto out = torch::empty({rows, width}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gr = gp + row * stride;
      for (int64_t j = 0; j < width; ++j) {  // std::exp: the library's accuracy, vectorized by the compiler or not
        const float g = gr[j];
        op[row * width + j] = g / (1.0f + std::exp(-g)) * gr[width + j];
      }
    }
  });
  return out;
}

// qkv [N, (H + 2 H_kv) D] (q | k | v per token), cos and sin [N, D] -> [q [N, H, D], k [N, H_kv, D]] rotated as
// apply_rotary_pos_emb rotates them: x * cos + rotate_half(x) * sin.
std::vector<torch::Tensor> rope_qk_f32(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                                       int64_t kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = qkv.size(0), dim = cos.size(1), half = dim / 2;
  TORCH_CHECK(half % kLanes == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim && cos.size(0) == rows &&
              sin.sizes() == cos.sizes(), "qkv [N, (H + 2 H_kv) D] with cos/sin [N, D], D a multiple of 16");
  auto q = torch::empty({rows, heads, dim}, qkv.options());
  auto k = torch::empty({rows, kv_heads, dim}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const int64_t x_stride = qkv.stride(0), c_stride = cos.stride(0), s_stride = sin.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* c = cp + row * c_stride;
      const float* s = sp + row * s_stride;
      for (int64_t head = 0; head < heads + kv_heads; ++head) {
        const float* x = xp + row * x_stride + head * dim;
        float* o = head < heads ? qp + (row * heads + head) * dim : kp + (row * kv_heads + head - heads) * dim;
        for (int64_t j = 0; j < half; j += kLanes) {
          const __m256 x1 = _mm256_loadu_ps(x + j), x2 = _mm256_loadu_ps(x + half + j);
          // first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (rotate_half = [-x2, x1]); each product
          // rounded before the sum, as the module's two multiplies and one add
          const __m256 lo = _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + j)),
                                          _mm256_mul_ps(x2, _mm256_loadu_ps(s + j)));
          const __m256 hi = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + j)),
                                          _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + j)));
          _mm256_storeu_ps(o + j, lo);
          _mm256_storeu_ps(o + half + j, hi);
        }
      }
    }
  });
  return {q, k};
}

void bind_fused(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm_f32, "(x [N, H], weight [H], eps) -> LlamaRMSNorm in fp32");
  m.def("silu_mul", &silu_mul_f32, "(gate_up [N, 2I]) -> silu(gate) * up in fp32");
  m.def("rope_qk", &rope_qk_f32, "(qkv [N, (H + 2 H_kv) D], cos [N, D], sin [N, D], H, H_kv) -> [q, k] rotated");
}
