// Single-query attention over a paged KV pool with head-major blocks, for XLA:CPU (an XLA FFI handler).
//
// What `models.paged_attention.paged_decode_attention(impl="cpu_kernel", block_layout="heads")` runs.
// q has H query heads and the pool [L, N, KVH, bs, D] KVH K/V heads, H = KVH * G (G = 1: MHA; GQA; KVH = 1:
// MQA); query head h reads K/V head h / G (Hugging Face's repeat_kv order). Each (row, K/V head) is one work
// item: it walks its row's blocks in place in the pool (layer `layer`, block `tables[b, j]`, head kh: bs x D
// contiguous values) and attends all G query heads of the group to each block while the block is in L1, so
// a step reads every K/V block from memory once per group, not once per query head, with no gather, no
// transpose and no per-(row, head) dot dispatch. Items are shared out over XLA's intra-op thread pool.
// Scores are kept for the row's whole context (G scratch lines per thread), so the softmax is exact in two
// passes instead of an online rescale. With G = 1 every product and sum runs in the order the per-head
// kernel ran them: MHA results are bit for bit what they were.
//
// Out-of-range indices. The release build clamps them (a block id outside [0, N) reads block 0 or N - 1, a
// length past the table stops at the table's end, the layer index is clamped into [0, L)), so a bad table
// cannot read outside the pool; the clamp is two integer ops per block, no branch and no extra pass on the
// serving path. Built with -DJAXSERVE_KERNEL_CHECKS (`JAXSERVE_KERNEL_CHECKS=1`, what the tests run), the
// handler first checks every block id a row will read, every length and the layer index, and fails the call
// through the FFI error path with a message naming the bad value.
// Built by `models.kernels.cpu` with the machine's C++ compiler.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t x) {  // bfloat16 bits -> float
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct Shapes {
  int64_t batch, heads, kv_heads, group, dim, layers, blocks, block_size, width;
  int64_t context() const { return width * block_size; }  // positions one row's table holds
};

// Per-thread scratch of one item: G score lines of the row's context, G accumulators of D, then per query
// head its max, its sum, its new position's score and 8 lanes of a vector max (no allocation per item).
inline int64_t ScratchFloats(const Shapes& s) { return s.group * (s.context() + s.dim + 3 + 8); }

inline int64_t ClampBlock(const Shapes& s, int32_t id) { return std::clamp<int64_t>(id, 0, s.blocks - 1); }

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JAXSERVE_AVX2 1

// 8 floats from 8 float32 or bfloat16 values.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The sums of each of 8 vectors, as one vector (lane t: the sum of v[t]'s lanes).
inline __m256 Sum8x8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // lanes: 0123 (low halves), 0123 (high)
  const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
  return _mm256_add_ps(lo, hi);
}

// exp(x) for x <= 0 (scores minus their max), to ~2 ulp; below -87 it returns 0.
inline __m256 Exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  // x = n ln2 + r, |r| <= ln2 / 2
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  // exp(r) on [-ln2/2, ln2/2]: degree-6 minimax-style Taylor tail
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Blocks lie anywhere in the pool and one block of one head is a few KiB (4 KiB at bs 16, D 64, f32), so the
// hardware prefetcher, which follows a stream within a page, cannot see the next block coming: a walk over a
// row's blocks would wait on memory at every block. Two software prefetches hide it: the block
// `kPrefetchAhead` blocks on is asked into the outer caches (prefetcht2: far enough ahead to cover DRAM
// latency at the rate the loop consumes blocks), the next block into L1; the K walk's last blocks ask for
// the V walk's first. On a pool larger than the L3 (GQA 9:3, D 64, 128 rows of 512 positions, one thread,
// AMD EPYC), 16.1 ms per layer with the next block only into L1, 11.2 ms with this.
constexpr int64_t kPrefetchAhead = 4;

// The prefetches are asm statements, not _mm_prefetch: GCC 12 dropped every _mm_prefetch of the walk below
// once it had two targets (the vectoriser removes prefetch calls from loops it rewrites), silently.
template <typename KV>
inline void PrefetchBlockFar(const KV* p, int64_t values) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < values * static_cast<int64_t>(sizeof(KV)); off += 64)
    asm volatile("prefetcht2 %0" : : "m"(c[off]));
}

