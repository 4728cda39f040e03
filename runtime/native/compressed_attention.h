// ai.fastcar CompressedAttention: native CPU kernel (semantics: docs/DESIGN.md, body: passes/fastcar_ops.py).
//
// Plain mode (no budget): dense causal GQA attention over a KV buffer that is either the exporter's growing
// cache (past [B,Hkv,P,D] -> present [B,Hkv,P+S,D], a copy) or a preallocated buffer [B,Hkv,N,D], N >= T,
// bound as both past and present (then only the S new rows are written: no per-step copy, as ORT's
// GroupQueryAttention with past_present_share_buffer). Left padding (attention_mask), batch > 1 and
// multi-token steps after the prompt are all exact: a query at KV index P+i sees key j iff j <= P+i and
// mask[b, j] == 1; a query that sees no key (a left pad) averages all T values, as the exporters' masks with
// a finite minimum make softmax do (so even pad positions equal the export).
// Compressed mode (budget > 0): the buffers hold C slots per KV head; see CompressedPath below.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dense_attention.h"

namespace fastcar_attn {

constexpr int64_t kRows = 16;    // query heads computed together against one slot (GroupAttend)

// exp for x <= 0 (softmax after max subtraction): 2^(x log2 e) by range reduction and a degree-6
// polynomial; relative error ~2e-7, and a plain loop of it vectorises (libm's expf does not).
inline float FastExp(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t);
  const float f = t - n;  // [0, 1)
  const float p = Exp2Poly(kExp2Poly[0], f);
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}



// Which slot leaves a full cache (fastar/cache.py HeadCache._evict, core/options.py EVICTION_POLICIES): each
// policy's name (the op's `eviction` attribute) and its score (the lowest score leaves), one entry each.
enum class Eviction { kMass, kOldest, kMean };

inline Eviction EvictionNamed(const std::string& name) {  // (the compiler writes only the names above)
  if (name == "oldest") return Eviction::kOldest;
  if (name == "mean") return Eviction::kMean;
  return Eviction::kMass;
}

// pos: the slot's latest position; mass: the attention probability it received; count: the tokens it holds
inline float EvictionScore(Eviction e, int64_t pos, float mass, float count) {
  switch (e) {
    case Eviction::kOldest: return static_cast<float>(pos);
    case Eviction::kMean: return mass / count;
    default: return mass;
  }
}

struct Settings {
  int64_t heads = 1, kv_heads = 1;
  float scale = 1.0f;
  int64_t budget = 0, sinks = 0, window = 0, frame_tokens = 1;
  float tempcache_sim = 2.0f;  // > 1: no merging
  Eviction eviction = Eviction::kMass;
  int64_t lsh_bits = 0, lsh_tables = 0;
  std::vector<float> lsh_planes;  // [tables, bits, D]
  int64_t int8_dirs = 0, int8_tables = 0;  // AnnSA by 8-bit quantised buckets (fastcar_compile/fastar/int8.py)
  std::vector<float> int8_planes;  // [tables, dirs, D], unit rows
  float prune_prompt = -1.0f;  // < 0: off; else the softmax weight a prompt key needs to count as hit
  int64_t CodeTables() const { return lsh_bits > 0 ? lsh_tables : int8_dirs > 0 ? int8_tables : 0; }
};

struct Shapes {
  int64_t B = 0, S = 0, D = 0, N = 0, T = 0, P = 0;
};

// present[b,h] = past[b,h] (unless it is the same buffer) with rows P..P+S-1 = new[b,h]; present has n_out rows.
inline void WriteNew(const Shapes& sh, int64_t Hkv, const float* past, const float* fresh, float* present,
                     int64_t n_out) {
  const int64_t D = sh.D;
  for (int64_t bh = 0; bh < sh.B * Hkv; ++bh) {
    float* dst = present + bh * n_out * D;
    if (present != past) std::memcpy(dst, past + bh * sh.N * D, sizeof(float) * std::min(sh.N, n_out) * D);
    std::memcpy(dst + sh.P * D, fresh + bh * sh.S * D, sizeof(float) * sh.S * D);
  }
}

