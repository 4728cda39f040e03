// CPU kernels of the fastcar::* torch ops (schemas and the ATen composite that serves every other device:
// fastcar_compile/torch/ops.py). Each op is one kernel instead of the ~10-15 small ATen ops of its composite:
// at batch 1 a decode step's gate and cache update are a few hundred bytes of work, so dispatch dominated.
// Semantics: docs/DESIGN.md (TemporalGate, MLPCacheRead, MLPCacheUpdate); tests compare against the composite.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <tuple>

namespace {

// The value of a one-element tensor, read in place when it is a CPU tensor of that type: .item() and .to() go
// through the dispatcher, and in a decode step (caches cold after the MLP's weights) each such call costs far
// more than its work; these ops run once per layer and step.
template <typename T>
T scalar_of(const at::Tensor& t) {
  if (t.device().is_cpu() && t.scalar_type() == c10::CppTypeToScalarType<T>::value) return *t.const_data_ptr<T>();
  return t.item<T>();
}

// `t` itself when it already has this dtype (and is contiguous), else the converted copy.
at::Tensor as(const at::Tensor& t, at::ScalarType dtype, bool contiguous = false) {
  at::Tensor r = t.scalar_type() == dtype ? t : t.to(dtype);
  return contiguous && !r.is_contiguous() ? r.contiguous() : r;
}

// (replay [B,S] bool, tas [B,S] float32, slot [S] int64, write [S] bool) for q [B,H,S,D], K [B,Hkv,T,D].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> temporal_gate(
    const at::Tensor& q, const at::Tensor& present_key, const at::Tensor& past_mlp_age, const at::Tensor& threshold,
    const at::Tensor& video_start, int64_t frame_tokens, int64_t max_replay) {
  TORCH_CHECK(q.dim() == 4 && present_key.dim() == 4 && past_mlp_age.dim() == 2, "fastcar::temporal_gate: q [B,H,S,D], "
              "present_key [B,Hkv,T,D], past_mlp_age [B,L] expected");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  const int64_t Hkv = present_key.size(1), T = present_key.size(2), L = frame_tokens;
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "fastcar::temporal_gate: query heads must be a multiple of KV heads");
  const int64_t g = H / Hkv;
  const float tau = scalar_of<float>(threshold);
  const int64_t vs = scalar_of<int64_t>(video_start);
  auto opts = q.options();
  at::Tensor replay = at::empty({B, S}, opts.dtype(at::kBool));
  at::Tensor tas = at::empty({B, S}, opts.dtype(at::kFloat));
  at::Tensor slot = at::empty({S}, opts.dtype(at::kLong));
  at::Tensor write = at::empty({S}, opts.dtype(at::kBool));
  auto slot_a = slot.accessor<int64_t, 1>();
  auto write_a = write.accessor<bool, 1>();
  for (int64_t i = 0; i < S; ++i) {
    const int64_t p = T - S + i;
    slot_a[i] = ((p - vs) % L + L) % L;
    write_a[i] = p >= vs && p >= T - L;
  }
  at::Tensor age = as(past_mlp_age, at::kLong);
  auto age_a = age.accessor<int64_t, 2>();
  auto replay_a = replay.accessor<bool, 2>();
  auto tas_a = tas.accessor<float, 2>();
  const float scale = 1.0f / (static_cast<float>(H) * std::sqrt(static_cast<float>(D)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fastcar_temporal_gate", [&] {
    at::Tensor k = as(present_key, q.scalar_type());
    auto q_a = q.accessor<scalar_t, 4>();
    auto k_a = k.accessor<scalar_t, 4>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < S; ++i) {
        const int64_t p = T - S + i, aligned = p - L;
        const int64_t kt = aligned < 0 ? 0 : aligned;  // the composite's clamp: a defined TAS for every token
        float acc = 0.0f;
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          for (int64_t d = 0; d < D; ++d) {
            float qs = 0.0f;  // the group's query heads read KV head hk
            for (int64_t j = 0; j < g; ++j) qs += static_cast<float>(q_a[b][hk * g + j][i][d]);
            acc += qs * static_cast<float>(k_a[b][hk][kt][d]);
          }
        }
        const float t = acc * scale;
        tas_a[b][i] = t;
        const int64_t a = age_a[b][slot_a[i]];
        const bool eligible = a >= 0 && (max_replay <= 0 || a < max_replay) && aligned >= vs && S == 1;
        replay_a[b][i] = eligible && t > tau;
      }
    }
  });
  return {replay, tas, slot, write};
}