template <typename KV>
inline void PrefetchBlockNear(const KV* p, int64_t values) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < values * static_cast<int64_t>(sizeof(KV)); off += 64)
    asm volatile("prefetcht0 %0" : : "m"(c[off]));
}

// At block j of a walk over `nblk` blocks of `pages`: block j + kPrefetchAhead far, block j + 1 near.
// `then` (may be null) is the walk that follows this one (the V blocks after the K blocks): its first blocks
// are asked for while this walk's last blocks are read.
template <typename KV, typename BlockAt>
inline void PrefetchWalk(int64_t j, int64_t nblk, int64_t values, BlockAt block_at, const KV* pages, const KV* then) {
  const int64_t far = j + kPrefetchAhead;
  if (far < nblk) {
    PrefetchBlockFar(block_at(pages, far), values);
  } else if (then != nullptr && far - nblk < nblk) {
    PrefetchBlockFar(block_at(then, far - nblk), values);
  }
  if (j + 1 < nblk) PrefetchBlockNear(block_at(pages, j + 1), values);
}

// One (row, K/V head) and its G query heads, for head dim 8 * DV: each block is fetched once and every query
// head of the group reads it from L1 (its query, its running max and its value sums held in registers meanwhile).
template <int DV, typename KV, typename Q>
void AttendGroupAvx2(const Shapes& s, int64_t item, const Q* q, const KV* k, const KV* v, const int32_t* tables,
                     const int32_t* lengths, int64_t layer, const Q* new_k, const Q* new_v, bool has_new, float scale,
                     float* scratch, float* out) {
  constexpr int64_t d = 8 * DV;
  const int64_t b = item / s.kv_heads, kh = item % s.kv_heads, bs = s.block_size, group = s.group;
  const int64_t ctx = s.context();
  float* const scores = scratch;                // [G, ctx]
  float* const accs = scratch + group * ctx;    // [G, D]
  float* const maxes = accs + group * d;        // [G]: the tail positions' max, then the whole max
  float* const sums = maxes + group;            // [G]
  float* const s_new = sums + group;            // [G]
  float* const vmax = s_new + group;            // [G, 8]: the 8-position groups' running vector max
  const int64_t n = std::clamp<int64_t>(lengths[b], 0, ctx);
  const int64_t nblk = (n + bs - 1) / bs;
  const int32_t* table = tables + b * s.width;
  const int64_t block_stride = s.kv_heads * bs * d;
  const int64_t layer_base = layer * s.blocks * block_stride + kh * bs * d;
  const int64_t q_base = (b * s.heads + kh * group) * d;  // query head kh * G + g at q_base + g * d
  const int64_t kv_row = (b * s.kv_heads + kh) * d;      // this K/V head's new_k / new_v line
  const __m256 scale8 = _mm256_set1_ps(scale);
  // block j of this row, layer and K/V head in `pages` (the K or the V pool)
  auto block_at = [&](const KV* pages, int64_t j) { return pages + layer_base + ClampBlock(s, table[j]) * block_stride; };

  // scores, 8 positions at a time where a block has them; per query head a running vector max.
  // score_blocks(g, j0, j1): query head g over blocks [j0, j1), its query and maxima in registers meanwhile.
  // G > 1: block by block, every head of the group while the block is in L1; G = 1: one call over all blocks
  // (the query stays in registers across blocks, as the per-head kernel had it).
  auto score_blocks = [&](int64_t g, int64_t j0, int64_t j1, bool prefetch) {
    __m256 qv[DV];
    for (int i = 0; i < DV; ++i) qv[i] = _mm256_mul_ps(Load8(q + q_base + g * d + 8 * i), scale8);
    auto dot = [&](const KV* kt) {
      __m256 acc = _mm256_mul_ps(qv[0], Load8(kt));
      for (int i = 1; i < DV; ++i) acc = _mm256_fmadd_ps(qv[i], Load8(kt + 8 * i), acc);
      return acc;
    };
    __m256 vm = _mm256_loadu_ps(vmax + 8 * g);
    float tail_max = maxes[g];
    for (int64_t j = j0; j < j1; ++j) {
      const KV* kb = block_at(k, j);
      const int64_t cnt = std::min(bs, n - j * bs);
      if (prefetch) PrefetchWalk(j, nblk, bs * d, block_at, k, v);
      float* sj = scores + g * ctx + j * bs;
      int64_t t = 0;
      for (; t + 8 <= cnt; t += 8) {
        __m256 acc[8];
        for (int u = 0; u < 8; ++u) acc[u] = dot(kb + (t + u) * d);
        const __m256 s8 = Sum8x8(acc);
        _mm256_storeu_ps(sj + t, s8);
        vm = _mm256_max_ps(vm, s8);
      }
      for (; t < cnt; ++t) {
        __m256 acc[8];
        acc[0] = dot(kb + t * d);
        for (int u = 1; u < 8; ++u) acc[u] = _mm256_setzero_ps();
        float lane[8];
        _mm256_storeu_ps(lane, Sum8x8(acc));
        sj[t] = lane[0];
        tail_max = std::max(tail_max, lane[0]);
      }
    }
    _mm256_storeu_ps(vmax + 8 * g, vm);
    maxes[g] = tail_max;
  };
  for (int64_t g = 0; g < group; ++g) {
    maxes[g] = -std::numeric_limits<float>::infinity();
    _mm256_storeu_ps(vmax + 8 * g, _mm256_set1_ps(-std::numeric_limits<float>::infinity()));
  }
  if (group == 1) {
    score_blocks(0, 0, nblk, true);
  } else {
    for (int64_t j = 0; j < nblk; ++j)
      for (int64_t g = 0; g < group; ++g) score_blocks(g, j, j + 1, g == 0);
  }
  if (n == 0 && !has_new) {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < d; ++i) out[q_base + g * d + i] = 0.f;
    return;
  }
  // per query head: the max (with the new position's score), probabilities in place, their sum
  for (int64_t g = 0; g < group; ++g) {
    float lanes[8];
    std::memcpy(lanes, vmax + 8 * g, sizeof(lanes));
    float run_max = maxes[g];
    for (float x : lanes) run_max = std::max(run_max, x);
    s_new[g] = 0.f;
    if (has_new) {
      const Q* qrow = q + q_base + g * d;
      for (int64_t i = 0; i < d; ++i) s_new[g] += ToFloat(qrow[i]) * scale * ToFloat(new_k[kv_row + i]);
      run_max = std::max(run_max, s_new[g]);
    }
    maxes[g] = run_max;
    float* sg = scores + g * ctx;
    const __m256 m8 = _mm256_set1_ps(run_max);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 p = Exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), m8));
      _mm256_storeu_ps(sg + i, p);
      sum8 = _mm256_add_ps(sum8, p);
    }
    float sum = 0.f;
    for (; i < n; ++i) {
      sg[i] = std::exp(sg[i] - run_max);
      sum += sg[i];
    }
    _mm256_storeu_ps(lanes, sum8);
    for (float x : lanes) sum += x;
    sums[g] = sum;
  }
  // the weighted values: each V block fetched once, every query head of the group adds its share (the same
  // two orders as the scores: value_blocks(g, j0, j1) keeps head g's sums in registers over blocks [j0, j1))
  auto value_blocks = [&](int64_t g, int64_t j0, int64_t j1, bool prefetch) {
    float* ag = accs + g * d;
    __m256 acc[DV];
    for (int u = 0; u < DV; ++u) acc[u] = _mm256_loadu_ps(ag + 8 * u);
    for (int64_t j = j0; j < j1; ++j) {
      const KV* vb = block_at(v, j);
      const int64_t cnt = std::min(bs, n - j * bs);
      if (prefetch) PrefetchWalk(j, nblk, bs * d, block_at, v, static_cast<const KV*>(nullptr));
      const float* pj = scores + g * ctx + j * bs;
      for (int64_t t = 0; t < cnt; ++t) {
        const __m256 p = _mm256_set1_ps(pj[t]);
        for (int u = 0; u < DV; ++u) acc[u] = _mm256_fmadd_ps(p, Load8(vb + t * d + 8 * u), acc[u]);
      }
    }
    for (int u = 0; u < DV; ++u) _mm256_storeu_ps(ag + 8 * u, acc[u]);
  };
  for (int64_t i = 0; i < group * d; ++i) accs[i] = 0.f;
  if (group == 1) {
    value_blocks(0, 0, nblk, true);
  } else {
    for (int64_t j = 0; j < nblk; ++j)
      for (int64_t g = 0; g < group; ++g) value_blocks(g, j, j + 1, g == 0);
  }
  for (int64_t g = 0; g < group; ++g) {
    __m256 acc[DV];
    for (int u = 0; u < DV; ++u) acc[u] = _mm256_loadu_ps(accs + g * d + 8 * u);
    float sum = sums[g];
    if (has_new) {
      const float pn = std::exp(s_new[g] - maxes[g]);
      sum += pn;
      const __m256 p = _mm256_set1_ps(pn);
      for (int u = 0; u < DV; ++u) acc[u] = _mm256_fmadd_ps(p, Load8(new_v + kv_row + 8 * u), acc[u]);
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int u = 0; u < DV; ++u) _mm256_storeu_ps(out + q_base + g * d + 8 * u, _mm256_mul_ps(acc[u], inv));
  }
}
#endif  // __AVX2__ && __FMA__

