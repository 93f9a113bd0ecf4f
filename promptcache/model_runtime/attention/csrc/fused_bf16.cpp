// Fused bf16 element-wise ops of a Llama-style decoder layer for AVX512-BF16 CPUs: RMSNorm, RoPE on the
// packed q|k|v projection, and the SiLU-gated product of the packed gate|up projection.
//
// Why: after the attention kernel (flash_bf16.cpp), the element-wise ops that PyTorch runs one pass each
// (RMSNorm alone is seven: cast, square, mean, add, rsqrt, multiply, cast, multiply by the weight) were the
// largest part of a small model's bf16 prefill that bf16 did not speed up. Each op here is one pass over
// its rows, and rounds to bf16 exactly where the Hugging Face modules do (a product of two bf16 values
// is exact in fp32, so `round(round(x * cos) + round(rot(x) * sin))` reproduces their RoPE bit for bit;
// RMSNorm and SiLU differ only where fp32 sums or exponentials differ in the last bit before a rounding).
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int64_t kLanes = 16;  // fp32 lanes of a zmm register

inline __m512 load_bf16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // round to nearest even

inline void store_bf16(at::BFloat16* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }

inline __m512 round_bf16(__m512 x) {  // x rounded to bf16 and widened back: the value PyTorch would hold
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

// e^x in fp32 within ~2 ulp: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite), a degree-7 polynomial for e^r,
// then 2^n by vscalefps, which also gives +inf and 0 where e^x leaves the fp32 range.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(200.0f)), _mm512_set1_ps(-200.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), name, " must be a bf16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, features] with contiguous rows");
}

// Each row of x [N, H] (H a multiple of 16) with its 1 / sqrt(mean(x^2) + eps) in fp32, handed to
// `write(out_row, x_row, inv_rms)`, which scales and rounds it as its norm does.
template <class Write>
torch::Tensor normalise_rows(const torch::Tensor& x, double eps, Write write) {
  const int64_t rows = x.size(0), width = x.size(1), x_stride = x.stride(0);
  auto out = torch::empty({rows, width}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const at::BFloat16* xr = xp + row * x_stride;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t j = 0; j < width; j += kLanes) {
        __m512 v = load_bf16(xr + j);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float variance = _mm512_reduce_add_ps(squares) / static_cast<float>(width);
      write(op + row * width, xr, _mm512_set1_ps(1.0f / std::sqrt(variance + static_cast<float>(eps))));
    }
  });
  return out;
}

// gate_up [N, 2I] (gate | up) -> [N, I]: bf16(act(gate)) * up, `act` computing 16 lanes in fp32 (rounded to bf16 after,
// as a bf16 activation module rounds its output before the product).
template <class Activation>
torch::Tensor gated_product(const torch::Tensor& gate_up, Activation act) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % (2 * kLanes) == 0, "gate_up's width must be a multiple of 32");
  auto out = torch::empty({rows, width}, gate_up.options());
  const auto* gp = gate_up.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const at::BFloat16* gr = gp + row * stride;
      for (int64_t j = 0; j < width; j += kLanes)
        store_bf16(op + row * width + j, _mm512_mul_ps(round_bf16(act(load_bf16(gr + j))), load_bf16(gr + width + j)));
    }
  });
  return out;
}

}  // namespace

// x [N, H], weight [H] -> [N, H]: weight * bf16(x * rsqrt(mean(x^2) + eps)), as LlamaRMSNorm in bf16.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t width = x.size(1);
  TORCH_CHECK(width % kLanes == 0 && weight.numel() == width && weight.is_contiguous() &&
              weight.scalar_type() == at::kBFloat16, "weight must be a contiguous bf16 [H], H a multiple of 16");
  const auto* wp = weight.data_ptr<at::BFloat16>();
  return normalise_rows(x, eps, [&](at::BFloat16* out, const at::BFloat16* xr, __m512 inv_rms) {
    for (int64_t j = 0; j < width; j += kLanes) {
      __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(xr + j), inv_rms));
      store_bf16(out + j, _mm512_mul_ps(load_bf16(wp + j), normed));
    }
  });
}

// x [N, H], scale [H] fp32 -> [N, H]: bf16(x * rsqrt(mean(x^2) + eps) * scale) in fp32, rounded once, as Gemma's
// RMSNorm in bf16 (it upcasts x, scales by 1 + w in fp32 and casts back).
torch::Tensor rms_norm_scaled(torch::Tensor x, torch::Tensor scale, double eps) {
  check_rows(x, "x");
  const int64_t width = x.size(1);
  TORCH_CHECK(width % kLanes == 0 && scale.numel() == width && scale.is_contiguous() &&
              scale.scalar_type() == at::kFloat, "scale must be a contiguous fp32 [H], H a multiple of 16");
  const auto* sp = scale.data_ptr<float>();
  return normalise_rows(x, eps, [&](at::BFloat16* out, const at::BFloat16* xr, __m512 inv_rms) {
    for (int64_t j = 0; j < width; j += kLanes)
      store_bf16(out + j, _mm512_mul_ps(_mm512_mul_ps(load_bf16(xr + j), inv_rms), _mm512_loadu_ps(sp + j)));
  });
}

// gate_up [N, 2I] (gate | up) -> [N, I]: bf16(silu(gate)) * up, as act_fn(gate_proj(x)) * up_proj(x) in bf16.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return gated_product(gate_up, [&](__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  });
}

