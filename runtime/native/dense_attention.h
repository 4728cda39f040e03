// Dense causal GQA attention over a KV buffer: the plain mode of ai.fastcar CompressedAttention, and the core any
// other ai.fastcar attention op calls (RunDense). Semantics (docs/DESIGN.md, body: passes/fastcar_ops.py): a query
// at KV index P+i sees key j iff j <= P+i and mask[b, j] == 1; a query that sees no key (a left pad) averages all
// T values, as the exporters' masks with a finite minimum make softmax do (DenseTask::empty: GroupQueryAttention
// follows ORT's kernel instead, see EmptyRow).
//
// Why this layout (decode is memory-bound: every step reads the whole K and V of each KV head once):
// - the query rows of one KV head (G heads x the tile's tokens) sit in vector lanes, 8 or 16 at a time, so each
//   K and V element is loaded once per chunk and feeds one FMA for all of them (a decode step of a G = 8 model
//   fills exactly one 8-lane vector);
// - one pass over the keys in blocks of kBlock (online softmax: running max, sum and unnormalised output per lane),
//   so no [rows x context] logits buffer is written and reread;
// - when (batch x KV heads x query tiles) are fewer than the cores, the key range is split across work items
//   (flash-decoding): each split keeps its own max / sum / partial output, combined exactly afterwards;
// - GCC vector extensions (8 x float) instead of intrinsics: the same source is the AVX-512 / AVX2+FMA clone and
//   the SSE (x86-64-v2) default; the library picks the clone for the CPU it runs on at load time (target_clones
//   + ifunc), so one cached build is correct on any x86-64 host that shares the cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sched.h>
#include <vector>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors stay inside always-inlined helpers (no ABI crossing)

// The hot loops are compiled once per ISA level and the best for the CPU is picked when the library loads (GCC
// target_clones: an ifunc resolver on __builtin_cpu_supports): the library lands in a per-user cache that a
// shared home may serve to several hosts, so it is built for the x86-64-v2 baseline (-march in build.py) and
// never for the build host alone (-march=native would crash elsewhere with SIGILL). `build.py --isa LEVEL`
// defines FASTCAR_CLONES empty and builds the one level instead (the tests check the SSE fallback that way).
// Only GCC >= 12 on x86-64 knows these arch names (clang's target_clones does not take arch=); elsewhere (aarch64,
// clang, older GCC) one plain build. The cloned functions are `static`: GCC exports an ifunc symbol despite
// -fvisibility=hidden, and an older cached library loaded RTLD_GLOBAL would otherwise interpose its own.
#ifndef FASTCAR_CLONES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define FASTCAR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTCAR_CLONES
#endif
#endif

namespace fastcar_attn {

// 2^f for f in [0, 1): degree-6 polynomial, Horner from the highest coefficient; written once for the scalar
// FastExp (compressed_attention.h) and its 8-lane ExpV (below): relative error ~2e-7.
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

template <typename T>
inline __attribute__((always_inline)) T Exp2Poly(T p, T f) {  // p: kExp2Poly[0] as a T
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  return p;
}

struct DenseTask {
  const float* q;     // [B,Hq,S,D]
  const float* key;   // present key [B,Hkv,N,D]
  const float* val;   // present value [B,Hkv,N,D]
  const int64_t* mask;  // [B,T]
  float* out;         // [B,S,Hq*D]
  int64_t B, Hq, Hkv, S, D, N, T, P, tiles, tile;
  float scale;
  // key-range splits per (b, hk, tile) (flash-decoding). 1: each item writes `out` itself; > 1: items write
  // `partial` [B*Hkv*tiles*splits, G*tile, D+2] (max, sum, unnormalised output) and DenseCombine finishes.
  int64_t splits = 1;
  float* partial = nullptr;
  // the output of a query that sees no key: kMeanAll = the mean of all T values (CompressedAttention, the
  // exporters' masks); ORT's GroupQueryAttention under an additive bias: kCausalMean = the mean of its causal values
  // 0..P+i (a finite bias above float-min: softmax of equal scores), kZero = zeros (a float-min or -inf bias)
  enum EmptyRow { kMeanAll, kCausalMean, kZero } empty = kMeanAll;
};

namespace dense {

#define FC_INLINE inline __attribute__((always_inline))

typedef float f8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4)));  // unaligned load / store
typedef int32_t i8 __attribute__((vector_size(32)));
constexpr int kLanes = 8;
constexpr int64_t kBlock = 64;   // keys per block: their K and V rows (16 KB at D = 64) stay in L1
constexpr float kNeg = -3.0e38f;  // "no score": finite, so max/subtract never make inf - inf
constexpr int64_t kMinSplitKeys = 256;  // a split shorter than this costs more in overhead than it gains

