// The inner loop of the bf16 attention kernels (flash_bf16.cpp, decode_bf16.cpp): QK^T and PV on
// vdpbf16ps register tiles over K and V packed by pack_bf16.h, online softmax in fp32 (base-2 domain),
// and the few-rows interface the decode kernels share.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "pack_bf16.h"

namespace attend {
constexpr int kBlockM = 32;   // query rows per work item
constexpr int kBlockN = 64;   // keys per inner step (4 zmm of 16 keys)
constexpr int kRows = 4;      // query rows per register tile

// 2^x for x <= 0 (fp32, |rel err| ~1e-7): x = n + f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }
inline __m512bh bcast_pair(const at::BFloat16* p) { return as_bh(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p))); }

// S[NR][64] = scale_log2 * Q[NR] . K[64 keys]^T, K packed [4][D/2][16][2].
template <int D, int NR>
inline void qk_tile(const at::BFloat16* q, int64_t q_stride, const at::BFloat16* kb, float* s, float scale_log2) {
  __m512 t[NR][4];
#pragma GCC unroll 16
  for (int a = 0; a < NR; ++a)
#pragma GCC unroll 4
    for (int b = 0; b < 4; ++b) t[a][b] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int j = 0; j < D / 2; ++j) {
    __m512bh kv[4];
#pragma GCC unroll 4
    for (int b = 0; b < 4; ++b) kv[b] = as_bh(_mm512_loadu_si512(kb + (b * (D / 2) + j) * 32));
#pragma GCC unroll 16
    for (int a = 0; a < NR; ++a) {
      __m512bh qa = bcast_pair(q + a * q_stride + 2 * j);
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) t[a][b] = _mm512_dpbf16_ps(t[a][b], qa, kv[b]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale_log2);
#pragma GCC unroll 16
  for (int a = 0; a < NR; ++a)
#pragma GCC unroll 4
    for (int b = 0; b < 4; ++b) _mm512_store_ps(s + a * kBlockN + b * 16, _mm512_mul_ps(t[a][b], sc));
}

// acc[NR][D] += P[NR][2 * pairs] . V[2 * pairs][D], V packed [pairs][D][2]: in column chunks of kCols zmm
// whose NR x kCols accumulators stay in registers (a whole row of D = 256 is 16 zmm: four rows of it would
// spill to the stack and halve the kernel's speed). Each accumulator sums the same pairs in the same order.
template <int D, int NR>
inline void pv_tile(const at::BFloat16* p, const at::BFloat16* vb, int64_t pairs, float* acc) {
  constexpr int kCols = std::min(D / 16, NR <= 2 ? 8 : 4);
  for (int c0 = 0; c0 < D / 16; c0 += kCols) {
    __m512 t[NR][kCols];
#pragma GCC unroll 16
    for (int a = 0; a < NR; ++a)
#pragma GCC unroll 8
      for (int b = 0; b < kCols; ++b) t[a][b] = _mm512_load_ps(acc + a * D + (c0 + b) * 16);
    for (int64_t i = 0; i < pairs; ++i) {
      __m512bh vv[kCols];
#pragma GCC unroll 8
      for (int b = 0; b < kCols; ++b) vv[b] = as_bh(_mm512_loadu_si512(vb + (i * D + (c0 + b) * 16) * 2));
#pragma GCC unroll 16
      for (int a = 0; a < NR; ++a) {
        __m512bh pa = bcast_pair(p + a * kBlockN + 2 * i);
#pragma GCC unroll 8
        for (int b = 0; b < kCols; ++b) t[a][b] = _mm512_dpbf16_ps(t[a][b], pa, vv[b]);
      }
    }
#pragma GCC unroll 16
    for (int a = 0; a < NR; ++a)
#pragma GCC unroll 8
      for (int b = 0; b < kCols; ++b) _mm512_store_ps(acc + a * D + (c0 + b) * 16, t[a][b]);
  }
}

// Online-softmax state of up to kBlockM query rows: running max (base-2 domain), running sum, fp32
// output accumulator.
template <int D>
struct RowState {
  alignas(64) float acc[kBlockM][D];
  float m[kBlockM], l[kBlockM];

