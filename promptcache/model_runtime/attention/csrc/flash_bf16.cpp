// Flash attention in bf16 for x86 CPUs with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids): QK^T and
// PV on vdpbf16ps (bf16 pairs multiplied, summed in fp32), online softmax in fp32. PyTorch's fused CPU op
// uses bf16 tiles only with AMX; without AMX it runs bf16 at fp32 speed (docs/benchmarks.md), which is
// what this kernel is for. Built on first use by promptcache/model_runtime/attention/bf16_kernel.py.
//
// q [H, M, D] (any strides, last dim contiguous); k and v as lists of segments [H_kv, N_i, D], attended
// as their concatenation (N = sum N_i) without copying them together: module KV, a sequence's earlier
// tokens and its new ones in one call, one online softmax, no merges. H a multiple of H_kv (GQA: query
// head h reads KV head h / (H / H_kv)); D = 64 or 128. Returns out (q's layout, bf16) and lse [H, M]
// fp32: the natural log of sum_j exp(scale * q.k_j). Causal masks are bottom-right aligned: query row r
// sees keys 0 .. r + N - M (the new tokens are the last M of the N keys). `first_rows` (optional, one per
// segment) hides a segment from the query rows before it: a prefill that recomputes tokens among cached
// ones, where a module's cached tail is positioned after some of the new tokens.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// pack_bf16.cpp, built into the same extension: K packed per 16-key block and d pair [blocks][D/2][16][2],
// V per key pair [pairs][D][2], both over the segments' concatenation padded with zeros to whole 64-key
// steps; one row per KV head.
std::pair<torch::Tensor, torch::Tensor> pack_kv(const std::vector<torch::Tensor>& k,
                                                const std::vector<torch::Tensor>& v, int64_t d);

namespace {

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

// acc[NR][D] += P[NR][2 * pairs] . V[2 * pairs][D], V packed [pairs][D][2].
template <int D, int NR>
inline void pv_tile(const at::BFloat16* p, const at::BFloat16* vb, int64_t pairs, float* acc) {
  __m512 t[NR][D / 16];
#pragma GCC unroll 16
  for (int a = 0; a < NR; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < D / 16; ++b) t[a][b] = _mm512_load_ps(acc + a * D + b * 16);
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh vv[D / 16];
#pragma GCC unroll 8
    for (int b = 0; b < D / 16; ++b) vv[b] = as_bh(_mm512_loadu_si512(vb + (i * D + b * 16) * 2));
#pragma GCC unroll 16
    for (int a = 0; a < NR; ++a) {
      __m512bh pa = bcast_pair(p + a * kBlockN + 2 * i);
#pragma GCC unroll 8
      for (int b = 0; b < D / 16; ++b) t[a][b] = _mm512_dpbf16_ps(t[a][b], pa, vv[b]);
    }
  }
#pragma GCC unroll 16
  for (int a = 0; a < NR; ++a)
#pragma GCC unroll 8
    for (int b = 0; b < D / 16; ++b) _mm512_store_ps(acc + a * D + b * 16, t[a][b]);
}