FC_INLINE f8 Load(const float* p) { return *reinterpret_cast<const f8u*>(p); }
FC_INLINE void Store(float* p, f8 x) { *reinterpret_cast<f8u*>(p) = x; }
// a broadcast: GCC 12 builds {x, x, ...} and x - f8{} lane by lane (vinsertps) in a target_clones clone of a
// -march=x86-64-v2 build; the shuffle becomes one vbroadcastss from memory
FC_INLINE f8 Splat(float x) { return __builtin_shuffle(f8{x}, i8{}); }
FC_INLINE f8 Max(f8 a, f8 b) { return a > b ? a : b; }

// FastExp (compressed_attention.h) on 8 lanes, for x <= 0: 2^(x log2 e), floor by truncate-and-fix (x86-64-v2
// has no vector floor in every encoding GCC picks), the same degree-6 polynomial; relative error ~2e-7.
FC_INLINE f8 ExpV(f8 x) {
  x = Max(x, Splat(-87.0f));
  const f8 t = x * 1.44269504088896341f;
  i8 n = __builtin_convertvector(t, i8);  // toward zero
  n += (__builtin_convertvector(n, f8) > t);  // -1 where truncation rounded up (t < 0, not integral)
  const f8 f = t - __builtin_convertvector(n, f8);  // [0, 1)
  const f8 p = Exp2Poly(Splat(kExp2Poly[0]), f);
  return reinterpret_cast<f8>(reinterpret_cast<i8>(p) + (n << 23));
}

struct Scratch {  // per thread, reused across items and steps; 32-byte aligned views into one float buffer
  std::vector<float> buf;
  f8* Get(int64_t vectors) {  // (std::vector<f8> would not align: GCC drops the vector type's alignment there)
    buf.resize(static_cast<size_t>(vectors + 1) * kLanes);
    const uintptr_t a = reinterpret_cast<uintptr_t>(buf.data());
    return reinterpret_cast<f8*>((a + 31) & ~uintptr_t{31});
  }
};

inline Scratch& ThreadScratch() {
  static thread_local Scratch s;
  return s;
}

// scores sc[j][v] = qT . K[j] for nb keys, KJ keys at a time (each K element broadcast once into every lane)
template <int V, int KJ>
FC_INLINE void Scores(const f8* qT, const float* k, int64_t nb, int64_t D, f8* sc) {
  int64_t j = 0;
  for (; j + KJ <= nb; j += KJ) {
    f8 a[KJ][V] = {};
    const float* kr = k + j * D;
    for (int64_t d = 0; d < D; ++d) {
      f8 qd[V];
      for (int v = 0; v < V; ++v) qd[v] = qT[d * V + v];
      for (int kk = 0; kk < KJ; ++kk) {
        const f8 x = Splat(kr[kk * D + d]);
        for (int v = 0; v < V; ++v) a[kk][v] += qd[v] * x;
      }
    }
    for (int kk = 0; kk < KJ; ++kk)
      for (int v = 0; v < V; ++v) sc[(j + kk) * V + v] = a[kk][v];
  }
  for (; j < nb; ++j) {
    f8 a[V] = {};
    const float* kr = k + j * D;
    for (int64_t d = 0; d < D; ++d)
      for (int v = 0; v < V; ++v) a[v] += qT[d * V + v] * Splat(kr[d]);
    for (int v = 0; v < V; ++v) sc[j * V + v] = a[v];
  }
}