// One (row, K/V head) and its G query heads, any head dim: plain loops the compiler vectorises.
template <typename KV, typename Q>
void AttendGroup(const Shapes& s, int64_t item, const Q* q, const KV* k, const KV* v, const int32_t* tables,
                 const int32_t* lengths, int64_t layer, const Q* new_k, const Q* new_v, bool has_new, float scale,
                 float* scratch, float* out) {
  const int64_t b = item / s.kv_heads, kh = item % s.kv_heads, d = s.dim, bs = s.block_size, group = s.group;
  const int64_t ctx = s.context();
  float* const scores = scratch;              // [G, ctx]
  float* const accs = scratch + group * ctx;  // [G, D]
  float* const maxes = accs + group * d;      // [G]
  float* const sums = maxes + group;          // [G]
  float* const s_new = sums + group;          // [G]
  float qv[512];  // dim <= 512, checked by the handler
  const int64_t n = std::clamp<int64_t>(lengths[b], 0, ctx);
  const int64_t nblk = (n + bs - 1) / bs;
  const int32_t* table = tables + b * s.width;
  const int64_t block_stride = s.kv_heads * bs * d;  // one block of one layer
  const int64_t layer_base = layer * s.blocks * block_stride + kh * bs * d;
  const int64_t q_base = (b * s.heads + kh * group) * d;
  const int64_t kv_row = (b * s.kv_heads + kh) * d;

  for (int64_t g = 0; g < group; ++g) maxes[g] = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < nblk; ++j) {
    const KV* kb = k + layer_base + ClampBlock(s, table[j]) * block_stride;
    const int64_t cnt = std::min(bs, n - j * bs);
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i = 0; i < d; ++i) qv[i] = ToFloat(q[q_base + g * d + i]) * scale;
      float* sj = scores + g * ctx + j * bs;
      float run_max = maxes[g];
      for (int64_t t = 0; t < cnt; ++t) {
        const KV* kt = kb + t * d;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qv[i] * ToFloat(kt[i]);
        sj[t] = dot;
        run_max = std::max(run_max, dot);
      }
      maxes[g] = run_max;
    }
  }
  if (n == 0 && !has_new) {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < d; ++i) out[q_base + g * d + i] = 0.f;
    return;
  }
  for (int64_t g = 0; g < group; ++g) {
    s_new[g] = 0.f;
    if (has_new) {
      for (int64_t i = 0; i < d; ++i) s_new[g] += ToFloat(q[q_base + g * d + i]) * scale * ToFloat(new_k[kv_row + i]);
      maxes[g] = std::max(maxes[g], s_new[g]);
    }
    const float run_max = maxes[g];
    float* sg = scores + g * ctx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      const float p = std::exp(sg[i] - run_max);
      sg[i] = p;
      sum += p;
    }
    sums[g] = sum;
  }
  for (int64_t i = 0; i < group * d; ++i) accs[i] = 0.f;
  for (int64_t j = 0; j < nblk; ++j) {
    const KV* vb = v + layer_base + ClampBlock(s, table[j]) * block_stride;
    const int64_t cnt = std::min(bs, n - j * bs);
    for (int64_t g = 0; g < group; ++g) {
      const float* pj = scores + g * ctx + j * bs;
      float* acc = accs + g * d;
      for (int64_t t = 0; t < cnt; ++t) {
        const KV* vt = vb + t * d;
        const float p = pj[t];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc[i] += p * ToFloat(vt[i]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* acc = accs + g * d;
    float sum = sums[g];
    if (has_new) {
      const float p = std::exp(s_new[g] - maxes[g]);
      sum += p;
      for (int64_t i = 0; i < d; ++i) acc[i] += p * ToFloat(new_v[kv_row + i]);
    }
    const float inv = 1.f / sum;
    float* o = out + q_base + g * d;
    for (int64_t i = 0; i < d; ++i) o[i] = acc[i] * inv;
  }
}

// Runs `fn(item, scratch)` for every item on the caller and on the pool's threads; returns when all are done.
template <typename F>
void ParallelItems(ffi::ThreadPool& pool, int64_t items, int64_t scratch, F fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, items, scratch, &fn]() {
    std::vector<float> buffer(static_cast<size_t>(std::max<int64_t>(scratch, 1)));
    int64_t finished = 0;
    for (int64_t i; (i = shared->next.fetch_add(1)) < items;) {
      fn(i, buffer.data());
      ++finished;
    }
    if (finished && shared->done.fetch_add(finished) + finished == items) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->cv.notify_all();
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) - 1;
  // A helper may start after the caller has finished every item; `shared` keeps the counters alive for it,
  // and `fn` is only called for items claimed before `done` reached `items`, i.e. while the caller waits.
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work]() { work(); });
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == items; });
}