template <int D>
void attend_block(const at::BFloat16* q, int64_t q_stride, at::BFloat16* o, int64_t o_stride, float* lse,
                  int64_t rows, int64_t row0, const at::BFloat16* kp, const at::BFloat16* vp, int64_t n,
                  int64_t visible_offset, bool causal, const int32_t* first_row, float scale_log2) {
  // Per row state: running max (base-2 domain), running sum, fp32 output accumulator.
  alignas(64) float acc[kBlockM][D];
  alignas(64) float s[kBlockM][kBlockN];
  alignas(64) at::BFloat16 p[kBlockM][kBlockN];
  float m[kBlockM], l[kBlockM];
  for (int r = 0; r < rows; ++r) { m[r] = -std::numeric_limits<float>::infinity(); l[r] = 0.f; }
  for (int r = 0; r < rows; ++r) for (int c = 0; c < D; ++c) acc[r][c] = 0.f;
  // Keys this block needs: causal rows see up to row0 + rows - 1 + visible_offset.
  int64_t key_end = causal ? std::min<int64_t>(n, row0 + rows + visible_offset) : n;
  for (int64_t k0 = 0; k0 < key_end; k0 += kBlockN) {
    int64_t kn = std::min<int64_t>(kBlockN, key_end - k0);
    const at::BFloat16* kb = kp + (k0 / 16) * (D / 2) * 32;
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
      __mmask16 masks[4], any = 0;
      for (int b = 0; b < 4; ++b) {
        int64_t left = visible - b * 16;
        masks[b] = left >= 16 ? (__mmask16)0xFFFF : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1));
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
      float m_new = std::max(m[r], block_max);
      float correction = std::exp2(m[r] - m_new);
      __m512 mv = _mm512_set1_ps(m_new), sum = _mm512_setzero_ps();
      for (int b = 0; b < 4; ++b) {
        __m512 e = _mm512_maskz_mov_ps(masks[b], exp2_ps(_mm512_sub_ps(_mm512_load_ps(&s[r][b * 16]), mv)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i*)&p[r][b * 16], (__m256i)_mm512_cvtneps_pbh(e));
      }
      l[r] = l[r] * correction + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
      if (correction != 1.f) {
        __m512 cv = _mm512_set1_ps(correction);
        for (int c = 0; c < D; c += 16) _mm512_store_ps(&acc[r][c], _mm512_mul_ps(_mm512_load_ps(&acc[r][c]), cv));
      }
    }
    // O += P V, kRows rows x D per register tile; key pairs beyond kn carry P = 0 (zero padded V).
    const at::BFloat16* vb = vp + (k0 / 2) * D * 2;
    int64_t pairs = (kn + 1) / 2;
    for (int r0 = 0; r0 < rows; r0 += kRows) {
      switch (std::min<int64_t>(kRows, rows - r0)) {
        case 4: pv_tile<D, 4>(&p[r0][0], vb, pairs, &acc[r0][0]); break;
        case 3: pv_tile<D, 3>(&p[r0][0], vb, pairs, &acc[r0][0]); break;
        case 2: pv_tile<D, 2>(&p[r0][0], vb, pairs, &acc[r0][0]); break;
        default: pv_tile<D, 1>(&p[r0][0], vb, pairs, &acc[r0][0]); break;
      }
    }
  }
  const float ln2 = 0.69314718055994531f;
  for (int r = 0; r < rows; ++r) {
    __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int c = 0; c < D; c += 16)
      _mm256_storeu_si256((__m256i*)(o + r * o_stride + c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&acc[r][c]), inv)));
    lse[r] = (m[r] + std::log2(l[r])) * ln2;
  }
}

}  // namespace

