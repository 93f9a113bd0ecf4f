// Weight-only int4 matrix product for few rows (decode) on AVX2 + FMA: y = x @ W^T with fp32 activations and W
// held as Q4_1 groups (w = scale * q + minimum per 32 inputs, q in 0..15).
//
// Why: PyTorch's CPU int4 kernel has vector code only for AVX-512; on an AVX2 CPU it runs element by element and
// is slower than the widened fp32 weights, which a decode step then reads at 8x the bytes of the file's 4 bits.
// Here a nibble becomes an fp32 lane with a shift, an and and one conversion, shared by every row of the pass:
//   y[n] = sum_g scale[n, g] * dot_g(x, q[n]) + minimum[n, g] * sum_g(x).
// Scales and minimums are held as fp16 when every one of them is an fp16 value (GGUF's Q4_1 stores them so):
// a decode waits on the bytes it reads, and they are a fifth of them in fp32.
//
// Packed layout (int4_pack), per block of 8 output channels and per 8 inputs (k = 8t..8t+7), 32 bytes:
// dword j holds channel j's q[8t + n] in its nibble n (bits 4n..4n+3), so (dwords >> 4n) & 15 is the
// 8 channels' weights for input 8t + n, one lane each.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;        // inputs per scale and minimum
constexpr int64_t kBlock = 8;         // output channels per block: fp32 lanes of a ymm register
constexpr int64_t kOctetBytes = 32;   // one block's 8 x 8 nibbles
constexpr int64_t kOctets = kGroup / 8;
constexpr int kMaxRows = 4;           // rows per pass, in registers
constexpr int64_t kAhead = 8;         // groups prefetched ahead of the one computed: ~DRAM latency at 1 row

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One pass over BLOCKS adjacent blocks of 8 output channels (first at `block`) for ROWS rows.
template <int ROWS, int BLOCKS, typename Scale>
void int4_pass(const float* x, int64_t x_stride, const float* group_sums, int64_t groups, const uint8_t* packed,
               const Scale* scales, const Scale* minimums, int64_t block, float* y, int64_t y_stride) {
  const __m256i low_mask = _mm256_set1_epi32(0xF);
  __m256 total[ROWS][BLOCKS];
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) total[r][b] = _mm256_setzero_ps();
  const int64_t block_bytes = groups * kOctets * kOctetBytes;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[ROWS][BLOCKS];
    for (int r = 0; r < ROWS; ++r)
      for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm256_setzero_ps();
    // kAhead groups ahead: the weights stream from memory once a step, and at one row a group takes a fraction of
    // the memory latency to compute (two groups ahead left the kernel at 10 GB/s of 24).
    for (int b = 0; b < BLOCKS; ++b)
      for (int64_t line = 0; line < kOctets * kOctetBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(packed + (block + b) * block_bytes +
                                                   (g + kAhead) * kOctets * kOctetBytes + line), _MM_HINT_T0);
    for (int64_t t = 0; t < kOctets; ++t) {
      const int64_t k = g * kGroup + 8 * t;
      __m256i words[BLOCKS];
      for (int b = 0; b < BLOCKS; ++b)
        words[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            packed + (block + b) * block_bytes + (g * kOctets + t) * kOctetBytes));
      for (int n = 0; n < 8; ++n) {
        __m256 w[BLOCKS];
        for (int b = 0; b < BLOCKS; ++b)
          w[b] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words[b], 4 * n), low_mask));
        for (int r = 0; r < ROWS; ++r) {
          const __m256 xs = _mm256_broadcast_ss(x + r * x_stride + k + n);
          for (int b = 0; b < BLOCKS; ++b) acc[r][b] = _mm256_fmadd_ps(w[b], xs, acc[r][b]);
        }
      }
    }
    for (int b = 0; b < BLOCKS; ++b) {
      const __m256 scale = load8(scales + ((block + b) * groups + g) * kBlock);
      const __m256 minimum = load8(minimums + ((block + b) * groups + g) * kBlock);
      for (int r = 0; r < ROWS; ++r) {
        total[r][b] = _mm256_fmadd_ps(acc[r][b], scale, total[r][b]);
        total[r][b] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(group_sums[r * groups + g]), total[r][b]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) _mm256_storeu_ps(y + r * y_stride + (block + b) * kBlock, total[r][b]);
}

// ROWS rows against output blocks [first, last): passes of up to BLOCKS blocks (fewer at the end).
template <int ROWS, typename Scale>
void int4_rows(const float* x, int64_t x_stride, const float* group_sums, int64_t groups, const uint8_t* packed,
               const Scale* scales, const Scale* minimums, int64_t first, int64_t last, float* y, int64_t y_stride) {
  constexpr int kPass = ROWS == 1 ? 4 : 2;  // accumulators + weights in the 16 ymm registers
  int64_t block = first;
  for (; block + kPass <= last; block += kPass)
    int4_pass<ROWS, kPass, Scale>(x, x_stride, group_sums, groups, packed, scales, minimums, block, y, y_stride);
  for (; block < last; ++block)
    int4_pass<ROWS, 1, Scale>(x, x_stride, group_sums, groups, packed, scales, minimums, block, y, y_stride);
}

template <typename Scale>
using RowsFn = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, const Scale*, const Scale*,
                        int64_t, int64_t, float*, int64_t);
template <typename Scale>
constexpr RowsFn<Scale> kRowsFns[kMaxRows] = {int4_rows<1, Scale>, int4_rows<2, Scale>, int4_rows<3, Scale>,
                                              int4_rows<4, Scale>};

