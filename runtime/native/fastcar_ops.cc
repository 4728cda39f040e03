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

#include "compressed_attention.h"
#include "annsa_attention.h"
#include "slot_attention.h"
#include "group_query_attention.h"
#include "row_ops.h"
#include "thread_scratch.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <memory>
#include <mutex>
#include <vector>

namespace {

using Ort::Custom::Tensor;

int64_t PyMod(int64_t a, int64_t m) { return ((a % m) + m) % m; }

// slot and write flag of the S new tokens at KV positions P..P+S-1 of T (docs/DESIGN.md semantics)
void SlotsAndWrites(int64_t P, int64_t S, int64_t T, int64_t L, int64_t vs, int64_t* sl, bool* wr) {
  for (int64_t i = 0; i < S; ++i) {
    const int64_t p = P + i;
    sl[i] = PyMod(p - vs, L);
    wr[i] = (p >= vs) && (p >= T - L);
  }
}

// a token may replay: a decode step (after the prefill, at most one frame of tokens: each token's slot is distinct
// and was written before the step, so it decides as a single-token step would), its aligned position inside the
// video, its slot written, not too old
bool Eligible(int64_t P, int64_t S, int64_t L, int64_t aligned, int64_t vs, int64_t age, int64_t K) {
  return P > 0 && S <= L && aligned >= vs && age >= 0 && (K == 0 || age < K);
}

template <typename T>
T AttrOr(const Ort::ConstKernelInfo& ki, const char* name, T fallback) {
  try {
    return ki.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

// TemporalGate: one kernel for every form (contract.GateForm), dispatching on the variant attributes.
//   inputs  q, key, past_mlp_age [B,L], threshold [] or [layers], video_start [], total_len [] int32,
//           past_mlp_cache [B,L,Hd], cos_cache [P,R/2], sin_cache, mlp_input [B,S,Hm]
//   outputs replay [B,S] bool, tas [B,S], slot [S] int64, write [S] bool, cached [B,S,Hd], compute_all [],
//           compute_some [], rows [1,n,Hm]
// q is [B,H,S,D], or with packed_qkv [B,S,W >= H*D] whose first H*D channels are the query (rotated at position
// total_len - S + i for do_rotary: rotation is linear, so the G query heads of a KV head are summed first and
// rotated once). key is [B,Hkv,N,D] read at K[max(p - L, 0)], or with aligned_keys [B,Hkv,S,D] whose row i is
// token i's aligned key. Tokens are at KV positions P..T-1, T = total_len (use_total_len) or N. A packed gate also
// outputs the slots' cached MLP rows and the branch's If conditions, select_rows the computing rows of mlp_input.
// The op names models compiled before the one gate op used for its forms (contract.LEGACY_GATE_OPS), registered
// onto this kernel: their form is fixed by the name and their inputs come in another order (`at`: the node's
// position of each TemporalGate input, -1 = none).
struct GateSignature {
  const char* name;
  bool use_total_len, aligned_keys, packed, rotary, select_rows;
  int at[10];
};
constexpr GateSignature kGate = {"TemporalGate", false, false, false, false, false, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}};
constexpr GateSignature kLegacyGates[] = {
    {"TemporalGateAt", true, false, false, false, false, {0, 1, 2, 3, 4, 5, -1, -1, -1, -1}},
    {"TemporalGateAligned", true, true, false, false, false, {0, 1, 2, 3, 4, 5, -1, -1, -1, -1}},
    {"TemporalGatePacked", true, false, true, false, false, {0, 1, 2, 4, 5, 6, 3, -1, -1, -1}},
    {"TemporalGatePackedRope", true, false, true, true, false, {0, 1, 2, 4, 5, 6, 3, 7, 8, -1}},
    {"TemporalGatePackedRows", true, false, true, false, true, {0, 1, 2, 4, 5, 6, 3, -1, -1, 7}},
    {"TemporalGatePackedRopeRows", true, false, true, true, true, {0, 1, 2, 4, 5, 6, 3, 7, 8, 9}},
};

struct GateKernel {
  int64_t L = 1, K = 0, age_offset = 0, H = 0, t_index = 0, rot_dim = 0;
  bool interleaved = false, use_total_len = false, aligned_keys = false, packed = false, rotary = false,
       select_rows = false;
  const GateSignature* sig;
  std::string node;                  // the node's name and its input names: errors name the graph's tensors
  std::vector<std::string> inputs;

  GateKernel(const OrtKernelInfo* info, const GateSignature* signature) : sig(signature) {
    Ort::ConstKernelInfo ki(info);
    node = ki.GetNodeName();
    for (size_t i = 0; i < ki.GetInputCount(); ++i) inputs.push_back(ki.GetInputName(i));
    L = ki.GetAttribute<int64_t>("frame_tokens");
    K = ki.GetAttribute<int64_t>("max_replay");
    age_offset = AttrOr<int64_t>(ki, "age_offset", 0);
    H = AttrOr<int64_t>(ki, "num_heads", 0);
    t_index = AttrOr<int64_t>(ki, "threshold_index", 0);
    rot_dim = AttrOr<int64_t>(ki, "rotary_embedding_dim", 0);
    interleaved = AttrOr<int64_t>(ki, "interleaved", 0) != 0;
    use_total_len = sig->use_total_len || AttrOr<int64_t>(ki, "use_total_len", 0) != 0;
    aligned_keys = sig->aligned_keys || AttrOr<int64_t>(ki, "aligned_keys", 0) != 0;
    packed = sig->packed || AttrOr<int64_t>(ki, "packed_qkv", 0) != 0;
    rotary = sig->rotary || AttrOr<int64_t>(ki, "do_rotary", 0) != 0;
    select_rows = sig->select_rows || AttrOr<int64_t>(ki, "select_rows", 0) != 0;
    if (L <= 0 || ((aligned_keys || packed) && !use_total_len) || ((rotary || select_rows) && !packed) ||
        (packed && H <= 0))
      throw std::runtime_error("TemporalGate: inconsistent form attributes (frame_tokens > 0; aligned_keys and "
                               "packed_qkv need use_total_len; do_rotary and select_rows need packed_qkv with "
                               "num_heads)");
  }

  Ort::ConstValue Input(const Ort::KernelContext& ctx, size_t i, const char* name) const {
    const int at = sig->at[i];
    Ort::ConstValue v = at >= 0 && static_cast<size_t>(at) < ctx.GetInputCount() ? ctx.GetInput(at)
                                                                                  : Ort::ConstValue(nullptr);
    if (!v) throw std::runtime_error(std::string("TemporalGate: this form needs the input ") + name);
    // ORT's IO binding runs a session without checking that every graph input is bound: an unbound one
    // reaches the kernel as a value holding no tensor (ORT's own words: "must contain a constructed tensor")
    if (!v.IsTensor())
      throw std::runtime_error("TemporalGate " + node + ": its input " + name + " ('" + inputs[at] +
                               "') has no value: a graph input that was not fed or bound; feed it");
    return v;
  }

  void Compute(OrtKernelContext* context) const {
    Ort::KernelContext ctx(context);
    Ort::ConstValue qv = Input(ctx, 0, "q"), kv = Input(ctx, 1, "key"), av = Input(ctx, 2, "past_mlp_age"),
                    tv = Input(ctx, 3, "threshold"), vv = Input(ctx, 4, "video_start");
    const auto qs = qv.GetTensorTypeAndShapeInfo().GetShape(), ks = kv.GetTensorTypeAndShapeInfo().GetShape(),
               as = av.GetTensorTypeAndShapeInfo().GetShape();
    const size_t n_tau = tv.GetTensorTypeAndShapeInfo().GetElementCount();
    if (qs.size() != (packed ? 3u : 4u) || ks.size() != 4)
      throw std::runtime_error(packed ? "TemporalGate: q must be [B,S,W] (packed_qkv) and key [B,Hkv,N,D]"
                                      : "TemporalGate: q must be [B,H,S,D] and key [B,Hkv,N,D]");
    const int64_t B = qs[0], Hq = packed ? H : qs[1], S = packed ? qs[1] : qs[2], D = ks[3];
    const int64_t Hkv = ks[1], Tbuf = ks[2], W = packed ? qs[2] : 0;
    const int64_t T = use_total_len ? static_cast<int64_t>(Input(ctx, 5, "total_len").GetTensorData<int32_t>()[0])
                                    : Tbuf;
    const int64_t P = T - S;
    if (Hkv <= 0 || Hq % Hkv != 0 || ks[0] != B || (!packed && qs[3] != D) || (packed && W < Hq * D) || P < 0 ||
        (!aligned_keys && T > Tbuf) || (aligned_keys && Tbuf != S) || as.size() != 2 || as[0] != B ||
        as[1] != L || static_cast<int64_t>(n_tau) <= t_index)
      throw std::runtime_error("TemporalGate: inconsistent shapes (q, key, past_mlp_age, threshold, total_len)");
    const int64_t G = Hq / Hkv;
    const int64_t vs = vv.GetTensorData<int64_t>()[0];
    const float tau = tv.GetTensorData<float>()[t_index];
    const float scale = 1.0f / (static_cast<float>(Hq) * std::sqrt(static_cast<float>(D)));
    const float* cos = nullptr;
    const float* sin = nullptr;
    int64_t R = 0, cstride = 0;
    if (rotary) {
      Ort::ConstValue cv = Input(ctx, 7, "cos_cache"), sv = Input(ctx, 8, "sin_cache");
      const auto cs = cv.GetTensorTypeAndShapeInfo().GetShape();
      R = rot_dim > 0 ? rot_dim : D;
      if (cs.size() != 2 || R > D || cs[1] < R / 2 || T > cs[0] || sv.GetTensorTypeAndShapeInfo().GetShape() != cs)
        throw std::runtime_error("TemporalGate: cos/sin caches shorter than the positions or rotary dim");
      cos = cv.GetTensorData<float>();
      sin = sv.GetTensorData<float>();
      cstride = cs[1];
    }
    const float* cache = nullptr;
    int64_t Hd = 0;
    if (packed) {
      Ort::ConstValue cv = Input(ctx, 6, "past_mlp_cache");
      const auto cs = cv.GetTensorTypeAndShapeInfo().GetShape();
      if (cs.size() != 3 || cs[0] != B || cs[1] != L)
        throw std::runtime_error("TemporalGate: past_mlp_cache must be [B, frame_tokens, hidden]");
      cache = cv.GetTensorData<float>();
      Hd = cs[2];
    }
    bool* rep = ctx.GetOutput(0, {B, S}).GetTensorMutableData<bool>();
    float* t = ctx.GetOutput(1, {B, S}).GetTensorMutableData<float>();
    int64_t* sl = ctx.GetOutput(2, {S}).GetTensorMutableData<int64_t>();
    bool* wr = ctx.GetOutput(3, {S}).GetTensorMutableData<bool>();
    float* out = packed ? ctx.GetOutput(4, {B, S, Hd}).GetTensorMutableData<float>() : nullptr;
    const float* qd = qv.GetTensorData<float>();
    const float* kd = kv.GetTensorData<float>();
    const int64_t* ad = av.GetTensorData<int64_t>();
    SlotsAndWrites(P, S, T, L, vs, sl, wr);
    std::vector<float> qsum(static_cast<size_t>(D));
    const int64_t half = R / 2;
    int64_t n_replay = 0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < S; ++i) {
        const int64_t p = P + i, aligned = p - L;
        const int64_t idx = aligned_keys ? i : (aligned > 0 ? aligned : 0);
        float acc = 0.0f;
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          const float* kr = kd + ((b * Hkv + hk) * Tbuf + idx) * D;
          if (!packed) {  // [B,H,S,D]: one dot per query head
            for (int64_t g = 0; g < G; ++g) {
              const float* qr = qd + ((b * Hq + hk * G + g) * S + i) * D;
              float dot = 0.0f;
              for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
              acc += dot;
            }
            continue;
          }
          std::fill(qsum.begin(), qsum.end(), 0.0f);
          const float* row = qd + (b * S + i) * W;
          for (int64_t g = 0; g < G; ++g) {
            const float* qh = row + (hk * G + g) * D;
            for (int64_t d = 0; d < D; ++d) qsum[d] += qh[d];
          }
          const float* c = rotary ? cos + p * cstride : nullptr;
          const float* sn = rotary ? sin + p * cstride : nullptr;
          for (int64_t j = 0; j < half; ++j) {  // rotated part
            const int64_t a1 = interleaved ? 2 * j : j, a2 = interleaved ? 2 * j + 1 : j + half;
            const float x1 = qsum[a1], x2 = qsum[a2];
            acc += (x1 * c[j] - x2 * sn[j]) * kr[a1] + (x2 * c[j] + x1 * sn[j]) * kr[a2];
          }
          for (int64_t d = R; d < D; ++d) acc += qsum[d] * kr[d];
        }
        const float v = acc * scale;
        t[b * S + i] = v;
        const bool r = Eligible(P, S, L, aligned, vs, ad[b * L + sl[i]] - age_offset, K) && v > tau;
        rep[b * S + i] = r;
        n_replay += r ? 1 : 0;
        if (packed) std::memcpy(out + (b * S + i) * Hd, cache + (b * L + sl[i]) * Hd, sizeof(float) * Hd);
      }
    }
    if (!packed) return;
    *ctx.GetOutput(5, {}).GetTensorMutableData<bool>() = n_replay == 0;
    *ctx.GetOutput(6, {}).GetTensorMutableData<bool>() = n_replay < B * S;
    if (select_rows) {
      Ort::ConstValue xv = Input(ctx, 9, "mlp_input");
      const auto info = xv.GetTensorTypeAndShapeInfo();
      const int64_t Hm = fastcar_rows::RowWidth(info.GetShape(), static_cast<int64_t>(info.GetElementCount()),
                                                B * S, "TemporalGate");
      const int64_t n = B * S - n_replay;
      fastcar_rows::CopyRows(xv.GetTensorData<float>(), Hm, rep, B * S,
                             ctx.GetOutput(7, {1, n, Hm}).GetTensorMutableData<float>());
    }
  }
};