// --- compressed mode: C slots per (row, KV head); semantics of fastcar_compile/fastar/cache.py (HeadCache) ----
// slot record (past_slots/present_slots [B,Hkv,C,F], float32, all zeros = free):
//   [0] KV index + 1 of the slot's latest member (0 = free), [1] members (count), [2] attention mass received,
//   [3 .. 3 + tables) the key's AnnSA bucket per table (LSH or int8), then with prompt pruning
//   [3 + tables] the latest video frame + 1 in which a query gave the slot weight >= prune_prompt (0 = never).
constexpr int64_t kPos = 0, kCount = 1, kMass = 2, kCodes = 3;

struct CompressedTask {
  const Settings* cfg = nullptr;
  Shapes sh;
  int64_t F = 3;
  const float *q = nullptr, *k = nullptr, *v = nullptr, *k_raw = nullptr;
  const int64_t* mask = nullptr;
  float *out = nullptr, *key = nullptr, *val = nullptr, *slots = nullptr, *key_raw = nullptr;
  float* aligned = nullptr;  // [B,Hkv,S,D]: key of token p - L per new token (zeros when not resident)
  // diagnostics (dense attention on the side): every token's key and value [B,Hkv,dense_cap,2D], and per
  // (row, KV head) this step's executed q.k pairs, dense pairs, recall sum, queries [B,Hkv,4]
  float* dense = nullptr;
  int64_t dense_cap = 0;
  float* stats = nullptr;
  int64_t video_start = 0;  // KV index of the first video token (the model's video_start): pruning, TempCache
};

// Recall of one query (fastcar_compile/fastar/attention.py): sum over tokens of min(p_dense(t), p_slot/count)
// with the slot's members the chain pos, pos - L, ... (TempCache merges only into the slot of token p - L).
inline float DenseSideRecall(const CompressedTask& t, const float* dense, const int64_t* m, const float* qv,
                             int64_t p, const int64_t* sel, const float* w, int64_t n,
                             float wsum, const float* slots, std::vector<float>& pd) {
  const Settings& c = *t.cfg;
  const int64_t D = t.sh.D, F = t.F;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t tk = 0; tk <= p; ++tk) {
    if (m[tk] == 0) continue;
    const float* kk = dense + tk * 2 * D;
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += qv[d] * kk[d];
    pd[tk] = dot * c.scale;
    mx = std::max(mx, pd[tk]);
  }
  float sum = 0.0f;
  for (int64_t tk = 0; tk <= p; ++tk) {
    pd[tk] = m[tk] != 0 ? std::exp(pd[tk] - mx) : 0.0f;
    sum += pd[tk];
  }
  float recall = 0.0f;
  for (int64_t a = 0; a < n; ++a) {
    const float* rec = slots + sel[a] * F;
    const int64_t cnt = static_cast<int64_t>(rec[kCount]);
    const float share = w[a] / wsum / static_cast<float>(cnt);
    for (int64_t j = 0; j < cnt; ++j) {
      const int64_t tk = static_cast<int64_t>(rec[kPos]) - 1 - j * c.frame_tokens;
      if (tk >= 0) recall += std::min(pd[tk] / sum, share);
    }
  }
  return recall;
}

// q.k with 8 independent partial sums: the compiler vectorises it without -ffast-math (a plain `dot += a*b`
// loop is a serial float reduction it must keep in order).
inline float Dot(const float* a, const float* b, int64_t D) {
  float lane[8] = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int64_t l = 0; l < 8; ++l) lane[l] += a[d + l] * b[d + l];
  for (; d < D; ++d) lane[0] += a[d] * b[d];
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

inline void LshCodes(const Settings& c, const float* x, int64_t D, float* codes) {
  for (int64_t t = 0; t < c.lsh_tables; ++t) {
    int64_t code = 0;
    for (int64_t bit = 0; bit < c.lsh_bits; ++bit) {
      const float dot = Dot(c.lsh_planes.data() + (t * c.lsh_bits + bit) * D, x, D);
      if (dot > 0.0f) code |= int64_t{1} << bit;
    }
    codes[t] = static_cast<float>(code);
  }
}

