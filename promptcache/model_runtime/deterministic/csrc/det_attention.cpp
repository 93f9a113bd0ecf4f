// Attention whose result for a query row depends only on the keys it sees and their order, not on how they
// are split: one prefill over a prompt, cached blocks plus the sequence's own keys, a batch of sequences
// sharing blocks all give the same bits.
//
// Each sequence's keys form one logical sequence: its KV pieces in order (cached modules and prefix blocks,
// the fork's prompt KV), then its own KV, whose last T keys are the step's T query rows (causal). A query
// row walks that logical sequence in blocks of kBlock keys aligned to the logical index (key j is in block
// j / kBlock wherever the pieces start), with an online softmax in fp32: per block, the scores of the keys
// it sees (q.k in one fixed order, times the scale), their max, p = e^(s - m), then l and the output
// accumulated key by key in logical order. Keys a row does not see (a piece hidden from the rows before its
// `first_row`, own keys after the row's own token) are skipped, never added as zeros.
//
// AttentionPlan is built once per forward pass from every layer's KV ([L, H_kv, n, D] views, any strides
// but the last) and called once per layer: attend(q [T, H, D], layer, scale) -> [T, H, D] in q's dtype.
// Work items are (sequence, KV head, block of query rows); no item splits a row's keys.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "det_common.h"

namespace {

constexpr int64_t kBlock = 32;     // keys per softmax block, aligned to the logical key index
constexpr int64_t kRowBlock = 16;  // query rows per work item

struct Piece {
  torch::Tensor keys, values;  // [L, H_kv, n, D]
  int64_t n;
  int64_t first_row;  // query rows (of this step, per sequence) before it do not see it; own KV: -1 (causal)
};

struct Seq {
  std::vector<Piece> pieces;  // in logical order, own KV last
  int64_t num_queries, first_query, own_prefix;  // own_prefix: own keys before the step's own tokens
};

template <typename T>
const T* row_ptr(const torch::Tensor& t, int64_t layer, int64_t head, int64_t i) {
  return t.data_ptr<T>() + layer * t.stride(0) + head * t.stride(1) + i * t.stride(2);
}

template <typename T>
void widen(const T* src, float* dst, int64_t d) {
  for (int64_t j = 0; j < d; j += det::kLanes) _mm256_storeu_ps(dst + j, det::load8(src + j));
}

// Scores of `rows` query rows (fp32 [rows][D]) against a block's keys, stored transposed (kt [D][kBlock]):
// s[r][j] = fma chain over d ascending of q[r][d] * k[j][d], then times the scale. Keys sit in lanes, so a
// score is the same chain in whichever lane, row or call it is computed.
template <int R>
void scores(const float* q, int64_t d, const float* kt, float scale, float* s) {
  __m256 acc[R][kBlock / det::kLanes];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kBlock / det::kLanes; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q + r * d + i);
#pragma GCC unroll 4
      for (int c = 0; c < kBlock / det::kLanes; ++c)
        acc[r][c] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(kt + i * kBlock + c * det::kLanes), acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kBlock / det::kLanes; ++c)
      _mm256_storeu_ps(s + r * kBlock + c * det::kLanes, _mm256_mul_ps(acc[r][c], _mm256_set1_ps(scale)));
}

// acc[0 .. 8 NV) of one row: acc * alpha (unless first), then + p_i v_i for the keys seen, in order.
template <int NV>
void accumulate(float* acc, bool first, float alpha, const float* p, const int64_t* seen, int64_t num_seen,
                const float* vb, int64_t d) {
  __m256 a[NV];
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c)
    a[c] = first ? _mm256_setzero_ps() : _mm256_mul_ps(_mm256_loadu_ps(acc + c * det::kLanes), _mm256_set1_ps(alpha));
  for (int64_t i = 0; i < num_seen; ++i) {
    const __m256 pb = _mm256_set1_ps(p[seen[i]]);
    const float* v = vb + seen[i] * d;
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) a[c] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + c * det::kLanes), a[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(acc + c * det::kLanes, a[c]);
}

using Accumulate = void (*)(float*, bool, float, const float*, const int64_t*, int64_t, const float*, int64_t);
constexpr Accumulate kAccumulate[9] = {nullptr, accumulate<1>, accumulate<2>, accumulate<3>, accumulate<4>,
                                       accumulate<5>, accumulate<6>, accumulate<7>, accumulate<8>};

