// Block-sparse attention by bucket: the kernel behind ai.fastcar AnnSAAttention (runtime/native/annsa_attention.h)
// and the fastcar::annsa_attention torch op (fastcar_compile/torch/fastcar_torch_ops.cc). No ONNX Runtime or
// torch header: the callers hand it pointers and a parallel-for.
//
// AnnSA's selection is a union of dense blocks: every query of a chunk attends to the same dense keys (sinks, the
// local frames, the chunk itself), and per table the queries of one bucket attend to that bucket's keys. So the
// work is a handful of small GEMMs, not a per-query scan: per (row, head) the queries are sorted by bucket once
// per table, merge-joined with the table's keys sorted by bucket (the runtime's index: each bucket's slots are one
// run), and each (bucket's queries) x (bucket's keys) block runs as the dense core does a tile: query rows in vector
// lanes (16 per AVX-512 register, 8 otherwise), the block's keys in tiles of 64 read through row pointers (no
// gather copy), scores, an online softmax whose running max / sum / output per query live in a per-query state
// that every block of the query updates, then P V. A pair that already met in an earlier table is masked in the
// block (it is counted once, where it first met); nothing is padded beyond the lanes of a query group.
//
// Per executed pair that is the arithmetic of a dense tile (2 D FMAs and one exp), so attention at density d costs
// about d of the dense work plus the sort and the lane padding of small buckets.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "dense_attention.h"  // FASTCAR_CLONES, kExp2Poly / Exp2Poly

// 64-byte vectors stay inside always-inlined helpers (no ABI crossing). Not popped at the end: the templates are
// instantiated at the end of the including file, where GCC would warn again.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace fastcar_bucket {

#define FB_INLINE inline __attribute__((always_inline))

template <int W>
struct Lanes;
template <>
struct Lanes<8> {
  typedef float f __attribute__((vector_size(32)));
  typedef int32_t i __attribute__((vector_size(32)));
};
template <>
struct Lanes<16> {
  typedef float f __attribute__((vector_size(64)));
  typedef int32_t i __attribute__((vector_size(64)));
};

constexpr int64_t kTile = 64;     // keys per tile: their scores stay in L1 between the products
constexpr int64_t kChunkBytes = 256 << 10;  // K + V rows every query group of a block passes over while in L2
constexpr float kNeg = -3.0e38f;  // "no score": finite, so max / subtract never make inf - inf
constexpr float kMasked = 0.5f * kNeg;

template <int W>
FB_INLINE typename Lanes<W>::f Splat(float x) {
  typedef typename Lanes<W>::f F;
  typedef typename Lanes<W>::i I;
  return __builtin_shuffle(F{x}, I{});  // one vbroadcastss (see dense_attention.h's Splat)
}

template <int W>
FB_INLINE typename Lanes<W>::f Max(typename Lanes<W>::f a, typename Lanes<W>::f b) {
  return a > b ? a : b;
}

// e^x for x <= 0 on W lanes (dense_attention.h's ExpV: the same polynomial, relative error ~2e-7)
template <int W>
FB_INLINE typename Lanes<W>::f ExpV(typename Lanes<W>::f x) {
  typedef typename Lanes<W>::f F;
  typedef typename Lanes<W>::i I;
  x = Max<W>(x, Splat<W>(-87.0f));
  const F t = x * 1.44269504088896341f;
  I n = __builtin_convertvector(t, I);
  n += (__builtin_convertvector(n, F) > t);
  const F f = t - __builtin_convertvector(n, F);
  const F p = fastcar_attn::Exp2Poly(Splat<W>(fastcar_attn::kExp2Poly[0]), f);
  return reinterpret_cast<F>(reinterpret_cast<I>(p) + (n << 23));
}

// A set of key rows for one block: K and V rows by pointer, an optional additive bias per key (kNeg or below:
// the key is absent), and for the dedup of table `table` > 0 each key's bucket ids in the tables before it.
struct KeySet {
  const float* const* k = nullptr;
  const float* const* v = nullptr;
  const float* bias = nullptr;    // [n] or null
  const int32_t* codes = nullptr;  // [n][T] ids (the first `table` used), or null: no dedup
  int64_t n = 0;
};

