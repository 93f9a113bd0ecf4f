// What the bf16 weight-only products (int4_bf16.cpp, int8_bf16.cpp) share: an activation pair broadcast for
// vdpbf16ps, scales held as fp32 or fp16, and the walk over blocks of 16 output channels.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

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

template <int ROWS>
inline void zero(__m512 (&tiles)[ROWS]) {
  for (int r = 0; r < ROWS; ++r) tiles[r] = _mm512_setzero_ps();
}

// The `bytes` at p into L1, a cache line at a time: a pass fetches its weights two groups ahead, since they stream
// from memory once per step (with passes over 4 blocks, the hardware prefetcher alone left the int4 product at about
// half the memory bandwidth; with one block a pass it neither helps nor hurts measurably on a Zen 4).
inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// Calls `pass(block)` for each block [0, num_blocks) of 16 output channels, the blocks spread over the threads. One
// block a pass: its weights and scales are two sequential streams. Passes over 2 or 4 adjacent blocks (more
// independent vdpbf16ps chains) read 4-8 streams at once and, measured on an AMD Zen 4 with the weights streaming
// from memory, were slower at 1, 2 and 4 rows: Gemma 3 270M's Q8_0 head (168 MB) at one row 9.0 -> 5.6 ms.
template <class Pass>
void over_blocks(int64_t num_blocks, const Pass& pass) {
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) pass(block);
  });
}

}  // namespace weights
