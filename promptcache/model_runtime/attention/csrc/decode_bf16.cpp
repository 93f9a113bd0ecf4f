// Decode-shaped attention in bf16: few query rows per KV head, every row seeing every key of its sets.
//
// attend_sets() is the engine: sets of members (query rows) that each attend one list of KV segments,
// a member's sets merged by log-sum-exp. A work item is (set, KV head, block of members, chunk of keys);
// it packs each 64-key step of K and V into its own buffers as it reads it (pack_bf16.h), so the KV is
// read once where it lies (a whole-head packed copy costs more than the attention when a few rows read
// many keys), and key chunks let both threads work on one sequence with 3 KV heads.
//
// Entry points: decode_bf16 (one call for a list of sequences, each with its own segments) and
// DecodeBatch, which a decode step builds once from every layer's KV ([L, H_kv, N, D] tensors) and calls
// once per layer: its sequences' own KV, the segments only one sequence sees, and the segments several
// sequences share (attended once by all their rows) in one call, no Python between them.
#include <immintrin.h>
#include <pybind11/stl.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "attend_bf16.h"
#include "decode_plan.h"

namespace attend {
namespace {

// A set's work split: members per block (whole GQA groups, at most kBlockM rows), chunks of keys.
struct Split {
  int64_t members_per_block, blocks, chunks, chunk_steps, first_item;
};

template <int D>
void attend_sets_d(const std::vector<RowSet>& sets, int64_t num_members, const QRows& q, const OutRows& out,
                   int64_t heads, int64_t kv_heads, float scale_log2) {
  const int64_t group = heads / kv_heads, num_sets = static_cast<int64_t>(sets.size());
  const int64_t members_per_block = std::max<int64_t>(1, kBlockM / group);
  const int64_t threads = at::get_num_threads();
  // Work is split by cost (rows x key steps): a set's blocks get key chunks of about a quarter of a
  // thread's share each (at least 4 key steps, 256 keys), so one set many sequences share is spread over
  // every thread however many small own-KV sets sit beside it.
  int64_t total_cost = 0;
  for (const auto& set : sets) total_cost += static_cast<int64_t>(set.members.size()) * ((set.n + kBlockN - 1) / kBlockN);
  const int64_t item_cost = std::max<int64_t>(1, kv_heads * total_cost / (4 * threads));
  std::vector<Split> splits(num_sets);
  int64_t items = 0;
  for (int64_t s = 0; s < num_sets; ++s) {
    const int64_t steps = (sets[s].n + kBlockN - 1) / kBlockN;
    Split& sp = splits[s];
    sp.members_per_block = members_per_block;
    sp.blocks = (static_cast<int64_t>(sets[s].members.size()) + members_per_block - 1) / members_per_block;
    const int64_t block_cost = std::min<int64_t>(static_cast<int64_t>(sets[s].members.size()), members_per_block) * steps;
    sp.chunks = std::max<int64_t>(1, std::min<int64_t>((block_cost + item_cost - 1) / item_cost, steps / 4));
    sp.chunk_steps = (steps + sp.chunks - 1) / sp.chunks;
    sp.first_item = items;
    items += kv_heads * sp.blocks * sp.chunks;
  }
  // Reused across calls (the engine calls from one thread, once per layer): no allocation per layer.
  static thread_local std::vector<RowState<D>> reused;
  if (static_cast<int64_t>(reused.size()) < items) reused.resize(items);
  RowState<D>* const states = reused.data();  // by pointer: worker threads see their own thread_locals
  // Items are taken one at a time by whichever thread is free (a contiguous split by count put every
  // item of a shared set on one thread and the small own-KV items on the other).
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    alignas(64) at::BFloat16 qbuf[kBlockM][D];
    alignas(64) at::BFloat16 kbuf[kBlockN * D], vbuf[kBlockN * D];
    int64_t s = 0;  // items come in increasing order on each thread: the set index only moves forward
    for (int64_t item; (item = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
      while (s + 1 < num_sets && item >= splits[s + 1].first_item) ++s;
      const RowSet& set = sets[s];
      const Split& sp = splits[s];
      const int64_t local = item - sp.first_item, c = local % sp.chunks, block = (local / sp.chunks) % sp.blocks;
      const int64_t g = local / (sp.chunks * sp.blocks);
      const int64_t first = block * sp.members_per_block;
      const int64_t count = std::min<int64_t>(sp.members_per_block, static_cast<int64_t>(set.members.size()) - first);
      const int64_t span = sp.chunk_steps * kBlockN;
      const int64_t k_begin = std::min(set.n, c * span), k_end = std::min(set.n, (c + 1) * span);
      RowState<D>& st = states[item];
      st.reset(count * group);
      if (k_begin >= k_end) continue;  // an empty chunk: max -inf, sum 0, no weight in the merge
      for (int64_t i = 0; i < count; ++i)  // row i * G + j: member first + i, query head g * G + j
        for (int64_t j = 0; j < group; ++j)
          std::copy_n(q.base + set.members[first + i] * q.member_stride + (g * group + j) * q.head_stride, D,
                      qbuf[i * group + j]);
      const pack::Rows k_rows(set.k, g), v_rows(set.v, g);
      size_t k_hint = 0, v_hint = 0;
      auto step = [&](int64_t k0) {
        // The next step's keys and values are on their way while this one is packed and attended:
        // a decode reads its KV from memory once, and the latency of each row is what it waits on.
        k_rows.prefetch(k0 + kBlockN, std::min(k_end, k0 + 2 * kBlockN), D * 2, k_hint);
        v_rows.prefetch(k0 + kBlockN, std::min(k_end, k0 + 2 * kBlockN), D * 2, v_hint);
        pack::pack_keys(k_rows, k0 / 16, k0 / 16 + 4, D, kbuf);
        pack::pack_values(v_rows, k0 / 2, k0 / 2 + 32, D, vbuf);
        return std::pair<const at::BFloat16*, const at::BFloat16*>(kbuf, vbuf);
      };
      attend_keys<D>(&qbuf[0][0], D, count * group, 0, k_begin, k_end, 0, false, nullptr, scale_log2, step, st);
    }
  });
  // Each member's places: (set, its index among the set's members).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> places(num_members);
  for (int64_t s = 0; s < num_sets; ++s)
    for (int64_t i = 0; i < static_cast<int64_t>(sets[s].members.size()); ++i) places[sets[s].members[i]].emplace_back(s, i);
  // Merge per member and KV head: every chunk of every set holding the member, weights 2^(m_c - max).
  at::parallel_for(0, num_members * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<const RowState<D>*, int64_t>> chunks;  // (state, the member's first row in it)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t member = item / kv_heads, g = item % kv_heads;
      chunks.clear();
      for (const auto& [s, i] : places[member]) {
        const Split& sp = splits[s];
        const int64_t block = i / sp.members_per_block, row = (i % sp.members_per_block) * group;
        for (int64_t c = 0; c < sp.chunks; ++c)
          chunks.emplace_back(&states[sp.first_item + (g * sp.blocks + block) * sp.chunks + c], row);
      }
      for (int64_t j = 0; j < group; ++j) {
        float m = -std::numeric_limits<float>::infinity(), l = 0.f;
        alignas(64) float acc[D] = {};
        for (const auto& [st, row] : chunks) m = std::max(m, st->m[row + j]);
        for (const auto& [st, row] : chunks) {
          const int64_t r = row + j;
          if (st->l[r] == 0.f) continue;
          const float w = std::exp2(st->m[r] - m);
          l += st->l[r] * w;
          const __m512 wv = _mm512_set1_ps(w);
          for (int d = 0; d < D; d += 16)
            _mm512_store_ps(acc + d, _mm512_fmadd_ps(_mm512_load_ps(&st->acc[r][d]), wv, _mm512_load_ps(acc + d)));
        }
        const int64_t h = g * group + j;
        at::BFloat16* o = out.base + member * out.member_stride + h * out.head_stride;
        const __m512 inv = _mm512_set1_ps(1.f / l);
        for (int d = 0; d < D; d += 16)
          _mm256_storeu_si256((__m256i*)(o + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + d), inv)));
        out.lse[member * out.lse_member_stride + h * out.lse_head_stride] = (m + std::log2(l)) * 0.69314718055994531f;
      }
    }
  });
}

}  // namespace