// The per-query softmax state every block of a query updates: running max m, sum l, unnormalised output acc.
struct State {
  float* acc;  // [Q][D]
  float* m;    // [Q]
  float* l;    // [Q]
};

struct Query {
  const float* q;        // [Q][D], scaled as the scores use it
  const int32_t* codes;  // [Q][T] bucket ids (dedup), or null
  int64_t Q, D, T;
};

// Scratch per thread, 64-byte aligned, reused across items and calls.
struct Scratch {
  std::vector<float> buf;
  float* Get(int64_t floats) {
    buf.resize(static_cast<size_t>(floats + 16));
    const uintptr_t a = reinterpret_cast<uintptr_t>(buf.data());
    return reinterpret_cast<float*>((a + 63) & ~uintptr_t{63});
  }
};

inline Scratch& ThreadScratch() {  // outside the cloned function: one per thread, whichever clone runs
  static thread_local Scratch s;
  return s;
}

// A query group's lanes (R = W V rows) in one float buffer, 64-byte aligned (vector loads assume it): qT [D][V], acc [D][V], m [V], l [V]
// (F vectors), then the rows' ids in the tables before this one [table][V] (I vectors).
template <int W, int V>
constexpr int64_t GroupFloats(int64_t D, int table) {  // rounded up to 16 floats: every group 64-byte aligned
  return ((2 * D * V + 2 * V + table * V) * W + 15) / 16 * 16;
}

// Rows `rows[0..nr)` (query indices, nr <= W V) into the lanes of `g`: queries, their state, their earlier ids.
template <int W, int V>
FB_INLINE void Load(const Query& qs, const int32_t* rows, int64_t nr, int table, const State& st, float* g) {
  constexpr int R = W * V;
  const int64_t D = qs.D;
  float* qf = g;
  float* af = g + D * R;
  float* mx = af + D * R;
  float* lx = mx + R;
  int32_t* qc = reinterpret_cast<int32_t*>(lx + R);
  for (int r = 0; r < R; ++r) {
    const bool real = r < nr;
    const int64_t i = real ? rows[r] : 0;
    const float* qr = qs.q + i * D;
    const float* ar = st.acc + i * D;
    for (int64_t d = 0; d < D; ++d) {
      qf[d * R + r] = real ? qr[d] : 0.0f;
      af[d * R + r] = real ? ar[d] : 0.0f;
    }
    mx[r] = real ? st.m[i] : kNeg;
    lx[r] = real ? st.l[i] : 0.0f;
    for (int u = 0; u < table; ++u) qc[u * R + r] = real ? qs.codes[i * qs.T + u] : -1;
  }
}

template <int W, int V>
FB_INLINE void Store(const int32_t* rows, int64_t nr, int64_t D, const State& st, const float* g) {
  constexpr int R = W * V;
  const float* af = g + D * R;
  const float* mx = af + D * R;
  const float* lx = mx + R;
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = rows[r];
    float* ar = st.acc + i * D;
    for (int64_t d = 0; d < D; ++d) ar[d] = af[d * R + r];
    st.m[i] = mx[r];
    st.l[i] = lx[r];
  }
}

