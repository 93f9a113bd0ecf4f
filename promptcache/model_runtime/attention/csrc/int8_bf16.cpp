// Weight-only int8 matrix product for few rows (decode, a short question) on AVX512-BF16: y = x @ W^T with bf16
// activations and W held as a GGUF's 8-bit blocks (w = scale * q per G inputs, q int8; G = 32 for Q8_0 and Q5_0,
// 16 for Q6_K's sub-blocks).
//
// Why: a small model's decode step waits on reading its weights. Widened to bf16 they are 2 bytes a weight; as
// stored, one byte plus a scale per group. Every int8 is exact in bf16, so each group's dot product runs on
// vdpbf16ps with fp32 accumulation over the very integers the file holds, and its scale multiplies the group's
// fp32 sum: y[n] = sum_g scale[n, g] * dot_g(x, q[n]). The products are exact; the sums round in fp32.
//
// Packed layout (int8_pack), per block of 16 output channels and per pair of inputs (k = 2t, 2t + 1), 32 bytes:
// byte 2j + e is channel j's q[2t + e]. Sign-extended to dwords and converted to fp32 in two halves, then joined
// by vcvtne2ps2bf16, the bytes land as bf16 words in their own order: dword j is channel j's pair, what
// vdpbf16ps multiplies by a broadcast x pair. Each conversion serves up to 8 rows held in registers.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "weights_bf16.h"

namespace {

using weights::load16;
using weights::x_pair;

constexpr int64_t kBlock = 16;     // output channels per block: fp32 lanes of a zmm register
constexpr int64_t kPairBytes = 32;  // one block's 16 x 2 int8 values
constexpr int kMaxRows = 8;        // rows per pass, in registers

// 16 int8 values at p -> 16 fp32 (exact)
inline __m512 to_fp32(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 32 int8 values -> 32 bf16 words in the same order (exact: |q| <= 128)
inline __m512bh widen(const uint8_t* p) { return _mm512_cvtne2ps_pbh(to_fp32(p + 16), to_fp32(p)); }

// One pass over the block of 16 output channels `block` for ROWS rows; `group`: inputs per scale.
template <int ROWS, typename Scale>
void int8_pass(const at::BFloat16* x, int64_t x_stride, int64_t groups, int64_t group, const uint8_t* packed,
               const Scale* scales, int64_t block, at::BFloat16* y, int64_t y_stride) {
  const int64_t pairs = group / 2, group_bytes = pairs * kPairBytes;
  const uint8_t* block_weights = packed + block * groups * group_bytes;
  __m512 total[ROWS];
  weights::zero(total);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[ROWS];
    weights::zero(acc);
    weights::prefetch(block_weights + (g + 2) * group_bytes, group_bytes);
    for (int64_t t = 0; t < pairs; ++t) {
      const int64_t k = g * group + 2 * t;
      const __m512bh w = widen(block_weights + g * group_bytes + t * kPairBytes);
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)x_pair(x + r * x_stride + k), w);
    }
    const __m512 scale = load16(scales + (block * groups + g) * kBlock);
    for (int r = 0; r < ROWS; ++r) total[r] = _mm512_fmadd_ps(acc[r], scale, total[r]);
  }
  for (int r = 0; r < ROWS; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + block * kBlock),
                        (__m256i)_mm512_cvtneps_pbh(total[r]));
}

template <int ROWS, typename Scale>
void int8_rows(const at::BFloat16* x, int64_t x_stride, int64_t groups, int64_t group, const uint8_t* packed,
               const Scale* scales, int64_t num_blocks, at::BFloat16* y, int64_t y_stride) {
  weights::over_blocks(num_blocks, [&](int64_t block) {
    int8_pass<ROWS, Scale>(x, x_stride, groups, group, packed, scales, block, y, y_stride);
  });
}

template <typename Scale>
using RowsFn = void (*)(const at::BFloat16*, int64_t, int64_t, int64_t, const uint8_t*, const Scale*, int64_t,
                        at::BFloat16*, int64_t);
template <typename Scale>
constexpr RowsFn<Scale> kRowsFns[kMaxRows] = {int8_rows<1, Scale>, int8_rows<2, Scale>, int8_rows<3, Scale>,
                                              int8_rows<4, Scale>, int8_rows<5, Scale>, int8_rows<6, Scale>,
                                              int8_rows<7, Scale>, int8_rows<8, Scale>};