// A raw OrtCustomOp, not a lite op: the forms leave optional inputs empty ("") between given ones.
struct GateOp : Ort::CustomOpBase<GateOp, GateKernel> {
  const GateSignature* sig;
  explicit GateOp(const GateSignature* signature) : sig(signature) {}
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
    (void)api;
    return new GateKernel(info, sig);
  }
  const char* GetName() const { return sig->name; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t Inputs() const {
    int n = 0;
    for (int at : sig->at) n = std::max(n, at + 1);
    return static_cast<size_t>(n);
  }
  size_t GetInputTypeCount() const { return Inputs(); }
  int Role(size_t node_input) const {  // which TemporalGate input the node's input is
    for (int i = 0; i < 10; ++i)
      if (sig->at[i] == static_cast<int>(node_input)) return i;
    return -1;
  }
  ONNXTensorElementDataType GetInputType(size_t k) const {
    const int i = Role(k);
    if (i == 2 || i == 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    if (i == 5) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t k) const {
    return sig == &kGate && k >= 5 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const {
    return sig == &kGate ? 8 : sig->select_rows ? 8 : sig->packed ? 7 : 4;
  }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    if (i == 0 || i == 3 || i == 5 || i == 6) return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
    if (i == 2) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return sig == &kGate && i >= 4 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
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
struct MLPCacheUpdate {
  int64_t age_offset = 0;  // stored age = age + age_offset

  MLPCacheUpdate(const OrtApi* api, const OrtKernelInfo* info) {
    (void)api;
    age_offset = AttrOr<int64_t>(Ort::ConstKernelInfo(info), "age_offset", 0);
  }

  void Compute(const Tensor<float>& cache, const Tensor<int64_t>& age, const Tensor<float>& branch,
               const Tensor<bool>& replay, const Tensor<int64_t>& slot, const Tensor<bool>& write,
               Tensor<float>& out_cache, Tensor<int64_t>& out_age) {
    Write(cache, age, branch.Data(), replay, slot, write, out_cache, out_age);
  }

  // the update with the used rows `br` [B,S,H]
  void Write(const Tensor<float>& cache, const Tensor<int64_t>& age, const float* br, const Tensor<bool>& replay,
             const Tensor<int64_t>& slot, const Tensor<bool>& write, Tensor<float>& out_cache,
             Tensor<int64_t>& out_age) const {
    const auto cs = cache.Shape();
    const int64_t B = cs[0], L = cs[1], Hd = cs[2];
    const int64_t S = slot.Shape()[0];
    float* oc = out_cache.Allocate({B, L, Hd});
    int64_t* oa = out_age.Allocate({B, L});
    const float* c = cache.Data();
    const int64_t* a = age.Data();
    if (oc != c) std::memcpy(oc, c, sizeof(float) * B * L * Hd);
    if (oa != a) std::memcpy(oa, a, sizeof(int64_t) * B * L);
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
        ag = rp[b * S + i] ? ag + 1 : age_offset;
      }
    }
  }
};

// MLPCacheMerge(past_mlp_cache [B,L,H], past_mlp_age [B,L], rows [.., H] (the computing tokens' MLP rows, in
//   order), replay [B,S], slot [S], write [S]) -> (present_mlp_cache, present_mlp_age, used [B,S,H]): used = rows
//   merged with the slots' cached rows (row_ops.h), then MLPCacheUpdate of used. In place like MLPCacheUpdate.
struct MLPCacheMerge : MLPCacheUpdate {
  MLPCacheMerge(const OrtApi* api, const OrtKernelInfo* info) : MLPCacheUpdate(api, info) {}

  void Compute(const Tensor<float>& cache, const Tensor<int64_t>& age, const Tensor<float>& rows,
               const Tensor<bool>& replay, const Tensor<int64_t>& slot, const Tensor<bool>& write,
               Tensor<float>& out_cache, Tensor<int64_t>& out_age, Tensor<float>& used) {
    const auto cs = cache.Shape(), as = age.Shape(), rs = replay.Shape();
    const int64_t S = slot.Shape().empty() ? -1 : slot.Shape()[0];
    if (cs.size() != 3 || as.size() != 2 || as[0] != cs[0] || as[1] != cs[1] || rs.size() != 2 || rs[0] != cs[0] ||
        rs[1] != S || static_cast<int64_t>(write.NumberOfElement()) != S || cs[2] <= 0 ||
        static_cast<int64_t>(rows.NumberOfElement()) % cs[2] != 0)
      throw std::runtime_error("MLPCacheMerge: inconsistent shapes (past_mlp_cache [B,L,H], past_mlp_age [B,L], "
                               "rows [.., H], replay [B,S], slot [S], write [S])");
    const int64_t B = cs[0], L = cs[1], Hd = cs[2];
    const int64_t* sl = slot.Data();
    for (int64_t i = 0; i < S; ++i)
      if (sl[i] < 0 || sl[i] >= L) throw std::runtime_error("MLPCacheMerge: slot out of [0, L)");
    float* u = used.Allocate({B, S, Hd});
    fastcar_rows::Merge(cache.Data(), L, Hd, rows.Data(), static_cast<int64_t>(rows.NumberOfElement()) / Hd,
                        replay.Data(), sl, B, S, u);
    Write(cache, age, u, replay, slot, write, out_cache, out_age);
  }
};

// CompressedAttention(q [B,Hq,S,D], k [B,Hkv,S,D], v, past_key [B,Hkv,N,D], past_value, attention_mask [B,T],
//   total_len [] int32, [past_slots [B,Hkv,C,F], k_raw [B,Hkv,S,D], past_key_raw [B,Hkv,C,D],
//   past_dense [B,Hkv,M,2D], video_start [] int64 (prune_prompt, TempCache; unused inputs before it are empty float[0])])
//   -> (out [B,S,Hq*D], present_key, present_value, [present_slots, aligned_key [B,Hkv,S,D], present_key_raw,
//       present_dense, kv_stats [B,Hkv,4]])
// qkv_perm [0,2,1,3]: q, k, v are [B,S,heads*D] (or [B,S,heads,D]) instead, as the projections produce them.
// Packed QKV (qkv_perm [0,2,1,3], k and v empty): q is [B,S,(heads + 2 kv_heads)*D], GroupQueryAttention's packed
// layout. do_rotary: q and k are rotated here (cos_cache/sin_cache [max_pos, <= D/2], inputs 12/13) at KV index
// total_len - S + i, as GroupQueryAttention rotates with seqlens_k = total_len - 1 (passes/attention_form.py).
struct CompressedAttention {
  // q/k/v copies; per thread, kept between Compute calls and trimmed after large ones (thread_scratch.h)
  struct Scratch {
    std::vector<float> q, k, v;
    void Trim() {
      for (auto* b : {&q, &k, &v}) fastcar_scratch::TrimBuffer(*b);
    }
  };
  fastcar_attn::Settings cfg;
  bool bshd = false;  // qkv_perm [0,2,1,3]: q/k/v are [B,S,heads*D] or [B,S,heads,D] (the projections' layout)
  bool do_rotary = false, rot_interleaved = false;

  CompressedAttention(const OrtApi* api, const OrtKernelInfo* info) {
    (void)api;
    Ort::ConstKernelInfo ki(info);
    cfg.heads = ki.GetAttribute<int64_t>("num_heads");
    cfg.kv_heads = ki.GetAttribute<int64_t>("kv_num_heads");
    cfg.scale = ki.GetAttribute<float>("scale");
    cfg.budget = AttrOr<int64_t>(ki, "budget", 0);
    cfg.sinks = AttrOr<int64_t>(ki, "sinks", 0);
    cfg.window = AttrOr<int64_t>(ki, "window", 0);
    cfg.frame_tokens = AttrOr<int64_t>(ki, "frame_tokens", 1);
    cfg.tempcache_sim = AttrOr<float>(ki, "tempcache_sim", 2.0f);
    cfg.eviction = fastcar_attn::EvictionNamed(AttrOr<std::string>(ki, "eviction", "mass"));
    cfg.lsh_bits = AttrOr<int64_t>(ki, "lsh_bits", 0);
    cfg.lsh_tables = AttrOr<int64_t>(ki, "lsh_tables", 0);
    if (cfg.lsh_bits > 0) cfg.lsh_planes = ki.GetAttributes<float>("lsh_planes");
    cfg.int8_dirs = AttrOr<int64_t>(ki, "int8_dirs", 0);
    cfg.int8_tables = AttrOr<int64_t>(ki, "int8_tables", 0);
    if (cfg.int8_dirs > 0) cfg.int8_planes = ki.GetAttributes<float>("int8_planes");
    cfg.prune_prompt = AttrOr<float>(ki, "prune_prompt", -1.0f);
    std::vector<int64_t> perm{0, 1, 2, 3};
    try {
      perm = ki.GetAttributes<int64_t>("qkv_perm");
    } catch (const Ort::Exception&) {
    }
    bshd = perm == std::vector<int64_t>{0, 2, 1, 3};
    if (!bshd && perm != std::vector<int64_t>{0, 1, 2, 3})
      throw std::runtime_error("CompressedAttention: qkv_perm must be [0,1,2,3] or [0,2,1,3]");
    do_rotary = AttrOr<int64_t>(ki, "do_rotary", 0) != 0;
    rot_interleaved = AttrOr<int64_t>(ki, "rotary_interleaved", 0) != 0;
    if (do_rotary && !bshd) throw std::runtime_error("CompressedAttention: do_rotary needs qkv_perm [0,2,1,3]");
  }

  // Heads [offset, offset + heads*D) of rows [B,S,stride] -> [B,heads,S,D]; with cos/sin [*, half] each token's
  // first 2*half channels of a head are rotated at KV index P + s (half-split pairs (j, j + half), or (2j, 2j + 1)
  // interleaved: com.microsoft.RotaryEmbedding's arithmetic), the rest copied.
  static const float* Gather(const float* x, int64_t stride, int64_t offset, int64_t B, int64_t S, int64_t heads,
                             int64_t D, const float* cos, const float* sin, int64_t half, int64_t P, bool interleaved,
                             std::vector<float>& buf) {
    buf.resize(static_cast<size_t>(B * heads * S * D));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        const float* c = cos == nullptr ? nullptr : cos + (P + s) * half;
        const float* sn = sin == nullptr ? nullptr : sin + (P + s) * half;
        for (int64_t h = 0; h < heads; ++h) {
          const float* src = x + (b * S + s) * stride + offset + h * D;
          float* dst = buf.data() + ((b * heads + h) * S + s) * D;
          std::memcpy(dst, src, sizeof(float) * D);
          if (c != nullptr) fastcar_gqa::Rotate(dst, c, sn, half, interleaved);  // GQA's rule, one definition
        }
      }
    return buf.data();
  }

  // [B,S,heads,D] -> [B,heads,S,D] (a prompt step: S > 1; one token needs no copy, the two layouts coincide)
  static const float* ToHeads(const float* x, int64_t B, int64_t S, int64_t heads, int64_t D, std::vector<float>& buf) {
    if (S == 1) return x;
    buf.resize(static_cast<size_t>(B * S * heads * D));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(buf.data() + ((b * heads + h) * S + s) * D, x + ((b * S + s) * heads + h) * D, sizeof(float) * D);
    return buf.data();
  }

  // q, k, v have the layout qkv_perm says, with these head counts and head size D
  bool LayoutOk(const std::vector<int64_t>& qs, const std::vector<int64_t>& xs, int64_t heads, int64_t S, int64_t D) const {
    if (xs.size() != qs.size() || xs[0] != qs[0]) return false;
    if (!bshd) return xs.size() == 4 && xs[1] == heads && xs[2] == S && xs[3] == D;
    if (xs.size() == 3) return xs[1] == S && xs[2] == heads * D;
    return xs.size() == 4 && xs[1] == S && xs[2] == heads && xs[3] == D;
  }

  void Compute(OrtKernelContext* context, const Tensor<float>& q, const Tensor<float>& k, const Tensor<float>& v,
               const Tensor<float>& past_key, const Tensor<float>& past_value, const Tensor<int64_t>& mask,
               const Tensor<int32_t>& total_len, std::optional<const Tensor<float>*> past_slots,
               std::optional<const Tensor<float>*> k_raw, std::optional<const Tensor<float>*> past_key_raw,
               std::optional<const Tensor<float>*> past_dense,
               std::optional<const Tensor<int64_t>*> video_start, std::optional<const Tensor<float>*> cos_cache,
               std::optional<const Tensor<float>*> sin_cache, Tensor<float>& out, Tensor<float>& present_key,
               Tensor<float>& present_value,
               std::optional<Tensor<float>*> present_slots, std::optional<Tensor<float>*> aligned_key,
               std::optional<Tensor<float>*> present_key_raw, std::optional<Tensor<float>*> present_dense,
               std::optional<Tensor<float>*> kv_stats) {
    const auto qs = q.Shape(), ks = past_key.Shape(), ms = mask.Shape();
    fastcar_attn::Shapes sh;
    if ((qs.size() != 4 && !(bshd && qs.size() == 3)) || ks.size() != 4)
      throw std::runtime_error("CompressedAttention: q must be [B,heads,S,D] (or [B,S,heads*D] with qkv_perm "
                               "[0,2,1,3]) and past_key [B,kv_heads,N,D]");
    sh.B = qs[0];
    sh.S = bshd ? qs[1] : qs[2];
    sh.D = ks[3];
    sh.N = ks[2];
    sh.T = static_cast<int64_t>(total_len.Data()[0]);
    sh.P = sh.T - sh.S;
    const int64_t HD = cfg.heads * sh.D, KD = cfg.kv_heads * sh.D;
    const bool packed = bshd && k.NumberOfElement() == 0 && v.NumberOfElement() == 0;
    const bool layout_ok = packed ? qs.size() == 3 && qs[2] == HD + 2 * KD
                                  : LayoutOk(qs, qs, cfg.heads, sh.S, sh.D) &&
                                        LayoutOk(qs, k.Shape(), cfg.kv_heads, sh.S, sh.D) &&
                                        LayoutOk(qs, v.Shape(), cfg.kv_heads, sh.S, sh.D);
    if (!layout_ok || ks[1] != cfg.kv_heads || ms.size() != 2 || ms[0] != sh.B || ms[1] != sh.T || sh.P < 0)
      throw std::runtime_error("CompressedAttention: inconsistent shapes (q, k, v, past_key, attention_mask, total_len; "
                               "packed QKV: q [B,S,(num_heads + 2 kv_num_heads)*D], k and v empty)");
    // the function bodies compute exactly two forms: packed q/k/v rotated here (overload packed_rotary), or
    // separate q/k/v already rotated (the base function); any other combination would differ from its body
    if (packed != do_rotary)
      throw std::runtime_error(std::string("CompressedAttention: ") + (packed ? "a packed q/k/v (k and v empty) "
                               "needs do_rotary = 1" : "do_rotary needs a packed q/k/v (k and v empty)") +
                               ", the only forms its function bodies compute; recompile the model");
    // [B,heads,S,D] copies (rotated, or of a multi-token [B,S,heads*D] step): this thread's buffers, kept between
    // calls (a decode step allocates nothing), trimmed when large, also when the call throws
    fastcar_scratch::Lease<Scratch> lease;
    Scratch& scratch = lease.s;
    const float *qd, *kd, *vd;
    if (packed) {
      if (!cos_cache.has_value() || !sin_cache.has_value())
        throw std::runtime_error("CompressedAttention: do_rotary needs cos_cache and sin_cache (inputs 12, 13)");
      const auto cs = (*cos_cache)->Shape();
      if (cs.size() != 2 || (*sin_cache)->Shape() != cs || 2 * cs[1] > sh.D || cs[0] < sh.T)
        throw std::runtime_error("CompressedAttention: cos_cache/sin_cache must both be [max_pos >= total_len, "
                                 "<= head_size/2] (total_len " + std::to_string(sh.T) + "; a longer video needs a "
                                 "compile with a larger --rotary-positions)");
      const float *cd = (*cos_cache)->Data(), *sd = (*sin_cache)->Data();
      const int64_t half = cs[1], stride = HD + 2 * KD;
      const float* x = q.Data();
      qd = Gather(x, stride, 0, sh.B, sh.S, cfg.heads, sh.D, cd, sd, half, sh.P, rot_interleaved, scratch.q);
      kd = Gather(x, stride, HD, sh.B, sh.S, cfg.kv_heads, sh.D, cd, sd, half, sh.P, rot_interleaved, scratch.k);
      vd = Gather(x, stride, HD + KD, sh.B, sh.S, cfg.kv_heads, sh.D, nullptr, nullptr, 0, 0, false, scratch.v);
    } else {
      qd = bshd ? ToHeads(q.Data(), sh.B, sh.S, cfg.heads, sh.D, scratch.q) : q.Data();
      kd = bshd ? ToHeads(k.Data(), sh.B, sh.S, cfg.kv_heads, sh.D, scratch.k) : k.Data();
      vd = bshd ? ToHeads(v.Data(), sh.B, sh.S, cfg.kv_heads, sh.D, scratch.v) : v.Data();
    }
    Ort::KernelContext kctx(context);
    float* o = out.Allocate({sh.B, sh.S, cfg.heads * sh.D});
    if (cfg.budget == 0) {
      const int64_t n_out = sh.N >= sh.T ? sh.N : sh.T;  // preallocated buffer, or the growing cache
      if (sh.N < sh.T && sh.N != sh.P)
        throw std::runtime_error("CompressedAttention: past_key holds neither the past tokens nor a buffer >= total_len");
      float* pk = present_key.Allocate({sh.B, cfg.kv_heads, n_out, sh.D});
      float* pv = present_value.Allocate({sh.B, cfg.kv_heads, n_out, sh.D});
      fastcar_attn::WriteNew(sh, cfg.kv_heads, past_key.Data(), kd, pk, n_out);
      fastcar_attn::WriteNew(sh, cfg.kv_heads, past_value.Data(), vd, pv, n_out);
      fastcar_attn::DenseTask t{qd, pk, pv, mask.Data(), o, sh.B, cfg.heads, cfg.kv_heads, sh.S, sh.D,
                                n_out, sh.T, sh.P, 1, sh.S, cfg.scale};
      fastcar_attn::RunDense(kctx, t);
      return;
    }
    if (!past_slots.has_value() || !present_slots.has_value())
      throw std::runtime_error("CompressedAttention: a budget needs past_slots / present_slots");
    // the bucket planes are attributes the compiler writes for this head size: a hand-edited or mismatched model
    // would read past them (or shift by a negative count for an int8_dirs outside 1/2/4/8)
    const auto planes = [&](int64_t tables, int64_t rows) { return static_cast<size_t>(tables * rows * sh.D); };
    if ((cfg.lsh_bits > 0 && cfg.lsh_planes.size() != planes(cfg.lsh_tables, cfg.lsh_bits)) ||
        (cfg.int8_dirs > 0 && (8 % cfg.int8_dirs != 0 || cfg.int8_dirs > 8 ||
                               cfg.int8_planes.size() != planes(cfg.int8_tables, cfg.int8_dirs))))
      throw std::runtime_error("CompressedAttention: lsh_planes / int8_planes do not match tables x bits (dirs) x "
                               "head_dim, or int8_dirs is not 1, 2, 4 or 8; recompile the model");
    const bool tempcache = cfg.tempcache_sim <= 1.0f;
    if (tempcache && !(k_raw.has_value() && past_key_raw.has_value() && present_key_raw.has_value()))
      throw std::runtime_error("CompressedAttention: tempcache_sim needs k_raw, past_key_raw and present_key_raw");
    fastcar_attn::CompressedTask t;
    t.cfg = &cfg;
    t.sh = sh;
    const auto ss = (*past_slots)->Shape();
    t.F = fastcar_attn::kCodes + cfg.CodeTables() + (cfg.prune_prompt >= 0.0f ? 1 : 0);
    if (ss.size() != 4 || ss[0] != sh.B || ss[1] != cfg.kv_heads || ss[2] != sh.N || ss[3] != t.F)
      throw std::runtime_error("CompressedAttention: past_slots must be [batch, kv_heads, budget, " +
                               std::to_string(t.F) + "] for this op's settings (a state from another compile?)");
    t.q = qd;
    t.k = kd;
    t.v = vd;
    t.mask = mask.Data();
    t.out = o;
    t.key = present_key.Allocate({sh.B, cfg.kv_heads, sh.N, sh.D});
    t.val = present_value.Allocate({sh.B, cfg.kv_heads, sh.N, sh.D});
    t.slots = (*present_slots)->Allocate({sh.B, cfg.kv_heads, sh.N, t.F});
    CopyIfDistinct(past_key.Data(), t.key, sh.B * cfg.kv_heads * sh.N * sh.D);
    CopyIfDistinct(past_value.Data(), t.val, sh.B * cfg.kv_heads * sh.N * sh.D);
    CopyIfDistinct((*past_slots)->Data(), t.slots, sh.B * cfg.kv_heads * sh.N * t.F);
    if (k_raw.has_value() && past_key_raw.has_value() && present_key_raw.has_value()) {  // diagnostics wire them
      t.k_raw = (*k_raw)->Data();
      t.key_raw = (*present_key_raw)->Allocate({sh.B, cfg.kv_heads, sh.N, sh.D});
      CopyIfDistinct((*past_key_raw)->Data(), t.key_raw, sh.B * cfg.kv_heads * sh.N * sh.D);
    }
    if (past_dense.has_value() && present_dense.has_value() && kv_stats.has_value()) {
      const auto ds = (*past_dense)->Shape();
      t.dense_cap = ds[2];
      const int64_t n = sh.B * cfg.kv_heads * t.dense_cap * 2 * sh.D;
      t.dense = (*present_dense)->Allocate({sh.B, cfg.kv_heads, t.dense_cap, 2 * sh.D});
      CopyIfDistinct((*past_dense)->Data(), t.dense, n);
      t.stats = (*kv_stats)->Allocate({sh.B, cfg.kv_heads, 4});
    }
    // video_start (input 11): prompt pruning needs it; TempCache merges only tokens whose p - L is video
    // (absent: 0, the graph input's default)
    const bool has_vs = video_start.has_value() && (*video_start)->NumberOfElement() == 1;
    if (cfg.prune_prompt >= 0.0f && !has_vs)
      throw std::runtime_error("CompressedAttention: prune_prompt needs the video_start input (input 11)");
    if (has_vs) t.video_start = (*video_start)->Data()[0];
    if (aligned_key.has_value()) t.aligned = (*aligned_key)->Allocate({sh.B, cfg.kv_heads, sh.S, sh.D});
    kctx.ParallelFor(fastcar_attn::CompressedItemThunk, static_cast<size_t>(sh.B * cfg.kv_heads), 0, &t);
  }

  static void CopyIfDistinct(const float* src, float* dst, int64_t n) {
    if (src != dst) std::memcpy(dst, src, sizeof(float) * n);
  }
};

