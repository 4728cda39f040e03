// BranchPass's row ops around the one MLP copy (passes/branch.py, bodies in passes/fastcar_ops.py):
// SelectRows gathers the rows of the tokens that compute, MLPCacheMerge puts the MLP's rows back among the
// replayed (cached) ones and updates the cache. Each is one launch where ONNX control flow needed two small Ifs
// and their Identity / NonZero / Gather / ScatterND nodes. Included by fastcar_ops.cc after the ORT headers.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace fastcar_rows {

using Ort::Custom::Tensor;

// x [..., H] (shape xs) as `tokens` rows: H, or an error naming `op` (SelectRows, or the gate that selects).
inline int64_t RowWidth(const std::vector<int64_t>& xs, int64_t numel, int64_t tokens, const char* op) {
  const int64_t H = xs.empty() ? 0 : xs.back();
  if (H <= 0 || numel != tokens * H)
    throw std::runtime_error(std::string(op) + ": the MLP input must be [..., H] with one row per token of "
                             "replay (" + std::to_string(tokens) + " tokens)");
  return H;
}

inline int64_t Computing(const bool* replay, int64_t tokens) {
  int64_t n = 0;
  for (int64_t t = 0; t < tokens; ++t) n += replay[t] ? 0 : 1;
  return n;
}

// out [n, H] = the rows of src whose replay flag is false, in order
inline void CopyRows(const float* src, int64_t H, const bool* replay, int64_t tokens, float* out) {
  for (int64_t t = 0, k = 0; t < tokens; ++t)
    if (!replay[t]) std::memcpy(out + (k++) * H, src + t * H, sizeof(float) * H);
}

// x [..., H] as T = numel / H rows; rows [1, n, H] = the rows whose replay flag is false, in order. Returns n.
inline int64_t Select(const Tensor<float>& x, const bool* replay, int64_t tokens, Tensor<float>& rows,
                      const char* op = "SelectRows") {
  const int64_t H = RowWidth(x.Shape(), static_cast<int64_t>(x.NumberOfElement()), tokens, op);
  const int64_t n = Computing(replay, tokens);
  CopyRows(x.Data(), H, replay, tokens, rows.Allocate({1, n, H}));
  return n;
}

// SelectRows(x [..., H], replay [B,S]) -> (rows [1, n, H], compute_some [] bool = n > 0)
inline void SelectRows(const Tensor<float>& x, const Tensor<bool>& replay, Tensor<float>& rows,
                       Tensor<bool>& compute_some) {
  const int64_t n = Select(x, replay.Data(), static_cast<int64_t>(replay.NumberOfElement()), rows);
  *compute_some.Allocate({}) = n > 0;
}

// used [B,S,H]: token (b, i) takes the next computed row when it computes, cache[b, slot[i]] when it replays.
// Reads the cache before anything writes it (the caller may bind present_mlp_cache to past_mlp_cache).
inline void Merge(const float* cache, int64_t L, int64_t Hd, const float* rows, int64_t n_rows, const bool* replay,
                  const int64_t* slot, int64_t B, int64_t S, float* used) {
  int64_t k = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i) {
      float* dst = used + (b * S + i) * Hd;
      if (replay[b * S + i]) {
        std::memcpy(dst, cache + (b * L + slot[i]) * Hd, sizeof(float) * Hd);
      } else {
        if (k >= n_rows) throw std::runtime_error("MLPCacheMerge: fewer rows than computing tokens");
        std::memcpy(dst, rows + (k++) * Hd, sizeof(float) * Hd);
      }
    }
  if (k != n_rows) throw std::runtime_error("MLPCacheMerge: more rows than computing tokens");
}

}  // namespace fastcar_rows