// acc[d][v] = acc[d][v] * alpha[v] + sum_j p[j][v] V[j][d], DC dims at a time held in registers over the block
template <int V, int DC>
FC_INLINE void AccumulatePV(const f8* p, const float* val, int64_t nb, int64_t D, const f8* alpha, f8* acc) {
  int64_t d0 = 0;
  for (; d0 + DC <= D; d0 += DC) {
    f8 a[DC][V];
    for (int dd = 0; dd < DC; ++dd)
      for (int v = 0; v < V; ++v) a[dd][v] = acc[(d0 + dd) * V + v] * alpha[v];
    for (int64_t j = 0; j < nb; ++j) {
      const float* vr = val + j * D + d0;
      f8 pj[V];
      for (int v = 0; v < V; ++v) pj[v] = p[j * V + v];
      for (int dd = 0; dd < DC; ++dd) {
        const f8 x = Splat(vr[dd]);
        for (int v = 0; v < V; ++v) a[dd][v] += pj[v] * x;
      }
    }
    for (int dd = 0; dd < DC; ++dd)
      for (int v = 0; v < V; ++v) acc[(d0 + dd) * V + v] = a[dd][v];
  }
  for (; d0 < D; ++d0) {
    f8 a[V];
    for (int v = 0; v < V; ++v) a[v] = acc[d0 * V + v] * alpha[v];
    for (int64_t j = 0; j < nb; ++j) {
      const f8 x = Splat(val[j * D + d0]);
      for (int v = 0; v < V; ++v) a[v] += p[j * V + v] * x;
    }
    for (int v = 0; v < V; ++v) acc[d0 * V + v] = a[v];
  }
}

// Load every cache line of n floats of K and of V once, in address order. Why: Scores reads 8 keys column by column
// (rows 256 B apart) and AccumulatePV walks V rows the same way, an order the hardware prefetchers do not follow, so
// a cold block came in a few lines per memory latency; in a decode step every block is cold (the layer's K/V was
// last read a whole step ago and the weights streamed since evicted it). One in-order pass first brings the block
// at streaming speed (1 thread, 8 layers' buffers evicted between calls, ctx 1024: 190 -> 127 us per layer; a pure
// read of the same bytes 45 us); it costs nothing measurable when the block is hot. Scalar float sums: not
// vectorised (no reassociation), one load per line; a volatile store keeps them.
FC_INLINE void Touch(const float* k, const float* v, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(float);
  float a = 0.0f, b = 0.0f;
  for (int64_t x = 0; x < n; x += kLine) {
    a += k[x];
    b += v[x];
  }
  volatile float keep = a + b;
  (void)keep;
}

// the output of query token i of (b, hk) that sees no key (DenseTask::empty)
inline void MeanValue(const DenseTask& t, int64_t b, int64_t hk, int64_t i, float* dst) {
  const float* vb = t.val + (b * t.Hkv + hk) * t.N * t.D;
  const int64_t n = t.empty == DenseTask::kCausalMean ? std::min(t.T, t.P + i + 1) : t.T;
  std::fill_n(dst, t.D, 0.0f);
  if (t.empty == DenseTask::kZero) return;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < t.D; ++d) dst[d] += vb[j * t.D + d];
  for (int64_t d = 0; d < t.D; ++d) dst[d] /= static_cast<float>(n);
}

