// A decode step's plan, shared by the two DecodeBatch kernels (decode_bf16.cpp in bf16, avx2/csrc/decode_f32.cpp in
// fp32): which KV each sequence attends (its own KV, the segments only it sees) and which segments several sequences
// share (one set, attended once by all their rows). Built once a step from every layer's KV ([L, H_kv, N, D], any
// strides, last dim contiguous); each kernel reads layer l of a part at k + l * k_layer.
#pragma once

#include <torch/extension.h>

#include <map>
#include <vector>

namespace decode_plan {

template <typename T>
struct LayerPart {  // a segment's first n keys, every layer
  const T *k, *v;
  int64_t k_layer, k_head, k_row, v_layer, v_head, v_row, n;
};

template <typename T>
struct Plan {  // the members (sequences) attending the parts as one set
  std::vector<int64_t> members;
  std::vector<LayerPart<T>> parts;
};

template <typename T>
class StepPlan {
 public:
  StepPlan(std::vector<torch::Tensor> own_k, std::vector<torch::Tensor> own_v, std::vector<int64_t> own_lens,
           std::vector<torch::Tensor> seg_k, std::vector<torch::Tensor> seg_v,
           std::vector<std::vector<int64_t>> seg_members, at::ScalarType dtype, const char* dtype_name)
      : batch_(static_cast<int64_t>(own_k.size())), dtype_(dtype), dtype_name_(dtype_name) {
    TORCH_CHECK(batch_ > 0 && own_v.size() == own_k.size() && own_lens.size() == own_k.size(),
                "DecodeBatch: one own key, value and length per sequence");
    TORCH_CHECK(seg_v.size() == seg_k.size() && seg_members.size() == seg_k.size(),
                "DecodeBatch: one value tensor and one member list per segment");
    kv_heads_ = own_k[0].size(1);
    head_dim_ = own_k[0].size(3);
    layers_ = own_k[0].size(0);
    std::vector<Plan<T>> own(batch_);
    for (int64_t b = 0; b < batch_; ++b) own[b].members = {b};
    std::map<std::vector<int64_t>, size_t> shared_index;
    std::vector<Plan<T>> shared;
    for (size_t i = 0; i < seg_k.size(); ++i) {
      if (seg_k[i].size(2) == 0) continue;
      const auto& members = seg_members[i];
      TORCH_CHECK(!members.empty(), "DecodeBatch: segment ", i, " has no members");
      for (int64_t b : members) TORCH_CHECK(0 <= b && b < batch_, "DecodeBatch: member ", b, " out of range");
      Plan<T>* plan;
      if (members.size() == 1) {
        plan = &own[members[0]];
      } else {  // segments seen by the same sequences: one set, attended once by all their rows
        auto [it, added] = shared_index.try_emplace(members, shared.size());
        if (added) shared.push_back(Plan<T>{members, {}});
        plan = &shared[it->second];
      }
      plan->parts.push_back(layer_part(seg_k[i], seg_v[i], seg_k[i].size(2)));
    }
    for (int64_t b = 0; b < batch_; ++b)
      if (own_lens[b] > 0) own[b].parts.push_back(layer_part(own_k[b], own_v[b], own_lens[b]));
    for (auto& plan : shared) plans_.push_back(std::move(plan));
    for (auto& plan : own)
      if (!plan.parts.empty()) plans_.push_back(std::move(plan));
    keep_ = {std::move(own_k), std::move(own_v), std::move(seg_k), std::move(seg_v)};
  }

  const std::vector<Plan<T>>& plans() const { return plans_; }
  int64_t batch() const { return batch_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t layers() const { return layers_; }

 private:
  LayerPart<T> layer_part(const torch::Tensor& k, const torch::Tensor& v, int64_t n) const {
    TORCH_CHECK(k.scalar_type() == dtype_ && v.scalar_type() == dtype_ && k.dim() == 4 && v.dim() == 4,
                "DecodeBatch: KV must be ", dtype_name_, " [L, H_kv, N, D]");
    TORCH_CHECK(k.size(0) == layers_ && v.size(0) == layers_ && k.size(1) == kv_heads_ && v.size(1) == kv_heads_ &&
                k.size(3) == head_dim_ && v.size(3) == head_dim_ && k.stride(3) == 1 && v.stride(3) == 1 &&
                n <= k.size(2) && n <= v.size(2), "DecodeBatch: KV shapes disagree");
    return {k.template data_ptr<T>(), v.template data_ptr<T>(), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), n};
  }

  int64_t batch_, kv_heads_ = 0, head_dim_ = 0, layers_ = 0;
  at::ScalarType dtype_;
  const char* dtype_name_;  // as the error messages name it
  std::vector<Plan<T>> plans_;
  std::vector<std::vector<torch::Tensor>> keep_;  // the tensors the plans point into stay alive
};

}  // namespace decode_plan
