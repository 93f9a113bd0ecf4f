// Decode-shaped attention in fp32 on AVX2 + FMA: one query row per decoding sequence, every row seeing every key of
// its sets; the same DecodeBatch as the bf16 kernel (attention/csrc/decode_bf16.cpp), for CPUs without AVX-512.
//
// Why: without it an fp32 decode step attends through the general path, ~450 ATen calls a layer (lse merges of each
// segment's fused call); here a step hands its KV over once and each layer is one call, merging in C++.
//
// Sets of members (query rows) each attend one list of KV segments, read where they lie; a member's sets are merged
// by log-sum-exp. A work item is (set, KV head, block of members, chunk of keys), so both threads work on one
// sequence. Keys go 8 at a time: 8 dot products reduced into one vector of scores, an online softmax in base 2,
// then the 8 values accumulated.
#include <immintrin.h>
#include <pybind11/stl.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "../../attention/csrc/decode_plan.h"

namespace {

constexpr int kKeys = 8;            // keys per inner step: fp32 lanes of a ymm register
constexpr int64_t kChunkUnit = 64;  // keys: the unit work is split in
constexpr int kBlockRows = 32;      // query rows per work item (members x query heads of a KV head)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

// 2^x for x <= 0 (|rel err| ~1e-7): x = n + f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial, 2^n in the exponent.
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Lane j = the sum of v[j]'s lanes.
inline __m256 sums8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

struct Part {  // one segment of a set in one layer: head g's key i at k + g * k_head + i * k_row
  const float *k, *v;
  int64_t k_head, k_row, v_head, v_row, n;
};

struct RowSet {
  std::vector<int64_t> members;
  std::vector<Part> parts;
  int64_t n = 0;  // keys over all parts
};

template <int D>
struct RowState {  // per query row of an item: running max (base 2), sum, and unnormalized output
  float m[kBlockRows], l[kBlockRows];
  alignas(32) float acc[kBlockRows][D];
  void reset(int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
      m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.f;
      std::fill_n(acc[r], D, 0.f);
    }
  }
};

struct Queries {
  const float* base;
  int64_t member_stride, head_stride;
};
struct Outputs {
  float* base;
  int64_t member_stride, head_stride;
  float* lse;
  int64_t lse_member_stride, lse_head_stride;
};

// rows query rows (q [rows][D], scaled to base 2) attend keys [begin, end) of the set's KV head g.
template <int D>
void attend_keys(const float (*q)[D], int64_t rows, const RowSet& set, int64_t g, int64_t begin, int64_t end,
                 RowState<D>& st) {
  const float* k[kKeys];
  const float* v[kKeys];
  size_t part = 0;
  int64_t part_start = 0;
  for (int64_t k0 = begin; k0 < end; k0 += kKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kKeys, end - k0));
    for (int j = 0; j < nk; ++j) {  // the keys' rows, wherever their segments lie
      while (k0 + j >= part_start + set.parts[part].n) part_start += set.parts[part++].n;
      const Part& p = set.parts[part];
      const int64_t i = k0 + j - part_start;
      k[j] = p.k + g * p.k_head + i * p.k_row;
      v[j] = p.v + g * p.v_head + i * p.v_row;
      // Two steps ahead (in this segment or past its end, harmlessly): each key is read from memory once, and
      // the rows' latency is what a step waits on.
      for (int line = 0; line < D; line += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(k[j] + 2 * kKeys * p.k_row + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v[j] + 2 * kKeys * p.v_row + line), _MM_HINT_T0);
      }
    }
    const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 valid = _mm256_cmp_ps(lanes, _mm256_set1_ps(static_cast<float>(nk)), _CMP_LT_OQ);
    for (int64_t r = 0; r < rows; ++r) {
      __m256 dots[kKeys];
      for (int j = 0; j < kKeys; ++j) {
        dots[j] = _mm256_setzero_ps();
        if (j >= nk) continue;
        for (int d = 0; d < D; d += 8)
          dots[j] = _mm256_fmadd_ps(_mm256_load_ps(q[r] + d), _mm256_loadu_ps(k[j] + d), dots[j]);
      }
      const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), sums8(dots), valid);
      const float m_new = std::max(st.m[r], hmax(s));
      const __m256 p = _mm256_and_ps(exp2_ps(_mm256_sub_ps(s, _mm256_set1_ps(m_new))), valid);
      const float correction = std::exp2(st.m[r] - m_new);  // 0 on the first keys (m = -inf)
      st.m[r] = m_new;
      st.l[r] = st.l[r] * correction + hsum(p);
      alignas(32) float pj[kKeys];
      _mm256_store_ps(pj, p);
      const __m256 c = _mm256_set1_ps(correction);
      for (int d0 = 0; d0 < D; d0 += 64) {  // 8 accumulators in registers, 8 independent FMA chains per key
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(_mm256_load_ps(st.acc[r] + d0 + 8 * i), c);
        for (int j = 0; j < nk; ++j) {
          const __m256 pv = _mm256_set1_ps(pj[j]);
          for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v[j] + d0 + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; ++i) _mm256_store_ps(st.acc[r] + d0 + 8 * i, a[i]);
      }
    }
  }
}

