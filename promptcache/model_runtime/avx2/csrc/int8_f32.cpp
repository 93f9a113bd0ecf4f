// Weight-only int8 matrix product for few rows on AVX2 + FMA: y = x @ W^T with fp32 activations and W held as Q8_0
// groups (w = scale * q per G inputs, q in -128..127; G = 32, or 16 for Q6_K's sub-blocks): a GGUF's output head and
// its 8-bit (Q8_0, Q5_0) and 6-bit (Q6_K) projections as the file stores them.
//
// Why: the head is the largest matrix of a small model (Gemma 3 270M: 262K x 640), read once per decode step. Widened
// to fp32 it is 4x the file's bytes; as two 4-bit planes (what the int4 product takes) it is the bytes but twice the
// arithmetic. Here each byte becomes an fp32 lane with one sign extension and one conversion:
//   y[n] = sum_g scale[n, g] * dot_g(x, q[n]),   exact weights in fp32 (an fp16 scale times an int8 fits 24 bits).
//
// Packed layout (int8_pack), per block of 8 output channels and per 8 inputs (k = 8t..8t+7), 64 bytes: byte 8n + j is
// channel j's q[8t + n], so the 8 bytes at 8n are the 8 channels' weights for input 8t + n.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kBlock = 8;        // output channels per block: fp32 lanes of a ymm register
constexpr int64_t kOctetBytes = 64;  // one block's 8 x 8 bytes
constexpr int kMaxRows = 4;          // rows per pass, in registers
constexpr int64_t kAhead = 4;        // groups of 32 inputs prefetched ahead of the one computed

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// GROUP: inputs per scale (32 or 16)
template <int GROUP, int ROWS, int BLOCKS, typename Scale>
void int8_pass(const float* x, int64_t x_stride, int64_t groups, const int8_t* packed, const Scale* scales,
               int64_t block, float* y, int64_t y_stride) {
  constexpr int64_t kOctets = GROUP / 8;
  constexpr int64_t kAheadGroups = kAhead * 32 / GROUP;  // the same bytes ahead whatever the group
  __m256 total[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) total[r][b] = _mm256_setzero_ps();
  const int64_t block_bytes = groups * kOctets * kOctetBytes;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[ROWS][BLOCKS];
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm256_setzero_ps();
    for (int b = 0; b < BLOCKS; ++b)
      for (int64_t line = 0; line < kOctets * kOctetBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(packed + (block + b) * block_bytes +
                                                   (g + kAheadGroups) * kOctets * kOctetBytes + line), _MM_HINT_T0);
    for (int64_t t = 0; t < kOctets; ++t) {
      const int64_t k = g * GROUP + 8 * t;
      for (int n = 0; n < 8; ++n) {
        __m256 w[BLOCKS];
        for (int b = 0; b < BLOCKS; ++b)
          w[b] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
              packed + (block + b) * block_bytes + (g * kOctets + t) * kOctetBytes + 8 * n))));
        for (int r = 0; r < ROWS; ++r) {
          const __m256 xs = _mm256_broadcast_ss(x + r * x_stride + k + n);
          for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm256_fmadd_ps(w[b], xs, acc[r][b]);
        }
      }
    }
    for (int b = 0; b < BLOCKS; ++b) {
      const __m256 scale = load8(scales + ((block + b) * groups + g) * kBlock);
      for (int r = 0; r < ROWS; ++r) total[r][b] = _mm256_fmadd_ps(acc[r][b], scale, total[r][b]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) _mm256_storeu_ps(y + r * y_stride + (block + b) * kBlock, total[r][b]);
}

template <int GROUP, int ROWS, typename Scale>
void int8_rows(const float* x, int64_t x_stride, int64_t groups, const int8_t* packed, const Scale* scales,
               int64_t first, int64_t last, float* y, int64_t y_stride) {
  constexpr int kPass = ROWS == 1 ? 4 : 2;  // accumulators + weights in the 16 ymm registers
  int64_t block = first;
  for (; block + kPass <= last; block += kPass)
    int8_pass<GROUP, ROWS, kPass, Scale>(x, x_stride, groups, packed, scales, block, y, y_stride);
  for (; block < last; ++block)
    int8_pass<GROUP, ROWS, 1, Scale>(x, x_stride, groups, packed, scales, block, y, y_stride);
}

template <typename Scale>
using RowsFn = void (*)(const float*, int64_t, int64_t, const int8_t*, const Scale*, int64_t, int64_t, float*,
                        int64_t);
template <int GROUP, typename Scale>
constexpr RowsFn<Scale> kRowsFns[kMaxRows] = {int8_rows<GROUP, 1, Scale>, int8_rows<GROUP, 2, Scale>,
                                              int8_rows<GROUP, 3, Scale>, int8_rows<GROUP, 4, Scale>};