  void reset(int64_t rows) {
    for (int r = 0; r < rows; ++r) {
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.f;
      for (int c = 0; c < D; ++c) acc[r][c] = 0.f;
    }
  }
  // Rows [first, first + rows) out: o = acc / l (bf16), lse = ln(sum_j exp(scale * q.k_j)).
  void finish(int64_t first, int64_t rows, at::BFloat16* o, int64_t o_stride, float* lse, int64_t lse_stride) const {
    const float ln2 = 0.69314718055994531f;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = first + i;
      __m512 inv = _mm512_set1_ps(1.f / l[r]);
      for (int c = 0; c < D; c += 16)
        _mm256_storeu_si256((__m256i*)(o + i * o_stride + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&acc[r][c]), inv)));
      lse[i * lse_stride] = (m[r] + std::log2(l[r])) * ln2;
    }
  }
};

// Attends `rows` query rows (row0 their first index in the call) to keys [k_begin, key_end) in 64-key
// steps, k_begin a multiple of 64; `step(k0)` returns that step's K packed [4][D/2][16][2] and V packed
// [32][D][2] (from a copy of the whole head, or packed on the spot), zero past the last key. Causal: row r
// sees keys up to row0 + r + visible_offset; `window` > 0 (causal only) also hides the keys W or more
// before that one (a sliding-window layer whose keys lie at consecutive positions).
template <int D, class Step>
void attend_keys(const at::BFloat16* q, int64_t q_stride, int64_t rows, int64_t row0, int64_t k_begin,
                 int64_t key_end, int64_t visible_offset, bool causal, const int32_t* first_row, float scale_log2,
                 Step step, RowState<D>& st, int64_t window = 0) {
  alignas(64) float s[kBlockM][kBlockN];
  alignas(64) at::BFloat16 p[kBlockM][kBlockN];
  for (int64_t k0 = k_begin; k0 < key_end; k0 += kBlockN) {
    int64_t kn = std::min<int64_t>(kBlockN, key_end - k0);
    const auto [kb, vb] = step(k0);
    // S = Q K^T, kRows rows x 64 keys per register tile.
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      switch (std::min<int64_t>(kRows, rows - r0)) {
        case 4: qk_tile<D, 4>(q + r0 * q_stride, q_stride, kb, &s[r0][0], scale_log2); break;
        case 3: qk_tile<D, 3>(q + r0 * q_stride, q_stride, kb, &s[r0][0], scale_log2); break;
        case 2: qk_tile<D, 2>(q + r0 * q_stride, q_stride, kb, &s[r0][0], scale_log2); break;
        default: qk_tile<D, 1>(q + r0 * q_stride, q_stride, kb, &s[r0][0], scale_log2); break;
      }
    }
    // Online softmax per row; P in bf16.
    for (int r = 0; r < rows; ++r) {
      int64_t visible = causal ? std::min<int64_t>(kn, row0 + r + visible_offset + 1 - k0) : kn;
      if (visible <= 0) {  // nothing visible in this block for this row
        for (int b = 0; b < 4; ++b) _mm256_storeu_si256((__m256i*)&p[r][b * 16], _mm256_setzero_si256());
        continue;
      }
      // With a window, the keys before row0 + r + visible_offset - W + 1 are out of this row's reach.
      const int64_t hidden_below = window > 0 ? row0 + r + visible_offset - window + 1 - k0 : 0;
      __mmask16 masks[4], any = 0;
      for (int b = 0; b < 4; ++b) {
        int64_t left = visible - b * 16;
        masks[b] = left >= 16 ? (__mmask16)0xFFFF : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1));
        const int64_t below = hidden_below - b * 16;
        if (below > 0) masks[b] &= below >= 16 ? (__mmask16)0 : (__mmask16)~((1u << below) - 1);
        if (first_row != nullptr)  // keys of segments positioned after this row's token
          masks[b] &= _mm512_cmple_epi32_mask(_mm512_loadu_si512(first_row + k0 + b * 16),
                                              _mm512_set1_epi32(static_cast<int32_t>(row0 + r)));
        any |= masks[b];
      }
      if (!any) {
        for (int b = 0; b < 4; ++b) _mm256_storeu_si256((__m256i*)&p[r][b * 16], _mm256_setzero_si256());
        continue;
      }
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int b = 0; b < 4; ++b) mx = _mm512_mask_max_ps(mx, masks[b], mx, _mm512_load_ps(&s[r][b * 16]));
      float block_max = _mm512_reduce_max_ps(mx);
      float m_new = std::max(st.m[r], block_max);
      float correction = std::exp2(st.m[r] - m_new);
      __m512 mv = _mm512_set1_ps(m_new), sum = _mm512_setzero_ps();
      for (int b = 0; b < 4; ++b) {
        __m512 e = _mm512_maskz_mov_ps(masks[b], exp2_ps(_mm512_sub_ps(_mm512_load_ps(&s[r][b * 16]), mv)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i*)&p[r][b * 16], (__m256i)_mm512_cvtneps_pbh(e));
      }
      st.l[r] = st.l[r] * correction + _mm512_reduce_add_ps(sum);
      st.m[r] = m_new;
      if (correction != 1.f) {
        __m512 cv = _mm512_set1_ps(correction);
        for (int c = 0; c < D; c += 16)
          _mm512_store_ps(&st.acc[r][c], _mm512_mul_ps(_mm512_load_ps(&st.acc[r][c]), cv));
      }
    }
    // O += P V, kRows rows x D per register tile; key pairs beyond kn carry P = 0 (zero padded V).
    int64_t pairs = (kn + 1) / 2;
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      switch (std::min<int64_t>(kRows, rows - r0)) {
        case 4: pv_tile<D, 4>(&p[r0][0], vb, pairs, &st.acc[r0][0]); break;
        case 3: pv_tile<D, 3>(&p[r0][0], vb, pairs, &st.acc[r0][0]); break;
        case 2: pv_tile<D, 2>(&p[r0][0], vb, pairs, &st.acc[r0][0]); break;
        default: pv_tile<D, 1>(&p[r0][0], vb, pairs, &st.acc[r0][0]); break;
      }
    }
  }
}

