// ai.fastcar GroupQueryAttention: a drop-in for com.microsoft.GroupQueryAttention (same inputs, outputs and
// attributes; ORT's CPU semantics) whose attention is the shared dense core (dense_attention.h RunDense).
//
// Why: onnxruntime-genai's builder graphs (and `--fused-attention gqa`) run ORT's GQA, ~1 ms per layer per decode
// step at ctx 4096 for 4 MB of KV on the benchmark LLaMA; the dense core computes the same attention several
// times faster (rows of a KV group scored together against each key row). Body (no library): the original op
// (passes/fastcar_ops.py); the swap: passes/native_gqa.py.
//
// Semantics (ORT 1.31 CPU kernel, checked by tests/test_native_gqa.py against ORT itself):
//   query [B,S,(H+2Hkv)D] packed, or query [B,S,HD] + key/value [B,S,Hkv D]; past_key/past_value [B,Hkv,Np,D];
//   seqlens_k [B] int32 (row b holds seqlens_k[b] + 1 tokens after this step); total_sequence_length [] int32.
//   present [B,Hkv,max(total, Np),D]; the same buffer as past (past_present_share_buffer) is written in place.
//   First prompt (S == total): row b's tokens are KV 0..S-1 (past 0), query i sees keys 0..min(i, seqlens_k[b])
//   (right pads attend to the real tokens only); otherwise (decode, S == 1, or a later
//   prompt at batch 1) past_b = seqlens_k[b] + 1 - S. New K/V go to rows past_b.., query i sees keys 0..past_b+i.
//   do_rotary: q and k rotated at position past_b + i (first prompt: i for every token, right pads included; later
//   steps: 1 where that is past the row's length, as ORT does),
//   cos/sin [max_pos, R/2], half-split or interleaved pairs.
//   attention_bias [B,1,S or 1,T] is accepted only in the form `--fused-attention gqa` writes (0 = visible,
//   <= -1e30 = a left pad, per column): it becomes the dense core's [B,T] mask. A query that sees no key gets, as
//   in ORT, zeros when the hidden columns are float-min / -inf, else the mean of its causal values.
// Unsupported (the pass never swaps such nodes): softcap, local_window_size, smooth_softmax=1, qk_output, causal=0,
// quantised KV, position_ids / head_sink / k_scale / v_scale / q,k norm inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dense_attention.h"
#include "thread_scratch.h"

