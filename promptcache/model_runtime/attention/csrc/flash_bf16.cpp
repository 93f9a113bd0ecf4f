// Flash attention in bf16 for x86 CPUs with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids): QK^T and
// PV on vdpbf16ps (bf16 pairs multiplied, summed in fp32), online softmax in fp32. PyTorch's fused CPU op
// uses bf16 tiles only with AMX; without AMX it runs bf16 at fp32 speed (docs/benchmarks.md), which is
// what this kernel is for. Built on first use by promptcache/model_runtime/attention/bf16_kernel.py.
//
// q [H, M, D] (any strides, last dim contiguous); k and v as lists of segments [H_kv, N_i, D], attended
// as their concatenation (N = sum N_i) without copying them together: module KV, a sequence's earlier
// tokens and its new ones in one call, one online softmax, no merges. H a multiple of H_kv (GQA: query
// head h reads KV head h / (H / H_kv)); D = 64, 128 or 256 (Gemma 3). Returns out (q's layout, bf16) and lse [H, M]
// fp32: the natural log of sum_j exp(scale * q.k_j). Causal masks are bottom-right aligned: query row r
// sees keys 0 .. r + N - M (the new tokens are the last M of the N keys). `first_rows` (optional, one per
// segment) hides a segment from the query rows before it: a prefill that recomputes tokens among cached
// ones, where a module's cached tail is positioned after some of the new tokens. `window` W > 0 (causal
// only): row r also sees no key W or more before its last one, a sliding-window layer whose keys lie at
// consecutive positions (sliding_window.py checks that), the steps wholly before a block's reach skipped.
#include <immintrin.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attend_bf16.h"

namespace {

using namespace attend;

// The general path: K and V of every KV head packed whole once (pack::pack_kv), then one work item per
// query head and block of kBlockM rows.
template <int D>
void attend_packed(const torch::Tensor& q, const std::vector<torch::Tensor>& k, const std::vector<torch::Tensor>& v,
                   int64_t n, bool causal, const int32_t* first_row, float scale_log2, torch::Tensor& out,
                   torch::Tensor& lse, int64_t window) {
  const int64_t heads = q.size(0), m = q.size(1), group = heads / k[0].size(0);
  auto [kp, vp] = pack::pack_kv(k, v, D);  // [H_kv, whole 64-key steps x 16 x D] each, zero past N
  const int64_t row_blocks = (m + kBlockM - 1) / kBlockM;
  at::parallel_for(0, heads * row_blocks, 1, [&](int64_t begin, int64_t end) {
    RowState<D> st;
    for (int64_t item = begin; item < end; ++item) {
      int64_t h = item / row_blocks, row0 = (item % row_blocks) * kBlockM, rows = std::min<int64_t>(kBlockM, m - row0);
      const at::BFloat16* kh = kp.data_ptr<at::BFloat16>() + (h / group) * kp.stride(0);
      const at::BFloat16* vh = vp.data_ptr<at::BFloat16>() + (h / group) * vp.stride(0);
      auto step = [&](int64_t k0) {
        return std::pair<const at::BFloat16*, const at::BFloat16*>(kh + (k0 / 16) * (D / 2) * 32, vh + (k0 / 2) * D * 2);
      };
      // Keys this block needs: causal rows see up to row0 + rows - 1 + (n - m).
      const int64_t key_end = causal ? std::min<int64_t>(n, row0 + rows + n - m) : n;
      // With a window the block's first row reaches back W - 1 keys: the steps before are skipped whole.
      const int64_t key_begin = window > 0 ? std::max<int64_t>(0, row0 + n - m - window + 1) / kBlockN * kBlockN : 0;
      st.reset(rows);
      attend_keys<D>(q.data_ptr<at::BFloat16>() + h * q.stride(0) + row0 * q.stride(1), q.stride(1), rows, row0,
                     key_begin, key_end, n - m, causal, first_row, scale_log2, step, st, window);
      st.finish(0, rows, out.data_ptr<at::BFloat16>() + h * out.stride(0) + row0 * out.stride(1), out.stride(1),
                lse.data_ptr<float>() + h * m + row0, 1);
    }
  });
}

}  // namespace