#ifdef JAXSERVE_KERNEL_CHECKS
// The checked build's guard: every index the items will read, before any is read.
ffi::Error CheckIndices(const Shapes& s, const int32_t* tables, const int32_t* lengths, int64_t layer) {
  const std::string where = "paged attention (JAXSERVE_KERNEL_CHECKS): ";
  if (layer < 0 || layer >= s.layers)
    return ffi::Error::InvalidArgument(where + "layer index " + std::to_string(layer) + " outside the pool's " +
                                       std::to_string(s.layers) + " layers");
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t n = lengths[b];
    if (n < 0 || n > s.context())
      return ffi::Error::InvalidArgument(where + "row " + std::to_string(b) + " length " + std::to_string(n) +
                                         " outside [0, " + std::to_string(s.context()) + "] (its table: " +
                                         std::to_string(s.width) + " blocks of " + std::to_string(s.block_size) +
                                         ")");
    for (int64_t j = 0; j < (n + s.block_size - 1) / s.block_size; ++j) {
      const int64_t id = tables[b * s.width + j];
      if (id < 0 || id >= s.blocks)
        return ffi::Error::InvalidArgument(where + "row " + std::to_string(b) + " table column " + std::to_string(j) +
                                           " names block id " + std::to_string(id) + ", outside the pool's " +
                                           std::to_string(s.blocks) + " blocks");
    }
  }
  return ffi::Error::Success();
}
#endif

