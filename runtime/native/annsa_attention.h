// ai.fastcar AnnSAAttention: AnnSA over a DiT's frame cache without padding (semantics: docs/DESIGN.md, body:
// passes/fastcar_ops.py, compiled by passes/dit_annsa.py).
//
// Why native: in ONNX ops the bucketed part is a batched MatMul over key blocks padded to the fullest bucket (one
// 4-bit LSH bucket can hold nearly every query of a chunk), so most of its products are padding. Here each query
// walks its own bucket's slots in every table (a run of the table's slots sorted by bucket id: CSR without an
// offsets array, the run found by binary search) and scores exactly the selected keys, each once. One work item
// per (row, head) on ORT's intra-op pool; the loops are cloned per x86-64 level (FASTCAR_CLONES, dense_attention.h).
// Included by fastcar_ops.cc after the ORT headers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "compressed_attention.h"

namespace fastcar_annsa {

using Ort::Custom::Tensor;

using fastcar_attn::Dot;  // compressed_attention.h: q.k with 8 partial sums (vectorised without -ffast-math)

struct Task {
  const float *q, *k, *v, *pk, *pv;
  const int64_t *dense, *qc, *kc, *sc, *sl;
  float* out;
  int64_t H, Q, D, S, T, N, Nd;
};

// Work item bh = b * H + h: per query its logits over [dense | chunk | its buckets' slots], softmax, values.
FASTCAR_CLONES
static void AnnSAItem(const Task& t, int64_t bh) {
  const int64_t D = t.D, T = t.T, N = t.N, S = t.S, Q = t.Q, Nd = t.Nd;
  const float* K = t.pk + bh * S * D;
  const float* V = t.pv + bh * S * D;
  const int64_t* kcb = t.kc + bh * S * T;
  std::vector<float> logit, acc(static_cast<size_t>(D));
  std::vector<const float*> rows;  // the value row of each logit
  for (int64_t i = 0; i < Q; ++i) {
    const float* qi = t.q + (bh * Q + i) * D;
    const int64_t* qci = t.qc + (bh * Q + i) * T;
    logit.clear();
    rows.clear();
    for (int64_t j = 0; j < Nd; ++j) {
      logit.push_back(Dot(qi, K + t.dense[j] * D, D));
      rows.push_back(V + t.dense[j] * D);
    }
    for (int64_t j = 0; j < Q; ++j) {
      logit.push_back(Dot(qi, t.k + (bh * Q + j) * D, D));
      rows.push_back(t.v + (bh * Q + j) * D);
    }
    for (int64_t tb = 0; tb < T; ++tb) {
      const int64_t* codes = t.sc + (bh * T + tb) * N;
      const int64_t* slots = t.sl + (bh * T + tb) * N;
      const auto run = std::equal_range(codes, codes + N, qci[tb]);
      for (const int64_t* c = run.first; c != run.second; ++c) {
        const int64_t p = slots[c - codes];
        bool seen = false;  // met in an earlier table: counted there
        for (int64_t u = 0; u < tb && !seen; ++u) seen = kcb[p * T + u] == qci[u];
        if (seen) continue;
        logit.push_back(Dot(qi, K + p * D, D));
        rows.push_back(V + p * D);
      }
    }
    // softmax times the values (logit holds >= Q >= 1 entries: the chunk's keys are always there)
    const float mx = *std::max_element(logit.begin(), logit.end());
    std::fill(acc.begin(), acc.end(), 0.0f);
    float sum = 0.0f;
    for (size_t j = 0; j < logit.size(); ++j) {
      const float e = std::exp(logit[j] - mx);
      sum += e;
      const float* r = rows[j];
      for (int64_t d = 0; d < D; ++d) acc[d] += e * r[d];
    }
    float* oi = t.out + (bh * Q + i) * D;
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < D; ++d) oi[d] = acc[d] * inv;
  }
}

inline void AnnSAThunk(void* task, size_t item) {
  AnnSAItem(*static_cast<const Task*>(task), static_cast<int64_t>(item));
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