// gate_up [N, 2I] (gate | up) -> [N, I]: bf16(gelu_tanh(gate)) * up, as Gemma's act_fn(gate_proj(x)) * up_proj(x) in
// bf16, by PyTorch's formula in fp32: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), so that 1 + tanh rounds
// where its rounds (for large negative g that sum cancels: the formula's value, not gelu's, is what HF computes).
// tanh(u) = sign(u) d / (d + 2) with d = e^2|u| - 1 (Sleef's form, whose tanh PyTorch calls: near -1 both round
// alike), and +-1 from |u| > 8.664339742 on, as Sleef's.
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f), half = _mm512_set1_ps(0.5f);
  const __m512 kappa = _mm512_set1_ps(0.044715f), beta = _mm512_set1_ps(0.7978845608028654f);  // sqrt(2 / pi)
  const __m512 limit = _mm512_set1_ps(8.664339742f);
  return gated_product(gate_up, [&](__m512 g) {
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(g, _mm512_mul_ps(kappa, cube)));
    const __m512 magnitude = _mm512_abs_ps(inner);
    // past the limit d may be inf and d / (d + 2) NaN: the blend takes 1 there
    const __m512 d = _mm512_sub_ps(exp_ps(_mm512_add_ps(magnitude, magnitude)), one);
    const __m512 y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(magnitude, limit, _CMP_GT_OQ),
                                          _mm512_div_ps(d, _mm512_add_ps(d, two)), one);
    const __m512 tanh = _mm512_mask_sub_ps(y, _mm512_cmp_ps_mask(inner, _mm512_setzero_ps(), _CMP_LT_OQ),
                                           _mm512_setzero_ps(), y);
    return _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, tanh));
  });
}

// qkv [N, (H + 2 H_kv) D] (q | k | v per token), cos and sin [N, D] -> [q [N, H, D], k [N, H_kv, D]] rotated:
// round(round(x * cos) + round(rotate_half(x) * sin)) per element, as apply_rotary_pos_emb in bf16.
std::vector<torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                                   int64_t kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = qkv.size(0), dim = cos.size(1), half = dim / 2;
  TORCH_CHECK(half % kLanes == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim && cos.size(0) == rows &&
              sin.sizes() == cos.sizes(), "qkv [N, (H + 2 H_kv) D] with cos/sin [N, D], D a multiple of 32");
  auto q = torch::empty({rows, heads, dim}, qkv.options());
  auto k = torch::empty({rows, kv_heads, dim}, qkv.options());
  const auto* xp = qkv.data_ptr<at::BFloat16>();
  const auto* cp = cos.data_ptr<at::BFloat16>();
  const auto* sp = sin.data_ptr<at::BFloat16>();
  auto* qp = q.data_ptr<at::BFloat16>();
  auto* kp = k.data_ptr<at::BFloat16>();
  const int64_t x_stride = qkv.stride(0), c_stride = cos.stride(0), s_stride = sin.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const at::BFloat16* c = cp + row * c_stride;
      const at::BFloat16* s = sp + row * s_stride;
      for (int64_t head = 0; head < heads + kv_heads; ++head) {
        const at::BFloat16* x = xp + row * x_stride + head * dim;
        at::BFloat16* o = head < heads ? qp + (row * heads + head) * dim : kp + (row * kv_heads + head - heads) * dim;
        for (int64_t j = 0; j < half; j += kLanes) {
          __m512 x1 = load_bf16(x + j), x2 = load_bf16(x + half + j);
          // first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (rotate_half = [-x2, x1])
          __m512 lo = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, load_bf16(c + j))),
                                    round_bf16(_mm512_mul_ps(x2, load_bf16(s + j))));
          __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, load_bf16(c + half + j))),
                                    round_bf16(_mm512_mul_ps(x1, load_bf16(s + half + j))));
          store_bf16(o + j, lo);
          store_bf16(o + half + j, hi);
        }
      }
    }
  });
  return {q, k};
}

// KeyShifter.shift_into in one pass: keys [B, n, D] (rotate-half RoPE layout) moved by per-token angles
// whose cos and sin (bf16, [n, R/2]) are given, written into out (same shape, may be a strided view):
// round(round(x1 cos) - x2 sin), round(round(x2 cos) + x1 sin), as its mul and addcmul_ round in bf16;
// dimensions past R (partial rotary) copied.
void shift_keys(torch::Tensor out, torch::Tensor keys, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && keys.dim() == 3 &&
              out.sizes() == keys.sizes() && keys.stride(2) == 1 && out.stride(2) == 1,
              "keys and out must be bf16 [B, n, D] with a contiguous last dim");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t batch = keys.size(0), n = keys.size(1), dim = keys.size(2), half = cos.size(1);
  TORCH_CHECK(half % kLanes == 0 && 2 * half <= dim && cos.size(0) == n && sin.sizes() == cos.sizes(),
              "cos/sin [n, R/2] with R/2 a multiple of 16 and R <= D");
  const auto* kp = keys.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const auto* cp = cos.data_ptr<at::BFloat16>();
  const auto* sp = sin.data_ptr<at::BFloat16>();
  at::parallel_for(0, batch * n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n, t = item % n;
      const at::BFloat16* x = kp + b * keys.stride(0) + t * keys.stride(1);
      at::BFloat16* o = op + b * out.stride(0) + t * out.stride(1);
      const at::BFloat16* c = cp + t * cos.stride(0);
      const at::BFloat16* s = sp + t * sin.stride(0);
      for (int64_t j = 0; j < half; j += kLanes) {
        __m512 x1 = load_bf16(x + j), x2 = load_bf16(x + half + j), cj = load_bf16(c + j), sj = load_bf16(s + j);
        store_bf16(o + j, _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, cj)), _mm512_mul_ps(x2, sj)));
        store_bf16(o + half + j, _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, cj)), _mm512_mul_ps(x1, sj)));
      }
      for (int64_t j = 2 * half; j < dim; ++j) o[j] = x[j];
    }
  });
}