// int8 buckets (fastcar_compile/fastar/int8.py): per table, each direction's projection of the unit vector,
// scaled by sqrt(D), quantised to int8 as floor(32 y) clamped to [-128, 127]; the bucket packs the top 8 / dirs
// bits of each code (floor division, offset to be non-negative) into one 8-bit id.
inline void Int8Codes(const Settings& c, const float* x, int64_t D, float* codes) {
  double nn = 0.0;
  for (int64_t d = 0; d < D; ++d) nn += double(x[d]) * x[d];
  const double inv = nn > 0.0 ? std::sqrt(double(D)) / std::sqrt(nn) : 0.0;
  const int64_t bits = 8 / c.int8_dirs, step = int64_t{1} << (8 - bits);
  for (int64_t t = 0; t < c.int8_tables; ++t) {
    int64_t code = 0;
    for (int64_t r = 0; r < c.int8_dirs; ++r) {
      const float* pl = c.int8_planes.data() + (t * c.int8_dirs + r) * D;
      double dot = 0.0;
      for (int64_t d = 0; d < D; ++d) dot += double(pl[d]) * x[d];
      const double q = std::min(127.0, std::max(-128.0, std::floor(32.0 * dot * inv)));
      const int64_t part = static_cast<int64_t>(std::floor(q / double(step))) + (int64_t{1} << (bits - 1));
      code |= part << (bits * r);
    }
    codes[t] = static_cast<float>(code);
  }
}

inline void BucketCodes(const Settings& c, const float* x, int64_t D, float* codes) {
  if (c.lsh_bits > 0) LshCodes(c, x, D, codes);
  else if (c.int8_dirs > 0) Int8Codes(c, x, D, codes);
}

inline float Cosine(const float* a, const float* b, int64_t D) {
  double ab = 0, aa = 0, bb = 0;
  for (int64_t d = 0; d < D; ++d) {
    ab += double(a[d]) * b[d];
    aa += double(a[d]) * a[d];
    bb += double(b[d]) * b[d];
  }
  const double den = std::sqrt(aa) * std::sqrt(bb);
  return den > 0 ? static_cast<float>(ab / den) : 0.0f;
}

struct GroupBuffers {  // GroupAttend's scratch, reused across tokens
  std::vector<float> qT, probs, acc;
};