// (values int8 [out, in], scales fp32 [out, in / G]) -> [packed uint8 [out / 16, in / 2, 32], scales
// [out / 16, in / G, 16]], the scales fp16 where every one is an fp16 value (Q8_0's and Q5_0's), else fp32
std::vector<torch::Tensor> int8_pack(torch::Tensor values, torch::Tensor scales) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == torch::kInt8, "values: int8 [out, in]");
  const int64_t out = values.size(0), in = values.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out && scales.size(1) > 0 && in % scales.size(1) == 0,
              "scales: [out, in / G]");
  const int64_t groups = scales.size(1), group = in / groups, blocks = out / kBlock;
  TORCH_CHECK(out % kBlock == 0 && in % 16 == 0 && group % 2 == 0,
              "int8_pack needs out % 16 == 0, in % 16 == 0 and an even group");
  // [out, in] -> [out / 16, 16, in / 2, 2] -> [out / 16, in / 2, 16, 2]: byte 2j + e of pair t is q[j][2t + e]
  auto packed = values.contiguous().view({blocks, kBlock, in / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  auto s = scales.to(torch::kFloat32).contiguous();
  auto block_major = s.view({blocks, kBlock, groups}).transpose(1, 2).contiguous();  // [out / 16, G, 16]
  const bool fp16_exact = torch::equal(s.to(torch::kHalf).to(torch::kFloat32), s);
  return {packed.view(torch::kUInt8).view({blocks, in / 2, kPairBytes}),
          block_major.to(fp16_exact ? torch::kHalf : torch::kFloat32)};
}

void check_packed(const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.size(2) == kPairBytes, "packed: int8_pack's uint8 [out / 16, in / 2, 32]");
  const auto held = scales.scalar_type();
  TORCH_CHECK((held == torch::kFloat32 || held == torch::kHalf) && scales.dim() == 3 && scales.is_contiguous() &&
              scales.size(0) == packed.size(0) && scales.size(2) == kBlock && scales.size(1) > 0 &&
              (packed.size(1) * 2) % scales.size(1) == 0,
              "scales: int8_pack's [out / 16, in / G, 16], fp32 or fp16");
}

// (x bf16 [rows, in], the two tensors of int8_pack) -> y bf16 [rows, out]
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x: bf16 [rows, in]");
  check_packed(packed, scales);
  const int64_t rows = x.size(0), in = x.size(1), blocks = packed.size(0), groups = scales.size(1);
  TORCH_CHECK(packed.size(1) * 2 == in, "x's inputs do not match the packed weight");
  const int64_t group = in / groups;
  if (x.stride(1) != 1) x = x.contiguous();
  auto y = torch::empty({rows, blocks * kBlock}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  for (int64_t row = 0; row < rows; row += kMaxRows) {
    const int64_t n = std::min<int64_t>(kMaxRows, rows - row);
    if (scales.scalar_type() == torch::kHalf)
      kRowsFns<at::Half>[n - 1](xp + row * x.stride(0), x.stride(0), groups, group, packed.data_ptr<uint8_t>(),
                                scales.data_ptr<at::Half>(), blocks, yp + row * y.stride(0), y.stride(0));
    else
      kRowsFns<float>[n - 1](xp + row * x.stride(0), x.stride(0), groups, group, packed.data_ptr<uint8_t>(),
                             scales.data_ptr<float>(), blocks, yp + row * y.stride(0), y.stride(0));
  }
  return y;
}

// (the two tensors of int8_pack) -> W bf16 [out, in]: bf16(scale * q) per weight (the fp32 product is exact for
// fp16 scales), what a bf16 copy of the widened checkpoint holds; for many rows, multiplied through oneDNN.
torch::Tensor int8_dequantize(torch::Tensor packed, torch::Tensor scales) {
  check_packed(packed, scales);
  const int64_t blocks = packed.size(0), in = packed.size(1) * 2, groups = scales.size(1), group = in / groups;
  auto s = scales.to(torch::kFloat32);
  auto w = torch::empty({blocks * kBlock, in}, torch::TensorOptions().dtype(torch::kBFloat16));
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  auto* wp = w.data_ptr<at::BFloat16>();
  // lane 2j + e of a widened half holds channel j's (of its 8) value: its scale is lane / 2's
  const __m512i low_channels = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i high_channels = _mm512_add_epi32(low_channels, _mm512_set1_epi32(8));
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t pairs[kBlock];
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        const __m512 scale = _mm512_loadu_ps(sp + (b * groups + g) * kBlock);
        const __m512 low_scale = _mm512_permutexvar_ps(low_channels, scale);
        const __m512 high_scale = _mm512_permutexvar_ps(high_channels, scale);
        for (int64_t t = g * group / 2; t < (g + 1) * group / 2; ++t) {
          const uint8_t* p = qp + (b * (in / 2) + t) * kPairBytes;
          const __m512 low = _mm512_mul_ps(to_fp32(p), low_scale), high = _mm512_mul_ps(to_fp32(p + 16), high_scale);
          _mm512_store_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(high, low));  // dword j: channel j's two weights
          for (int64_t j = 0; j < kBlock; ++j) std::memcpy(wp + (b * kBlock + j) * in + 2 * t, pairs + j, 4);
        }
      }
  });
  return w;
}

}  // namespace

void bind_int8(pybind11::module_& m) {
  m.def("int8_pack", &int8_pack, "(values int8 [out, in], scales fp32 [out, in / G]) -> [packed, scales]: 8-bit "
        "blocks in int8_mm's layout (out % 16 == 0, G even)");
  m.def("int8_mm", &int8_mm, "(x bf16 [rows, in], packed, scales) -> y bf16 [rows, out]: x @ W^T for int8_pack's "
        "weight, made for few rows (decode)");
  m.def("int8_dequantize", &int8_dequantize, "(packed, scales) -> W bf16 [out, in]: bf16(scale * q)");
}
