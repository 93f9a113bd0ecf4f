// Weight-only int4 matrix product for few rows (decode) on AVX512-BF16: y = x @ W^T with bf16 activations
// and W held as Q4_1 groups (w = scale * q + minimum per 32 inputs, q in 0..15).
//
// Why: PyTorch's CPU int4 kernel is compute bound at decode's few rows, not bound by reading the weights.
// Here each nibble becomes the bf16 value 128 + q with two
// integer ops (0x4300 | q: every integer 128..255 is exact in bf16), so the group's dot product runs on
// vdpbf16ps with fp32 accumulation, and the 128 comes back out in the per-group fp32 epilogue:
//   y[n] = sum_g scale[n, g] * dot_g(x, 128 + q[n]) + (minimum[n, g] - 128 scale[n, g]) * sum_g(x).
// Each weight load serves up to 8 rows held in registers. Scales and minimums are held as fp16 when every
// one of them is an fp16 value (GGUF's Q4_1 stores them so): a fifth fewer bytes a step than fp32, the
// bytes a decode waits on; the epilogue widens them, and its fp32 arithmetic is the same either way.
//
// Packed layout (int4_pack), per block of 16 output channels and per 8 inputs (k = 8t..8t+7), 64 bytes:
// 16-bit word 2j + e holds channel j's q[8t + 2n + e] in its nibble n (bits 4n..4n+3). A shift and one
// vpternlogd per n give, in dword j, the bf16 pair for inputs (8t + 2n, 8t + 2n + 1): what vdpbf16ps
// multiplies by a broadcast x pair. No conversion or shuffle: 7 integer ops expand 128 weights.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "weights_bf16.h"

namespace {

using weights::load16;
using weights::x_pair;

constexpr int64_t kGroup = 32;      // inputs per scale and minimum
constexpr int64_t kBlock = 16;      // output channels per block: fp32 lanes of a zmm register
constexpr int64_t kOctetBytes = 64;  // one block's 16 x 8 nibbles
constexpr int64_t kGroupBytes = kOctetBytes * kGroup / 8;
constexpr float kOffset = 128.0f;   // the expanded nibble is 128 + q
constexpr int kMaxRows = 8;         // rows per pass, in registers

// One pass over the block of 16 output channels `block` for ROWS rows.
template <int ROWS, typename Scale>
void int4_pass(const at::BFloat16* x, int64_t x_stride, const float* row_sums, int64_t groups,
               const uint8_t* packed, const Scale* scales, const Scale* minimums, int64_t block,
               at::BFloat16* y, int64_t y_stride) {
  const __m512i low_mask = _mm512_set1_epi16(0x000F);
  const __m512i exponent = _mm512_set1_epi16(0x4300);  // bf16 128.0
  const uint8_t* block_weights = packed + block * groups * kGroupBytes;
  __m512 total[ROWS];
  weights::zero(total);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[ROWS];
    weights::zero(acc);
    weights::prefetch(block_weights + (g + 2) * kGroupBytes, kGroupBytes);
    for (int64_t t = 0; t < kGroup / 8; ++t) {
      const int64_t k = g * kGroup + 8 * t;
      const __m512i words = _mm512_loadu_si512(block_weights + g * kGroupBytes + t * kOctetBytes);
      for (int n = 0; n < 4; ++n) {
        // ((words >> 4n) & 0xF) | 0x4300: the bf16 values 128 + q
        const __m512i pairs = _mm512_ternarylogic_epi32(n == 0 ? words : _mm512_srli_epi16(words, 4 * n), low_mask,
                                                        exponent, 0xEA);  // (a & b) | c
        for (int r = 0; r < ROWS; ++r)
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)x_pair(x + r * x_stride + k + 2 * n), (__m512bh)pairs);
      }
    }
    const int64_t at = (block * groups + g) * kBlock;
    const __m512 scale = load16(scales + at);
    const __m512 minimum = _mm512_fnmadd_ps(_mm512_set1_ps(kOffset), scale, load16(minimums + at));  // m - 128 s
    for (int r = 0; r < ROWS; ++r) {
      total[r] = _mm512_fmadd_ps(acc[r], scale, total[r]);
      total[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(row_sums[r * groups + g]), total[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + block * kBlock),
                        (__m256i)_mm512_cvtneps_pbh(total[r]));
}

template <int ROWS, typename Scale>
void int4_rows(const at::BFloat16* x, int64_t x_stride, const float* row_sums, int64_t groups,
               const uint8_t* packed, const Scale* scales, const Scale* minimums, int64_t num_blocks,
               at::BFloat16* y, int64_t y_stride) {
  weights::over_blocks(num_blocks, [&](int64_t block) {
    int4_pass<ROWS, Scale>(x, x_stride, row_sums, groups, packed, scales, minimums, block, y, y_stride);
  });
}

template <typename Scale>
using RowsFn = void (*)(const at::BFloat16*, int64_t, const float*, int64_t, const uint8_t*, const Scale*,
                        const Scale*, int64_t, at::BFloat16*, int64_t);
template <typename Scale>
constexpr RowsFn<Scale> kRowsFns[kMaxRows] = {int4_rows<1, Scale>, int4_rows<2, Scale>, int4_rows<3, Scale>,
                                              int4_rows<4, Scale>, int4_rows<5, Scale>, int4_rows<6, Scale>,
                                              int4_rows<7, Scale>, int4_rows<8, Scale>};