// ai.fastcar GroupQueryAttention: com.microsoft.GroupQueryAttention's inputs/outputs/attributes, dense core inside
// (group_query_attention.h). A raw OrtCustomOp, not a lite op: genai's graphs leave key/value empty ("") between
// present inputs, which the lite API cannot take.
struct GqaKernel {
  fastcar_gqa::Settings cfg;  // read-only after construction: concurrent Run calls of one session are safe

  explicit GqaKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    cfg.heads = ki.GetAttribute<int64_t>("num_heads");
    cfg.kv_heads = ki.GetAttribute<int64_t>("kv_num_heads");
    cfg.scale = AttrOr<float>(ki, "scale", 0.0f);
    cfg.do_rotary = AttrOr<int64_t>(ki, "do_rotary", 0) != 0;
    cfg.interleaved = AttrOr<int64_t>(ki, "rotary_interleaved", 0) != 0;
    if (cfg.heads <= 0 || cfg.kv_heads <= 0 || cfg.heads % cfg.kv_heads != 0)
      throw std::runtime_error("GroupQueryAttention: num_heads must be a positive multiple of kv_num_heads");
    const int64_t smooth = AttrOr<int64_t>(ki, "smooth_softmax", 0);  // ORT: -1 and 0 are off
    if (AttrOr<float>(ki, "softcap", 0.0f) != 0.0f || AttrOr<int64_t>(ki, "local_window_size", -1) > 0 ||
        (smooth != 0 && smooth != -1) || AttrOr<int64_t>(ki, "qk_output", 0) != 0 ||
        AttrOr<int64_t>(ki, "causal", 1) != 1)
      throw std::runtime_error("ai.fastcar GroupQueryAttention: softcap, local_window_size, smooth_softmax, qk_output "
                               "and causal=0 are not supported (passes/native_gqa.py does not swap such nodes)");
  }

  static const float* Floats(const Ort::KernelContext& ctx, size_t i, std::vector<int64_t>* shape) {
    if (i >= ctx.GetInputCount()) return nullptr;
    Ort::ConstValue v = ctx.GetInput(i);
    if (!v) return nullptr;
    auto info = v.GetTensorTypeAndShapeInfo();
    if (shape != nullptr) *shape = info.GetShape();
    return v.GetTensorData<float>();
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    std::vector<int64_t> qs, ks, vs, ps, pvs, cs, ss, bs;
    fastcar_gqa::Inputs in;
    in.query = Floats(ctx, 0, &qs);
    in.key = Floats(ctx, 1, &ks);
    in.value = Floats(ctx, 2, &vs);
    in.past_key = Floats(ctx, 3, &ps);
    in.past_value = Floats(ctx, 4, &pvs);
    in.cos = Floats(ctx, 7, &cs);
    in.sin = Floats(ctx, 8, &ss);
    if (ctx.GetInputCount() > 9 && ctx.GetInput(9))
      throw std::runtime_error("ai.fastcar GroupQueryAttention: position_ids is not supported");
    in.bias = Floats(ctx, 10, &bs);
    const int64_t H = cfg.heads, Hkv = cfg.kv_heads;
    // every shape the kernel indexes is checked here: a bad feed is a failed Run, never an out-of-bounds read
    if (qs.size() != 3 || (in.key == nullptr) != (in.value == nullptr))
      throw std::runtime_error("GroupQueryAttention: query must be [B,S,hidden]; key and value both present or both "
                               "absent");
    in.B = qs[0];
    in.S = qs[1];
    const int64_t per_token = in.key == nullptr ? H + 2 * Hkv : H;  // head_size-wide slices in query's last axis
    if (in.S <= 0 || qs[2] <= 0 || qs[2] % per_token != 0)
      throw std::runtime_error("GroupQueryAttention: query [B,S,W] needs S > 0 and W a positive multiple of " +
                               std::string(in.key == nullptr ? "num_heads + 2*kv_num_heads (packed QKV)"
                                                             : "num_heads") +
                               ", got S=" + std::to_string(in.S) + " W=" + std::to_string(qs[2]));
    in.D = qs[2] / per_token;
    if (in.key != nullptr && (ks.size() != 3 || ks[0] != in.B || ks[1] != in.S || ks[2] != Hkv * in.D || vs != ks))
      throw std::runtime_error("GroupQueryAttention: key and value must both be [B,S,kv_num_heads*head_size] with "
                               "query's B and S");
    if ((in.past_key == nullptr) != (in.past_value == nullptr))
      throw std::runtime_error("GroupQueryAttention: past_key and past_value must both be given or both be absent");
    if (in.past_key != nullptr && (ps.size() != 4 || ps[0] != in.B || ps[1] != Hkv || ps[3] != in.D || pvs != ps))
      throw std::runtime_error("GroupQueryAttention: past_key and past_value must both be "
                               "[B,kv_num_heads,past,head_size]");
    in.Np = in.past_key != nullptr ? ps[2] : 0;
    Ort::ConstValue seqlens = ctx.GetInput(5), total = ctx.GetInput(6);
    if (seqlens.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(in.B))
      throw std::runtime_error("GroupQueryAttention: seqlens_k must hold batch_size (" + std::to_string(in.B) +
                               ") values");
    if (total.GetTensorTypeAndShapeInfo().GetElementCount() != 1)
      throw std::runtime_error("GroupQueryAttention: total_sequence_length must be one value");
    in.seqlens_k = seqlens.GetTensorData<int32_t>();
    in.total = total.GetTensorData<int32_t>()[0];
    if (in.total <= 0) throw std::runtime_error("GroupQueryAttention: total_sequence_length must be positive");
    if (cfg.do_rotary) {
      if (in.cos == nullptr || in.sin == nullptr || cs.size() != 2 || 2 * cs[1] > in.D || ss != cs)
        throw std::runtime_error("GroupQueryAttention: do_rotary needs cos_cache and sin_cache, both "
                                 "[max_pos, <= head_size/2]");
      in.max_pos = cs[0];
      in.half = cs[1];
    }
    if (in.bias != nullptr) {
      if (bs.size() != 4 || bs[0] != in.B || bs[1] != 1 || (bs[2] != in.S && bs[2] != 1) || bs[3] != in.total)
        throw std::runtime_error("ai.fastcar GroupQueryAttention: attention_bias must be [B,1,S or 1,total]");
      in.bias_rows = bs[2];
    }
    const int64_t N = std::max(in.total, in.Np);
    float* out = ctx.GetOutput(0, {in.B, in.S, H * in.D}).GetTensorMutableData<float>();
    float* key = ctx.GetOutput(1, {in.B, Hkv, N, in.D}).GetTensorMutableData<float>();
    float* val = ctx.GetOutput(2, {in.B, Hkv, N, in.D}).GetTensorMutableData<float>();
    if ((key == in.past_key) != (val == in.past_value))
      throw std::runtime_error("GroupQueryAttention: bind both or neither of present_key/present_value to the past");
    fastcar_gqa::Run(cfg, in, key, val, N, out, ctx);  // q scratch and mask: per-thread, reused (no allocation)
  }
};