std::vector<torch::Tensor> flash_bf16(torch::Tensor q, std::vector<torch::Tensor> k, std::vector<torch::Tensor> v,
                                      double scale, bool causal, std::vector<int64_t> first_rows) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.stride(2) == 1,
              "flash_bf16: q must be bfloat16 [H, M, D] with a contiguous last dim");
  TORCH_CHECK(!k.empty() && k.size() == v.size(), "flash_bf16: as many key as value segments, at least one");
  const int64_t heads = q.size(0), m = q.size(1), d = q.size(2), kv_heads = k[0].size(0);
  TORCH_CHECK(d == 64 || d == 128, "flash_bf16: head dim must be 64 or 128, got ", d);
  TORCH_CHECK(heads % kv_heads == 0, "flash_bf16: ", heads, " query heads for ", kv_heads, " KV heads");
  int64_t n = 0;
  for (size_t i = 0; i < k.size(); ++i) {
    const auto &ki = k[i], &vi = v[i];
    TORCH_CHECK(ki.scalar_type() == at::kBFloat16 && vi.scalar_type() == at::kBFloat16, "flash_bf16: k, v must be bfloat16");
    TORCH_CHECK(ki.dim() == 3 && vi.dim() == 3 && ki.stride(2) == 1 && vi.stride(2) == 1,
                "flash_bf16: k/v segments [H_kv, N_i, D] with a contiguous last dim");
    TORCH_CHECK(ki.size(0) == kv_heads && vi.size(0) == kv_heads && ki.size(2) == d && vi.size(2) == d &&
                vi.size(1) == ki.size(1), "flash_bf16: shape mismatch in segment ", i);
    n += ki.size(1);
  }
  TORCH_CHECK(n > 0 && (!causal || n >= m), "flash_bf16: need N > 0 and, when causal, N >= M");
  auto out = torch::empty_like(q);
  auto lse = torch::empty({heads, m}, q.options().dtype(at::kFloat));
  TORCH_CHECK(first_rows.empty() || first_rows.size() == k.size(), "flash_bf16: one first row per segment");
  auto [kp, vp] = pack_kv(k, v, d);  // [H_kv, whole 64-key steps x 16 x D] each, zero past N
  // Per key, the first query row that sees it (its segment's entry of first_rows), when any is > 0.
  std::vector<int32_t> key_first_row;
  if (std::any_of(first_rows.begin(), first_rows.end(), [](int64_t r) { return r > 0; })) {
    key_first_row.assign((n + 63) / 64 * 64, 0);
    int64_t start = 0;
    for (size_t i = 0; i < k.size(); ++i) {
      std::fill_n(key_first_row.begin() + start, k[i].size(1), static_cast<int32_t>(std::max<int64_t>(0, first_rows[i])));
      start += k[i].size(1);
    }
  }
  const int32_t* first_row = key_first_row.empty() ? nullptr : key_first_row.data();
  const int64_t row_blocks = (m + kBlockM - 1) / kBlockM, group = heads / kv_heads;
  const float scale_log2 = static_cast<float>(scale) * 1.4426950408889634f;
  at::parallel_for(0, heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      int64_t h = item / row_blocks, row0 = (item % row_blocks) * kBlockM, rows = std::min<int64_t>(kBlockM, m - row0);
      int64_t g = h / group;
      const at::BFloat16* qh = q.data_ptr<at::BFloat16>() + h * q.stride(0) + row0 * q.stride(1);
      at::BFloat16* oh = out.data_ptr<at::BFloat16>() + h * out.stride(0) + row0 * out.stride(1);
      float* lh = lse.data_ptr<float>() + h * m + row0;
      const at::BFloat16* kh = kp.data_ptr<at::BFloat16>() + g * kp.stride(0);
      const at::BFloat16* vh = vp.data_ptr<at::BFloat16>() + g * vp.stride(0);
      if (d == 64)
        attend_block<64>(qh, q.stride(1), oh, out.stride(1), lh, rows, row0, kh, vh, n, n - m, causal, first_row,
                         scale_log2);
      else
        attend_block<128>(qh, q.stride(1), oh, out.stride(1), lh, rows, row0, kh, vh, n, n - m, causal, first_row,
                          scale_log2);
    }
  });
  return {out, lse};
}

// fused_bf16.cpp, built into the same extension
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                                   int64_t kv_heads);
void shift_keys(torch::Tensor out, torch::Tensor keys, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flash_bf16", &flash_bf16, "bf16 flash attention on AVX512-BF16: (q, [k...], [v...], scale, causal, first_rows) -> [out, lse]",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("scale"), pybind11::arg("causal"),
        pybind11::arg("first_rows") = std::vector<int64_t>{});
  m.def("rms_norm", &rms_norm, "(x [N, H], weight [H], eps) -> LlamaRMSNorm in bf16");
  m.def("silu_mul", &silu_mul, "(gate_up [N, 2I]) -> silu(gate) * up in bf16");
  m.def("shift_keys", &shift_keys, "(out [B, n, D], keys [B, n, D], cos [n, R/2], sin [n, R/2]): KeyShifter in bf16");
  m.def("rope_qk", &rope_qk, "(qkv [N, (H + 2 H_kv) D], cos [N, D], sin [N, D], H, H_kv) -> [q, k] rotated");
}