at::Tensor mlp_cache_read(const at::Tensor& past_mlp_cache, const at::Tensor& slot) {
  return at::index_select(past_mlp_cache, 1, slot);
}

// Store the value used this step in each written token's slot; age + 1 where it replayed, else 0.
std::tuple<at::Tensor, at::Tensor> mlp_cache_update(const at::Tensor& past_mlp_cache, const at::Tensor& past_mlp_age,
                                                    const at::Tensor& branch, const at::Tensor& replay,
                                                    const at::Tensor& slot, const at::Tensor& write) {
  TORCH_CHECK(past_mlp_cache.dim() == 3 && branch.dim() == 3 && past_mlp_age.dim() == 2,
              "fastcar::mlp_cache_update: cache [B,L,H], branch [B,S,H], age [B,L] expected");
  at::Tensor cache = past_mlp_cache.clone(at::MemoryFormat::Contiguous);
  at::Tensor age = past_mlp_age.clone(at::MemoryFormat::Contiguous);
  at::Tensor src = as(branch, cache.scalar_type(), true);
  at::Tensor rep = as(replay, at::kBool, true);
  at::Tensor old = as(past_mlp_age, at::kLong);
  const int64_t B = cache.size(0), L = cache.size(1), Hd = cache.size(2), S = src.size(1);
  TORCH_CHECK(age.scalar_type() == at::kLong, "fastcar::mlp_cache_update: past_mlp_age must be int64");
  auto slot_a = slot.accessor<int64_t, 1>();
  auto write_a = write.accessor<bool, 1>();
  auto rep_a = rep.accessor<bool, 2>();
  auto old_a = old.accessor<int64_t, 2>();
  auto age_a = age.accessor<int64_t, 2>();
  const size_t row = static_cast<size_t>(Hd) * cache.element_size();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < S; ++i) {
    if (!write_a[i]) continue;
    const int64_t s = slot_a[i];
    TORCH_CHECK(s >= 0 && s < L, "fastcar::mlp_cache_update: slot out of range");
    for (int64_t b = 0; b < B; ++b) {
      std::memcpy(dst + (b * L + s) * row, from + (b * S + i) * row, row);
      age_a[b][s] = rep_a[b][i] ? old_a[b][s] + 1 : 0;
    }
  }
  return {cache, age};
}

// The same update written into the state itself (the eager runtime owns its state): no copy of the caches.
void mlp_cache_update_(at::Tensor& past_mlp_cache, at::Tensor& past_mlp_age, const at::Tensor& branch,
                       const at::Tensor& replay, const at::Tensor& slot, const at::Tensor& write) {
  TORCH_CHECK(past_mlp_cache.dim() == 3 && branch.dim() == 3 && past_mlp_age.dim() == 2 &&
              past_mlp_age.scalar_type() == at::kLong, "fastcar::mlp_cache_update_: cache [B,L,H], branch [B,S,H], "
              "age [B,L] int64 expected");
  at::Tensor src = as(branch, past_mlp_cache.scalar_type(), true);
  at::Tensor rep = as(replay, at::kBool, true);
  const int64_t B = past_mlp_cache.size(0), L = past_mlp_cache.size(1), Hd = past_mlp_cache.size(2);
  const int64_t S = src.size(1);
  auto slot_a = slot.accessor<int64_t, 1>();
  auto write_a = write.accessor<bool, 1>();
  auto rep_a = rep.accessor<bool, 2>();
  auto age_a = past_mlp_age.accessor<int64_t, 2>();
  const bool flat = past_mlp_cache.is_contiguous();
  const size_t row = static_cast<size_t>(Hd) * past_mlp_cache.element_size();
  char* dst = static_cast<char*>(past_mlp_cache.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < S; ++i) {  // the written tokens' slots are distinct (at most L consecutive tokens)
    if (!write_a[i]) continue;
    const int64_t s = slot_a[i];
    TORCH_CHECK(s >= 0 && s < L, "fastcar::mlp_cache_update_: slot out of range");
    if (!flat) past_mlp_cache.select(1, s).copy_(src.select(1, i));
    for (int64_t b = 0; b < B; ++b) {
      if (flat) std::memcpy(dst + (b * L + s) * row, from + (b * S + i) * row, row);
      age_a[b][s] = rep_a[b][i] ? age_a[b][s] + 1 : 0;
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(fastcar, CPU, m) {
  m.impl("temporal_gate", &temporal_gate);
  m.impl("mlp_cache_read", &mlp_cache_read);
  m.impl("mlp_cache_update", &mlp_cache_update);
  m.impl("mlp_cache_update_", &mlp_cache_update_);
}