namespace fastcar_gqa {

struct Settings {
  int64_t heads = 1, kv_heads = 1;
  float scale = 0.0f;  // 0: 1/sqrt(head_size)
  bool do_rotary = false, interleaved = false;
};

struct Inputs {
  const float* query = nullptr;
  const float* key = nullptr;    // nullptr: packed QKV
  const float* value = nullptr;
  const float* past_key = nullptr;  // nullptr: no past
  const float* past_value = nullptr;
  const int32_t* seqlens_k = nullptr;
  const float* cos = nullptr;  // [max_pos, R/2]
  const float* sin = nullptr;
  const float* bias = nullptr;  // [B,1,Sb,T] mask-form (see above), Sb = S or 1
  int64_t B = 0, S = 0, D = 0, Np = 0, total = 0, max_pos = 0, half = 0, bias_rows = 0;
};

// Rotate x in place (head_size D, rotary dims 2 * half) with cos/sin rows c, s.
inline void Rotate(float* x, const float* c, const float* s, int64_t half, bool interleaved) {
  for (int64_t j = 0; j < half; ++j) {
    const int64_t a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + half;
    const float x1 = x[a], x2 = x[b];
    x[a] = x1 * c[j] - x2 * s[j];
    x[b] = x2 * c[j] + x1 * s[j];
  }
}

// Per (b, token i): the query heads into q [B,H,S,D] and the new key/value rows into the present buffers at KV
// row past[b] + i, rotated at pos[b*S+i] when do_rotary.
struct PrepTask {
  const Settings* cfg;
  const Inputs* in;
  const int64_t* past;  // [B]
  const int64_t* pos;   // [B*S]
  float *q, *key, *val;
  int64_t N;  // present rows
};

inline void PrepRow(const PrepTask& t, int64_t bi) {
  const Settings& c = *t.cfg;
  const Inputs& in = *t.in;
  const int64_t b = bi / in.S, i = bi % in.S, D = in.D, H = c.heads, Hkv = c.kv_heads;
  const bool packed = in.key == nullptr;
  const float* qrow = in.query + bi * (packed ? (H + 2 * Hkv) * D : H * D);
  const float* krow = packed ? qrow + H * D : in.key + bi * Hkv * D;
  const float* vrow = packed ? qrow + (H + Hkv) * D : in.value + bi * Hkv * D;
  const int64_t p = t.pos[bi];
  const float* cs = c.do_rotary ? in.cos + p * in.half : nullptr;
  const float* sn = c.do_rotary ? in.sin + p * in.half : nullptr;
  for (int64_t h = 0; h < H; ++h) {
    float* dst = t.q + ((b * H + h) * in.S + i) * D;
    std::memcpy(dst, qrow + h * D, sizeof(float) * D);
    if (cs != nullptr) Rotate(dst, cs, sn, in.half, c.interleaved);
  }
  const int64_t row = t.past[b] + i;
  for (int64_t h = 0; h < Hkv; ++h) {
    float* kd = t.key + ((b * Hkv + h) * t.N + row) * D;
    std::memcpy(kd, krow + h * D, sizeof(float) * D);
    if (cs != nullptr) Rotate(kd, cs, sn, in.half, c.interleaved);
    std::memcpy(t.val + ((b * Hkv + h) * t.N + row) * D, vrow + h * D, sizeof(float) * D);
  }
}

inline void PrepThunk(void* data, size_t item) {
  PrepRow(*static_cast<PrepTask*>(data), static_cast<int64_t>(item));
}

// Working memory of one Run call: q [B,H,S,D], the [B,T] mask and the per-row positions; per thread, kept between
// calls and trimmed after large ones (thread_scratch.h).
struct Scratch {
  std::vector<float> q;
  std::vector<int64_t> mask, past, pos, rows;
  void Trim() {
    fastcar_scratch::TrimBuffer(q);
    fastcar_scratch::TrimBuffer(mask);
    fastcar_scratch::TrimBuffer(pos);
  }
};

// The whole op. key/val: the present buffers [B,Hkv,N,D] (may be the past buffers); out [B,S,H D]. ctx: anything
// with Ort::KernelContext's ParallelFor (ORT's pool). Working memory: this thread's Scratch.
template <class Ctx>
void Run(const Settings& c, const Inputs& in, float* key, float* val, int64_t N, float* out, Ctx& ctx) {
  const int64_t B = in.B, S = in.S, D = in.D, H = c.heads, Hkv = c.kv_heads;
  const bool first_prompt = S == in.total;
  if (S > 1 && !first_prompt && B != 1)
    throw std::runtime_error("GroupQueryAttention: batch_size must be 1 when sequence_length > 1 and past context "
                             "is given");
  fastcar_scratch::Lease<Scratch> lease;  // trimmed also when a check below throws
  Scratch& sc = lease.s;
  std::vector<int64_t>& past = sc.past;
  std::vector<int64_t>& pos = sc.pos;
  std::vector<int64_t>& rows = sc.rows;
  std::vector<int64_t>& mask = sc.mask;
  past.resize(static_cast<size_t>(B));
  pos.resize(static_cast<size_t>(B * S));
  rows.resize(static_cast<size_t>(B));
  sc.q.resize(static_cast<size_t>(B * H * S * D));
  float* q = sc.q.data();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tot = static_cast<int64_t>(in.seqlens_k[b]) + 1;
    past[b] = first_prompt ? 0 : tot - S;
    rows[b] = past[b] + S;  // KV rows the step's queries may see
    if (past[b] < 0 || rows[b] > N || (in.past_key != nullptr && key != in.past_key && past[b] > in.Np))
      throw std::runtime_error("GroupQueryAttention: seqlens_k[" + std::to_string(b) + "] + 1 = " +
                               std::to_string(tot) + " does not fit sequence_length " + std::to_string(S) +
                               " and the KV buffers");
    for (int64_t i = 0; i < S; ++i) {
      const int64_t p = past[b] + i;
      // first prompt: every token (right pads too) at position i, as ORT 1.31; later steps: ORT's clamp to 1
      pos[b * S + i] = first_prompt || p < tot ? p : 1;
      if (c.do_rotary && pos[b * S + i] >= in.max_pos)
        throw std::runtime_error("GroupQueryAttention: position past cos_cache / sin_cache");
    }
  }
  // present = past rows [0, past_b), zeros elsewhere (ORT zero-fills a separate present buffer)
  if (key != in.past_key) {
    std::memset(key, 0, sizeof(float) * B * Hkv * N * D);
    std::memset(val, 0, sizeof(float) * B * Hkv * N * D);
    if (in.past_key != nullptr)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t bh = b * Hkv + h;
          std::memcpy(key + bh * N * D, in.past_key + bh * in.Np * D, sizeof(float) * past[b] * D);
          std::memcpy(val + bh * N * D, in.past_value + bh * in.Np * D, sizeof(float) * past[b] * D);
        }
  }
  PrepTask prep{&c, &in, past.data(), pos.data(), q, key, val, N};
  ctx.ParallelFor(PrepThunk, static_cast<size_t>(B * S), 0, &prep);
  // visibility per row: all ones, or the mask-form bias's last query row (columns 0..T-1)
  int64_t T = 0;
  for (int64_t b = 0; b < B; ++b) T = std::max(T, rows[b]);
  mask.assign(static_cast<size_t>(B * T), 1);
  bool hidden_lowest = true;  // every hidden column's bias is float-min or -inf: ORT gives a query seeing none 0
  if (in.bias != nullptr) {
    if (T > in.total) throw std::runtime_error("GroupQueryAttention: attention_bias narrower than the keys");
    for (int64_t b = 0; b < B; ++b) {
      const float* br = in.bias + (b * in.bias_rows + in.bias_rows - 1) * in.total;
      for (int64_t j = 0; j < T; ++j) {
        mask[b * T + j] = br[j] > -1e30f ? 1 : 0;
        if (br[j] <= -1e30f && br[j] > std::numeric_limits<float>::lowest()) hidden_lowest = false;
      }
    }
  }
  // first prompt: ORT's query i sees keys 0..min(i, seqlens_k[b]) (a right pad attends to the row's real tokens
  // only), so the pad keys are masked out for every query
  if (first_prompt)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = static_cast<int64_t>(in.seqlens_k[b]) + 1; j < T; ++j) mask[b * T + j] = 0;
  // the dense core (RunDense: tiles, key splits, ORT's pool): one task for the batch when every row holds the same
  // length (the prompt, or genai's batch decode of equal rows), else one per row (its own P and T)
  const float scale = c.scale != 0.0f ? c.scale : 1.0f / std::sqrt(static_cast<float>(D));
  const bool same = std::all_of(past.begin(), past.end(), [&](int64_t p) { return p == past[0]; });
  for (int64_t b0 = 0; b0 < B; b0 += same ? B : 1) {
    fastcar_attn::DenseTask t{};
    t.q = q + b0 * H * S * D;
    t.key = key + b0 * Hkv * N * D;
    t.val = val + b0 * Hkv * N * D;
    t.mask = mask.data() + b0 * T;
    t.out = out + b0 * S * H * D;
    t.B = same ? B : 1;
    t.Hq = H;
    t.Hkv = Hkv;
    t.S = S;
    t.D = D;
    t.N = N;
    t.T = same ? T : rows[b0];  // the mask rows are T apart: with one task T is every row's length
    t.P = past[b0];
    t.scale = scale;
    // a query that sees no key (a left pad under the bias), as ORT: zeros under float-min, else its causal mean
    t.empty = hidden_lowest ? fastcar_attn::DenseTask::kZero : fastcar_attn::DenseTask::kCausalMean;
    fastcar_attn::RunDense(ctx, t);
  }
}

}  // namespace fastcar_gqa