template <typename T>
void attend_item(const Seq& seq, int64_t layer, int64_t kv_head, int64_t group, int64_t d, int64_t t0, int64_t t1,
                 const T* q, int64_t q_row_stride, int64_t q_head_stride, T* out, int64_t out_row_stride,
                 int64_t out_head_stride, float scale) {
  const int64_t rows = (t1 - t0) * group;  // (query row, head of the KV group) pairs, row-major
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  std::vector<float> qf(rows * d), acc(rows * d, 0.0f), m(rows, kNegInf), l(rows, 0.0f);
  std::vector<float> kt(d * kBlock), vb(kBlock * d), s(rows * kBlock);
  std::vector<int64_t> min_row(kBlock), seen(kBlock);
  alignas(32) float lanes[kBlock];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < group; ++g)
      widen(q + (seq.first_query + t) * q_row_stride + (kv_head * group + g) * q_head_stride, &qf[((t - t0) * group + g) * d], d);
  // The logical keys this block of rows may see: every piece, and own keys up to the last row's token.
  int64_t total = 0;
  for (size_t i = 0; i + 1 < seq.pieces.size(); ++i) total += seq.pieces[i].n;
  total += seq.own_prefix + t1;
  size_t piece = 0;
  int64_t piece_start = 0;  // logical index of the current piece's first key
  for (int64_t b0 = 0; b0 < total; b0 += kBlock) {
    const int64_t slots = std::min(kBlock, total - b0);
    // Gather the block's keys (transposed) and values, widened to fp32, and the first row that sees each key;
    // slots past the end hold zeros that no row sees.
    int64_t first_seen = std::numeric_limits<int64_t>::max();
    for (int64_t j = 0; j < kBlock; ++j) {
      if (j >= slots) {
        for (int64_t i = 0; i < d; ++i) kt[i * kBlock + j] = 0.0f;
        min_row[j] = std::numeric_limits<int64_t>::max();
        continue;
      }
      const int64_t logical = b0 + j;
      while (logical >= piece_start + seq.pieces[piece].n) piece_start += seq.pieces[piece++].n;
      const Piece& pc = seq.pieces[piece];
      const int64_t i = logical - piece_start;
      const T* key = row_ptr<T>(pc.keys, layer, kv_head, i);
      for (int64_t c = 0; c < d; ++c) kt[c * kBlock + j] = det::to_float(key[c]);
      widen(row_ptr<T>(pc.values, layer, kv_head, i), &vb[j * d], d);
      min_row[j] = pc.first_row >= 0 ? pc.first_row : i - seq.own_prefix;
      first_seen = std::min(first_seen, min_row[j]);
    }
    if (first_seen >= t1) continue;  // no row of this item sees a key of the block
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3) scores<3>(&qf[r * d], d, kt.data(), scale, &s[r * kBlock]);
    for (; r < rows; ++r) scores<1>(&qf[r * d], d, kt.data(), scale, &s[r * kBlock]);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = t0 + r / group;
      if (first_seen > t) continue;
      int64_t num_seen = 0;
      float block_max = kNegInf;
      const float* sr = &s[r * kBlock];
      for (int64_t j = 0; j < kBlock; ++j)
        if (min_row[j] <= t) {
          seen[num_seen++] = j;
          block_max = std::max(block_max, sr[j]);
        }
      const bool first = m[r] == kNegInf;
      const float m_new = std::max(m[r], block_max);
      const float alpha = first ? 0.0f : det::exp1(m[r] - m_new);
      for (int64_t c = 0; c < kBlock; c += det::kLanes)  // lane by lane: unseen lanes are computed, never used
        _mm256_store_ps(lanes + c, det::exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + c), _mm256_set1_ps(m_new))));
      float block_sum = 0.0f;
      for (int64_t i = 0; i < num_seen; ++i) block_sum += lanes[seen[i]];
      l[r] = first ? block_sum : l[r] * alpha + block_sum;
      for (int64_t c = 0; c < d; c += 8 * det::kLanes)  // up to 64 values of the row at a time in registers
        kAccumulate[std::min<int64_t>(8, (d - c) / det::kLanes)](&acc[r * d + c], first, alpha, lanes, seen.data(),
                                                                 num_seen, vb.data() + c, d);
      m[r] = m_new;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group, g = r % group;
    T* o = out + (seq.first_query + t) * out_row_stride + (kv_head * group + g) * out_head_stride;
    const float inv = 1.0f / l[r];  // every row sees at least its own token
    for (int64_t c = 0; c < d; ++c) det::store(o + c, acc[r * d + c] * inv);
  }
}

class AttentionPlan {
 public:
  // Per sequence: its pieces' keys and values [L, H_kv, n, D] and first rows (logical order), its own KV
  // [L, H_kv, >= own_len, D] holding `own_len` keys after this step's writes, and its number of query rows.
  AttentionPlan(std::vector<std::vector<torch::Tensor>> keys, std::vector<std::vector<torch::Tensor>> values,
                std::vector<std::vector<int64_t>> first_rows, std::vector<torch::Tensor> own_keys,
                std::vector<torch::Tensor> own_values, std::vector<int64_t> own_lens, std::vector<int64_t> query_lens) {
    const size_t num = query_lens.size();
    TORCH_CHECK(keys.size() == num && values.size() == num && first_rows.size() == num && own_keys.size() == num &&
                own_values.size() == num && own_lens.size() == num, "one entry per sequence in every list");
    int64_t first_query = 0;
    for (size_t i = 0; i < num; ++i) {
      TORCH_CHECK(keys[i].size() == values[i].size() && keys[i].size() == first_rows[i].size(),
                  "sequence ", i, ": one value tensor and first row per key tensor");
      TORCH_CHECK(query_lens[i] >= 1 && own_lens[i] >= query_lens[i], "sequence ", i, ": ", query_lens[i],
                  " query rows need as many own keys, got ", own_lens[i]);
      Seq seq;
      for (size_t j = 0; j < keys[i].size(); ++j) {
        check(keys[i][j], values[i][j]);
        TORCH_CHECK(first_rows[i][j] >= 0, "first rows must be >= 0");
        seq.pieces.push_back({keys[i][j], values[i][j], keys[i][j].size(2), first_rows[i][j]});
      }
      check(own_keys[i], own_values[i]);
      TORCH_CHECK(own_keys[i].size(2) >= own_lens[i], "sequence ", i, ": own KV holds fewer than ", own_lens[i], " keys");
      seq.pieces.push_back({own_keys[i], own_values[i], own_lens[i], -1});
      seq.num_queries = query_lens[i];
      seq.first_query = first_query;
      seq.own_prefix = own_lens[i] - query_lens[i];
      first_query += query_lens[i];
      seqs_.push_back(std::move(seq));
    }
    total_queries_ = first_query;
  }