template <typename KV, typename Q>
ffi::Error Run(ffi::ThreadPool& pool, const Shapes& s, const Q* q, const KV* k, const KV* v, const int32_t* tables,
               const int32_t* lengths, int64_t layer, const Q* new_k, const Q* new_v, bool has_new, float scale,
               float* out) {
  auto item_fn = &AttendGroup<KV, Q>;
#ifdef JAXSERVE_AVX2
  if (s.dim == 32) item_fn = &AttendGroupAvx2<4, KV, Q>;
  if (s.dim == 64) item_fn = &AttendGroupAvx2<8, KV, Q>;
  if (s.dim == 128) item_fn = &AttendGroupAvx2<16, KV, Q>;
#endif
  ParallelItems(pool, s.batch * s.kv_heads, ScratchFloats(s), [&](int64_t item, float* scratch) {
    item_fn(s, item, q, k, v, tables, lengths, layer, new_k, new_v, has_new, scale, scratch, out);
  });
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer,
                              ffi::AnyBuffer new_k, ffi::AnyBuffer new_v, float scale, bool has_new,
                              ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto td = tables.dimensions();
  const auto nd = new_k.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2 || nd.size() != 3)
    return ffi::Error::InvalidArgument(
        "paged attention: q [B,H,D], pages [L,N,KVH,bs,D], tables [B,M], new K/V [B,KVH,D] expected");
  const int64_t heads = qd[1], kv_heads = kd[2];
  if (kv_heads < 1 || heads % kv_heads)
    return ffi::Error::InvalidArgument("paged attention: " + std::to_string(heads) +
                                       " query heads are not a multiple of the pool's " + std::to_string(kv_heads) +
                                       " K/V heads");
  Shapes s{qd[0], heads, kv_heads, heads / kv_heads, qd[2], kd[0], kd[1], kd[3], td[1]};
  if (kd[4] != s.dim || td[0] != s.batch || s.dim > 512 || nd[0] != s.batch || nd[1] != kv_heads || nd[2] != s.dim)
    return ffi::Error::InvalidArgument("paged attention: q, pages, tables and new K/V disagree (or head dim > 512)");
  if (k_pages.element_type() != v_pages.element_type() || q.element_type() != new_k.element_type())
    return ffi::Error::InvalidArgument("paged attention: K and V pages (q and new K/V) must share a dtype");
  const int32_t* tb = tables.typed_data();
  const int32_t* ln = lengths.typed_data();
