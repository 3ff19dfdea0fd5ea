// Single-query attention over a paged KV pool with head-major blocks, for XLA:CPU (an XLA FFI handler).
//
// What `models.paged_attention.paged_decode_attention(impl="cpu_kernel", block_layout="heads")` runs:
// each (row, head) is one work item that reads its row's blocks in place from the pool
// [L, N, H, bs, D] (layer `layer`, block `tables[b, j]`, head h: bs x D contiguous values), so the
// step reads K and V once, with no gather, no transpose and no per-(row, head) dot dispatch. Items
// are shared out over XLA's intra-op thread pool. Scores are kept for the row's whole context (one
// scratch line per thread), so the softmax is exact in two passes instead of an online rescale.
//
// Indices are clamped (a block id outside [0, N) reads block 0 or N - 1, a length past the table stops at
// the table's end, the layer index is clamped into [0, L)), so a bad table cannot read outside the pool.
// Built by `models.kernels.cpu` with the machine's C++ compiler.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
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
  int64_t batch, heads, dim, layers, blocks, block_size, width;
};


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

// Asks for the next block's lines while this one is read: blocks lie anywhere in the pool, so the
// hardware prefetcher, which follows one stream, cannot see the next one coming.
template <typename KV>
inline void PrefetchBlock(const KV* p, int64_t values) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < values * static_cast<int64_t>(sizeof(KV)); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// One (row, head) for head dim 8 * DV, the query and the running sums held in registers.
template <int DV, typename KV, typename Q>
void AttendItemAvx2(const Shapes& s, int64_t item, const Q* q, const KV* k, const KV* v, const int32_t* tables,
                    const int32_t* lengths, int64_t layer, const Q* new_k, const Q* new_v, bool has_new, float scale,
                    float* scores, float* out) {
  constexpr int64_t d = 8 * DV;
  const int64_t b = item / s.heads, h = item % s.heads, bs = s.block_size;
  const int64_t row = (b * s.heads + h) * d;
  __m256 qv[DV];
  for (int i = 0; i < DV; ++i) qv[i] = _mm256_mul_ps(Load8(q + row + 8 * i), _mm256_set1_ps(scale));
  const int64_t n = std::clamp<int64_t>(lengths[b], 0, s.width * bs);
  const int64_t nblk = (n + bs - 1) / bs;
  const int32_t* table = tables + b * s.width;
  const int64_t block_stride = s.heads * bs * d;
  const int64_t layer_base = layer * s.blocks * block_stride + h * bs * d;
  auto dot = [&](const auto* kt) {
    __m256 acc = _mm256_mul_ps(qv[0], Load8(kt));
    for (int i = 1; i < DV; ++i) acc = _mm256_fmadd_ps(qv[i], Load8(kt + 8 * i), acc);
    return acc;
  };

  // scores, 8 positions at a time where a block has them
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  float run_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < nblk; ++j) {
    const int64_t blk = std::clamp<int64_t>(table[j], 0, s.blocks - 1);
    const KV* kb = k + layer_base + blk * block_stride;
    const int64_t cnt = std::min(bs, n - j * bs);
    if (j + 1 < nblk) PrefetchBlock(k + layer_base + std::clamp<int64_t>(table[j + 1], 0, s.blocks - 1) * block_stride, bs * d);
    float* sj = scores + j * bs;
    int64_t t = 0;
    for (; t + 8 <= cnt; t += 8) {
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = dot(kb + (t + u) * d);
      const __m256 s8 = Sum8x8(acc);
      _mm256_storeu_ps(sj + t, s8);
      vmax = _mm256_max_ps(vmax, s8);
    }
    for (; t < cnt; ++t) {
      __m256 acc[8];
      acc[0] = dot(kb + t * d);
      for (int u = 1; u < 8; ++u) acc[u] = _mm256_setzero_ps();
      float lane[8];
      _mm256_storeu_ps(lane, Sum8x8(acc));
      sj[t] = lane[0];
      run_max = std::max(run_max, lane[0]);
    }
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  for (float x : lanes) run_max = std::max(run_max, x);
  float s_new = 0.f;
  if (has_new) {
    for (int64_t i = 0; i < d; ++i) s_new += ToFloat(q[row + i]) * scale * ToFloat(new_k[row + i]);
    run_max = std::max(run_max, s_new);
  }
  float* o = out + row;
  if (n == 0 && !has_new) {
    for (int64_t i = 0; i < d; ++i) o[i] = 0.f;
    return;
  }
  // probabilities in place, and their sum
  const __m256 m8 = _mm256_set1_ps(run_max);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 p = Exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), m8));
    _mm256_storeu_ps(scores + i, p);
    sum8 = _mm256_add_ps(sum8, p);
  }
  float sum = 0.f;
  for (; i < n; ++i) {
    scores[i] = std::exp(scores[i] - run_max);
    sum += scores[i];
  }
  _mm256_storeu_ps(lanes, sum8);
  for (float x : lanes) sum += x;
  // the weighted values
  __m256 acc[DV];
  for (int u = 0; u < DV; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < nblk; ++j) {
    const int64_t blk = std::clamp<int64_t>(table[j], 0, s.blocks - 1);
    const KV* vb = v + layer_base + blk * block_stride;
    const int64_t cnt = std::min(bs, n - j * bs);
    const float* pj = scores + j * bs;
    if (j + 1 < nblk) PrefetchBlock(v + layer_base + std::clamp<int64_t>(table[j + 1], 0, s.blocks - 1) * block_stride, bs * d);
    for (int64_t t = 0; t < cnt; ++t) {
      const __m256 p = _mm256_set1_ps(pj[t]);
      for (int u = 0; u < DV; ++u) acc[u] = _mm256_fmadd_ps(p, Load8(vb + t * d + 8 * u), acc[u]);
    }
  }
  if (has_new) {
    const float pn = std::exp(s_new - run_max);
    sum += pn;
    const __m256 p = _mm256_set1_ps(pn);
    for (int u = 0; u < DV; ++u) acc[u] = _mm256_fmadd_ps(p, Load8(new_v + row + 8 * u), acc[u]);
  }
  const __m256 inv = _mm256_set1_ps(1.f / sum);
  for (int u = 0; u < DV; ++u) _mm256_storeu_ps(o + 8 * u, _mm256_mul_ps(acc[u], inv));
}
#endif  // __AVX2__ && __FMA__