// Rows r0 .. r0+nr-1 of tile (b, hk, i0) (row = token * G + head in the group) over keys [jlo, jhi) in 8V lanes:
// with rec == nullptr the normalised outputs go to t.out, else (max, sum, unnormalised output) per row to rec.
// touch: each block's K/V is loaded in address order first (Touch: the decode layout, whose blocks are cold).
template <int V, int KJ = 8 / V, int DC = 8 / V>
FC_INLINE void Chunk(const DenseTask& t, int64_t b, int64_t hk, int64_t i0, int64_t r0, int64_t nr, int64_t jlo,
                     int64_t jhi, float* rec, bool touch) {
  constexpr int R = kLanes * V;
  const int64_t D = t.D, G = t.Hq / t.Hkv;
  const int64_t* m = t.mask + b * t.T;
  const float* kb = t.key + (b * t.Hkv + hk) * t.N * D;
  const float* vb = t.val + (b * t.Hkv + hk) * t.N * D;
  f8* qT = ThreadScratch().Get(2 * D * V + kBlock * V);
  f8* acc = qT + D * V;
  f8* sc = acc + D * V;
  std::fill(qT, sc, f8{});
  alignas(32) int32_t last[R];  // last key index each lane may see (-1: padding lane)
  for (int r = 0; r < R; ++r) {
    last[r] = -1;
    if (r >= nr) continue;
    const int64_t g = (r0 + r) % G, i = i0 + (r0 + r) / G;
    const float* qr = t.q + ((b * t.Hq + hk * G + g) * t.S + i) * D;
    float* lanes = reinterpret_cast<float*>(qT);
    for (int64_t d = 0; d < D; ++d) lanes[d * R + r] = qr[d] * t.scale;
    last[r] = static_cast<int32_t>(t.P + i);
  }
  const int64_t all_see = t.P + i0 + r0 / G;  // keys <= this are causally visible to every row of the chunk
  f8 mrun[V], lrun[V];
  i8 lastv[V];
  for (int v = 0; v < V; ++v) {
    mrun[v] = Splat(kNeg);
    lrun[v] = f8{};
    std::memcpy(&lastv[v], last + v * kLanes, sizeof(i8));
  }
  for (int64_t j0 = jlo; j0 < jhi; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, jhi - j0);
    if (touch) Touch(kb + j0 * D, vb + j0 * D, nb * D);
    Scores<V, KJ>(qT, kb + j0 * D, nb, D, sc);
    bool exact = j0 + nb - 1 <= all_see;  // every key of the block visible to every row
    for (int64_t j = 0; j < nb && exact; ++j) exact = m[j0 + j] != 0;
    if (!exact) {
      for (int64_t j = 0; j < nb; ++j) {
        const i8 jv = i8{} + static_cast<int32_t>(j0 + j);
        for (int v = 0; v < V; ++v) {
          const i8 vis = (jv <= lastv[v]) & (i8{} + (m[j0 + j] != 0 ? -1 : 0));
          sc[j * V + v] = vis ? sc[j * V + v] : Splat(kNeg);
        }
      }
    }
    f8 mnew[V], alpha[V], sum[V];
    for (int v = 0; v < V; ++v) mnew[v] = mrun[v];
    for (int64_t j = 0; j < nb; ++j)
      for (int v = 0; v < V; ++v) mnew[v] = Max(mnew[v], sc[j * V + v]);
    for (int v = 0; v < V; ++v) {
      alpha[v] = ExpV(mrun[v] - mnew[v]);
      sum[v] = f8{};
    }
    for (int64_t j = 0; j < nb; ++j)
      for (int v = 0; v < V; ++v) {
        f8 p = ExpV(sc[j * V + v] - mnew[v]);
        if (!exact) p = sc[j * V + v] > Splat(0.5f * kNeg) ? p : f8{};  // invisible keys weigh exactly 0
        sc[j * V + v] = p;
        sum[v] += p;
      }
    for (int v = 0; v < V; ++v) {
      lrun[v] = lrun[v] * alpha[v] + sum[v];
      mrun[v] = mnew[v];
    }
    AccumulatePV<V, DC>(sc, vb + j0 * D, nb, D, alpha, acc);
  }
  alignas(32) float mx[R], l[R];
  for (int v = 0; v < V; ++v) {
    std::memcpy(mx + v * kLanes, &mrun[v], sizeof(f8));
    std::memcpy(l + v * kLanes, &lrun[v], sizeof(f8));
  }
  const float* lanes = reinterpret_cast<const float*>(acc);
  for (int64_t r = 0; r < nr; ++r) {
    if (rec != nullptr) {
      float* o = rec + (r0 + r) * (D + 2);
      o[0] = mx[r];
      o[1] = l[r];
      for (int64_t d = 0; d < D; ++d) o[2 + d] = lanes[d * R + r];
      continue;
    }
    const int64_t g = (r0 + r) % G, i = i0 + (r0 + r) / G;
    float* o = t.out + ((b * t.S + i) * t.Hq + hk * G + g) * D;
    if (l[r] == 0.0f) {  // sees no key: the mean of the values (all T, or its causal ones)
      MeanValue(t, b, hk, i, o);
      continue;
    }
    const float inv = 1.0f / l[r];
    for (int64_t d = 0; d < D; ++d) o[d] = lanes[d * R + r] * inv;
  }
}

}  // namespace dense