// The group in `g` against keys [j_begin, j_end) of `ks` (tiles of kTile keys; `sc`: kTile V vectors of scratch),
// `table` tables before this one for the dedup.
template <int W, int V, int KJ, int DC>
FB_INLINE void Pass(float* g, int64_t D, int64_t T, const KeySet& ks, int64_t j_begin, int64_t j_end, int table,
                    float* scf, bool prefetch) {
  typedef typename Lanes<W>::f F;
  typedef typename Lanes<W>::i I;
  F* qT = reinterpret_cast<F*>(g);
  F* acc = qT + D * V;
  F* mp = acc + D * V;
  F* lp = mp + V;
  const I* qcv = reinterpret_cast<const I*>(lp + V);
  F* sc = reinterpret_cast<F*>(scf);
  F mrun[V], lrun[V];
  for (int v = 0; v < V; ++v) {
    mrun[v] = mp[v];
    lrun[v] = lp[v];
  }
  const bool masks = ks.bias != nullptr || table > 0;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTile) {
    const int64_t nb = std::min(kTile, j_end - j0);
    const float* const* kp = ks.k + j0;
    if (prefetch)  // the next tile's rows: a bucket's keys are scattered over the cache (latency, not bandwidth)
      for (int64_t j = j0 + kTile; j < std::min(j_end, j0 + 2 * kTile); ++j)
        for (int64_t x = 0; x < D; x += 16) {
          __builtin_prefetch(ks.k[j] + x);
          __builtin_prefetch(ks.v[j] + x);
        }
    // scores: KJ keys at a time, each key element broadcast once into every lane
    int64_t j = 0;
    for (; j + KJ <= nb; j += KJ) {
      F a[KJ][V] = {};
      const float* kr[KJ];
      for (int kk = 0; kk < KJ; ++kk) kr[kk] = kp[j + kk];
      for (int64_t d = 0; d < D; ++d) {
        F qd[V];
        for (int v = 0; v < V; ++v) qd[v] = qT[d * V + v];
        for (int kk = 0; kk < KJ; ++kk) {
          const F x = Splat<W>(kr[kk][d]);
          for (int v = 0; v < V; ++v) a[kk][v] += qd[v] * x;
        }
      }
      for (int kk = 0; kk < KJ; ++kk)
        for (int v = 0; v < V; ++v) sc[(j + kk) * V + v] = a[kk][v];
    }
    for (; j < nb; ++j) {
      F a[V] = {};
      const float* kr = kp[j];
      for (int64_t d = 0; d < D; ++d) {
        const F x = Splat<W>(kr[d]);
        for (int v = 0; v < V; ++v) a[v] += qT[d * V + v] * x;
      }
      for (int v = 0; v < V; ++v) sc[j * V + v] = a[v];
    }
    if (masks) {
      const F neg = Splat<W>(kNeg);
      for (int64_t jj = 0; jj < nb; ++jj) {
        const float bias = ks.bias != nullptr ? ks.bias[j0 + jj] : 0.0f;
        for (int v = 0; v < V; ++v) {
          F s = bias <= kMasked ? neg : sc[jj * V + v] + bias;
          for (int u = 0; u < table; ++u) {  // met in table u < this one: counted there
            const I same = qcv[u * V + v] == (I{} + ks.codes[(j0 + jj) * T + u]);
            s = same ? neg : s;
          }
          sc[jj * V + v] = s;
        }
      }
    }
    F mnew[V], alpha[V], sum[V];
    for (int v = 0; v < V; ++v) mnew[v] = mrun[v];
    for (int64_t jj = 0; jj < nb; ++jj)
      for (int v = 0; v < V; ++v) mnew[v] = Max<W>(mnew[v], sc[jj * V + v]);
    for (int v = 0; v < V; ++v) {
      alpha[v] = ExpV<W>(mrun[v] - mnew[v]);
      sum[v] = F{};
    }
    for (int64_t jj = 0; jj < nb; ++jj)
      for (int v = 0; v < V; ++v) {
        F p = ExpV<W>(sc[jj * V + v] - mnew[v]);
        if (masks) p = sc[jj * V + v] > Splat<W>(kMasked) ? p : F{};  // absent keys weigh exactly 0
        sc[jj * V + v] = p;
        sum[v] += p;
      }
    for (int v = 0; v < V; ++v) {
      lrun[v] = lrun[v] * alpha[v] + sum[v];
      mrun[v] = mnew[v];
    }
    // acc = acc * alpha + P V, DC output dims held in registers across the tile's keys
    const float* const* vp = ks.v + j0;
    int64_t d0 = 0;
    for (; d0 + DC <= D; d0 += DC) {
      F o[DC][V];
      for (int dd = 0; dd < DC; ++dd)
        for (int v = 0; v < V; ++v) o[dd][v] = acc[(d0 + dd) * V + v] * alpha[v];
      for (int64_t jj = 0; jj < nb; ++jj) {
        const float* vr = vp[jj] + d0;
        F pj[V];
        for (int v = 0; v < V; ++v) pj[v] = sc[jj * V + v];
        for (int dd = 0; dd < DC; ++dd) {
          const F x = Splat<W>(vr[dd]);
          for (int v = 0; v < V; ++v) o[dd][v] += pj[v] * x;
        }
      }
      for (int dd = 0; dd < DC; ++dd)
        for (int v = 0; v < V; ++v) acc[(d0 + dd) * V + v] = o[dd][v];
    }
    for (; d0 < D; ++d0) {
      F o[V];
      for (int v = 0; v < V; ++v) o[v] = acc[d0 * V + v] * alpha[v];
      for (int64_t jj = 0; jj < nb; ++jj) {
        const F x = Splat<W>(vp[jj][d0]);
        for (int v = 0; v < V; ++v) o[v] += sc[jj * V + v] * x;
      }
      for (int v = 0; v < V; ++v) acc[d0 * V + v] = o[v];
    }
  }
  for (int v = 0; v < V; ++v) {
    mp[v] = mrun[v];
    lp[v] = lrun[v];
  }
}