#ifdef JAXSERVE_KERNEL_CHECKS
  if (ffi::Error bad = CheckIndices(s, tb, ln, layer.typed_data()[0]); bad.failure()) return bad;
#endif
  const int64_t li = std::clamp<int64_t>(layer.typed_data()[0], 0, s.layers - 1);
  float* o = out->typed_data();
  const auto kt = k_pages.element_type(), qt = q.element_type();
  if (kt == ffi::F32 && qt == ffi::F32)
    return Run<float, float>(pool, s, q.typed_data<float>(), k_pages.typed_data<float>(),
                             v_pages.typed_data<float>(), tb, ln, li, new_k.typed_data<float>(),
                             new_v.typed_data<float>(), has_new, scale, o);
  if (kt == ffi::BF16 && qt == ffi::BF16)
    return Run<uint16_t, uint16_t>(
        pool, s, static_cast<const uint16_t*>(q.untyped_data()), static_cast<const uint16_t*>(k_pages.untyped_data()),
        static_cast<const uint16_t*>(v_pages.untyped_data()), tb, ln, li,
        static_cast<const uint16_t*>(new_k.untyped_data()), static_cast<const uint16_t*>(new_v.untyped_data()),
        has_new, scale, o);
  return ffi::Error::InvalidArgument("paged attention: float32 or bfloat16 q and pages expected (the same dtype)");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()        // q [B, H, D]
                                  .Arg<ffi::AnyBuffer>()        // k_pages [L, N, KVH, bs, D]
                                  .Arg<ffi::AnyBuffer>()        // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>() // tables [B, M]
                                  .Arg<ffi::Buffer<ffi::S32>>() // lengths [B]
                                  .Arg<ffi::Buffer<ffi::S32>>() // layer []
                                  .Arg<ffi::AnyBuffer>()        // new_k [B, KVH, D]
                                  .Arg<ffi::AnyBuffer>()        // new_v [B, KVH, D]
                                  .Attr<float>("scale")
                                  .Attr<bool>("has_new")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, H, D]
);