// (values uint8 [out, in] 0..15, scales fp32 [out, in / 32], minimums fp32 [out, in / 32])
//   -> [packed uint8 [out / 16, in / 8, 64], scales [out / 16, in / 32, 16], minimums (same)], scales and
//   minimums fp16 where both are exactly fp16 values, else fp32
std::vector<torch::Tensor> int4_pack(torch::Tensor values, torch::Tensor scales, torch::Tensor minimums) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == torch::kUInt8, "values: uint8 [out, in]");
  const int64_t out = values.size(0), in = values.size(1);
  TORCH_CHECK(out % kBlock == 0 && in % kGroup == 0, "int4_pack needs out % 16 == 0 and in % 32 == 0");
  const int64_t groups = in / kGroup, blocks = out / kBlock;
  TORCH_CHECK(scales.sizes() == minimums.sizes() && scales.size(0) == out && scales.size(1) == groups,
              "scales and minimums: [out, in / 32]");
  auto q = values.contiguous();
  auto s = scales.to(torch::kFloat32).contiguous(), m = minimums.to(torch::kFloat32).contiguous();
  auto packed = torch::empty({blocks, in / 8, kOctetBytes}, torch::kUInt8);
  const uint8_t* src = q.data_ptr<uint8_t>();
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<uint8_t>());
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t t = 0; t < in / 8; ++t)
      for (int64_t j = 0; j < kBlock; ++j)
        for (int64_t e = 0; e < 2; ++e) {
          const uint8_t* row = src + (b * kBlock + j) * in + 8 * t + e;
          uint16_t word = 0;
          for (int n = 0; n < 4; ++n) word |= static_cast<uint16_t>((row[2 * n] & 0x0F) << (4 * n));
          dst[(b * (in / 8) + t) * (kOctetBytes / 2) + 2 * j + e] = word;
        }
  // [out, G] -> [out / 16, G, 16]: one zmm of scales per block and group
  auto block_major = [&](const torch::Tensor& t) {
    return t.view({blocks, kBlock, groups}).transpose(1, 2).contiguous();
  };
  const bool fp16_exact = torch::equal(s.to(torch::kHalf).to(torch::kFloat32), s) &&
                          torch::equal(m.to(torch::kHalf).to(torch::kFloat32), m);
  const auto held = fp16_exact ? torch::kHalf : torch::kFloat32;
  return {packed, block_major(s).to(held), block_major(m).to(held)};
}

// (x bf16 [rows, in], the three tensors of int4_pack) -> y bf16 [rows, out]
torch::Tensor int4_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x: bf16 [rows, in]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
              packed.size(2) == kOctetBytes, "packed: int4_pack's uint8 [out / 16, in / 8, 64]");
  const int64_t rows = x.size(0), in = x.size(1), blocks = packed.size(0), groups = in / kGroup;
  TORCH_CHECK(in % kGroup == 0 && packed.size(1) * 8 == in, "x's inputs do not match the packed weight");
  const auto held = scales.scalar_type();
  for (const auto& t : {scales, minimums})
    TORCH_CHECK((held == torch::kFloat32 || held == torch::kHalf) && t.scalar_type() == held &&
                t.is_contiguous() && t.size(0) == blocks && t.size(1) == groups && t.size(2) == kBlock,
                "scales / minimums: int4_pack's [out / 16, in / 32, 16], both fp32 or both fp16");
  if (x.stride(1) != 1) x = x.contiguous();
  auto y = torch::empty({rows, blocks * kBlock}, x.options());
  if (rows == 0) return y;
  const auto* xp = x.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  // Per row and group, the sum of x (fp32 over the bf16 values): the minimums' term. Summed here, not by
  // a torch op: at decode's one row the op's dispatch cost more than the sums.
  std::vector<float> row_sums(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const at::BFloat16* xg = xp + r * x.stride(0) + g * kGroup;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = 0; k < kGroup; k += 16)
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + k))), 16)));
      row_sums[r * groups + g] = _mm512_reduce_add_ps(sum);
    }
  const float* sums = row_sums.data();
  for (int64_t row = 0; row < rows; row += kMaxRows) {
    const int64_t n = std::min<int64_t>(kMaxRows, rows - row);
    if (held == torch::kHalf)
      kRowsFns<at::Half>[n - 1](xp + row * x.stride(0), x.stride(0), sums + row * groups, groups,
                                packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), minimums.data_ptr<at::Half>(),
                                blocks, yp + row * y.stride(0), y.stride(0));
    else
      kRowsFns<float>[n - 1](xp + row * x.stride(0), x.stride(0), sums + row * groups, groups,
                             packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), minimums.data_ptr<float>(),
                             blocks, yp + row * y.stride(0), y.stride(0));
  }
  return y;
}

}  // namespace

void bind_int4(pybind11::module_& m) {
  m.def("int4_pack", &int4_pack, "(values uint8 [out, in] 0..15, scales fp32 [out, in/32], minimums fp32 "
        "[out, in/32]) -> [packed, scales, minimums]: Q4_1 blocks in int4_mm's layout (out % 16 == 0)");
  m.def("int4_mm", &int4_mm, "(x bf16 [rows, in], packed, scales, minimums) -> y bf16 [rows, out]: "
        "x @ W^T for int4_pack's weight, made for few rows (decode)");
}