constexpr int64_t kRowQueries = 8;  // a group of at most this many queries runs in the row form (PassRows)

typedef float Row16 __attribute__((vector_size(64), aligned(4)));  // 16 floats of a row, any alignment
typedef int32_t RowIdx __attribute__((vector_size(64)));

FB_INLINE float HSum(Row16 v) {  // the 16 lanes' sum: 4 shuffle + add steps
  v += __builtin_shuffle(v, RowIdx{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, RowIdx{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, RowIdx{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, RowIdx{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

FB_INLINE float RowDot(const float* a, const float* b, int64_t D) {
  Row16 acc = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) acc += *reinterpret_cast<const Row16*>(a + d) * *reinterpret_cast<const Row16*>(b + d);
  float s = HSum(acc);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

FB_INLINE void RowAxpy(float* y, float a, const float* x, int64_t D) {  // y += a x
  int64_t d = 0;
  const Row16 av = Row16{} + a;
  for (; d + 16 <= D; d += 16)
    *reinterpret_cast<Row16*>(y + d) += av * *reinterpret_cast<const Row16*>(x + d);
  for (; d < D; ++d) y[d] += a * x[d];
}

// A small group (nr <= kRowQueries rows) against keys [j_begin, j_end), in the row form: each pair one dot product
// along the head (D / 16 vector FMAs and a reduction) and one p v update of the query's state row, the key's and
// value's rows read once for all nr queries. Vector lanes across queries (Pass) would run mostly empty here (a
// small bucket: the trained DiT's int8 buckets hold ~3 queries), costing a full group's arithmetic per key.
FB_INLINE void PassRows(const Query& qs, const int32_t* rows, int64_t nr, const KeySet& ks, int64_t j_begin,
                        int64_t j_end, int table, const State& st, float* sc) {
  typedef typename Lanes<16>::f F;
  const int64_t D = qs.D;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTile) {
    const int64_t nb = std::min(kTile, j_end - j0);
    const int64_t nv = (nb + 15) / 16;  // the tile's scores as 16-lane vectors per row (padding lanes: kNeg)
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t x = nb; x < nv * 16; ++x) sc[r * kTile + x] = kNeg;
    for (int64_t jj = 0; jj < nb; ++jj) {
      const float* kr = ks.k[j0 + jj];
      const float bias = ks.bias != nullptr ? ks.bias[j0 + jj] : 0.0f;
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t i = rows[r];
        float s = bias <= kMasked ? kNeg : RowDot(qs.q + i * D, kr, D) + bias;
        for (int u = 0; u < table; ++u)  // met in table u < this one: counted there
          if (qs.codes[i * qs.T + u] == ks.codes[(j0 + jj) * qs.T + u]) s = kNeg;
        sc[r * kTile + jj] = s;
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t i = rows[r];
      float* sr = sc + r * kTile;
      float mnew = st.m[i];
      for (int64_t jj = 0; jj < nb; ++jj) mnew = std::max(mnew, sr[jj]);
      const F mv = Splat<16>(mnew);
      F sum = F{};
      for (int64_t v = 0; v < nv; ++v) {
        F x;
        std::memcpy(&x, sr + v * 16, sizeof(F));
        F p = ExpV<16>(x - mv);
        p = x > Splat<16>(kMasked) ? p : F{};  // absent keys (and the padding lanes) weigh exactly 0
        std::memcpy(sr + v * 16, &p, sizeof(F));
        sum += p;
      }
      float total = 0.0f;
      for (int x = 0; x < 16; ++x) total += sum[x];
      const float alpha = ExpV<16>(Splat<16>(st.m[i] - mnew))[0];
      st.l[i] = st.l[i] * alpha + total;
      st.m[i] = mnew;
      float* acc = st.acc + i * D;
      if (alpha != 1.0f)
        for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
    }
    for (int64_t jj = 0; jj < nb; ++jj) {
      const float* vr = ks.v[j0 + jj];
      for (int64_t r = 0; r < nr; ++r) {
        const float pj = sc[r * kTile + jj];
        if (pj != 0.0f) RowAxpy(st.acc + rows[r] * D, pj, vr, D);
      }
    }
  }
}

// The lane configurations: (W lanes, V vectors per row group); Pass's register blocking follows from them. kRows:
// the row form (PassRows), for groups of at most kRowQueries rows.
enum class Lane { k16x2, k16x1, k8x2, k8x1, kRows };

struct GroupPlan {
  int64_t r0, nr;
  Lane lane;
  int64_t offset;  // floats into the block's lane buffer
};

template <Lane L>
struct LaneOf;
template <>
struct LaneOf<Lane::k16x2> { static constexpr int W = 16, V = 2, KJ = 8, DC = 8; };
template <>
struct LaneOf<Lane::k16x1> { static constexpr int W = 16, V = 1, KJ = 8, DC = 8; };
template <>
struct LaneOf<Lane::k8x2> { static constexpr int W = 8, V = 2, KJ = 4, DC = 4; };
template <>
struct LaneOf<Lane::k8x1> { static constexpr int W = 8, V = 1, KJ = 8, DC = 8; };

template <Lane L>
FB_INLINE void LoadL(const Query& qs, const int32_t* rows, int64_t nr, int table, const State& st, float* g) {
  Load<LaneOf<L>::W, LaneOf<L>::V>(qs, rows, nr, table, st, g);
}
template <Lane L>
FB_INLINE void StoreL(const int32_t* rows, int64_t nr, int64_t D, const State& st, const float* g) {
  Store<LaneOf<L>::W, LaneOf<L>::V>(rows, nr, D, st, g);
}
template <Lane L>
FB_INLINE void PassL(float* g, int64_t D, int64_t T, const KeySet& ks, int64_t j0, int64_t j1, int table, float* sc,
                     bool prefetch) {
  Pass<LaneOf<L>::W, LaneOf<L>::V, LaneOf<L>::KJ, LaneOf<L>::DC>(g, D, T, ks, j0, j1, table, sc, prefetch);
}

#define FB_BY_LANE(lane, CALL)                     \
  switch (lane) {                                   \
    case Lane::k16x2: CALL(Lane::k16x2); break;     \
    case Lane::k16x1: CALL(Lane::k16x1); break;     \
    case Lane::k8x2: CALL(Lane::k8x2); break;       \
    case Lane::k8x1: CALL(Lane::k8x1); break;       \
    default: break;                                 \
  }

// One block: every row of `rows` against every key of `ks`. The rows go into query groups sized to the rows left
// (the widest lanes the CPU has; fewer rows, narrower groups, so a small bucket pads at most a few lanes), each
// group's queries transposed into lanes once; the keys run in chunks that stay in L2 while every group passes
// over them (so K and V stream from memory once per chunk, not once per group).
FASTCAR_CLONES
static void Block(const Query& qs, const int32_t* rows, int64_t nrows, const KeySet& ks, int table, State st) {
  if (nrows <= 0 || ks.n <= 0) return;
  static const bool wide = __builtin_cpu_supports("avx512f");
  const int64_t D = qs.D;
  thread_local std::vector<GroupPlan> groups;
  groups.clear();
  int64_t floats = 0;
  for (int64_t r0 = 0; r0 < nrows;) {
    const int64_t left = nrows - r0;
    GroupPlan g{r0, left, Lane::k8x1, floats};
    if (wide && left > 16) {
      g.nr = std::min<int64_t>(32, left);
      g.lane = Lane::k16x2;
      floats += GroupFloats<16, 2>(D, table);
    } else if (wide && left > 8) {
      g.lane = Lane::k16x1;
      floats += GroupFloats<16, 1>(D, table);
    } else if (!wide && left > 8) {
      g.nr = std::min<int64_t>(16, left);
      g.lane = Lane::k8x2;
      floats += GroupFloats<8, 2>(D, table);
    } else if (left <= kRowQueries) {
      g.lane = Lane::kRows;  // its state stays in st's rows: no lanes to load
    } else {
      floats += GroupFloats<8, 1>(D, table);
    }
    groups.push_back(g);
    r0 += g.nr;
  }
  Scratch& scratch = ThreadScratch();
  float* base = scratch.Get(floats + kTile * std::max<int64_t>(32, kRowQueries));
  float* sc = base + floats;
  for (const GroupPlan& g : groups) {
#define FB_LOAD(L) LoadL<L>(qs, rows + g.r0, g.nr, table, st, base + g.offset)
    FB_BY_LANE(g.lane, FB_LOAD)
#undef FB_LOAD
  }
  const int64_t chunk = std::max<int64_t>(kTile, (kChunkBytes / (8 * D)) / kTile * kTile);  // K + V rows in L2
  for (int64_t j0 = 0; j0 < ks.n; j0 += chunk) {
    const int64_t j1 = std::min(ks.n, j0 + chunk);
    for (const GroupPlan& g : groups) {
      if (g.lane == Lane::kRows) {
        PassRows(qs, rows + g.r0, g.nr, ks, j0, j1, table, st, sc);
        continue;
      }
#define FB_PASS(L) PassL<L>(base + g.offset, D, qs.T, ks, j0, j1, table, sc, &g == &groups[0])
      FB_BY_LANE(g.lane, FB_PASS)
#undef FB_PASS
    }
  }
  for (const GroupPlan& g : groups) {
#define FB_STORE(L) StoreL<L>(rows + g.r0, g.nr, D, st, base + g.offset)
    FB_BY_LANE(g.lane, FB_STORE)
#undef FB_STORE
  }
}

#undef FB_BY_LANE
#undef FB_INLINE

// AnnSA over one (row, head)'s cache: the inputs of ai.fastcar AnnSAAttention for one bh (annsa_attention.h).
struct AnnSAItem {
  const float *q, *k, *v;    // [Q, D] the chunk's (q scaled)
  const float *pk, *pv;      // [S, D] the cache
  const float* pbias;        // [S] per slot additive bias (TempCache's log count), or null
  const int64_t* dense;      // [Nd] cache positions every query attends
  const int64_t* qc;         // [Q, T] query ids
  const int64_t* kc;         // [S, T] slot ids (-1: not bucketed)
  const int64_t *sc, *sl;    // [T, N] per table the bucketed slots' ids ascending, and their positions
  float* out;                // [Q, D]
  int64_t Q, D, S, T, N, Nd;
  int64_t* executed = nullptr;  // += the q.k pairs computed (each once, where it first met), or null
};

// q.k pairs of a bucket block in table `tb` not met in an earlier table (those the block masks): rows' ids qcodes
// [Q][T], the block keys' kcodes [nk][T] (the first tb tables filled).
inline int64_t BlockPairs(const int32_t* rows, int64_t nr, const int32_t* qcodes, const int32_t* kcodes, int64_t nk,
                          int64_t T, int64_t tb) {
  if (tb == 0) return nr * nk;
  int64_t n = 0;
  for (int64_t i = 0; i < nr; ++i) {
    const int32_t* qc = qcodes + rows[i] * T;
    for (int64_t j = 0; j < nk; ++j) {
      const int32_t* kc = kcodes + j * T;
      bool met = false;
      for (int64_t u = 0; u < tb && !met; ++u) met = qc[u] == kc[u];
      n += !met;
    }
  }
  return n;
}

// Per-thread buffers of one item (reused across items and calls).
struct ItemBuffers {
  std::vector<float> acc, m, l, bias;
  std::vector<int32_t> qcodes, kcodes, rows;
  std::vector<const float*> kp, vp;
  std::vector<std::pair<int64_t, int32_t>> order;
};

inline void RunItem(const AnnSAItem& t) {
  static thread_local ItemBuffers b;
  const int64_t Q = t.Q, D = t.D, T = t.T, N = t.N;
  b.acc.assign(static_cast<size_t>(Q * D), 0.0f);
  b.m.assign(static_cast<size_t>(Q), kNeg);
  b.l.assign(static_cast<size_t>(Q), 0.0f);
  b.qcodes.resize(static_cast<size_t>(Q * T));
  for (int64_t i = 0; i < Q * T; ++i) b.qcodes[i] = static_cast<int32_t>(t.qc[i]);
  const Query qs{t.q, b.qcodes.data(), Q, D, T};
  const State st{b.acc.data(), b.m.data(), b.l.data()};
  // 1. the dense block: every query x (dense cache slots | the chunk)
  const int64_t nd = t.Nd + Q;
  b.kp.resize(static_cast<size_t>(std::max(nd, N)));
  b.vp.resize(b.kp.size());
  for (int64_t j = 0; j < t.Nd; ++j) {
    b.kp[j] = t.pk + t.dense[j] * D;
    b.vp[j] = t.pv + t.dense[j] * D;
  }
  for (int64_t j = 0; j < Q; ++j) {
    b.kp[t.Nd + j] = t.k + j * D;
    b.vp[t.Nd + j] = t.v + j * D;
  }
  KeySet dense{b.kp.data(), b.vp.data(), nullptr, nullptr, nd};
  if (t.pbias != nullptr) {
    b.bias.resize(static_cast<size_t>(nd));
    for (int64_t j = 0; j < t.Nd; ++j) b.bias[j] = std::max(t.pbias[t.dense[j]], kNeg);
    std::fill(b.bias.begin() + t.Nd, b.bias.begin() + nd, 0.0f);
    dense.bias = b.bias.data();
  }
  b.rows.resize(static_cast<size_t>(Q));
  for (int64_t i = 0; i < Q; ++i) b.rows[i] = static_cast<int32_t>(i);
  Block(qs, b.rows.data(), Q, dense, 0, st);
  if (t.executed != nullptr) *t.executed += Q * nd;
  // 2. per table, each bucket's queries x the bucket's slots (merge-join of the two sorted lists)
  b.order.resize(static_cast<size_t>(Q));
  if (T > 1) b.kcodes.resize(static_cast<size_t>(N * T));
  for (int64_t tb = 0; tb < T && N > 0; ++tb) {
    for (int64_t i = 0; i < Q; ++i) b.order[i] = {t.qc[i * T + tb], static_cast<int32_t>(i)};
    std::sort(b.order.begin(), b.order.end());
    for (int64_t i = 0; i < Q; ++i) b.rows[i] = b.order[i].second;
    const int64_t* codes = t.sc + tb * N;
    const int64_t* slots = t.sl + tb * N;
    int64_t qi = 0, kj = 0;
    while (qi < Q && kj < N) {
      const int64_t c = b.order[qi].first;
      if (codes[kj] < c) {
        kj = std::lower_bound(codes + kj, codes + N, c) - codes;
        continue;
      }
      int64_t qe = qi;
      while (qe < Q && b.order[qe].first == c) ++qe;
      if (codes[kj] > c) {
        qi = qe;
        continue;
      }
      const int64_t ke = std::upper_bound(codes + kj, codes + N, c) - codes;
      for (int64_t j = kj; j < ke; ++j) {
        const int64_t p = slots[j];
        b.kp[j - kj] = t.pk + p * D;
        b.vp[j - kj] = t.pv + p * D;
        for (int64_t u = 0; u < tb; ++u) b.kcodes[(j - kj) * T + u] = static_cast<int32_t>(t.kc[p * T + u]);
      }
      KeySet ks{b.kp.data(), b.vp.data(), nullptr, tb > 0 ? b.kcodes.data() : nullptr, ke - kj};
      if (t.pbias != nullptr) {
        b.bias.resize(std::max(b.bias.size(), static_cast<size_t>(ke - kj)));
        for (int64_t j = kj; j < ke; ++j) b.bias[j - kj] = std::max(t.pbias[slots[j]], kNeg);
        ks.bias = b.bias.data();
      }
      // the next bucket's first rows, fetched while this block runs: a small bucket's block is over before its
      // scattered rows would stream in on their own (the trained DiT's int8 buckets: 3 queries, ~50 slots each)
      for (int64_t j = ke; j < std::min(N, ke + kTile); ++j)
        for (int64_t x = 0; x < D; x += 16) {
          __builtin_prefetch(t.pk + slots[j] * D + x);
          __builtin_prefetch(t.pv + slots[j] * D + x);
        }
      Block(qs, b.rows.data() + qi, qe - qi, ks, static_cast<int>(tb), st);
      if (t.executed != nullptr)
        *t.executed += BlockPairs(b.rows.data() + qi, qe - qi, b.qcodes.data(), b.kcodes.data(), ke - kj, T, tb);
      qi = qe;
      kj = ke;
    }
  }
  // 3. normalise (every query has the chunk's keys, so l > 0 unless every logit was absent)
  for (int64_t i = 0; i < Q; ++i) {
    float* o = t.out + i * D;
    const float inv = b.l[i] > 0.0f ? 1.0f / b.l[i] : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = b.acc[i * D + d] * inv;
  }
}

// AnnSA over G groups of a slot cache whose slots are described by masks (the eager DiT runtime's layout,
// dit/sparse.py, through the C entry point FastcarAnnSAGroups): per group g, the slots with dense[g, p] are dense,
// the other slots with a bucket id (key_codes >= 0) bucketed, and slots whose bias is -inf (no slot there) left out
// of both; each table's bucketed slots are sorted by id here (the ONNX Runtime op gets them from the stream
// runtime's index). Groups run on `threads` threads.
struct Groups {
  const float *q, *k, *v, *pk, *pv, *bias;  // [G,Q,D] x3 (q scaled), [G,S,D] x2, [G,S]
  const uint8_t* dense;                     // [G,S]
  const int64_t *qc, *kc;                   // [G,Q,T], [G,S,T]
  float* out;                               // [G,Q,D]
  int64_t* executed;                        // [G] q.k pairs computed per group, or null
  int64_t G, Q, D, S, T;
};

inline void RunGroup(const Groups& t, int64_t g) {
  static thread_local std::vector<int64_t> listed, bucketed, sorted_codes, sorted_slots;
  static thread_local std::vector<std::pair<int64_t, int64_t>> order;
  const int64_t Q = t.Q, D = t.D, S = t.S, T = t.T;
  const float* b = t.bias + g * S;
  const uint8_t* d = t.dense + g * S;
  const int64_t* kc = t.kc + g * S * T;
  listed.clear();
  bucketed.clear();
  for (int64_t p = 0; p < S; ++p) {
    if (!(b[p] > kNeg)) continue;  // -inf (or below kNeg): no slot
    if (d[p]) listed.push_back(p);
    else if (T > 0 && kc[p * T] >= 0) bucketed.push_back(p);
  }
  const int64_t N = static_cast<int64_t>(bucketed.size());
  sorted_codes.resize(static_cast<size_t>(T * N));
  sorted_slots.resize(sorted_codes.size());
  for (int64_t tb = 0; tb < T; ++tb) {
    order.clear();
    for (const int64_t p : bucketed) order.emplace_back(kc[p * T + tb], p);
    std::sort(order.begin(), order.end());
    for (int64_t j = 0; j < N; ++j) {
      sorted_codes[tb * N + j] = order[j].first;
      sorted_slots[tb * N + j] = order[j].second;
    }
  }
  const AnnSAItem it{t.q + g * Q * D, t.k + g * Q * D, t.v + g * Q * D, t.pk + g * S * D, t.pv + g * S * D, b,
                     listed.data(), t.qc + g * Q * T, kc, sorted_codes.data(), sorted_slots.data(), t.out + g * Q * D,
                     Q, D, S, T, N, static_cast<int64_t>(listed.size()),
                     t.executed == nullptr ? nullptr : t.executed + g};
  if (t.executed != nullptr) t.executed[g] = 0;
  RunItem(it);
}

// static: internal linkage for its thread lambda too, so the std::thread instantiations stay out of the library's
// exported symbols (an older cached library loaded RTLD_GLOBAL would otherwise interpose them).
static void RunGroups(const Groups& t, int64_t threads) {
  threads = std::max<int64_t>(1, std::min(threads, t.G));
  if (threads == 1) {
    for (int64_t g = 0; g < t.G; ++g) RunGroup(t, g);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t g = next++; g < t.G; g = next++) RunGroup(t, g);
  };
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
}

}  // namespace fastcar_bucket