void attend_sets(const std::vector<RowSet>& sets, int64_t num_members, const QRows& q, const OutRows& out,
                 int64_t heads, int64_t kv_heads, int64_t d, float scale_log2) {
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kBlockM, "decode attention: ", heads,
              " query heads for ", kv_heads, " KV heads");
  std::vector<bool> covered(num_members, false);
  for (const auto& set : sets) {
    TORCH_CHECK(set.n > 0 && set.k.size() == set.v.size(), "decode attention: a set without keys");
    for (int64_t member : set.members) {
      TORCH_CHECK(0 <= member && member < num_members, "decode attention: member ", member, " out of range");
      covered[member] = true;
    }
  }
  for (int64_t member = 0; member < num_members; ++member)
    TORCH_CHECK(covered[member], "decode attention: sequence ", member, " has no keys");
  if (d == 64) attend_sets_d<64>(sets, num_members, q, out, heads, kv_heads, scale_log2);
  else if (d == 128) attend_sets_d<128>(sets, num_members, q, out, heads, kv_heads, scale_log2);
  else attend_sets_d<256>(sets, num_members, q, out, heads, kv_heads, scale_log2);
}

}  // namespace attend

namespace {

using attend::OutRows;
using attend::QRows;
using attend::RowSet;

// (q [B, H, D], out [B, H, D], lse [B, H]) as the members' addressing.
QRows rows_of(const torch::Tensor& q) { return {q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1)}; }
OutRows out_of(torch::Tensor& out, torch::Tensor& lse) {
  return {out.data_ptr<at::BFloat16>(), out.stride(0), out.stride(1), lse.data_ptr<float>(), lse.stride(0), lse.stride(1)};
}

