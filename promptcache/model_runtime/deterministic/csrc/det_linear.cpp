// y = x W^T + b whose every output element is one fixed chain of fp32 FMAs, whatever the number of rows.
//
// Why: a BLAS picks its kernel and its split of the K sum by the shape (MKL's fp32 GEMV at one row, other
// blockings at a few rows or many), so a row's result depends on how many rows its step holds. Here
// y[m][n] = fma(x[m][K-1], w[K-1][n], ... fma(x[m][1], w[1][n], x[m][0] * w[0][n])) + b[n], k ascending,
// in every tile shape: the tiles (rows x 16-feature panels) only choose how many such chains run side by
// side in the registers, never how one chain is computed. Threads split the panels and row blocks, so
// their number changes nothing either.
//
// The weight [N, K] is packed once at load into panels of 16 output features, [ceil(N/16)][K][16], zero
// past N, in its own dtype (fp32 or bf16, widened as loaded). x is fp32 or bf16 [M, K] (widened once into
// a scratch copy); y has x's dtype, accumulated in fp32.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "det_common.h"

namespace {

using det::load8;

constexpr int64_t kPanel = 16;  // output features per packed panel: two ymm registers

// MR rows x NP panels of output: MR * NP * 2 accumulators, each one output element's chain per lane.
template <int MR, int NP, typename W, typename Y>
void tile(const float* x, int64_t x_stride, const W* panels, int64_t k_len, const float* bias, int64_t n0,
          int64_t n_len, Y* y, int64_t y_stride) {
  // Whole tiles unrolled so that the accumulators stay in registers (GCC otherwise spills them every k).
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_len; ++k) {
    __m256 w[NP][2];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const W* at = panels + (p * k_len + k) * kPanel;
      w[p][0] = load8(at);
      w[p][1] = load8(at + det::kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + k);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        acc[r][p][0] = _mm256_fmadd_ps(xb, w[p][0], acc[r][p][0]);  // 0 + x0 w0 is x0 w0 rounded: the chain's start
        acc[r][p][1] = _mm256_fmadd_ps(xb, w[p][1], acc[r][p][1]);
      }
    }
  }
  alignas(32) float out[MR][NP * kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      _mm256_store_ps(&out[r][p * kPanel], acc[r][p][0]);
      _mm256_store_ps(&out[r][p * kPanel + det::kLanes], acc[r][p][1]);
    }
  const int64_t count = std::min<int64_t>(NP * kPanel, n_len - n0);
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < count; ++j)
      det::store(y + r * y_stride + n0 + j, bias ? out[r][j] + bias[n0 + j] : out[r][j]);
}

// Rows [m0, m1) x panels [p0, p1): few rows take wide tiles (enough independent chains to hide the FMA
// latency), many rows take 6 x 1 tiles (6 broadcasts and 2 weight loads per 12 FMAs).
template <typename W, typename Y>
void block(const float* x, int64_t x_stride, const W* packed, int64_t k_len, const float* bias, int64_t n_len, Y* y,
           int64_t y_stride, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  const int64_t panel_size = k_len * kPanel;
  auto at = [&](int64_t m, int64_t p) {
    return std::make_tuple(x + m * x_stride, packed + p * panel_size, y + m * y_stride);
  };
#define PC_TILE(MR, NP)                                                                      \
  {                                                                                          \
    auto [xr, wp, yr] = at(m, p);                                                            \
    tile<MR, NP>(xr, x_stride, wp, k_len, bias, p * kPanel, n_len, yr, y_stride);            \
  }
  const int64_t rows = m1 - m0;
  if (rows <= 3) {
    for (int64_t p = p0; p < p1;) {
      const int64_t m = m0, left = p1 - p;
      if (rows == 1 && left >= 6) { PC_TILE(1, 6) p += 6; }
      else if (rows == 2 && left >= 3) { PC_TILE(2, 3) p += 3; }
      else if (rows == 3 && left >= 2) { PC_TILE(3, 2) p += 2; }
      else {
        for (int64_t m = m0; m < m1; ++m) PC_TILE(1, 1)
        p += 1;
      }
    }
    return;
  }
  for (int64_t p = p0; p < p1; ++p) {
    int64_t m = m0;
    for (; m + 6 <= m1; m += 6) PC_TILE(6, 1)
    for (; m < m1; ++m) PC_TILE(1, 1)
  }
#undef PC_TILE
}

template <typename W, typename Y>
void linear_typed(const float* x, int64_t x_stride, const W* packed, int64_t m, int64_t k, int64_t n, const float* bias,
                  Y* y) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  // Work items: blocks of rows x groups of panels, about 4 per thread (their size changes no result).
  const int64_t row_block = m <= 3 ? m : 48;
  const int64_t row_blocks = (m + row_block - 1) / row_block;
  const int64_t threads = at::get_num_threads();
  const int64_t wanted_groups = std::max<int64_t>(1, (4 * threads + row_blocks - 1) / row_blocks);
  const int64_t group = std::max<int64_t>(6, (panels + wanted_groups - 1) / wanted_groups);
  const int64_t groups = (panels + group - 1) / group;
  at::parallel_for(0, row_blocks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t rb = item % row_blocks, g = item / row_blocks;
      const int64_t m0 = rb * row_block, m1 = std::min(m, m0 + row_block);
      block(x, x_stride, packed, k, bias, n, y, n, m0, m1, g * group, std::min(panels, (g + 1) * group));
    }
  });
}

}  // namespace

// w [N, K] (fp32 or bf16) -> panels [ceil(N/16), K, 16] in w's dtype, zero past N.
torch::Tensor det_pack(torch::Tensor w) {
  det::check_float_rows(w, "weight");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, k}, w.options());
  padded.slice(0, 0, n).copy_(w);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

// x [M, K], packed (det_pack's), n = N, bias [N] or None -> y [M, N] in x's dtype.
torch::Tensor det_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  det::check_float_rows(x, "x");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
              packed.size(0) * kPanel >= n && n > 0 && packed.size(0) == (n + kPanel - 1) / kPanel,
              "packed must be det_pack's [ceil(N/16), K, 16]");
  TORCH_CHECK(packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16, "packed must be fp32 or bf16");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " features, the weight ", packed.size(1));
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  torch::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat).contiguous();  // widening is exact
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias must have ", n, " elements");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const float* xp = xf.data_ptr<float>();
  const int64_t xs = xf.stride(0);
  const bool w16 = packed.scalar_type() == at::kBFloat16, y16 = x.scalar_type() == at::kBFloat16;
  if (w16 && y16)
    linear_typed(xp, xs, packed.data_ptr<at::BFloat16>(), m, k, n, bp, y.data_ptr<at::BFloat16>());
  else if (w16)
    linear_typed(xp, xs, packed.data_ptr<at::BFloat16>(), m, k, n, bp, y.data_ptr<float>());
  else if (y16)
    linear_typed(xp, xs, packed.data_ptr<float>(), m, k, n, bp, y.data_ptr<at::BFloat16>());
  else
    linear_typed(xp, xs, packed.data_ptr<float>(), m, k, n, bp, y.data_ptr<float>());
  return y;
}
