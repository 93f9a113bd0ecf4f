// What the bf16 weight-only products (int4_bf16.cpp, int8_bf16.cpp) share: an activation pair broadcast for
// vdpbf16ps, scales held as fp32 or fp16, and the walk over blocks of 16 output channels in passes sized to the rows
// held in registers.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>

namespace weights {

inline __m512i x_pair(const at::BFloat16* x) {  // x[0], x[1] as one dword, broadcast to all lanes
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));  // bf16 pairs need not be 4-byte aligned
  return _mm512_set1_epi32(pair);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int ROWS, int BLOCKS>
inline void zero(__m512 (&tiles)[ROWS][BLOCKS]) {
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b) tiles[r][b] = _mm512_setzero_ps();
}

// The `bytes` at p into L1, a cache line at a time: a pass fetches its weights two groups ahead, since they stream
// from memory once per step and each row's latency is what a pass waits on (the hardware prefetcher alone left the
// int4 product at about half the memory bandwidth).
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// Blocks per pass: enough independent accumulator chains to hide vdpbf16ps latency, few enough that
// accumulators and totals (2 * ROWS * BLOCKS zmm) stay in registers.
template <int ROWS>
constexpr int blocks_per_pass() { return ROWS <= 2 ? 4 : (ROWS <= 4 ? 2 : 1); }

// Calls `pass(std::integral_constant<int, B>{}, block)` for blocks [0, num_blocks) of 16 output channels, B adjacent
// blocks a call (blocks_per_pass<ROWS>(); the last ones one by one), the calls spread over the threads.
template <int ROWS, class Pass>
void over_blocks(int64_t num_blocks, const Pass& pass) {
  constexpr int kPass = blocks_per_pass<ROWS>();
  const int64_t passes = (num_blocks + kPass - 1) / kPass;
  at::parallel_for(0, passes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t block = p * kPass;
      if (block + kPass <= num_blocks) {
        pass(std::integral_constant<int, kPass>{}, block);
      } else {
        for (int64_t b = block; b < num_blocks; ++b) pass(std::integral_constant<int, 1>{}, b);
      }
    }
  });
}

}  // namespace weights