  torch::Tensor attend(torch::Tensor q, int64_t layer, double scale) const {
    TORCH_CHECK(q.dim() == 3 && q.size(0) == total_queries_ && q.stride(2) == 1, "q must be [", total_queries_,
                ", H, D] with a contiguous last dim");
    TORCH_CHECK(q.scalar_type() == dtype_ && q.device().is_cpu(), "q must have the KV's dtype");
    TORCH_CHECK(q.size(2) == d_ && q.size(1) % kv_heads_ == 0, "q's head dim or head count does not fit the KV");
    TORCH_CHECK(layer >= 0 && layer < layers_, "layer out of range");
    auto out = torch::empty(q.sizes(), q.options());
    const int64_t group = q.size(1) / kv_heads_;
    std::vector<std::array<int64_t, 3>> items;  // (sequence, KV head, first row)
    for (size_t i = 0; i < seqs_.size(); ++i)
      for (int64_t h = 0; h < kv_heads_; ++h)
        for (int64_t t = 0; t < seqs_[i].num_queries; t += kRowBlock) items.push_back({static_cast<int64_t>(i), h, t});
    // Items that see the most keys first, taken one at a time by whichever thread is free (which thread
    // computes an item changes nothing in it).
    std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) { return cost(a) > cost(b); });
    std::atomic<int64_t> next{0};
    const int64_t num_items = static_cast<int64_t>(items.size());
    at::parallel_for(0, std::min<int64_t>(num_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      for (int64_t it = next++; it < num_items; it = next++) {
        const auto [i, h, t0] = items[it];
        const Seq& seq = seqs_[i];
        const int64_t t1 = std::min(seq.num_queries, t0 + kRowBlock);
        if (dtype_ == at::kBFloat16)
          attend_item<at::BFloat16>(seq, layer, h, group, d_, t0, t1, q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1),
                                    out.data_ptr<at::BFloat16>(), out.stride(0), out.stride(1), static_cast<float>(scale));
        else
          attend_item<float>(seq, layer, h, group, d_, t0, t1, q.data_ptr<float>(), q.stride(0), q.stride(1),
                             out.data_ptr<float>(), out.stride(0), out.stride(1), static_cast<float>(scale));
      }
    });
    return out;
  }

 private:
  int64_t cost(const std::array<int64_t, 3>& item) const {  // keys the item's last row sees
    const Seq& seq = seqs_[item[0]];
    int64_t keys = seq.own_prefix + std::min(seq.num_queries, item[2] + kRowBlock);
    for (size_t i = 0; i + 1 < seq.pieces.size(); ++i) keys += seq.pieces[i].n;
    return keys;
  }

  void check(const torch::Tensor& k, const torch::Tensor& v) {
    TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "KV must be [L, H_kv, n, D] pairs");
    TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.device().is_cpu() && v.device().is_cpu(),
                "KV must be CPU tensors with a contiguous last dim");
    TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16), "KV must be fp32 or bf16");
    if (layers_ < 0) {
      layers_ = k.size(0), kv_heads_ = k.size(1), d_ = k.size(3), dtype_ = k.scalar_type();
      TORCH_CHECK(d_ % det::kLanes == 0 && d_ > 0, "head dim must be a multiple of 8");
    }
    TORCH_CHECK(k.size(0) == layers_ && k.size(1) == kv_heads_ && k.size(3) == d_ && k.scalar_type() == dtype_,
                "every KV tensor must have the same layers, KV heads, head dim and dtype");
  }

  std::vector<Seq> seqs_;
  int64_t total_queries_ = 0, layers_ = -1, kv_heads_ = 0, d_ = 0;
  at::ScalarType dtype_ = at::kFloat;
};

}  // namespace

void bind_attention(pybind11::module& m) {
  pybind11::class_<AttentionPlan>(m, "AttentionPlan")
      .def(pybind11::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<torch::Tensor>>,
                          std::vector<std::vector<int64_t>>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<int64_t>, std::vector<int64_t>>(),
           "(keys, values, first_rows: per sequence its pieces in logical order, own_keys, own_values, own_lens, "
           "query_lens)")
      .def("attend", &AttentionPlan::attend, "(q [T, H, D], layer, scale) -> [T, H, D]");
}
