// Packs K and V for flash_bf16.cpp's vdpbf16ps tiles, reading a list of KV segments where they lie.
// A header of inline functions: flash_bf16.cpp packs whole KV heads (pack_kv) or one 64-key block at a
// time into a work item's own buffer (pack_keys / pack_values).
//
// K per 16-key block and d pair: [blocks][D/2][16][2], so one zmm load gives 16 keys' values of one d
// pair; V per key pair: [pairs][D][2], so one load gives 16 dims of two keys. Both over the segments'
// concatenation, zero past N, padded to whole 64-key steps. The work is a transpose: K's 16 keys x 16 d
// pairs as a 16 x 16 transpose of 32-bit elements in registers, V's key pairs interleaved by one
// two-source permute. Scalar copies cost more than the attention itself when a few query rows read many
// cached keys (a module-mix prefill, a decode step).
#pragma once

#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace pack {

// One KV segment of one layer, read where it lies: element d of key j of KV head h is
// data[h * head_stride + j * row_stride + d].
struct Part {
  const at::BFloat16* data;
  int64_t head_stride, row_stride, n;
};

inline Part part_of(const torch::Tensor& t) {  // t [H_kv, N, D]
  return {t.data_ptr<at::BFloat16>(), t.stride(0), t.stride(1), t.size(1)};
}

// The keys (or values) of one KV head as the concatenation of several segments, read where they lie.
struct Rows {
  std::vector<const at::BFloat16*> base;  // per segment: its first row of this head
  std::vector<int64_t> stride, start;     // per segment: row stride; first key index (start.back() = N)

  Rows(const std::vector<Part>& parts, int64_t head) {
    int64_t n = 0;
    for (const auto& p : parts) {
      base.push_back(p.data + head * p.head_stride);
      stride.push_back(p.row_stride);
      start.push_back(n);
      n += p.n;
    }
    start.push_back(n);
  }
  int64_t size() const { return start.back(); }
  // Row `key` (< size()); `hint` is the segment of the previous lookup: keys are read in order.
  const at::BFloat16* row(int64_t key, size_t& hint) const {
    while (key >= start[hint + 1]) ++hint;
    while (key < start[hint]) --hint;
    return base[hint] + (key - start[hint]) * stride[hint];
  }
  // Asks for rows [begin, end) (clipped to size()) to be brought into the cache, `bytes` of each.
  void prefetch(int64_t begin, int64_t end, int64_t bytes, size_t& hint) const {
    for (int64_t key = begin; key < std::min(end, size()); ++key) {
      const char* p = reinterpret_cast<const char*>(row(key, hint));
      for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T0);
    }
  }
};

// In-register transpose of a 16 x 16 matrix of 32-bit elements: r[i] = row i in, column i out.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // 32-bit interleave of row pairs
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 64-bit interleave: r[4i + m] lane L = column 4L + m of rows 4i..4i+3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes, then again across the two halves
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// K packed per 16-key block and d pair: [blocks][D/2][16][2], keys past N zero. Blocks [begin, end), written
// from `out` on:
// 16 keys' d pairs are 32-bit elements, transposed 16 x 16 in registers (scalar copies cost more than
// the attention itself when a few queries read many cached keys).
inline void pack_keys(const Rows& k, int64_t begin, int64_t end, int d, at::BFloat16* out) {
  __m512i r[16];
  size_t hint = 0;
  for (int64_t b = begin; b < end; ++b) {
    int32_t* dst = reinterpret_cast<int32_t*>(out + (b - begin) * (d / 2) * 32);
    for (int j0 = 0; j0 < d / 2; j0 += 16) {  // 16 d pairs (32 values) of each key at a time
      for (int c = 0; c < 16; ++c) {
        const int64_t key = b * 16 + c;
        r[c] = key < k.size() ? _mm512_loadu_si512(k.row(key, hint) + 2 * j0) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (j0 + j) * 16, r[j]);
    }
  }
}

// V packed per key pair: [pairs][D][2], keys past N zero. Pairs [begin, end), written from `out` on: two rows interleaved 32
// values at a time by one two-source permute.
inline void pack_values(const Rows& v, int64_t begin, int64_t end, int d, at::BFloat16* out) {
  alignas(64) int16_t low[32], high[32];
  for (int e = 0; e < 32; ++e) {  // even lanes from the first key, odd from the second (index + 32)
    low[e] = static_cast<int16_t>((e % 2) * 32 + e / 2);
    high[e] = static_cast<int16_t>((e % 2) * 32 + 16 + e / 2);
  }
  const __m512i lo = _mm512_load_si512(low), hi = _mm512_load_si512(high);
  size_t hint = 0;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t key = 2 * i;
    const at::BFloat16* first = key < v.size() ? v.row(key, hint) : nullptr;
    const at::BFloat16* second = key + 1 < v.size() ? v.row(key + 1, hint) : nullptr;
    at::BFloat16* dst = out + (i - begin) * d * 2;
    for (int c = 0; c < d; c += 32) {
      __m512i a = first ? _mm512_loadu_si512(first + c) : _mm512_setzero_si512();
      __m512i b = second ? _mm512_loadu_si512(second + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// K and V of every KV head packed whole: [H_kv, whole 64-key steps x 16 x D] each, zero past N.
inline std::pair<torch::Tensor, torch::Tensor> pack_kv(const std::vector<torch::Tensor>& k,
                                                       const std::vector<torch::Tensor>& v, int64_t d) {
  const int64_t kv_heads = k[0].size(0);
  std::vector<Part> k_parts, v_parts;
  int64_t n = 0;
  for (size_t i = 0; i < k.size(); ++i) k_parts.push_back(part_of(k[i])), v_parts.push_back(part_of(v[i])), n += k[i].size(1);
  const int64_t key_blocks = (n + 63) / 64 * 4;  // 16-key blocks, padded to whole 64-key steps
  auto kp = torch::empty({kv_heads, key_blocks * 16 * d}, k[0].options());
  auto vp = torch::empty({kv_heads, key_blocks * 16 * d}, v[0].options());
  std::vector<Rows> k_rows, v_rows;
  for (int64_t h = 0; h < kv_heads; ++h) k_rows.emplace_back(k_parts, h), v_rows.emplace_back(v_parts, h);
  // Per KV head and 64-key step, both threads sharing even a single head's keys.
  const int64_t steps = key_blocks / 4;
  at::parallel_for(0, kv_heads * steps, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / steps, s = item % steps;
      pack_keys(k_rows[h], 4 * s, 4 * s + 4, static_cast<int>(d),
                kp.data_ptr<at::BFloat16>() + h * kp.stride(0) + 4 * s * (d / 2) * 32);
      pack_values(v_rows[h], 32 * s, 32 * s + 32, static_cast<int>(d),
                  vp.data_ptr<at::BFloat16>() + h * vp.stride(0) + 32 * s * d * 2);
    }
  });
  return {kp, vp};
}

}  // namespace pack