void check_queries(const torch::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.stride(2) == 1 && q.size(0) > 0,
              "decode attention: q must be bfloat16 [B, H, D] with a contiguous last dim");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128 || q.size(2) == 256,
              "decode attention: head dim must be 64, 128 or 256, got ", q.size(2));
}

constexpr float kLog2e = 1.4426950408889634f;

}  // namespace

std::vector<torch::Tensor> decode_bf16(torch::Tensor q, std::vector<std::vector<torch::Tensor>> k,
                                       std::vector<std::vector<torch::Tensor>> v, double scale) {
  check_queries(q);
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(static_cast<int64_t>(k.size()) == batch && static_cast<int64_t>(v.size()) == batch,
              "decode_bf16: one key and one value list per sequence");
  TORCH_CHECK(!k[0].empty(), "decode_bf16: sequence 0 has no keys");
  const int64_t kv_heads = k[0][0].size(0);
  std::vector<RowSet> sets;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = attend::checked_length(k[b], v[b], kv_heads, d);
    TORCH_CHECK(n > 0, "decode_bf16: sequence ", b, " has no keys");
    RowSet set{{b}, {}, {}, n};
    for (size_t i = 0; i < k[b].size(); ++i) set.k.push_back(pack::part_of(k[b][i])), set.v.push_back(pack::part_of(v[b][i]));
    sets.push_back(std::move(set));
  }
  auto out = torch::empty_like(q);
  auto lse = torch::empty({batch, heads}, q.options().dtype(at::kFloat));
  attend::attend_sets(sets, batch, rows_of(q), out_of(out, lse), heads, kv_heads, d, static_cast<float>(scale) * kLog2e);
  return {out, lse};
}

// A decode step's attention, planned once for all layers (decode_plan.h); `attend(q, layer, scale)` reads layer
// `layer` of each of the step's KV tensors.
class DecodeBatch {
 public:
  DecodeBatch(std::vector<torch::Tensor> own_k, std::vector<torch::Tensor> own_v, std::vector<int64_t> own_lens,
              std::vector<torch::Tensor> seg_k, std::vector<torch::Tensor> seg_v,
              std::vector<std::vector<int64_t>> seg_members)
      : plan_(std::move(own_k), std::move(own_v), std::move(own_lens), std::move(seg_k), std::move(seg_v),
              std::move(seg_members), at::kBFloat16, "bfloat16") {}

  // q [B, H, D] (any strides, last dim contiguous), one row per sequence -> [out [B, H, D], lse [B, H] fp32].
  std::vector<torch::Tensor> attend(torch::Tensor q, int64_t layer, double scale) const {
    check_queries(q);
    const int64_t batch = plan_.batch();
    TORCH_CHECK(q.size(0) == batch && q.size(2) == plan_.head_dim(), "DecodeBatch: q must be [", batch, ", H, ",
                plan_.head_dim(), "]");
    TORCH_CHECK(0 <= layer && layer < plan_.layers(), "DecodeBatch: layer ", layer, " of ", plan_.layers());
    std::vector<RowSet> sets;
    sets.reserve(plan_.plans().size());
    for (const auto& plan : plan_.plans()) {
      RowSet set{plan.members, {}, {}, 0};
      for (const auto& p : plan.parts) {
        set.k.push_back({p.k + layer * p.k_layer, p.k_head, p.k_row, p.n});
        set.v.push_back({p.v + layer * p.v_layer, p.v_head, p.v_row, p.n});
        set.n += p.n;
      }
      sets.push_back(std::move(set));
    }
    auto out = torch::empty_like(q);
    auto lse = torch::empty({batch, q.size(1)}, q.options().dtype(at::kFloat));
    attend::attend_sets(sets, batch, rows_of(q), out_of(out, lse), q.size(1), plan_.kv_heads(), plan_.head_dim(),
                        static_cast<float>(scale) * kLog2e);
    return {out, lse};
  }

 private:
  decode_plan::StepPlan<at::BFloat16> plan_;
};

void bind_decode(pybind11::module_& m) {
  m.def("decode_bf16", &decode_bf16, "decoding sequences, one query row each, each over its own KV segments: "
        "(q [B, H, D], [[k...] per sequence], [[v...]], scale) -> [out [B, H, D], lse [B, H]]");
  pybind11::class_<DecodeBatch>(m, "DecodeBatch")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<std::vector<int64_t>>>(),
           pybind11::arg("own_keys"), pybind11::arg("own_values"), pybind11::arg("own_lens"),
           pybind11::arg("segment_keys"), pybind11::arg("segment_values"), pybind11::arg("segment_members"))
      .def("attend", &DecodeBatch::attend, pybind11::arg("q"), pybind11::arg("layer"), pybind11::arg("scale"));
}