struct Split {  // a set's work: members per block (whole query-head groups), chunks of keys
  int64_t members_per_block, blocks, chunks, chunk_keys, first_item;
};

template <int D>
void attend_sets_d(const std::vector<RowSet>& sets, int64_t num_members, const Queries& q, const Outputs& out,
                   int64_t heads, int64_t kv_heads, float scale_log2) {
  const int64_t group = heads / kv_heads, num_sets = static_cast<int64_t>(sets.size());
  const int64_t members_per_block = std::max<int64_t>(1, kBlockRows / group);
  const int64_t threads = at::get_num_threads();
  // Split by cost (rows x key units): a block's keys in chunks of about a quarter of a thread's share each (at
  // least 4 units), so one long set is spread over every thread however many short ones sit beside it.
  int64_t total_cost = 0;
  for (const auto& set : sets)
    total_cost += static_cast<int64_t>(set.members.size()) * ((set.n + kChunkUnit - 1) / kChunkUnit);
  const int64_t item_cost = std::max<int64_t>(1, kv_heads * total_cost / (4 * threads));
  std::vector<Split> splits(num_sets);
  int64_t items = 0;
  for (int64_t s = 0; s < num_sets; ++s) {
    const int64_t units = (sets[s].n + kChunkUnit - 1) / kChunkUnit;
    const int64_t size = static_cast<int64_t>(sets[s].members.size());
    Split& sp = splits[s];
    sp.members_per_block = members_per_block;
    sp.blocks = (size + members_per_block - 1) / members_per_block;
    const int64_t block_cost = std::min(size, members_per_block) * units;
    sp.chunks = std::max<int64_t>(1, std::min<int64_t>((block_cost + item_cost - 1) / item_cost, units / 4));
    sp.chunk_keys = (units + sp.chunks - 1) / sp.chunks * kChunkUnit;
    sp.first_item = items;
    items += kv_heads * sp.blocks * sp.chunks;
  }
  std::vector<RowState<D>> states(items);
  std::atomic<int64_t> next_item{0};  // items go to whichever thread is free
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    alignas(32) float qbuf[kBlockRows][D];
    int64_t s = 0;  // items come in increasing order on each thread: the set index only moves forward
    for (int64_t item; (item = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
      while (s + 1 < num_sets && item >= splits[s + 1].first_item) ++s;
      const RowSet& set = sets[s];
      const Split& sp = splits[s];
      const int64_t local = item - sp.first_item, c = local % sp.chunks, block = (local / sp.chunks) % sp.blocks;
      const int64_t g = local / (sp.chunks * sp.blocks);
      const int64_t first = block * sp.members_per_block;
      const int64_t count = std::min<int64_t>(sp.members_per_block, static_cast<int64_t>(set.members.size()) - first);
      const int64_t k_begin = std::min(set.n, c * sp.chunk_keys), k_end = std::min(set.n, (c + 1) * sp.chunk_keys);
      RowState<D>& st = states[item];
      st.reset(count * group);
      if (k_begin >= k_end) continue;  // an empty chunk: max -inf, sum 0, no weight in the merge
      for (int64_t i = 0; i < count; ++i)  // row i * G + j: member first + i, query head g * G + j
        for (int64_t j = 0; j < group; ++j) {
          const float* row = q.base + set.members[first + i] * q.member_stride + (g * group + j) * q.head_stride;
          for (int d = 0; d < D; ++d) qbuf[i * group + j][d] = row[d] * scale_log2;
        }
      attend_keys<D>(qbuf, count * group, set, g, k_begin, k_end, st);
    }
  });
  std::vector<std::vector<std::pair<int64_t, int64_t>>> places(num_members);  // (set, index among its members)
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
        alignas(32) float acc[D] = {};
        for (const auto& [st, row] : chunks) m = std::max(m, st->m[row + j]);
        for (const auto& [st, row] : chunks) {
          const int64_t r = row + j;
          if (st->l[r] == 0.f) continue;
          const float w = std::exp2(st->m[r] - m);
          l += st->l[r] * w;
          const __m256 wv = _mm256_set1_ps(w);
          for (int d = 0; d < D; d += 8)
            _mm256_store_ps(acc + d, _mm256_fmadd_ps(_mm256_load_ps(&st->acc[r][d]), wv, _mm256_load_ps(acc + d)));
        }
        const int64_t h = g * group + j;
        float* o = out.base + member * out.member_stride + h * out.head_stride;
        const __m256 inv = _mm256_set1_ps(1.f / l);
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_load_ps(acc + d), inv));
        out.lse[member * out.lse_member_stride + h * out.lse_head_stride] = (m + std::log2(l)) * kLn2;
      }
    }
  });
}