// All G query heads of KV head hk for token p over the same n slots `sel` (no AnnSA: the selection is shared):
// kRows heads at a time against 4 slots per inner block, so each key row is read once for every head and the
// inner loops vectorise (the per-head path below does one dot product per head and slot). Same semantics:
// logits q.k scale + bias (log count), softmax, mass received per slot, probability-weighted values.
FASTCAR_CLONES
static inline void GroupAttend(const CompressedTask& t, int64_t b, int64_t hk, int64_t i, int64_t p, const int64_t* sel,
                        const float* bias, int64_t n, const float* key, const float* val, float* slots,
                        const int64_t* m, const float* dense, float* stats, std::vector<float>& pd,
                        GroupBuffers& buf) {
  const Settings& c = *t.cfg;
  const int64_t D = t.sh.D, F = t.F, G = c.heads / c.kv_heads;
  buf.qT.resize(D * kRows);
  buf.probs.resize(kRows * std::max<int64_t>(n, 1));
  buf.acc.resize(kRows * D);
  float* qT = buf.qT.data();
  float* pr = buf.probs.data();
  for (int64_t g0 = 0; g0 < G; g0 += kRows) {
    const int64_t nr = std::min(kRows, G - g0);
    std::fill(buf.qT.begin(), buf.qT.end(), 0.0f);
    for (int64_t r = 0; r < nr; ++r) {
      const float* qv = t.q + ((b * c.heads + hk * G + g0 + r) * t.sh.S + i) * D;
      for (int64_t d = 0; d < D; ++d) qT[d * kRows + r] = qv[d] * c.scale;
    }
    int64_t a = 0;
    for (; a + 4 <= n; a += 4) {
      float a0[kRows] = {}, a1[kRows] = {}, a2[kRows] = {}, a3[kRows] = {};
      const float *k0 = key + sel[a] * D, *k1 = key + sel[a + 1] * D, *k2 = key + sel[a + 2] * D,
                  *k3 = key + sel[a + 3] * D;
      for (int64_t d = 0; d < D; ++d) {
        const float* qd = qT + d * kRows;
        const float x0 = k0[d], x1 = k1[d], x2 = k2[d], x3 = k3[d];
        for (int64_t r = 0; r < kRows; ++r) {
          a0[r] += qd[r] * x0;
          a1[r] += qd[r] * x1;
          a2[r] += qd[r] * x2;
          a3[r] += qd[r] * x3;
        }
      }
      for (int64_t r = 0; r < nr; ++r) {
        pr[r * n + a] = a0[r] + bias[a];
        pr[r * n + a + 1] = a1[r] + bias[a + 1];
        pr[r * n + a + 2] = a2[r] + bias[a + 2];
        pr[r * n + a + 3] = a3[r] + bias[a + 3];
      }
    }
    for (; a < n; ++a) {
      float a0[kRows] = {};
      const float* k0 = key + sel[a] * D;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t r = 0; r < kRows; ++r) a0[r] += qT[d * kRows + r] * k0[d];
      for (int64_t r = 0; r < nr; ++r) pr[r * n + a] = a0[r] + bias[a];
    }
    for (int64_t r = 0; r < nr; ++r) {  // softmax per head, mass, diagnostics
      float* lr = pr + r * n;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, lr[j]);
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        lr[j] = FastExp(lr[j] - mx);
        sum += lr[j];
      }
      if (stats != nullptr) {
        const float* qv = t.q + ((b * c.heads + hk * G + g0 + r) * t.sh.S + i) * D;
        int64_t visible = 0;
        for (int64_t tk = 0; tk <= p; ++tk) visible += m[tk] != 0;
        stats[0] += static_cast<float>(n);
        stats[1] += static_cast<float>(visible);
        stats[2] += DenseSideRecall(t, dense, m, qv, p, sel, lr, n, sum, slots, pd);
        stats[3] += 1.0f;
      }
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < n; ++j) {
        lr[j] *= inv;
        slots[sel[j] * F + kMass] += lr[j];
      }
    }
    std::fill(buf.acc.begin(), buf.acc.end(), 0.0f);  // P @ V: each value row read once for every head
    for (int64_t j = 0; j < n; ++j) {
      const float* vv = val + sel[j] * D;
      for (int64_t r = 0; r < nr; ++r) {
        const float pj = pr[r * n + j];
        float* ar = buf.acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) ar[d] += pj * vv[d];
      }
    }
    for (int64_t r = 0; r < nr; ++r)
      std::memcpy(t.out + ((b * t.sh.S + i) * c.heads + hk * G + g0 + r) * D, buf.acc.data() + r * D,
                  sizeof(float) * D);
  }
}

// The slot whose latest member is KV index `kv` (-1: none). Slot records keep KV index + 1 as a float (exact
// below 2^24 tokens), so the scan compares floats and never converts.
inline int64_t FindSlot(const float* slots, int64_t C, int64_t F, int64_t kv) {
  const float want = static_cast<float>(kv + 1);
  for (int64_t s = 0; s < C; ++s)
    if (slots[s * F + kPos] == want) return s;
  return -1;
}

// FindSlot, trying first the slot at the token's own index (where it sits when nothing merged or was evicted
// before it: slots fill in order), then every slot. Exact: a latest position names at most one slot.
inline int64_t FindSlotFrom(const float* slots, int64_t C, int64_t F, int64_t kv) {
  if (kv < C && slots[kv * F + kPos] == static_cast<float>(kv + 1)) return kv;
  return FindSlot(slots, C, F, kv);
}

// A slot's stored bucket id in table tb, clamped into [0, ids) (ids are whole numbers below ids; the clamp only
// guards the counting sort against a corrupt record).
inline int64_t BucketId(const float* slots, int64_t s, int64_t F, int64_t tb, int64_t ids) {
  const int64_t id = static_cast<int64_t>(slots[s * F + kCodes + tb]);
  return std::min(std::max<int64_t>(id, 0), ids - 1);
}