// One work item: batch row b, KV head hk, a tile of query tokens (all G query heads of the group), one key split.
FASTCAR_CLONES
static inline void DenseItem(const DenseTask& t, int64_t item) {
  const int64_t G = t.Hq / t.Hkv;
  const int64_t split = item % t.splits;
  const int64_t rest = item / t.splits;
  const int64_t tile_id = rest % t.tiles;
  const int64_t bh = rest / t.tiles;
  const int64_t b = bh / t.Hkv, hk = bh % t.Hkv;
  const int64_t i0 = tile_id * t.tile, i1 = std::min(t.S, i0 + t.tile);
  const int64_t rows = G * (i1 - i0);
  const int64_t jmax = t.P + i1;  // keys [0, jmax) can be visible to some row of this tile
  int64_t jlo = 0, jhi = jmax;
  float* rec = nullptr;
  if (t.splits > 1) {
    const int64_t span = ((jmax + t.splits - 1) / t.splits + dense::kBlock - 1) / dense::kBlock * dense::kBlock;
    jlo = std::min(jmax, split * span);
    jhi = std::min(jmax, jlo + span);
    rec = t.partial + item * G * t.tile * (t.D + 2);
  }
  // 8 rows (decode, G <= 8), 16, or with AVX-512's 32 registers 32 rows x 4 keys / 4 dims per register block
  // (multi-token tiles: half the loads per FMA of 16 x 4)
  static const bool wide = __builtin_cpu_supports("avx512f");
  const int64_t R = rows <= dense::kLanes ? dense::kLanes : rows <= 2 * dense::kLanes || !wide ? 2 * dense::kLanes
                                                                                               : 4 * dense::kLanes;
  // decode-sized tiles read their K/V cold and once per chunk: touch it in order first (dense::Touch); a prompt tile's
  // chunks reread the same blocks from cache
  const bool touch = t.tile <= 4;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int64_t nr = std::min(R, rows - r0);
    const int64_t jend = std::min(jhi, t.P + i0 + (r0 + nr - 1) / G + 1);  // keys any row of the chunk may see
    if (R == dense::kLanes)
      dense::Chunk<1>(t, b, hk, i0, r0, nr, jlo, std::max(jlo, jend), rec, touch);
    else if (R == 2 * dense::kLanes)
      dense::Chunk<2>(t, b, hk, i0, r0, nr, jlo, std::max(jlo, jend), rec, touch);
    else
      dense::Chunk<4, 4, 4>(t, b, hk, i0, r0, nr, jlo, std::max(jlo, jend), rec, touch);
  }
}

inline void DenseItemThunk(void* data, size_t item) { DenseItem(*static_cast<DenseTask*>(data), item); }