// One (row, head), any head dim: plain loops the compiler vectorises.
template <typename KV, typename Q>
void AttendItem(const Shapes& s, int64_t item, const Q* q, const KV* k, const KV* v, const int32_t* tables,
                const int32_t* lengths, int64_t layer, const Q* new_k, const Q* new_v, bool has_new, float scale,
                float* scores, float* out) {
  const int64_t b = item / s.heads, h = item % s.heads, d = s.dim, bs = s.block_size;
  float qv[512];  // dim <= 512, checked by the handler
  float acc[512];
  const Q* qrow = q + (b * s.heads + h) * d;
  for (int64_t i = 0; i < d; ++i) qv[i] = ToFloat(qrow[i]) * scale;
  const int64_t n = std::clamp<int64_t>(lengths[b], 0, s.width * bs);
  const int64_t nblk = (n + bs - 1) / bs;
  const int32_t* table = tables + b * s.width;
  const int64_t block_stride = s.heads * bs * d;  // one block of one layer
  const int64_t layer_base = layer * s.blocks * block_stride + h * bs * d;

  float run_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < nblk; ++j) {
    const int64_t blk = std::clamp<int64_t>(table[j], 0, s.blocks - 1);
    const KV* kb = k + layer_base + blk * block_stride;
    const int64_t cnt = std::min(bs, n - j * bs);
    float* sj = scores + j * bs;
    for (int64_t t = 0; t < cnt; ++t) {
      const KV* kt = kb + t * d;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += qv[i] * ToFloat(kt[i]);
      sj[t] = dot;
      run_max = std::max(run_max, dot);
    }
  }
  float s_new = 0.f;
  if (has_new) {
    const Q* kn = new_k + (b * s.heads + h) * d;
    for (int64_t i = 0; i < d; ++i) s_new += qv[i] * ToFloat(kn[i]);
    run_max = std::max(run_max, s_new);
  }
  float* o = out + (b * s.heads + h) * d;
  if (n == 0 && !has_new) {
    for (int64_t i = 0; i < d; ++i) o[i] = 0.f;
    return;
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float p = std::exp(scores[i] - run_max);
    scores[i] = p;
    sum += p;
  }
  for (int64_t i = 0; i < d; ++i) acc[i] = 0.f;
  for (int64_t j = 0; j < nblk; ++j) {
    const int64_t blk = std::clamp<int64_t>(table[j], 0, s.blocks - 1);
    const KV* vb = v + layer_base + blk * block_stride;
    const int64_t cnt = std::min(bs, n - j * bs);
    const float* pj = scores + j * bs;
    for (int64_t t = 0; t < cnt; ++t) {
      const KV* vt = vb + t * d;
      const float p = pj[t];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[i] += p * ToFloat(vt[i]);
    }
  }
  if (has_new) {
    const float p = std::exp(s_new - run_max);
    sum += p;
    const Q* vn = new_v + (b * s.heads + h) * d;
    for (int64_t i = 0; i < d; ++i) acc[i] += p * ToFloat(vn[i]);
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < d; ++i) o[i] = acc[i] * inv;
}