template <typename Scale>
void int4_mm_impl(const float* x, int64_t rows, int64_t in, const float* group_sums, const uint8_t* packed,
                  const Scale* scales, const Scale* minimums, int64_t out, float* y) {
  const int64_t groups = in / kGroup, blocks = out / kBlock;
  // Split over output blocks (each thread streams its own weights once for every row).
  at::parallel_for(0, blocks, 8, [&](int64_t first, int64_t last) {
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      const int64_t count = std::min<int64_t>(kMaxRows, rows - r);
      kRowsFns<Scale>[count - 1](x + r * in, in, group_sums + r * groups, groups, packed, scales, minimums, first,
                                 last, y + r * out, out);
    }
  });
}

// Per block of 8 channels and group: [out / 8, groups, 8] (the epilogue loads one vector of each).
torch::Tensor blocked(const torch::Tensor& per_channel) {  // [out, groups] -> [out / 8, groups, 8]
  const int64_t out = per_channel.size(0), groups = per_channel.size(1);
  return per_channel.reshape({out / kBlock, kBlock, groups}).permute({0, 2, 1}).contiguous();
}

}  // namespace

// (values uint8 [out, in] 0..15, scales fp32 [out, in / 32], minimums fp32 [out, in / 32])
//   -> [packed uint8 [out / 8, in / 8, 32], scales, minimums [out / 8, in / 32, 8] fp16 where exact, else fp32]
std::vector<torch::Tensor> int4_pack(torch::Tensor values, torch::Tensor scales, torch::Tensor minimums) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == torch::kUInt8, "values: uint8 [out, in]");
  const int64_t out = values.size(0), in = values.size(1);
  TORCH_CHECK(out % kBlock == 0 && in % kGroup == 0, "int4_pack needs out % 8 == 0 and in % 32 == 0");
  TORCH_CHECK(scales.sizes() == minimums.sizes() && scales.size(0) == out && scales.size(1) == in / kGroup &&
                  scales.scalar_type() == torch::kFloat32 && minimums.scalar_type() == torch::kFloat32,
              "scales / minimums: fp32 [out, in / 32]");
  // [out / 8, 8 channels, in / 8, 8 inputs] -> [out / 8, in / 8, 8 channels, 8 inputs]: nibble n of dword j
  auto q = values.reshape({out / kBlock, kBlock, in / 8, 8}).permute({0, 2, 1, 3});
  // little-endian dword: byte i holds nibbles 2i (low) and 2i + 1 (high)
  auto bytes = q.slice(3, 0, 8, 2).bitwise_or(q.slice(3, 1, 8, 2).bitwise_left_shift(4));  // [out/8, in/8, 8, 4]
  auto packed = bytes.contiguous().reshape({out / kBlock, in / 8, kOctetBytes});
  const bool fp16_exact = torch::equal(scales.to(torch::kHalf).to(torch::kFloat32), scales) &&
                          torch::equal(minimums.to(torch::kHalf).to(torch::kFloat32), minimums);
  const auto held = fp16_exact ? torch::kHalf : torch::kFloat32;
  return {packed, blocked(scales.to(held)), blocked(minimums.to(held))};
}

// (x fp32 [rows, in], the three tensors of int4_pack) -> y fp32 [rows, out]
torch::Tensor int4_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [rows, in]");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.size(1) * 8 == in && packed.size(2) == kOctetBytes,
              "packed: int4_pack's uint8 [out / 8, in / 8, 32]");
  const int64_t out = packed.size(0) * kBlock, groups = in / kGroup;
  TORCH_CHECK(scales.sizes() == minimums.sizes() && scales.dim() == 3 && scales.size(0) == out / kBlock &&
                  scales.size(1) == groups && scales.size(2) == kBlock && scales.is_contiguous() &&
                  minimums.is_contiguous() && scales.scalar_type() == minimums.scalar_type() &&
                  (scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kHalf),
              "scales / minimums: int4_pack's [out / 8, in / 32, 8], both fp32 or both fp16");
  auto y = torch::empty({rows, out}, x.options());
  if (rows == 0) return y;
  std::vector<float> group_sums(rows * groups);  // per row and group: sum(x), the minimums' factor
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < rows * groups; ++i) {
    float sum = 0.f;
    for (int64_t k = 0; k < kGroup; ++k) sum += xp[i * kGroup + k];
    group_sums[i] = sum;
  }
  if (scales.scalar_type() == torch::kHalf)
    int4_mm_impl<at::Half>(x.data_ptr<float>(), rows, in, group_sums.data(), packed.data_ptr<uint8_t>(),
                           scales.data_ptr<at::Half>(), minimums.data_ptr<at::Half>(), out, y.data_ptr<float>());
  else
    int4_mm_impl<float>(x.data_ptr<float>(), rows, in, group_sums.data(), packed.data_ptr<uint8_t>(),
                        scales.data_ptr<float>(), minimums.data_ptr<float>(), out, y.data_ptr<float>());
  return y;
}

// decode_f32.cpp, fused_f32.cpp and int8_f32.cpp, built into the same extension
void bind_decode(pybind11::module_& m);
void bind_fused(pybind11::module_& m);
void bind_int8(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode(m);
  bind_fused(m);
  bind_int8(m);
  m.def("int4_pack", &int4_pack, "(values uint8 [out, in] 0..15, scales fp32 [out, in/32], minimums fp32 "
        "[out, in/32]) -> [packed, scales, minimums]: Q4_1 blocks in int4_mm's layout (out % 8 == 0)");
  m.def("int4_mm", &int4_mm, "(x fp32 [rows, in], packed, scales, minimums) -> y fp32 [rows, out]: x @ W^T for "
        "int4_pack's weight, made for few rows (decode) on AVX2");
}