// The first free slot (-1: none). This op never frees a slot (a merge joins one, an eviction reuses one) and takes
// the first free one, so from a new video's zero state the free slots are always a suffix: found by bisection
// instead of a pass over every record per token. A state that breaks the suffix (not this op's) gets the scan.
inline int64_t FirstFree(const float* slots, int64_t C, int64_t F) {
  int64_t lo = 0, hi = C;  // slots [0, lo) used, [hi, C) free
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (slots[mid * F + kPos] == 0.0f) hi = mid;
    else lo = mid + 1;
  }
  if (lo < C) {  // check the prefix's shape where it is cheap to (its last used slots); the scan if it fails
    bool ok = true;
    for (int64_t s = lo - std::min<int64_t>(lo, 64); s < lo && ok; ++s) ok = slots[s * F + kPos] != 0.0f;
    if (ok) return lo;
  }  // (a full cache scans: its eviction below passes over every slot anyway)
  for (int64_t s = 0; s < C; ++s)
    if (slots[s * F + kPos] == 0.0f) return s;
  return -1;
}

// log(count) for a slot's logit; counts are small integers, so a table serves most (std::log per live slot per
// token showed in decode profiles)
inline float LogCount(float count) {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 1; i < 256; ++i) t[i] = std::log(static_cast<float>(i));
    return t;
  }();
  const int64_t n = static_cast<int64_t>(count);
  return n < 256 && static_cast<float>(n) == count ? table[n] : std::log(count);
}

// One work item's buffers (CompressedItem), per thread, reused across tokens and calls. `runs`: AnnSA's live slots
// grouped by bucket id per table (a counting sort once per token, so each head gathers its buckets' slots instead
// of testing every live slot); `stamp`: which live slots a head already selected (one table's match is enough).
struct ItemBuffers {
  std::vector<float> w, qcode, bias, pd;
  std::vector<int64_t> sel, live, pad_queries, always, order, start, fill;
  std::vector<uint32_t> stamp;
  uint32_t epoch = 0;
  GroupBuffers group;
  void Size(int64_t C, int64_t tables) {
    const size_t n = static_cast<size_t>(C);
    if (w.size() < n) {
      for (auto* v : {&w, &bias}) v->resize(n);
      for (auto* v : {&sel, &live, &always}) v->resize(n);
      stamp.assign(n, 0);
      epoch = 0;
    }
    if (order.size() < n * static_cast<size_t>(tables)) order.resize(n * static_cast<size_t>(tables));
    qcode.resize(static_cast<size_t>(tables));
  }
};

inline ItemBuffers& ThreadBuffers() {
  static thread_local ItemBuffers b;
  return b;
}