std::vector<torch::Tensor> flash_bf16(torch::Tensor q, std::vector<torch::Tensor> k, std::vector<torch::Tensor> v,
                                      double scale, bool causal, std::vector<int64_t> first_rows, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.stride(2) == 1,
              "flash_bf16: q must be bfloat16 [H, M, D] with a contiguous last dim");
  TORCH_CHECK(!k.empty(), "flash_bf16: at least one KV segment");
  const int64_t heads = q.size(0), m = q.size(1), d = q.size(2), kv_heads = k[0].size(0);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "flash_bf16: head dim must be 64, 128 or 256, got ", d);
  TORCH_CHECK(heads % kv_heads == 0, "flash_bf16: ", heads, " query heads for ", kv_heads, " KV heads");
  const int64_t n = checked_length(k, v, kv_heads, d);
  TORCH_CHECK(n > 0 && (!causal || n >= m), "flash_bf16: need N > 0 and, when causal, N >= M");
  auto out = torch::empty_like(q);
  auto lse = torch::empty({heads, m}, q.options().dtype(at::kFloat));
  TORCH_CHECK(first_rows.empty() || first_rows.size() == k.size(), "flash_bf16: one first row per segment");
  TORCH_CHECK(window >= 0 && (window == 0 || causal), "flash_bf16: a window (>= 0) applies to causal calls only");
  const float scale_log2 = static_cast<float>(scale) * 1.4426950408889634f;
  const bool hidden = std::any_of(first_rows.begin(), first_rows.end(), [](int64_t r) { return r > 0; });
  // Every row sees every key (a causal call of one row too), few rows per KV head: the decode path.
  if (!hidden && window == 0 && (!causal || m == 1) && (heads / kv_heads) * m <= kBlockM) {
    RowSet rows{{}, {}, {}, n};  // the M rows as members: row r of head h is q[h, r]
    for (int64_t r = 0; r < m; ++r) rows.members.push_back(r);
    for (size_t i = 0; i < k.size(); ++i) rows.k.push_back(pack::part_of(k[i])), rows.v.push_back(pack::part_of(v[i]));
    attend_sets({rows}, m, {q.data_ptr<at::BFloat16>(), q.stride(1), q.stride(0)},
                {out.data_ptr<at::BFloat16>(), out.stride(1), out.stride(0), lse.data_ptr<float>(), 1, m}, heads,
                kv_heads, d, scale_log2);
    return {out, lse};
  }
  // Per key, the first query row that sees it (its segment's entry of first_rows), when any is > 0.
  std::vector<int32_t> key_first_row;
  if (hidden) {
    key_first_row.assign((n + 63) / 64 * 64, 0);
    int64_t start = 0;
    for (size_t i = 0; i < k.size(); ++i) {
      std::fill_n(key_first_row.begin() + start, k[i].size(1), static_cast<int32_t>(std::max<int64_t>(0, first_rows[i])));
      start += k[i].size(1);
    }
  }
  const int32_t* first_row = key_first_row.empty() ? nullptr : key_first_row.data();
  if (d == 64) attend_packed<64>(q, k, v, n, causal, first_row, scale_log2, out, lse, window);
  else if (d == 128) attend_packed<128>(q, k, v, n, causal, first_row, scale_log2, out, lse, window);
  else attend_packed<256>(q, k, v, n, causal, first_row, scale_log2, out, lse, window);
  return {out, lse};
}

// decode_bf16.cpp, built into the same extension: decode_bf16 and DecodeBatch
void bind_decode(pybind11::module_& m);
// int4_bf16.cpp, built into the same extension
void bind_int4(pybind11::module_& m);
void bind_int8(pybind11::module_& m);  // int8_bf16.cpp

// fused_bf16.cpp, built into the same extension
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rms_norm_scaled(torch::Tensor x, torch::Tensor scale, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                                   int64_t kv_heads);
void shift_keys(torch::Tensor out, torch::Tensor keys, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flash_bf16", &flash_bf16,
        "bf16 flash attention on AVX512-BF16: (q, [k...], [v...], scale, causal, first_rows, window) -> [out, lse]",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("scale"), pybind11::arg("causal"),
        pybind11::arg("first_rows") = std::vector<int64_t>{}, pybind11::arg("window") = 0);
  bind_decode(m);
  bind_int4(m);
  bind_int8(m);
  m.def("rms_norm", &rms_norm, "(x [N, H], weight [H], eps) -> LlamaRMSNorm in bf16");
  m.def("rms_norm_scaled", &rms_norm_scaled, "(x [N, H], scale [H] fp32, eps) -> Gemma's RMSNorm (1 + w) in bf16");
  m.def("silu_mul", &silu_mul, "(gate_up [N, 2I]) -> silu(gate) * up in bf16");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "(gate_up [N, 2I]) -> gelu_tanh(gate) * up in bf16 (Gemma's MLP)");
  m.def("shift_keys", &shift_keys, "(out [B, n, D], keys [B, n, D], cos [n, R/2], sin [n, R/2]): KeyShifter in bf16");
  m.def("rope_qk", &rope_qk, "(qkv [N, (H + 2 H_kv) D], cos [N, D], sin [N, D], H, H_kv) -> [q, k] rotated");
}