// Query rows addressed as (member, query head): row (i, h) starts at base + i * member_stride + h * head_stride.
struct QRows {
  const at::BFloat16* base;
  int64_t member_stride, head_stride;
};

// Where out rows (bf16, q's addressing) and their log-sum-exp (fp32) go.
struct OutRows {
  at::BFloat16* base;
  int64_t member_stride, head_stride;
  float* lse;
  int64_t lse_member_stride, lse_head_stride;
};

// Members (rows of QRows) that attend one list of KV segments in full: every query head of every member
// sees every key.
struct RowSet {
  std::vector<int64_t> members;
  std::vector<pack::Part> k, v;
  int64_t n;  // keys: the parts' total
};

// Checks one call's KV segments against q's head dim and KV head count; returns their total length N.
inline int64_t checked_length(const std::vector<torch::Tensor>& k, const std::vector<torch::Tensor>& v, int64_t kv_heads,
                       int64_t d) {
  TORCH_CHECK(k.size() == v.size(), "bf16 attention: as many key as value segments");
  int64_t n = 0;
  for (size_t i = 0; i < k.size(); ++i) {
    const auto &ki = k[i], &vi = v[i];
    TORCH_CHECK(ki.scalar_type() == at::kBFloat16 && vi.scalar_type() == at::kBFloat16, "bf16 attention: k, v must be bfloat16");
    TORCH_CHECK(ki.dim() == 3 && vi.dim() == 3 && ki.stride(2) == 1 && vi.stride(2) == 1,
                "bf16 attention: k/v segments [H_kv, N_i, D] with a contiguous last dim");
    TORCH_CHECK(ki.size(0) == kv_heads && vi.size(0) == kv_heads && ki.size(2) == d && vi.size(2) == d &&
                vi.size(1) == ki.size(1), "bf16 attention: shape mismatch in segment ", i);
    n += ki.size(1);
  }
  return n;
}

// Attends every set; a member in several sets (a sequence's shared modules and its own KV) gets their
// softmax merged by log-sum-exp. Every member 0 .. num_members - 1 must be in at least one set with keys.
// D = 64, 128 or 256; G = heads / kv_heads <= 32. Defined in decode_bf16.cpp.
void attend_sets(const std::vector<RowSet>& sets, int64_t num_members, const QRows& q, const OutRows& out,
                 int64_t heads, int64_t kv_heads, int64_t d, float scale_log2);

}  // namespace attend
