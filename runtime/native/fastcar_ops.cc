// Native CPU kernels of the ai.fastcar custom ops (docs/DESIGN.md, bodies in passes/fastcar_ops.py).
//
// Why native: the function bodies copy the whole MLP cache every step (ScatterElements writes a new
// tensor) and compute TAS in several passes (Reshape/ReduceSum/Mul/...). Here TemporalGate reads each
// aligned key once and decides replay in the same loop, and MLPCacheUpdate writes only the slots of this
// step: when the caller binds present_mlp_cache to the buffer of past_mlp_cache (IO binding), no copy is
// made at all. Built against ORT's C API (version 21 or newer), float32 models only.

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace {

using Ort::Custom::Tensor;

int64_t PyMod(int64_t a, int64_t m) { return ((a % m) + m) % m; }

struct TemporalGate {
  int64_t L = 1;
  int64_t K = 0;

  TemporalGate(const OrtApi* api, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    L = ki.GetAttribute<int64_t>("frame_tokens");
    K = ki.GetAttribute<int64_t>("max_replay");
    (void)api;
  }

  // q [B,H,S,D], present_key [B,Hkv,T,D], past_mlp_age [B,L], threshold [], video_start []
  //   -> replay [B,S] bool, tas [B,S] float, slot [S] int64, write [S] bool
  void Compute(const Tensor<float>& q, const Tensor<float>& key, const Tensor<int64_t>& age,
               const Tensor<float>& threshold, const Tensor<int64_t>& video_start, Tensor<bool>& replay,
               Tensor<float>& tas, Tensor<int64_t>& slot, Tensor<bool>& write) {
    Run(q, key, age, threshold, video_start, key.Shape()[2], replay, tas, slot, write);
  }

  // T: tokens in the cache (the key buffer may be longer: a preallocated shared buffer)
  void Run(const Tensor<float>& q, const Tensor<float>& key, const Tensor<int64_t>& age,
           const Tensor<float>& threshold, const Tensor<int64_t>& video_start, const int64_t T,
           Tensor<bool>& replay, Tensor<float>& tas, Tensor<int64_t>& slot, Tensor<bool>& write) {
    const auto qs = q.Shape();
    const auto ks = key.Shape();
    const int64_t B = qs[0], H = qs[1], S = qs[2], D = qs[3];
    const int64_t Hkv = ks[1], Tbuf = ks[2];
    const int64_t G = H / Hkv;
    const int64_t P = T - S;
    const int64_t vs = video_start.Data()[0];
    const float tau = threshold.Data()[0];
    const float scale = 1.0f / (static_cast<float>(H) * std::sqrt(static_cast<float>(D)));
    bool* rep = replay.Allocate({B, S});
    float* t = tas.Allocate({B, S});
    int64_t* sl = slot.Allocate({S});
    bool* wr = write.Allocate({S});
    const float* qd = q.Data();
    const float* kd = key.Data();
    const int64_t* ad = age.Data();
    for (int64_t i = 0; i < S; ++i) {
      const int64_t p = P + i;
      sl[i] = PyMod(p - vs, L);
      wr[i] = (p >= vs) && (p >= T - L);
    }
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < S; ++i) {
        const int64_t p = P + i;
        const int64_t aligned = p - L;
        const int64_t idx = aligned > 0 ? aligned : 0;
        float acc = 0.0f;
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          const float* kr = kd + ((b * Hkv + hk) * Tbuf + idx) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qr = qd + ((b * H + hk * G + g) * S + i) * D;
            float dot = 0.0f;
            for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
            acc += dot;
          }
        }
        const float v = acc * scale;
        t[b * S + i] = v;
        const int64_t a = ad[b * L + sl[i]];
        const bool eligible = S == 1 && aligned >= vs && a >= 0 && (K == 0 || a < K);
        rep[b * S + i] = eligible && v > tau;
      }
    }
  }
};