template <int GROUP, typename Scale>
void int8_mm_impl(const float* x, int64_t rows, int64_t in, const int8_t* packed, const Scale* scales, int64_t out,
                  float* y) {
  const int64_t groups = in / GROUP, blocks = out / kBlock;
  at::parallel_for(0, blocks, 8, [&](int64_t first, int64_t last) {
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      const int64_t count = std::min<int64_t>(kMaxRows, rows - r);
      kRowsFns<GROUP, Scale>[count - 1](x + r * in, in, groups, packed, scales, first, last, y + r * out, out);
    }
  });
}

template <typename Scale>
void int8_mm_group(int64_t group, const float* x, int64_t rows, int64_t in, const int8_t* packed, const Scale* scales,
                   int64_t out, float* y) {
  if (group == 16)
    int8_mm_impl<16, Scale>(x, rows, in, packed, scales, out, y);
  else
    int8_mm_impl<32, Scale>(x, rows, in, packed, scales, out, y);
}

}  // namespace

// Inputs per scale of a layer whose `in` inputs have `num_groups` scales: 32 (Q8_0, Q5_0) or 16 (Q6_K); 0 otherwise.
int64_t group_of(int64_t in, int64_t num_groups) {
  if (num_groups <= 0 || in % num_groups) return 0;
  const int64_t group = in / num_groups;
  return group == 32 || group == 16 ? group : 0;
}

// (values int8 [out, in], scales fp32 [out, in / G]) -> [packed int8 [out / 8, in / 8, 64], scales [out / 8, in / G,
// 8] fp16 where exact, else fp32], G = 32 or 16
std::vector<torch::Tensor> int8_pack(torch::Tensor values, torch::Tensor scales) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == torch::kInt8, "values: int8 [out, in]");
  const int64_t out = values.size(0), in = values.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == out && scales.scalar_type() == torch::kFloat32,
              "scales: fp32 [out, in / G]");
  const int64_t group = group_of(in, scales.size(1));
  TORCH_CHECK(group != 0, "scales: one per 32 or per 16 inputs");
  TORCH_CHECK(out % kBlock == 0, "int8_pack needs out % 8 == 0");
  // [out / 8, 8 channels, in / 8, 8 inputs] -> [out / 8, in / 8, 8 inputs, 8 channels]
  auto packed = values.reshape({out / kBlock, kBlock, in / 8, 8}).permute({0, 2, 3, 1}).contiguous()
                    .reshape({out / kBlock, in / 8, kOctetBytes});
  const bool fp16_exact = torch::equal(scales.to(torch::kHalf).to(torch::kFloat32), scales);
  auto held = scales.to(fp16_exact ? torch::kHalf : torch::kFloat32);
  auto blocked = held.reshape({out / kBlock, kBlock, in / group}).permute({0, 2, 1}).contiguous();
  return {packed, blocked};
}

// (x fp32 [rows, in], the two tensors of int8_pack) -> y fp32 [rows, out]
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [rows, in]");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kInt8 && packed.is_contiguous() &&
                  packed.size(1) * 8 == in && packed.size(2) == kOctetBytes,
              "packed: int8_pack's int8 [out / 8, in / 8, 64]");
  const int64_t out = packed.size(0) * kBlock;
  TORCH_CHECK(scales.dim() == 3, "scales: int8_pack's [out / 8, in / G, 8]");
  const int64_t group = group_of(in, scales.size(1));
  TORCH_CHECK(group != 0 && scales.size(0) == out / kBlock && scales.size(2) == kBlock && scales.is_contiguous() &&
                  (scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kHalf),
              "scales: int8_pack's [out / 8, in / G, 8] (G = 32 or 16), fp32 or fp16");
  auto y = torch::empty({rows, out}, x.options());
  if (rows == 0) return y;
  if (scales.scalar_type() == torch::kHalf)
    int8_mm_group<at::Half>(group, x.data_ptr<float>(), rows, in, packed.data_ptr<int8_t>(),
                            scales.data_ptr<at::Half>(), out, y.data_ptr<float>());
  else
    int8_mm_group<float>(group, x.data_ptr<float>(), rows, in, packed.data_ptr<int8_t>(), scales.data_ptr<float>(),
                         out, y.data_ptr<float>());
  return y;
}

void bind_int8(pybind11::module_& m) {
  m.def("int8_pack", &int8_pack, "(values int8 [out, in], scales fp32 [out, in/G], G = 32 or 16) -> [packed, scales]: "
        "8-bit blocks in int8_mm's layout (out % 8 == 0)");
  m.def("int8_mm", &int8_mm, "(x fp32 [rows, in], packed, scales) -> y fp32 [rows, out]: x @ W^T for int8_pack's "
        "weight, made for few rows (decode) on AVX2");
}
