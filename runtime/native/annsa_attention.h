// ai.fastcar AnnSAAttention: AnnSA over a DiT's frame cache at its density (semantics: docs/DESIGN.md, body:
// passes/fastcar_ops.py, compiled by passes/dit_annsa.py).
//
// Why native: in ONNX ops the bucketed part is a batched MatMul over key blocks padded to the fullest bucket (one
// 4-bit LSH bucket can hold nearly every query of a chunk), so most of its products are padding. Here the work is
// bucket_attention.h's dense blocks: per (row, head) every query against the dense slots and the chunk, then per
// table each bucket's queries against that bucket's slots (a run of the table's slots sorted by bucket id, found by
// a merge-join with the queries sorted by bucket), each executed pair once, at a dense tile's cost per pair. One
// work item per (row, head) on ORT's intra-op pool. Included by fastcar_ops.cc after the ORT headers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "bucket_attention.h"

namespace fastcar_annsa {

using Ort::Custom::Tensor;

struct Task {
  const float *q, *k, *v, *pk, *pv;
  const int64_t *dense, *qc, *kc, *sc, *sl;
  float* out;
  int64_t H, Q, D, S, T, N, Nd;
};

// Work item bh = b * H + h: bucket_attention.h's blocks for one (row, head).
inline void AnnSAThunk(void* task, size_t item) {
  const Task& t = *static_cast<const Task*>(task);
  const int64_t bh = static_cast<int64_t>(item), Q = t.Q, D = t.D, S = t.S, T = t.T, N = t.N;
  const fastcar_bucket::AnnSAItem it{t.q + bh * Q * D, t.k + bh * Q * D, t.v + bh * Q * D, t.pk + bh * S * D,
                                     t.pv + bh * S * D, nullptr, t.dense, t.qc + bh * Q * T, t.kc + bh * S * T,
                                     t.sc + bh * T * N, t.sl + bh * T * N, t.out + bh * Q * D, Q, D, S, T, N, t.Nd};
  fastcar_bucket::RunItem(it);
}

// AnnSAAttention(q [B,H,Q,D] (scaled), k [B,H,Q,D] (the chunk's keys), v [B,H,Q,D], past_key [B,H,S,D],
//   past_value [B,H,S,D], dense [Nd] int64 (cache positions every query attends), query_codes [B,H,Q,T] int64,
//   key_codes [B,H,S,T] int64 (each cached slot's bucket per table, -1: not bucketed), sorted_codes [B,H,T,N]
//   int64 (per table the bucketed slots' ids, ascending), sorted_slots [B,H,T,N] int64 (their cache positions))
//   -> out [B,H,Q,D]: per query, softmax over [dense | chunk | the bucketed slots sharing a bucket with it in some
//   table, each once: in the first table where they meet] times the values.
inline void AnnSAAttention(OrtKernelContext* context, const Tensor<float>& q, const Tensor<float>& k,
                           const Tensor<float>& v, const Tensor<float>& past_key, const Tensor<float>& past_value,
                           const Tensor<int64_t>& dense, const Tensor<int64_t>& query_codes,
                           const Tensor<int64_t>& key_codes, const Tensor<int64_t>& sorted_codes,
                           const Tensor<int64_t>& sorted_slots, Tensor<float>& out) {
  const auto qs = q.Shape(), ps = past_key.Shape(), cs = query_codes.Shape(), ss = sorted_codes.Shape();
  if (qs.size() != 4 || ps.size() != 4 || cs.size() != 4 || ss.size() != 4)
    throw std::runtime_error("AnnSAAttention: q, past_key, query_codes and sorted_codes must be 4-D");
  const int64_t B = qs[0], H = qs[1], Q = qs[2], D = qs[3], S = ps[2], T = cs[3], N = ss[3];
  const int64_t Nd = static_cast<int64_t>(dense.NumberOfElement());
  if (k.Shape() != qs || v.Shape() != qs || ps[0] != B || ps[1] != H || ps[3] != D || past_value.Shape() != ps ||
      cs[0] != B || cs[1] != H || cs[2] != Q || key_codes.Shape() != std::vector<int64_t>{B, H, S, T} ||
      ss[0] != B || ss[1] != H || ss[2] != T || sorted_slots.Shape() != ss)
    throw std::runtime_error("AnnSAAttention: inconsistent shapes (q, k, v [B,H,Q,D]; past_key, past_value "
                             "[B,H,S,D]; query_codes [B,H,Q,T]; key_codes [B,H,S,T]; sorted_codes, sorted_slots "
                             "[B,H,T,N])");
  const int64_t* dn = dense.Data();
  const int64_t* sl = sorted_slots.Data();
  for (int64_t i = 0; i < Nd; ++i)
    if (dn[i] < 0 || dn[i] >= S) throw std::runtime_error("AnnSAAttention: a dense position is outside past_key");
  for (int64_t i = 0; i < B * H * T * N; ++i)
    if (sl[i] < 0 || sl[i] >= S) throw std::runtime_error("AnnSAAttention: a slot position is outside past_key");
  Task task{q.Data(), k.Data(), v.Data(), past_key.Data(), past_value.Data(), dn, query_codes.Data(),
            key_codes.Data(), sorted_codes.Data(), sl, out.Allocate({B, H, Q, D}), H, Q, D, S, T, N, Nd};
  Ort::KernelContext(context).ParallelFor(AnnSAThunk, static_cast<size_t>(B * H), 0, &task);
}

}  // namespace fastcar_annsa