// Finish split items: per row, out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s (exact
// rescaling of the partial softmaxes); a row no split gave any weight (sees no key) gets MeanValue.
inline void DenseCombine(const DenseTask& t) {
  const int64_t G = t.Hq / t.Hkv, D = t.D, rt = G * t.tile;
  static thread_local std::vector<float> o;  // one row's output; kept, so a decode step allocates nothing
  o.resize(static_cast<size_t>(D));
  for (int64_t bt = 0; bt < t.B * t.Hkv * t.tiles; ++bt) {
    const int64_t tile_id = bt % t.tiles, bh = bt / t.tiles, b = bh / t.Hkv, hk = bh % t.Hkv;
    const int64_t i0 = tile_id * t.tile, rows = G * (std::min(t.S, i0 + t.tile) - i0);
    for (int64_t r = 0; r < rows; ++r) {
      float M = dense::kNeg;
      for (int64_t s = 0; s < t.splits; ++s) {
        const float* rec = t.partial + ((bt * t.splits + s) * rt + r) * (D + 2);
        if (rec[1] > 0.0f) M = std::max(M, rec[0]);
      }
      float L = 0.0f;
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t s = 0; s < t.splits; ++s) {
        const float* rec = t.partial + ((bt * t.splits + s) * rt + r) * (D + 2);
        if (!(rec[1] > 0.0f)) continue;
        const float w = std::exp(rec[0] - M);
        L += rec[1] * w;
        for (int64_t d = 0; d < D; ++d) o[d] += rec[2 + d] * w;
      }
      const int64_t g = r % G, i = i0 + r / G;
      float* dst = t.out + ((b * t.S + i) * t.Hq + hk * G + g) * D;
      if (L == 0.0f) {
        dense::MeanValue(t, b, hk, i, dst);
        continue;
      }
      for (int64_t d = 0; d < D; ++d) dst[d] = o[d] / L;
    }
  }
}

namespace dense {
inline int64_t CoresHere() {  // the cores this process may run on (a container's share, not the host's)
  static const int64_t n = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
  }();
  return n;
}
}  // namespace dense

// Tiles and key splits for a task whose pointers and shapes are set: query tiles of up to 32 tokens; for short
// steps (decode) the key range is split so that there are about 4 items per core this process may use, each
// split at least kMinSplitKeys long.
inline void PlanDense(DenseTask& t) {
  t.tile = t.S <= 4 ? t.S : 32;
  t.tiles = (t.S + t.tile - 1) / t.tile;
  t.splits = 1;
  const int64_t base = t.B * t.Hkv * t.tiles, want = 4 * std::min<int64_t>(dense::CoresHere(), 64);
  if (t.S <= 4 && base < want)
    t.splits = std::max<int64_t>(1, std::min((want + base - 1) / base, t.T / dense::kMinSplitKeys));
}

// Plan, run every item on ORT's intra-op pool (ctx: Ort::KernelContext, or anything with its ParallelFor), and
// combine split partials: the whole dense attention of one op call. `t.partial` is owned here: a per-thread
// buffer kept between calls (every record is written before DenseCombine reads it, so it needs no zeroing; a
// call finishes before the same thread's next one starts).
template <class Ctx>
inline void RunDense(Ctx& ctx, DenseTask& t) {
  if (t.S <= 0 || t.D <= 0) return;  // nothing to compute (and tile 0 would divide by zero)
  PlanDense(t);
  static thread_local std::vector<float> partial;
  if (t.splits > 1) {
    const size_t n = static_cast<size_t>(t.B * t.Hkv * t.tiles * t.splits * (t.Hq / t.Hkv) * t.tile * (t.D + 2));
    if (partial.size() < n) partial.resize(n);
    t.partial = partial.data();
  }
  ctx.ParallelFor(DenseItemThunk, static_cast<size_t>(t.B * t.Hkv * t.tiles * t.splits), 0, &t);
  if (t.splits > 1) DenseCombine(t);
  t.partial = nullptr;
}

#undef FC_INLINE

}  // namespace fastcar_attn

#pragma GCC diagnostic pop