// TemporalGate whose token count comes from total_len (int32 scalar, GroupQueryAttention's
// total_sequence_length) instead of the key buffer's length (onnxruntime-genai's shared KV buffer).
struct TemporalGateAt : TemporalGate {
  TemporalGateAt(const OrtApi* api, const OrtKernelInfo* info) : TemporalGate(api, info) {}
  void Compute(const Tensor<float>& q, const Tensor<float>& key, const Tensor<int64_t>& age,
               const Tensor<float>& threshold, const Tensor<int64_t>& video_start,
               const Tensor<int32_t>& total_len, Tensor<bool>& replay, Tensor<float>& tas,
               Tensor<int64_t>& slot, Tensor<bool>& write) {
    Run(q, key, age, threshold, video_start, static_cast<int64_t>(total_len.Data()[0]), replay, tas, slot,
        write);
  }
};

// past_mlp_cache [B,L,H], slot [S] -> cached [B,S,H]
void MLPCacheRead(const Tensor<float>& cache, const Tensor<int64_t>& slot, Tensor<float>& out) {
  const auto cs = cache.Shape();
  const int64_t B = cs[0], L = cs[1], Hd = cs[2];
  const int64_t S = slot.Shape()[0];
  float* o = out.Allocate({B, S, Hd});
  const float* c = cache.Data();
  const int64_t* sl = slot.Data();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i)
      std::memcpy(o + (b * S + i) * Hd, c + (b * L + sl[i]) * Hd, sizeof(float) * Hd);
}

// (past_mlp_cache [B,L,H], past_mlp_age [B,L], branch [B,S,H], replay [B,S], slot [S], write [S])
//   -> (present_mlp_cache, present_mlp_age). In place when the outputs share the inputs' buffers.
void MLPCacheUpdate(const Tensor<float>& cache, const Tensor<int64_t>& age, const Tensor<float>& branch,
                    const Tensor<bool>& replay, const Tensor<int64_t>& slot, const Tensor<bool>& write,
                    Tensor<float>& out_cache, Tensor<int64_t>& out_age) {
  const auto cs = cache.Shape();
  const int64_t B = cs[0], L = cs[1], Hd = cs[2];
  const int64_t S = slot.Shape()[0];
  float* oc = out_cache.Allocate({B, L, Hd});
  int64_t* oa = out_age.Allocate({B, L});
  const float* c = cache.Data();
  const int64_t* a = age.Data();
  if (oc != c) std::memcpy(oc, c, sizeof(float) * B * L * Hd);
  if (oa != a) std::memcpy(oa, a, sizeof(int64_t) * B * L);
  const float* br = branch.Data();
  const bool* rp = replay.Data();
  const int64_t* sl = slot.Data();
  const bool* wr = write.Data();
  for (int64_t i = 0; i < S; ++i) {
    if (!wr[i]) continue;
    const int64_t s = sl[i];
    for (int64_t b = 0; b < B; ++b) {
      const float* src = br + (b * S + i) * Hd;
      float* dst = oc + (b * L + s) * Hd;
      if (dst != src) std::memcpy(dst, src, sizeof(float) * Hd);
      int64_t& ag = oa[b * L + s];
      ag = rp[b * S + i] ? ag + 1 : 0;
    }
  }
}

std::once_flag g_once;
std::unique_ptr<Ort::CustomOpDomain> g_domain;
std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>> g_ops;

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) api = api_base->GetApi(21);
  if (api == nullptr) return nullptr;  // unreachable for ORT >= 1.21
  Ort::InitApi(api);
  try {
    std::call_once(g_once, [] {
      g_domain = std::make_unique<Ort::CustomOpDomain>("ai.fastcar");
      g_ops.emplace_back(Ort::Custom::CreateLiteCustomOp<TemporalGate>("TemporalGate", "CPUExecutionProvider"));
      g_ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp<TemporalGateAt>("TemporalGateAt", "CPUExecutionProvider"));
      g_ops.emplace_back(Ort::Custom::CreateLiteCustomOp("MLPCacheRead", "CPUExecutionProvider", MLPCacheRead));
      g_ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp("MLPCacheUpdate", "CPUExecutionProvider", MLPCacheUpdate));
      for (auto& op : g_ops) g_domain->Add(op.get());
    });
    Ort::UnownedSessionOptions so(options);
    so.Add(*g_domain);
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