// Runs `fn(item, scores)` for every item on the caller and on the pool's threads; returns when all are done.
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
    std::vector<float> scores(static_cast<size_t>(std::max<int64_t>(scratch, 1)));
    int64_t finished = 0;
    for (int64_t i; (i = shared->next.fetch_add(1)) < items;) {
      fn(i, scores.data());
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

template <typename KV, typename Q>
ffi::Error Run(ffi::ThreadPool& pool, const Shapes& s, const Q* q, const KV* k, const KV* v, const int32_t* tables,
               const int32_t* lengths, int64_t layer, const Q* new_k, const Q* new_v, bool has_new, float scale,
               float* out) {
  auto item_fn = &AttendItem<KV, Q>;
#ifdef JAXSERVE_AVX2
  if (s.dim == 32) item_fn = &AttendItemAvx2<4, KV, Q>;
  if (s.dim == 64) item_fn = &AttendItemAvx2<8, KV, Q>;
  if (s.dim == 128) item_fn = &AttendItemAvx2<16, KV, Q>;
#endif
  ParallelItems(pool, s.batch * s.heads, s.width * s.block_size, [&](int64_t item, float* scores) {
    item_fn(s, item, q, k, v, tables, lengths, layer, new_k, new_v, has_new, scale, scores, out);
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
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q [B,H,D], pages [L,N,H,bs,D], tables [B,M] expected");
  Shapes s{qd[0], qd[1], qd[2], kd[0], kd[1], kd[3], td[1]};
  if (kd[2] != s.heads || kd[4] != s.dim || td[0] != s.batch || s.dim > 512)
    return ffi::Error::InvalidArgument("paged attention: q, pages and tables disagree (or head dim > 512)");
  if (k_pages.element_type() != v_pages.element_type() || q.element_type() != new_k.element_type())
    return ffi::Error::InvalidArgument("paged attention: K and V pages (q and new K/V) must share a dtype");
  const int64_t li = std::clamp<int64_t>(layer.typed_data()[0], 0, s.layers - 1);
  float* o = out->typed_data();
  const auto kt = k_pages.element_type(), qt = q.element_type();
  const int32_t* tb = tables.typed_data();
  const int32_t* ln = lengths.typed_data();
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
                                  .Arg<ffi::AnyBuffer>()        // k_pages [L, N, H, bs, D]
                                  .Arg<ffi::AnyBuffer>()        // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>() // tables [B, M]
                                  .Arg<ffi::Buffer<ffi::S32>>() // lengths [B]
                                  .Arg<ffi::Buffer<ffi::S32>>() // layer []
                                  .Arg<ffi::AnyBuffer>()        // new_k [B, H, D]
                                  .Arg<ffi::AnyBuffer>()        // new_v [B, H, D]
                                  .Attr<float>("scale")
                                  .Attr<bool>("has_new")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, H, D]
);
