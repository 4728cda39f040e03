// ai.fastcar AnnSAAttention: AnnSA over a DiT's frame cache without padding (semantics: docs/DESIGN.md, body:
// passes/fastcar_ops.py, compiled by fastcar_compile/dit/annsa_graph.py).
//
// Why native: in ONNX ops the bucketed part is a batched MatMul over key blocks padded to the fullest bucket (one
// 4-bit LSH bucket can hold nearly every query of a chunk), so most of its products are padding. Here each query
// walks its own bucket's slots in every table (a run of the table's slots sorted by bucket id: CSR without an
// offsets array, the run found by binary search) and scores exactly the selected keys, each once.
// Included by fastcar_ops.cc after the ORT headers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "compressed_attention.h"

namespace fastcar_annsa {

using Ort::Custom::Tensor;

using fastcar_attn::Dot;  // compressed_attention.h: q.k with 8 partial sums (vectorised without -ffast-math)

// AnnSAAttention(q [B,H,Q,D] (scaled), k [B,H,Q,D] (the chunk's keys), v [B,H,Q,D], past_key [B,H,S,D],
//   past_value [B,H,S,D], dense [Nd] int64 (cache positions every query attends), query_codes [B,H,Q,T] int64,
//   key_codes [B,H,S,T] int64 (each cached slot's bucket per table, -1: not bucketed), sorted_codes [B,H,T,N]
//   int64 (per table the bucketed slots' ids, ascending), sorted_slots [B,H,T,N] int64 (their cache positions))
//   -> out [B,H,Q,D]: per query, softmax over [dense | chunk | the bucketed slots sharing a bucket with it in some
//   table, each once: in the first table where they meet] times the values.
inline void AnnSAAttention(const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v,
                           const Tensor<float>& past_key, const Tensor<float>& past_value,
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
  const float* qd = q.Data();
  const float* kd = k.Data();
  const float* vd = v.Data();
  const float* pk = past_key.Data();
  const float* pv = past_value.Data();
  const int64_t* dn = dense.Data();
  const int64_t* qc = query_codes.Data();
  const int64_t* kc = key_codes.Data();
  const int64_t* sc = sorted_codes.Data();
  const int64_t* sl = sorted_slots.Data();
  for (int64_t i = 0; i < Nd; ++i)
    if (dn[i] < 0 || dn[i] >= S) throw std::runtime_error("AnnSAAttention: a dense position is outside past_key");
  for (int64_t i = 0; i < B * H * T * N; ++i)
    if (sl[i] < 0 || sl[i] >= S) throw std::runtime_error("AnnSAAttention: a slot position is outside past_key");
  float* o = out.Allocate({B, H, Q, D});
  std::vector<float> logit;
  std::vector<const float*> rows;  // the value row of each logit
  std::vector<float> acc(static_cast<size_t>(D));
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const float* K = pk + bh * S * D;
    const float* V = pv + bh * S * D;
    const int64_t* kcb = kc + bh * S * T;
    for (int64_t i = 0; i < Q; ++i) {
      const float* qi = qd + (bh * Q + i) * D;
      const int64_t* qci = qc + (bh * Q + i) * T;
      logit.clear();
      rows.clear();
      for (int64_t j = 0; j < Nd; ++j) {
        logit.push_back(Dot(qi, K + dn[j] * D, D));
        rows.push_back(V + dn[j] * D);
      }
      for (int64_t j = 0; j < Q; ++j) {
        logit.push_back(Dot(qi, kd + (bh * Q + j) * D, D));
        rows.push_back(vd + (bh * Q + j) * D);
      }
      for (int64_t t = 0; t < T; ++t) {
        const int64_t* codes = sc + (bh * T + t) * N;
        const int64_t* slots = sl + (bh * T + t) * N;
        const auto run = std::equal_range(codes, codes + N, qci[t]);
        for (const int64_t* c = run.first; c != run.second; ++c) {
          const int64_t p = slots[c - codes];
          bool seen = false;  // met in an earlier table: counted there
          for (int64_t u = 0; u < t && !seen; ++u) seen = kcb[p * T + u] == qci[u];
          if (seen) continue;
          logit.push_back(Dot(qi, K + p * D, D));
          rows.push_back(V + p * D);
        }
      }
      float* oi = o + (bh * Q + i) * D;
      if (logit.empty()) {
        std::fill(oi, oi + D, std::numeric_limits<float>::quiet_NaN());  // as a softmax over nothing
        continue;
      }
      const float mx = *std::max_element(logit.begin(), logit.end());
      std::fill(acc.begin(), acc.end(), 0.0f);
      float sum = 0.0f;
      for (size_t j = 0; j < logit.size(); ++j) {
        const float w = std::exp(logit[j] - mx);
        sum += w;
        const float* r = rows[j];
        for (int64_t d = 0; d < D; ++d) acc[d] += w * r[d];
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < D; ++d) oi[d] = acc[d] * inv;
    }
  }
}

}  // namespace fastcar_annsa