// A decode step's attention, planned once for all layers (decode_plan.h, as the bf16 kernel's DecodeBatch);
// `attend(q, layer, scale)` reads layer `layer` of each of the step's KV tensors.
class DecodeBatch {
 public:
  DecodeBatch(std::vector<torch::Tensor> own_k, std::vector<torch::Tensor> own_v, std::vector<int64_t> own_lens,
              std::vector<torch::Tensor> seg_k, std::vector<torch::Tensor> seg_v,
              std::vector<std::vector<int64_t>> seg_members)
      : plan_(std::move(own_k), std::move(own_v), std::move(own_lens), std::move(seg_k), std::move(seg_v),
              std::move(seg_members), at::kFloat, "float32") {
    TORCH_CHECK(plan_.head_dim() == 64 || plan_.head_dim() == 128 || plan_.head_dim() == 256,
                "DecodeBatch: head dim must be 64, 128 or 256, got ", plan_.head_dim());
    std::vector<bool> covered(plan_.batch(), false);
    for (const auto& plan : plan_.plans())
      for (int64_t b : plan.members) covered[b] = true;
    for (int64_t b = 0; b < plan_.batch(); ++b) TORCH_CHECK(covered[b], "DecodeBatch: sequence ", b, " has no keys");
  }

  // q [B, H, D] fp32 (any strides, last dim contiguous), one row per sequence -> [out [B, H, D], lse [B, H]].
  std::vector<torch::Tensor> attend(torch::Tensor q, int64_t layer, double scale) const {
    const int64_t batch = plan_.batch(), kv_heads = plan_.kv_heads(), head_dim = plan_.head_dim();
    TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1, "DecodeBatch: q must be float32 "
                "[B, H, D] with a contiguous last dim");
    TORCH_CHECK(q.size(0) == batch && q.size(2) == head_dim, "DecodeBatch: q must be [", batch, ", H, ", head_dim,
                "]");
    TORCH_CHECK(q.size(1) % kv_heads == 0 && q.size(1) / kv_heads <= kBlockRows, "DecodeBatch: ", q.size(1),
                " query heads for ", kv_heads, " KV heads");
    TORCH_CHECK(0 <= layer && layer < plan_.layers(), "DecodeBatch: layer ", layer, " of ", plan_.layers());
    std::vector<RowSet> sets;
    sets.reserve(plan_.plans().size());
    for (const auto& plan : plan_.plans()) {
      RowSet set{plan.members, {}, 0};
      for (const auto& p : plan.parts) {
        set.parts.push_back({p.k + layer * p.k_layer, p.v + layer * p.v_layer, p.k_head, p.k_row, p.v_head, p.v_row,
                             p.n});
        set.n += p.n;
      }
      sets.push_back(std::move(set));
    }
    auto out = torch::empty({batch, q.size(1), head_dim}, q.options());
    auto lse = torch::empty({batch, q.size(1)}, q.options());
    const Queries rows{q.data_ptr<float>(), q.stride(0), q.stride(1)};
    const Outputs outs{out.data_ptr<float>(), out.stride(0), out.stride(1), lse.data_ptr<float>(), lse.stride(0),
                       lse.stride(1)};
    const float scale_log2 = static_cast<float>(scale) * kLog2e;
    if (head_dim == 64) attend_sets_d<64>(sets, batch, rows, outs, q.size(1), kv_heads, scale_log2);
    else if (head_dim == 128) attend_sets_d<128>(sets, batch, rows, outs, q.size(1), kv_heads, scale_log2);
    else attend_sets_d<256>(sets, batch, rows, outs, q.size(1), kv_heads, scale_log2);  // Gemma 3
    return {out, lse};
  }

 private:
  decode_plan::StepPlan<float> plan_;
};

}  // namespace

void bind_decode(pybind11::module_& m) {
  pybind11::class_<DecodeBatch>(m, "DecodeBatch")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<std::vector<int64_t>>>(),
           pybind11::arg("own_keys"), pybind11::arg("own_values"), pybind11::arg("own_lens"),
           pybind11::arg("segment_keys"), pybind11::arg("segment_values"), pybind11::arg("segment_members"))
      .def("attend", &DecodeBatch::attend, pybind11::arg("q"), pybind11::arg("layer"), pybind11::arg("scale"));
}