struct GqaOp : Ort::CustomOpBase<GqaOp, GqaKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const {
    (void)api;
    return new GqaKernel(info);
  }
  const char* GetName() const { return "GroupQueryAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 11; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 5 || i == 6) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    if (i == 9) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 0 || i == 5 || i == 6 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

std::once_flag g_once;
std::unique_ptr<Ort::CustomOpDomain> g_domain;
std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>> g_ops;
GqaOp g_gqa;
std::vector<std::unique_ptr<GateOp>> g_gates;

}  // namespace

// AnnSA for the eager DiT runtime (dit/sparse.native_annsa, through ctypes: that runtime sits below the torch front
// end, so it calls this library's kernel rather than a torch op): bucket_attention.h's RunGroups, no ORT involved.
// `executed` [G] (or null) receives each group's computed q.k pairs, the runtime's density counter.
extern "C" __attribute__((visibility("default"))) int FastcarAnnSAGroups(
    const float* q, const float* k, const float* v, const float* past_key, const float* past_value, const float* bias,
    const uint8_t* dense, const int64_t* query_codes, const int64_t* key_codes, float* out, int64_t* executed,
    int64_t G, int64_t Q, int64_t D, int64_t S, int64_t T, int64_t threads) {
  try {
    fastcar_bucket::RunGroups(
        {q, k, v, past_key, past_value, bias, dense, query_codes, key_codes, out, executed, G, Q, D, S, T}, threads);
  } catch (...) {
    return 1;
  }
  return 0;
}

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) api = api_base->GetApi(21);
  if (api == nullptr) return nullptr;  // unreachable for ORT >= 1.21
  Ort::InitApi(api);
  try {
    std::call_once(g_once, [] {
      g_domain = std::make_unique<Ort::CustomOpDomain>("ai.fastcar");
      g_ops.emplace_back(Ort::Custom::CreateLiteCustomOp("MLPCacheRead", "CPUExecutionProvider", MLPCacheRead));
      g_ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp<MLPCacheUpdate>("MLPCacheUpdate", "CPUExecutionProvider"));
      g_ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp<CompressedAttention>("CompressedAttention", "CPUExecutionProvider"));
      g_ops.emplace_back(
          Ort::Custom::CreateLiteCustomOp("SelectRows", "CPUExecutionProvider", fastcar_rows::SelectRows));
      g_ops.emplace_back(Ort::Custom::CreateLiteCustomOp<MLPCacheMerge>("MLPCacheMerge", "CPUExecutionProvider"));
      g_ops.emplace_back(Ort::Custom::CreateLiteCustomOp("AnnSAAttention", "CPUExecutionProvider",
                                                         fastcar_annsa::AnnSAAttention));
      g_ops.emplace_back(Ort::Custom::CreateLiteCustomOp("SlotAttention", "CPUExecutionProvider",
                                                         fastcar_slots::SlotAttention));
      for (auto& op : g_ops) g_domain->Add(op.get());
      g_gates.push_back(std::make_unique<GateOp>(&kGate));
      for (const GateSignature& legacy : kLegacyGates) g_gates.push_back(std::make_unique<GateOp>(&legacy));
      for (auto& op : g_gates) g_domain->Add(op.get());
      g_domain->Add(&g_gqa);
    });
    Ort::UnownedSessionOptions so(options);
    so.Add(*g_domain);
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(ORT_FAIL, e.what());
  }
  return nullptr;
}