FASTCAR_CLONES
static inline void CompressedItem(const CompressedTask& t, int64_t bh) {
  const Settings& c = *t.cfg;
  const Shapes& sh = t.sh;
  const int64_t D = sh.D, C = sh.N, F = t.F, G = c.heads / c.kv_heads;
  const int64_t b = bh / c.kv_heads, hk = bh % c.kv_heads;
  float* key = t.key + bh * C * D;
  float* val = t.val + bh * C * D;
  float* slots = t.slots + bh * C * F;
  float* key_raw = t.key_raw != nullptr ? t.key_raw + bh * C * D : nullptr;
  const int64_t* m = t.mask + b * sh.T;
  const bool tempcache = c.tempcache_sim <= 1.0f;
  const int64_t tables = c.CodeTables(), kHit = kCodes + tables;
  const bool prune = c.prune_prompt >= 0.0f;
  const int64_t vs = t.video_start;
  // Per-thread buffers, kept across calls: a C-sized allocation per call is an mmap and page faults per decode step
  // (budgets of thousands of slots), which cost more than the attention over the selected slots.
  ItemBuffers& buf = ThreadBuffers();
  buf.Size(C, std::max<int64_t>(tables, 1));
  float* dense = t.dense != nullptr ? t.dense + bh * t.dense_cap * 2 * D : nullptr;
  float* stats = t.stats != nullptr ? t.stats + bh * 4 : nullptr;
  std::vector<float>& pd = buf.pd;
  if (dense != nullptr && pd.size() < static_cast<size_t>(t.dense_cap)) pd.resize(static_cast<size_t>(t.dense_cap));
  if (stats != nullptr) std::fill_n(stats, 4, 0.0f);
  std::vector<float>&w = buf.w, &qcode = buf.qcode, &bias = buf.bias;
  std::vector<int64_t>&sel = buf.sel, &live = buf.live, &pad_queries = buf.pad_queries;
  pad_queries.clear();
  GroupBuffers& block = buf.group;
  auto pos = [&](int64_t s) { return static_cast<int64_t>(slots[s * F + kPos]) - 1; };
  for (int64_t i = 0; i < sh.S; ++i) {
    const int64_t p = sh.P + i;
    // the slot of token p - L, looked up before token p is written (it may merge there)
    const int64_t prev = p >= c.frame_tokens ? FindSlotFrom(slots, C, F, p - c.frame_tokens) : -1;
    if (t.aligned != nullptr) {  // the gate's aligned key (zeros when p - L is not resident)
      float* dst = t.aligned + (bh * sh.S + i) * D;
      if (prev >= 0) std::memcpy(dst, key + prev * D, sizeof(float) * D);
      else std::fill_n(dst, D, 0.0f);
    }
    // a left-pad token is stored (the gate may read it as an aligned key, as in the dense cache) but never
    // merged into, never attended (mask), and its own query sees nothing (output 0)
    const bool real = m[p] != 0;
    const float* kn = t.k + (bh * sh.S + i) * D;
    const float* vn = t.v + (bh * sh.S + i) * D;
    const float* kr = key_raw != nullptr ? t.k_raw + (bh * sh.S + i) * D : nullptr;
    // 1. TempCache: merge into the slot of token p - L (aligned correspondent: the same spatial position one
    // video frame back: p - L >= video_start, contract.aligned_is_video, as for the gate's replay) when the raw keys agree
    int64_t slot = -1;
    if (real && tempcache && prev >= 0 && p >= c.sinks && p - c.frame_tokens >= c.sinks &&
        p - c.frame_tokens >= vs && m[p - c.frame_tokens] != 0 && Cosine(kr, key_raw + prev * D, D) > c.tempcache_sim)
      slot = prev;
    if (slot >= 0) {
      float* sv = val + slot * D;
      const float cnt = slots[slot * F + kCount];
      for (int64_t d = 0; d < D; ++d) sv[d] = (sv[d] * cnt + vn[d]) / (cnt + 1.0f);
      slots[slot * F + kCount] = cnt + 1.0f;
    } else {
      slot = FirstFree(slots, C, F);
      if (slot < 0) {  // 2. full: evict a slot that is neither a sink nor in the window
        float best = std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < C; ++s) {
          const int64_t ps = pos(s);
          if (ps < c.sinks || ps > p - c.window) continue;
          const float score = EvictionScore(c.eviction, ps, slots[s * F + kMass], slots[s * F + kCount]);
          if (score < best) {
            best = score;
            slot = s;
          }
        }
        if (slot < 0) throw std::runtime_error("CompressedAttention: no evictable slot (budget <= sinks + window)");
      }
      std::memcpy(val + slot * D, vn, sizeof(float) * D);
      slots[slot * F + kCount] = 1.0f;
      slots[slot * F + kMass] = 0.0f;
      if (prune) slots[slot * F + kHit] = 0.0f;
    }
    std::memcpy(key + slot * D, kn, sizeof(float) * D);
    if (key_raw != nullptr) std::memcpy(key_raw + slot * D, kr, sizeof(float) * D);
    slots[slot * F + kPos] = static_cast<float>(p + 1);
    if (tables > 0) BucketCodes(c, kn, D, slots + slot * F + kCodes);
    if (dense != nullptr) {
      if (p >= t.dense_cap) throw std::runtime_error("CompressedAttention: the video is longer than the diagnostics' dense buffer (--kv-diagnostics)");
      std::memcpy(dense + p * 2 * D, kn, sizeof(float) * D);
      std::memcpy(dense + p * 2 * D + D, vn, sizeof(float) * D);
    }
    if (!real) {  // a left-pad query: after the step, the mean of every live slot's value (below)
      pad_queries.push_back(i);
      continue;
    }
    // 3. attend: every query head of the group, over all live slots or (AnnSA) bucket hits + sinks + window,
    // minus (prompt pruning, from video frame 1 on) prefix slots no query of the previous frame hit.
    // The live, visible slots and their log(count) bias are the same for the whole group: gathered once.
    const int64_t frame = p >= vs ? (p - vs) / c.frame_tokens : -1;
    // AnnSA with one query head per KV head (MHA): that head's selection is made in the same pass (its bucket
    // ids first), so `live` holds exactly the slots it attends: one pass over the slot records per token
    const bool fused = tables > 0 && G == 1;
    if (fused) BucketCodes(c, t.q + ((b * c.heads + hk) * sh.S + i) * D, D, qcode.data());
    int64_t nl = 0;
    for (int64_t s = 0; s < C; ++s) {
      const float* rec = slots + s * F;
      if (rec[kPos] == 0.0f) continue;
      const int64_t ps = static_cast<int64_t>(rec[kPos]) - 1;
      if (m[ps] == 0) continue;
      if (prune && frame >= 1 && ps < vs && s != slot && rec[kHit] < static_cast<float>(frame)) continue;
      if (fused) {
        bool keep = s == slot || ps < c.sinks || ps > p - c.window;
        for (int64_t tb = 0; tb < tables && !keep; ++tb) keep = rec[kCodes + tb] == qcode[tb];
        if (!keep) continue;
      }
      live[nl] = s;
      bias[nl++] = rec[kCount] > 1.0f ? LogCount(rec[kCount]) : 0.0f;  // log(1) = 0 exactly
    }
    if (tables == 0 && !prune && G >= 4) {  // every query head attends to the same slots: score them together
      GroupAttend(t, b, hk, i, p, live.data(), bias.data(), nl, key, val, slots, m, dense, stats, pd, block);
      continue;
    }
    // AnnSA with G >= 4 heads per KV head: the live slots every head keeps (own slot, sinks, window), and per table
    // the live slots by bucket id (a counting sort once per token), so each head gathers its buckets' slots; with
    // 2-3 heads each head tests every live slot (one pass each, cheaper than the sort)
    const bool runs = tables > 0 && G >= 4;
    int64_t na = 0;
    const int64_t ids = runs ? (c.lsh_bits > 0 ? int64_t{1} << c.lsh_bits : 256) : 0;
    if (runs) {
      buf.start.assign(static_cast<size_t>(tables * (ids + 1)), 0);
      for (int64_t a = 0; a < nl; ++a) {
        const int64_t s = live[a];
        const int64_t ps = pos(s);
        if (s == slot || ps < c.sinks || ps > p - c.window) buf.always[na++] = a;
        for (int64_t tb = 0; tb < tables; ++tb) ++buf.start[tb * (ids + 1) + BucketId(slots, s, F, tb, ids) + 1];
      }
      for (int64_t tb = 0; tb < tables; ++tb) {
        int64_t* st = buf.start.data() + tb * (ids + 1);
        for (int64_t u = 0; u < ids; ++u) st[u + 1] += st[u];
        buf.fill.assign(st, st + ids);  // the next position in each bucket's run
        for (int64_t a = 0; a < nl; ++a) buf.order[tb * nl + buf.fill[BucketId(slots, live[a], F, tb, ids)]++] = a;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qv = t.q + ((b * c.heads + hk * G + g) * sh.S + i) * D;
      int64_t n = 0;
      if (tables > 0 && !fused && !runs) {
        BucketCodes(c, qv, D, qcode.data());
        for (int64_t a = 0; a < nl; ++a) {
          const int64_t s = live[a];
          const int64_t ps = pos(s);
          bool keep = s == slot || ps < c.sinks || ps > p - c.window;
          for (int64_t tb = 0; tb < tables && !keep; ++tb) keep = slots[s * F + kCodes + tb] == qcode[tb];
          if (keep) {
            sel[n] = s;
            w[n++] = bias[a];
          }
        }
      } else if (runs) {
        BucketCodes(c, qv, D, qcode.data());
        if (++buf.epoch == 0) {  // the stamps wrapped: clear them
          std::fill(buf.stamp.begin(), buf.stamp.end(), 0u);
          buf.epoch = 1;
        }
        const uint32_t e = buf.epoch;
        for (int64_t x = 0; x < na; ++x) {
          const int64_t a = buf.always[x];
          buf.stamp[a] = e;
          sel[n] = live[a];
          w[n++] = bias[a];
        }
        for (int64_t tb = 0; tb < tables; ++tb) {
          const int64_t id = static_cast<int64_t>(qcode[tb]);
          if (id < 0 || id >= ids) continue;
          const int64_t* st = buf.start.data() + tb * (ids + 1);
          for (int64_t r = st[id]; r < st[id + 1]; ++r) {
            const int64_t a = buf.order[tb * nl + r];
            if (buf.stamp[a] == e) continue;
            buf.stamp[a] = e;
            sel[n] = live[a];
            w[n++] = bias[a];
          }
        }
      } else {
        std::copy_n(live.data(), nl, sel.data());
        std::copy_n(bias.data(), nl, w.data());
        n = nl;
      }
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t a = 0; a < n; ++a) {
        if (a + 8 < n) {  // AnnSA's selected rows are scattered: fetch ahead (a no-op cost on consecutive ones)
          __builtin_prefetch(key + sel[a + 8] * D);
          __builtin_prefetch(val + sel[a + 8] * D);
        }
        w[a] += Dot(qv, key + sel[a] * D, D) * c.scale;
        mx = std::max(mx, w[a]);
      }
      float sum = 0.0f;
      for (int64_t a = 0; a < n; ++a) {
        w[a] = FastExp(w[a] - mx);
        sum += w[a];
      }
      if (stats != nullptr) {
        int64_t visible = 0;
        for (int64_t tk = 0; tk <= p; ++tk) visible += m[tk] != 0;
        stats[0] += static_cast<float>(n);
        stats[1] += static_cast<float>(visible);
        stats[2] += DenseSideRecall(t, dense, m, qv, p, sel.data(), w.data(), n, sum, slots, pd);
        stats[3] += 1.0f;
      }
      float* o = t.out + ((b * sh.S + i) * c.heads + hk * G + g) * D;
      std::fill_n(o, D, 0.0f);
      const float inv = 1.0f / sum;
      for (int64_t a = 0; a < n; ++a) {
        const float pa = w[a] * inv;
        slots[sel[a] * F + kMass] += pa;
        if (prune && frame >= 0 && pos(sel[a]) < vs && pa >= c.prune_prompt)
          slots[sel[a] * F + kHit] = static_cast<float>(frame + 1);
        const float* vv = val + sel[a] * D;
        for (int64_t d = 0; d < D; ++d) o[d] += pa * vv[d];
      }
    }
  }
  // left-pad queries see no key: like the exporters' finite-minimum masks (and the plain mode), they average
  // every value the cache holds after the step (with a budget >= context: all T tokens)
  for (const int64_t i : pad_queries) {
    std::vector<float> mean(D, 0.0f);
    int64_t live = 0;
    for (int64_t s = 0; s < C; ++s) {
      if (slots[s * F + kPos] == 0.0f) continue;
      ++live;
      for (int64_t d = 0; d < D; ++d) mean[d] += val[s * D + d];
    }
    for (int64_t g = 0; g < G; ++g) {
      float* o = t.out + ((b * sh.S + i) * c.heads + hk * G + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = live > 0 ? mean[d] / static_cast<float>(live) : 0.0f;
    }
  }
}

inline void CompressedItemThunk(void* data, size_t item) {
  CompressedItem(*static_cast<CompressedTask*>(data), static_cast<int64_t>(item));
}

}  // namespace fastcar_attn
