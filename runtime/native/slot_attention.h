// ai.fastcar SlotAttention: attention over the cache slots a (row, head) lists, each with an additive bias
// (semantics: docs/DESIGN.md, body: passes/fastcar_ops.py). TempCache's resident slots with log(count): the work
// follows the slots listed, not the buffer's size, so a merged slot that left the list costs nothing.
// bucket_attention.h's dense block (every query x the listed rows | the chunk, rows read through pointers). One
// work item per (row, head) on ORT's intra-op pool. Included by fastcar_ops.cc after the ORT headers.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "bucket_attention.h"

namespace fastcar_slots {

using Ort::Custom::Tensor;

struct Task {
  const float *q, *k, *v, *pk, *pv, *bias;
  const int64_t* slots;
  float* out;
  int64_t H, Q, D, S, N;
};

inline void SlotThunk(void* task, size_t item) {
  const Task& t = *static_cast<const Task*>(task);
  const int64_t bh = static_cast<int64_t>(item), Q = t.Q, D = t.D, S = t.S;
  static thread_local std::vector<int64_t> listed;  // this (row, head)'s slots, the -1 entries left out
  listed.clear();
  const int64_t* sl = t.slots + bh * t.N;
  for (int64_t j = 0; j < t.N; ++j)
    if (sl[j] >= 0) listed.push_back(sl[j]);
  const fastcar_bucket::AnnSAItem it{t.q + bh * Q * D, t.k + bh * Q * D, t.v + bh * Q * D, t.pk + bh * S * D,
                                     t.pv + bh * S * D, t.bias + bh * S, listed.data(), nullptr, nullptr, nullptr,
                                     nullptr, t.out + bh * Q * D, Q, D, S, 0, 0,
                                     static_cast<int64_t>(listed.size())};
  fastcar_bucket::RunItem(it);
}

// SlotAttention(q, k, v [B,H,Q,D] (q scaled), past_key, past_value [B,H,S,D], slots [B,H,N] int64 (-1: none),
//   slot_bias [B,H,S]) -> out [B,H,Q,D]: per query, softmax over [listed slots (+ bias) | chunk] times the values.
inline void SlotAttention(OrtKernelContext* context, const Tensor<float>& q, const Tensor<float>& k,
                          const Tensor<float>& v, const Tensor<float>& past_key, const Tensor<float>& past_value,
                          const Tensor<int64_t>& slots, const Tensor<float>& slot_bias, Tensor<float>& out) {
  const auto qs = q.Shape(), ps = past_key.Shape(), ls = slots.Shape();
  if (qs.size() != 4 || ps.size() != 4 || ls.size() != 3)
    throw std::runtime_error("SlotAttention: q and past_key must be 4-D, slots 3-D");
  const int64_t B = qs[0], H = qs[1], Q = qs[2], D = qs[3], S = ps[2], N = ls[2];
  if (k.Shape() != qs || v.Shape() != qs || ps[0] != B || ps[1] != H || ps[3] != D || past_value.Shape() != ps ||
      ls[0] != B || ls[1] != H || slot_bias.Shape() != std::vector<int64_t>{B, H, S})
    throw std::runtime_error("SlotAttention: inconsistent shapes (q, k, v [B,H,Q,D]; past_key, past_value [B,H,S,D]; "
                             "slots [B,H,N]; slot_bias [B,H,S])");
  const int64_t* sl = slots.Data();
  for (int64_t i = 0; i < B * H * N; ++i)
    if (sl[i] < -1 || sl[i] >= S) throw std::runtime_error("SlotAttention: a slot is outside past_key");
  Task task{q.Data(), k.Data(), v.Data(), past_key.Data(), past_value.Data(), slot_bias.Data(), sl,
            out.Allocate({B, H, Q, D}), H, Q, D, S, N};
  Ort::KernelContext(context).ParallelFor(SlotThunk, static_cast<size_t>(B * H), 0, &task);
}

}  // namespace fastcar_slots
