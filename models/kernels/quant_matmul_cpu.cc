// x [B, in] float32 @ W -> [B, out] float32 with W block-quantized, for XLA:CPU (an XLA FFI handler).
//
// What `models.quant.quant_matmul(impl="cpu_kernel")` runs. W is a `models.quant.QuantizedWeight`: output-major
// rows of packed integers (int8 [out, in_pad], or uint8 [out, in_pad / 2] with two 4-bit values a byte, per 32
// values byte j holding value j low and 16 + j high), float16 or float32 scales and mins [out, in_pad / block]:
//     w[o, i] = scale[o, i / block] * q[o, i] + min[o, i / block]
// (no mins: min = 0 for 8-bit, min = -8 scale for 4-bit, llama.cpp's Q4_0: s (q - 8) = s q - 8 s exactly).
//
// Decode is bandwidth-bound, so the design is: every weight byte is read from memory once per call for the
// whole batch. Output rows go in groups of 4; a group's rows are walked 32 inputs at a time, each step's
// values dequantized in registers (the product s q is exact in float32, so w = fma(s, q, m) is the same float
// the XLA form computes) and multiplied into register accumulators for all batch rows (batch 1-4). A larger
// batch dequantizes the group once per 256 inputs into an L1 buffer that float tiles of 4 x 4 read (`Group`).
// Only the order of the sums differs from the XLA form's dot: results agree within float32 summation rounding.
//
// 4-bit on AVX-512: the 16 possible values of a block are one register (table = s * [0..15] + m), and
// vpermps looks each nibble up in it (it reads the low 4 bits of each lane, so the low nibbles need no mask):
// per 32 weights one widening load, one shift, two permutes and one fma build the floats.
// Threads: XLA:CPU runs a custom call on the caller's thread; with work enough (kMinParallelBytes of
// weights) the row groups are shared with XLA's intra-op pool (`ffi::ThreadPool`) in chunks.
// Built by `models.kernels.cpu` with the machine's C++ compiler and -march=native: AVX-512, else AVX2 + FMA,
// else plain loops.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

// The tile loops must be unrolled whole: their accumulators are registers only if every index is a constant.
#define JAXSERVE_UNROLL _Pragma("GCC unroll 32")

namespace {

constexpr int64_t kStep = 32;                 // inputs per step (the padded input is a multiple of it)
constexpr int64_t kGroup = 4;                 // output rows per work item
constexpr int64_t kMinParallelBytes = 96 << 10;  // below this, a call runs on the caller's thread alone
constexpr int64_t kItemsPerChunk = 8;         // row groups per claim from the shared counter

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 16 float lanes: one zmm on AVX-512, two ymm on AVX2, an array the compiler vectorises otherwise.
#if defined(__AVX512F__)
struct V16 {
  __m512 v;
};
inline V16 Zero() { return {_mm512_setzero_ps()}; }
inline V16 Set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 Load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void Store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
// Keeps `a` in a register: without it GCC folds a load into each of its uses, two loads per fma.
inline void Pin(V16& a) { asm volatile("" : "+v"(a.v)); }
inline V16 Fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float Sum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline V16 Add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
// 16 int8 -> floats
inline V16 ConvertI8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// 16 int8 -> floats, times s plus m
inline V16 DequantI8(const int8_t* p, V16 s, V16 m) {
  const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s.v, m.v)};
}
// 16 bytes of nibbles -> values 0..15 (low nibbles) and 16..31 (high nibbles) of a block, s q + m
inline void DequantNibbles(const uint8_t* p, V16 s, V16 m, V16* lo, V16* hi) {
  const __m512 table = _mm512_fmadd_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), s.v, m.v);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo->v = _mm512_permutexvar_ps(bytes, table);  // vpermps reads each lane's low 4 bits
  hi->v = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 {
  __m256 a, b;
};
inline V16 Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 Set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 Load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void Store(float* p, V16 x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
inline void Pin(V16& x) { asm volatile("" : "+x"(x.a), "+x"(x.b)); }
inline V16 Fma(V16 x, V16 y, V16 z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline V16 Add(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline float Sum(V16 x) {
  const __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
inline V16 ConvertI8(const int8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)))};
}
inline V16 DequantI8(const int8_t* p, V16 s, V16 m) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 qa = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  const __m256 qb = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
  return {_mm256_fmadd_ps(qa, s.a, m.a), _mm256_fmadd_ps(qb, s.b, m.b)};
}
inline void DequantNibbles(const uint8_t* p, V16 s, V16 m, V16* lo, V16* hi) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const __m256i a = _mm256_cvtepu8_epi32(raw), b = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
  auto f = [&](__m256i q, __m256 sc, __m256 mn) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sc, mn); };
  lo->a = f(_mm256_and_si256(a, mask), s.a, m.a);
  lo->b = f(_mm256_and_si256(b, mask), s.b, m.b);
  hi->a = f(_mm256_srli_epi32(a, 4), s.a, m.a);
  hi->b = f(_mm256_srli_epi32(b, 4), s.b, m.b);
}
#else
struct V16 {
  float v[16];
};
inline V16 Set1(float x) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
inline V16 Zero() { return Set1(0.f); }
inline V16 Load(const float* p) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = p[i];
  return r;
}
inline void Store(float* p, V16 a) {
  for (int i = 0; i < 16; ++i) p[i] = a.v[i];
}
inline void Pin(V16&) {}
inline V16 Fma(V16 a, V16 b, V16 c) {
  for (int i = 0; i < 16; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline V16 Add(V16 a, V16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
inline float Sum(V16 a) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += a.v[i];
  return s;
}
inline V16 ConvertI8(const int8_t* p) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline V16 DequantI8(const int8_t* p, V16 s, V16 m) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = __builtin_fmaf(static_cast<float>(p[i]), s.v[i], m.v[i]);
  return r;
}
inline void DequantNibbles(const uint8_t* p, V16 s, V16 m, V16* lo, V16* hi) {
  for (int i = 0; i < 16; ++i) {
    lo->v[i] = __builtin_fmaf(static_cast<float>(p[i] & 0x0F), s.v[i], m.v[i]);
    hi->v[i] = __builtin_fmaf(static_cast<float>(p[i] >> 4), s.v[i], m.v[i]);
  }
}
#endif

struct Problem {
  int64_t batch, in, in_pad, out, bits, block;
  const float* x;        // [batch, in_pad], zero-padded (the handler's copy)
  const uint8_t* values;  // [out, in_pad * bits / 8]
  int64_t row_bytes;
  float* y;  // [batch, out]
  bool row_scale;  // 8-bit, one block per row, no mins (int8 per channel): scale the row's sum, not each weight
  int64_t blocks() const { return in_pad / block; }
};

inline float ToFloat(float v) { return v; }
inline float ToFloat(uint16_t v) {
#if defined(__F16C__)
  return _cvtsh_ss(v);
#else
  return HalfToFloat(v);
#endif
}

inline void ToFloats(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, sizeof(float) * n); }
inline void ToFloats(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = ToFloat(src[i]);
}

// A row's scales and mins as float32 (mins made explicit: 0 for 8-bit without mins, -8 s for 4-bit).
template <typename S>
void RowScales(const Problem& p, int64_t row, const S* scales, const S* mins, bool has_mins, float* sc, float* mn) {
  const int64_t nb = p.blocks();
  ToFloats(scales + row * nb, nb, sc);
  if (has_mins) {
    ToFloats(mins + row * nb, nb, mn);
  } else {
    const float f = p.bits == 4 ? -8.f : 0.f;
    for (int64_t k = 0; k < nb; ++k) mn[k] = f * sc[k];
  }
}

// Calls `fn(k, i0, i1)` for every 32-input step k of a row: i0 the block of its first 16 inputs, i1 of its
// last 16 (they differ only for 16-input blocks). No division per step: blocks outside, steps inside.
template <typename F>
inline void ForSteps(const Problem& p, F fn) {
  if (p.block == 16) {
    for (int64_t k = 0; k < p.in_pad / kStep; ++k) fn(k, 2 * k, 2 * k + 1);
    return;
  }
  const int64_t per = p.block / kStep;
  for (int64_t kb = 0; kb < p.blocks(); ++kb)
    for (int64_t k = kb * per; k < (kb + 1) * per; ++k) fn(k, kb, kb);
}

// Step k (32 inputs) of a quantized row, dequantized into two registers.
template <int BITS>
inline void DequantStep(const uint8_t* row, int64_t k, float s0, float m0, float s1, float m1, V16* lo, V16* hi) {
  if constexpr (BITS == 4) {  // a 4-bit block is >= 32 inputs: s0 == s1
    DequantNibbles(row + 16 * k, Set1(s0), Set1(m0), lo, hi);
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(row) + kStep * k;
    *lo = DequantI8(q, Set1(s0), Set1(m0));
    *hi = DequantI8(q + 16, Set1(s1), Set1(m1));
  }
}

// The weights stream from memory once per call, four rows at a time: four short interleaved streams (a row of
// SmolLM2's 576 4-bit inputs is 4.5 cache lines) that the hardware prefetcher follows poorly. Streaming 75 MB
// of int8 rows (in 768, one thread, loaded machine) ran at 2.6 GB/s against 7 GB/s for the same rows from
// L3; with this, 12.3 GB/s (prefetcht1, into L2 only: 4.2). So each 8-bit group asks for the group
// kPrefetchGroups ahead, step by step: at step k it prefetches its share of that group's bytes. 4-bit rows
// stream well without (75 MB of in-768 rows: 14.0 Gweights/s without, 7.8 with): they have none.
constexpr int64_t kPrefetchGroups = 2;

// A group of rows is kGroup * in_pad * BITS / 8 bytes, contiguous; a step's share is kGroup * 4 * BITS bytes.
template <int BITS>
inline void PrefetchShare(const uint8_t* ahead, int64_t k) {
  if constexpr (BITS == 4) return;
  constexpr int64_t share = kGroup * 4 * BITS;  // bytes: 128 (8-bit)
  JAXSERVE_UNROLL
  for (int64_t off = 0; off < share; off += 64)  // not _mm_prefetch: GCC may drop those in loops
    asm volatile("prefetcht0 %0" : : "m"(ahead[k * share + off]));
}

// R output rows x BT batch rows over all inputs, the rows `rows[r]` dequantized step by step in registers
// (scales `sc`, mins `mn`: R lines of `blocks()`); S accumulators per (row, batch row) (2 at BT = 1, for 8
// independent fma chains). The last group's rows may repeat its last row; only the first `live` are stored.
// ROW_SCALE (`Problem::row_scale`): the integers are multiplied as they are and each row's sum is scaled once
// (two of the nine vector ops a row's step took, at batch 1); the result then differs from the XLA form's by
// the order of one multiplication, s (sum q x) against sum (s q) x, within the same rounding bound.
template <int BITS, int R, int BT, int S, bool ROW_SCALE = false>
void Tile(const Problem& p, const int64_t* rows, int live, int64_t b0, const float* sc, const float* mn,
          const uint8_t* ahead) {
  V16 acc[R][BT][S];
  JAXSERVE_UNROLL
  for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL
    for (int b = 0; b < BT; ++b)
      JAXSERVE_UNROLL
      for (int h = 0; h < S; ++h) acc[r][b][h] = Zero();
  const float* xs[BT];
  JAXSERVE_UNROLL
  for (int b = 0; b < BT; ++b) xs[b] = p.x + (b0 + b) * p.in_pad;
  auto multiply = [&](int64_t k, V16 (&w)[R][2]) {
    JAXSERVE_UNROLL
    for (int b = 0; b < BT; ++b) {
      V16 x0 = Load(xs[b] + kStep * k), x1 = Load(xs[b] + kStep * k + 16);
      Pin(x0);
      Pin(x1);
      JAXSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        acc[r][b][0] = Fma(w[r][0], x0, acc[r][b][0]);
        acc[r][b][S - 1] = Fma(w[r][1], x1, acc[r][b][S - 1]);
      }
    }
  };
  {
    // All R rows share the block structure: walk it once, read each row's scale per block.
    const int64_t nb = p.blocks();
    const uint8_t* rp[R];
    JAXSERVE_UNROLL
    for (int r = 0; r < R; ++r) rp[r] = p.values + rows[r] * p.row_bytes;
    ForSteps(p, [&](int64_t k, int64_t k0, int64_t k1) {
      PrefetchShare<BITS>(ahead, k);
      V16 w[R][2];
      JAXSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        if constexpr (ROW_SCALE) {
          const int8_t* q = reinterpret_cast<const int8_t*>(rp[r]) + kStep * k;
          w[r][0] = ConvertI8(q);
          w[r][1] = ConvertI8(q + 16);
        } else {
          DequantStep<BITS>(rp[r], k, sc[r * nb + k0], mn[r * nb + k0], sc[r * nb + k1], mn[r * nb + k1], &w[r][0],
                            &w[r][1]);
        }
      }
      multiply(k, w);
    });
  }
  JAXSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    if (r >= live) break;
    JAXSERVE_UNROLL
    for (int b = 0; b < BT; ++b) {
      V16 a = acc[r][b][0];
      if constexpr (S == 2) a = Add(a, acc[r][b][1]);
      p.y[(b0 + b) * p.out + rows[r]] = ROW_SCALE ? Sum(a) * sc[r * p.blocks()] : Sum(a);
    }
  }
}

// kGroup float rows (`w`: kGroup lines of `wline` floats, steps [0, steps) of this chunk) x BT batch rows from
// input `k0 * kStep` on, added to the partial sums `part` (kGroup x BT vectors, kept between chunks).
template <int BT>
void FloatTile(const Problem& p, const float* w, int64_t wline, int64_t steps, int64_t k0, int64_t b0, V16* part) {
  constexpr int R = kGroup;
  V16 acc[R][BT];
  JAXSERVE_UNROLL
  for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL
    for (int b = 0; b < BT; ++b) acc[r][b] = part[r * BT + b];
  for (int64_t k = 0; k < steps; ++k) {
    JAXSERVE_UNROLL
    for (int h = 0; h < 2; ++h) {
      V16 wr[R];
      JAXSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        wr[r] = Load(w + r * wline + kStep * k + 16 * h);
        Pin(wr[r]);
      }
      JAXSERVE_UNROLL
      for (int b = 0; b < BT; ++b) {
        V16 x = Load(p.x + (b0 + b) * p.in_pad + kStep * (k0 + k) + 16 * h);
        Pin(x);
        JAXSERVE_UNROLL
        for (int r = 0; r < R; ++r) acc[r][b] = Fma(wr[r], x, acc[r][b]);
      }
    }
  }
  JAXSERVE_UNROLL
  for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL
    for (int b = 0; b < BT; ++b) part[r * BT + b] = acc[r][b];
}

constexpr int64_t kChunkSteps = 8;  // 256 inputs: the chunk's float rows (4 KiB) and 16 batch rows of x in L1

// One group of kGroup output rows against the whole batch. Up to 4 batch rows: one tile, dequantizing in
// registers. More: chunk by chunk of the input, the group's rows are dequantized once into `wbuf` (float32)
// and float tiles of 4 batch rows read them (x's chunk and the rows stay in L1), so no weight is dequantized
// twice and no load is wasted; the partial sums (`part`, 4 rows x batch vectors) wait in memory between chunks.
template <int BITS>
void Group(const Problem& p, int64_t group, const float* sc, const float* mn, float* wbuf, V16* part) {
  const int64_t first = group * kGroup;
  const int live = static_cast<int>(std::min<int64_t>(kGroup, p.out - first));
  int64_t rows[kGroup];
  for (int r = 0; r < kGroup; ++r) rows[r] = std::min<int64_t>(first + r, p.out - 1);
  // the group to prefetch; near the end, the last whole group again (cheaper than a test per step)
  const int64_t later = std::max<int64_t>(std::min(first + kPrefetchGroups * kGroup, p.out - kGroup), 0);
  const uint8_t* ahead = p.values + (p.out >= kGroup ? later : 0) * p.row_bytes;
  if constexpr (BITS == 8) {
    if (p.row_scale) {
      switch (p.batch) {
        case 1: return Tile<8, kGroup, 1, 2, true>(p, rows, live, 0, sc, mn, ahead);
        case 2: return Tile<8, kGroup, 2, 1, true>(p, rows, live, 0, sc, mn, ahead);
        case 3: return Tile<8, kGroup, 3, 1, true>(p, rows, live, 0, sc, mn, ahead);
        case 4: return Tile<8, kGroup, 4, 1, true>(p, rows, live, 0, sc, mn, ahead);
        default: break;
      }
    }
  }
  switch (p.batch) {
    case 1: return Tile<BITS, kGroup, 1, 2>(p, rows, live, 0, sc, mn, ahead);
    case 2: return Tile<BITS, kGroup, 2, 1>(p, rows, live, 0, sc, mn, ahead);
    case 3: return Tile<BITS, kGroup, 3, 1>(p, rows, live, 0, sc, mn, ahead);
    case 4: return Tile<BITS, kGroup, 4, 1>(p, rows, live, 0, sc, mn, ahead);
    default: break;
  }
  const int64_t nb = p.blocks(), steps = p.in_pad / kStep, wline = kChunkSteps * kStep;
  for (int64_t i = 0; i < kGroup * p.batch; ++i) part[i] = Zero();
  const uint8_t* rp[kGroup];
  for (int r = 0; r < kGroup; ++r) rp[r] = p.values + rows[r] * p.row_bytes;
  for (int64_t k0 = 0; k0 < steps; k0 += kChunkSteps) {
    const int64_t n = std::min(kChunkSteps, steps - k0);
    const int64_t per = p.block == 16 ? 0 : p.block / kStep;  // steps per block (a 16-input block: two a step)
    for (int64_t k = k0; k < k0 + n; ++k) {
      PrefetchShare<BITS>(ahead, k);
      const int64_t i0 = per ? k / per : 2 * k, i1 = per ? i0 : 2 * k + 1;  // once per step and group
      for (int r = 0; r < kGroup; ++r) {
        V16 lo, hi;
        DequantStep<BITS>(rp[r], k, sc[r * nb + i0], mn[r * nb + i0], sc[r * nb + i1], mn[r * nb + i1], &lo, &hi);
        Store(wbuf + r * wline + kStep * (k - k0), lo);
        Store(wbuf + r * wline + kStep * (k - k0) + 16, hi);
      }
    }
    for (int64_t b = 0; b < p.batch; b += 4) {
      V16* pb = part + kGroup * b;
      switch (std::min<int64_t>(p.batch - b, 4)) {
        case 1: FloatTile<1>(p, wbuf, wline, n, k0, b, pb); break;
        case 2: FloatTile<2>(p, wbuf, wline, n, k0, b, pb); break;
        case 3: FloatTile<3>(p, wbuf, wline, n, k0, b, pb); break;
        default: FloatTile<4>(p, wbuf, wline, n, k0, b, pb); break;
      }
    }
  }
  for (int64_t b = 0; b < p.batch; b += 4) {
    const int64_t bt = std::min<int64_t>(p.batch - b, 4);
    for (int r = 0; r < live; ++r)
      for (int64_t j = 0; j < bt; ++j) p.y[(b + j) * p.out + rows[r]] = Sum(part[kGroup * b + r * bt + j]);
  }
}

// Runs `fn(first, end)` over chunks of [0, items) on the caller and on the pool's threads; returns when all
// chunks are done. Each thread's chunks come from a shared counter, so a slow thread takes fewer.
template <typename F>
void ParallelChunks(ffi::ThreadPool& pool, int64_t items, int64_t threads, F fn) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  const int64_t chunks = (items + kItemsPerChunk - 1) / kItemsPerChunk;
  auto work = [shared, items, chunks, &fn]() {
    int64_t finished = 0;
    for (int64_t c; (c = shared->next.fetch_add(1)) < chunks; ++finished)
      fn(c * kItemsPerChunk, std::min(items, (c + 1) * kItemsPerChunk));
    if (finished && shared->done.fetch_add(finished) + finished == chunks) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->cv.notify_all();
    }
  };
  // A helper that starts after the caller finished every chunk claims none and touches only `shared`.
  for (int64_t t = 0; t < std::min(threads, chunks) - 1; ++t) pool.Schedule([work]() { work(); });
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == chunks; });
}

template <int BITS, typename S>
void Run(ffi::ThreadPool& pool, const Problem& p, const S* scales, const S* mins, bool has_mins) {
  const int64_t groups = (p.out + kGroup - 1) / kGroup;
  const int64_t nb = p.blocks();
  auto range = [&](int64_t g0, int64_t g1) {
    // the group's scales and mins; batch > 4: a chunk of its rows dequantized, and the partial sums
    thread_local std::vector<float> buffer;
    thread_local std::vector<V16> part;
    buffer.resize(static_cast<size_t>(2 * kGroup * nb + kGroup * kChunkSteps * kStep));
    part.resize(static_cast<size_t>(kGroup * p.batch));
    float* sc = buffer.data();
    float* mn = sc + kGroup * nb;
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t r = 0; r < kGroup; ++r)
        RowScales(p, std::min(g * kGroup + r, p.out - 1), scales, mins, has_mins, sc + r * nb, mn + r * nb);
      Group<BITS>(p, g, sc, mn, mn + kGroup * nb, part.data());
    }
  };
  const int64_t weight_bytes = p.out * p.row_bytes;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (threads == 1 || weight_bytes * std::min<int64_t>(p.batch, 4) < kMinParallelBytes) {
    range(0, groups);
  } else {
    ParallelChunks(pool, groups, threads, range);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JAXSERVE_INT8_ACTIVATIONS 1
// Decode with int8 activations (llama.cpp's Q8 x Q4 form): each batch row of x is quantized once per call per
// 32-block to q_x = rint(x * 127 / amax) (int8) with d_x = amax / 127, and each 32-block's dot is an integer
// one, vpdpbusd (u8 x s8 -> s32, exact): y = sum_blocks s_w d_x sum(u_w q_x) + m_w d_x sum(q_x), where u_w is
// the stored weight as an unsigned byte: a nibble 0..15 (min m_w: Q4_1's, or -8 s_w for Q4_0), or an int8
// value plus 128 (xor 0x80; min -128 s_w, plus the stored min if any). Against the float32 form this rounds x
// to 8 bits a block (|error| <= d_x / 2 a value), the cost llama.cpp pays too; integer sums are exact.
// One zmm holds a pair of blocks: 4-bit bytes come out as [lo k, lo k+1, hi k, hi k+1] (16 bytes each), so x
// is quantized into that byte order once; 8-bit as [k, k+1] (32 each). `kLaneBlock` maps a dword lane to its
// block of the pair; the per-lane scale s_w d_x is a permute of two floats times x's lane scales.
struct QuantizedX {
  int64_t nb, pairs, nbp;    // blocks, block pairs, blocks padded to 16 (the min term's vectors)
  std::vector<int8_t> q;     // [batch, pairs * 64] in the weights' byte order (a missing last block: zeros)
  std::vector<float> dxv;    // [batch, pairs, 16]: d_x of each dword lane's block
  std::vector<float> sx;     // [batch, nbp]: d_x * sum(q_x) of each block (the min term's factor)
};

template <int BITS>
inline int LaneBlock(int lane) {
  return BITS == 4 ? (lane / 4) % 2 : lane / 8;
}

// Where input j of block `blk` goes in the pair's 64 bytes.
template <int BITS>
inline int64_t PairByte(int64_t blk, int64_t j) {
  const int64_t h = blk % 2;
  if constexpr (BITS == 4) return 16 * h + (j < 16 ? j : 32 + j - 16);
  return 32 * h + j;
}

template <int BITS>
void QuantizeX(const Problem& p, QuantizedX* qx) {
  qx->nb = p.in_pad / 32;
  qx->pairs = (qx->nb + 1) / 2;
  qx->nbp = (qx->nb + 15) / 16 * 16;
  qx->q.assign(static_cast<size_t>(p.batch * qx->pairs * 64), 0);
  qx->dxv.assign(static_cast<size_t>(p.batch * qx->pairs * 16), 0.f);
  qx->sx.assign(static_cast<size_t>(p.batch * qx->nbp), 0.f);
  for (int64_t b = 0; b < p.batch; ++b) {
    int8_t* q = qx->q.data() + b * qx->pairs * 64;
    float* dxv = qx->dxv.data() + b * qx->pairs * 16;
    for (int64_t blk = 0; blk < qx->nb; ++blk) {
      const float* xs = p.x + b * p.in_pad + 32 * blk;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xs[j]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f, d = amax / 127.f;
      int32_t sum = 0;
      int8_t* pair = q + (blk / 2) * 64;
      for (int j = 0; j < 32; ++j) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xs[j] * inv));
        pair[PairByte<BITS>(blk, j)] = static_cast<int8_t>(v);
        sum += v;
      }
      for (int lane = 0; lane < 16; ++lane)
        if (LaneBlock<BITS>(lane) == blk % 2) dxv[(blk / 2) * 16 + lane] = d;
      qx->sx[b * qx->nbp + blk] = d * static_cast<float>(sum);
    }
  }
}

// kGroup output rows x BT batch rows (BT <= 4) over all inputs. `sc`, `mn`: kGroup lines of `nbp` floats (zero
// past the blocks), `mn` the unsigned form's min (see above).
template <int BITS, int BT>
void TileI8(const Problem& p, const QuantizedX& qx, const int64_t* rows, int live, const float* sc, const float* mn,
            const uint8_t* ahead) {
  constexpr int R = kGroup;
  __m512 acc[R][BT];
  JAXSERVE_UNROLL
  for (int r = 0; r < R; ++r)
    JAXSERVE_UNROLL
    for (int b = 0; b < BT; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint8_t* rp[R];
  JAXSERVE_UNROLL
  for (int r = 0; r < R; ++r) rp[r] = p.values + rows[r] * p.row_bytes;
  const __m512i idx = BITS == 4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                                : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t nbp = qx.nbp;
  for (int64_t pp = 0; pp < qx.pairs; ++pp) {
    const bool half = 2 * pp + 1 == qx.nb;  // the last pair of an odd number of blocks: read one block only
    if constexpr (BITS == 8) {  // 8-bit rows: the group kPrefetchGroups ahead, a pair's share (as `Tile` does)
      JAXSERVE_UNROLL
      for (int64_t off = 0; off < kGroup * 64; off += 64) asm volatile("prefetcht0 %0" : : "m"(ahead[pp * kGroup * 64 + off]));
    }
    __m512i w[R];
    __m512 ws[R];
    JAXSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      if constexpr (BITS == 4) {
        const uint8_t* src = rp[r] + 32 * pp;
        const __m256i raw = half ? _mm256_maskz_loadu_epi8(0xFFFF, src)
                                 : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        w[r] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), nibble);
      } else {
        const uint8_t* src = rp[r] + 64 * pp;
        const __m512i raw = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, src) : _mm512_loadu_si512(src);
        w[r] = _mm512_xor_si512(raw, flip);
      }
      double two;  // the pair's two row scales
      std::memcpy(&two, sc + r * nbp + 2 * pp, sizeof(two));
      ws[r] = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_set_sd(two))));
    }
    JAXSERVE_UNROLL
    for (int b = 0; b < BT; ++b) {
      const __m512i xq = _mm512_loadu_si512(qx.q.data() + (b * qx.pairs + pp) * 64);
      const __m512 dx = _mm512_loadu_ps(qx.dxv.data() + (b * qx.pairs + pp) * 16);
      JAXSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], xq));
        acc[r][b] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws[r], dx), acc[r][b]);
      }
    }
  }
  JAXSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    if (r >= live) break;
    JAXSERVE_UNROLL
    for (int b = 0; b < BT; ++b) {
      __m512 a = acc[r][b];
      for (int64_t j = 0; j < nbp; j += 16)  // the min term: sum_blocks m_w d_x sum(q_x)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(mn + r * nbp + j), _mm512_loadu_ps(qx.sx.data() + b * nbp + j), a);
      p.y[b * p.out + rows[r]] = _mm512_reduce_add_ps(a);
    }
  }
}

template <int BITS, typename S>
void RunI8(ffi::ThreadPool& pool, const Problem& p, const QuantizedX& qx, const S* scales, const S* mins,
           bool has_mins) {
  const int64_t groups = (p.out + kGroup - 1) / kGroup;
  const int64_t nb = qx.nb, nbp = qx.nbp;
  auto range = [&](int64_t g0, int64_t g1) {
    thread_local std::vector<float> buffer;
    buffer.assign(static_cast<size_t>(2 * kGroup * nbp), 0.f);  // the padding stays zero
    float* sc = buffer.data();
    float* mn = sc + kGroup * nbp;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t first = g * kGroup;
      const int live = static_cast<int>(std::min<int64_t>(kGroup, p.out - first));
      int64_t rows[kGroup];
      const int64_t later = std::max<int64_t>(std::min(first + kPrefetchGroups * kGroup, p.out - kGroup), 0);
      const uint8_t* ahead = p.values + (p.out >= kGroup ? later : 0) * p.row_bytes;
      for (int r = 0; r < kGroup; ++r) {
        rows[r] = std::min<int64_t>(first + r, p.out - 1);
        RowScales(p, rows[r], scales, mins, has_mins, sc + r * nbp, mn + r * nbp);
        if constexpr (BITS == 8)  // the values stored signed, read as value + 128: min - 128 s
          for (int64_t k = 0; k < nb; ++k) mn[r * nbp + k] -= 128.f * sc[r * nbp + k];
      }
      switch (p.batch) {
        case 1: TileI8<BITS, 1>(p, qx, rows, live, sc, mn, ahead); break;
        case 2: TileI8<BITS, 2>(p, qx, rows, live, sc, mn, ahead); break;
        case 3: TileI8<BITS, 3>(p, qx, rows, live, sc, mn, ahead); break;
        default: TileI8<BITS, 4>(p, qx, rows, live, sc, mn, ahead); break;
      }
    }
  };
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (threads == 1 || p.out * p.row_bytes * p.batch < kMinParallelBytes) {
    range(0, groups);
  } else {
    ParallelChunks(pool, groups, threads, range);
  }
}
#endif

// The whole weight dequantized, float32 [out, in_pad] (output-major, the padding columns included): what a
// prefill multiplies by. Many batch rows make a matmul compute-bound, where XLA's own float GEMM beats the
// tiles above; this writes its operand at memory speed (XLA's dequantizing fusion ran ~10x slower).
template <int BITS, typename S>
void Dequantize(ffi::ThreadPool& pool, const Problem& p, const S* scales, const S* mins, bool has_mins, float* w) {
  const int64_t nb = p.blocks();
  auto range = [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> buffer;
    buffer.resize(static_cast<size_t>(2 * nb));
    float* sc = buffer.data();
    float* mn = sc + nb;
    for (int64_t r = r0; r < r1; ++r) {
      RowScales(p, r, scales, mins, has_mins, sc, mn);
      const uint8_t* row = p.values + r * p.row_bytes;
      float* dst = w + r * p.in_pad;
      ForSteps(p, [&](int64_t k, int64_t i0, int64_t i1) {
        V16 lo, hi;
        DequantStep<BITS>(row, k, sc[i0], mn[i0], sc[i1], mn[i1], &lo, &hi);
        Store(dst + kStep * k, lo);
        Store(dst + kStep * k + 16, hi);
      });
    }
  };
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (threads == 1 || p.out * p.row_bytes < kMinParallelBytes) {
    range(0, p.out);
  } else {
    ParallelChunks(pool, p.out, threads, range);
  }
}

// The weight's parts (values, scales, mins, bits, block) checked against each other and written into `p`
// (out, row_bytes, in_pad, bits, block); what each handler shares. `where` names the handler in the error.
ffi::Error WeightParts(const std::string& where, const ffi::AnyBuffer& values, const ffi::AnyBuffer& scales,
                       const ffi::AnyBuffer& mins, int64_t bits, int64_t block, bool has_mins, Problem* p) {
  const auto vd = values.dimensions(), sd = scales.dimensions();
  if (vd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument(where + "values [out, packed] and scales [out, blocks] expected");
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument(where + "bits must be 4 or 8");
  const auto vt = values.element_type(), st = scales.element_type();
  if ((bits == 8 && vt != ffi::S8) || (bits == 4 && vt != ffi::U8))
    return ffi::Error::InvalidArgument(where + "8-bit values must be int8, 4-bit values uint8");
  if (st != ffi::F16 && st != ffi::F32) return ffi::Error::InvalidArgument(where + "scales must be f16 or f32");
  p->out = vd[0];
  p->row_bytes = vd[1];
  p->in_pad = vd[1] * 8 / bits;
  p->bits = bits;
  p->block = block;
  if (block < 16 || block % (bits == 4 ? 32 : 16) || p->in_pad % block || p->in_pad % kStep)
    return ffi::Error::InvalidArgument(where + "block " + std::to_string(block) + " does not tile the padded input " +
                                       std::to_string(p->in_pad));
  if (sd[0] != p->out || sd[1] != p->in_pad / block)
    return ffi::Error::InvalidArgument(where + "values and scales disagree");
  if (has_mins && (mins.element_type() != st || mins.dimensions().size() != 2 || mins.dimensions()[0] != sd[0] ||
                   mins.dimensions()[1] != sd[1]))
    return ffi::Error::InvalidArgument(where + "mins must match the scales' shape and dtype");
  p->values = static_cast<const uint8_t*>(values.untyped_data());
  return ffi::Error::Success();
}

// `fn(scales, mins)` with the pointers typed as the scales are stored (f16 as uint16_t bits, or f32).
template <typename F>
void WithScales(const ffi::AnyBuffer& scales, const ffi::AnyBuffer& mins, F fn) {
  if (scales.element_type() == ffi::F16) {
    fn(static_cast<const uint16_t*>(scales.untyped_data()), static_cast<const uint16_t*>(mins.untyped_data()));
  } else {
    fn(static_cast<const float*>(scales.untyped_data()), static_cast<const float*>(mins.untyped_data()));
  }
}

ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer values, ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                          int64_t bits, int64_t block, bool has_mins, ffi::Result<ffi::Buffer<ffi::F32>> w) {
  Problem p{};
  if (auto e = WeightParts("quantized dequantize: ", values, scales, mins, bits, block, has_mins, &p); e.failure())
    return e;
  p.in = p.in_pad;
  const auto wd = w->dimensions();
  if (wd.size() != 2 || wd[0] != p.out || wd[1] != p.in_pad)
    return ffi::Error::InvalidArgument("quantized dequantize: the output must be float32 [out, in_pad]");
  if (p.out == 0) return ffi::Error::Success();
  float* out = w->typed_data();
  WithScales(scales, mins, [&](const auto* s, const auto* m) {
    bits == 4 ? Dequantize<4>(pool, p, s, m, has_mins, out) : Dequantize<8>(pool, p, s, m, has_mins, out);
  });
  return ffi::Error::Success();
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                           ffi::AnyBuffer mins, int64_t bits, int64_t block, bool has_mins, bool int8_activations,
                           ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const std::string where = "quantized matmul: ";
  Problem p{};
  if (auto e = WeightParts(where, values, scales, mins, bits, block, has_mins, &p); e.failure()) return e;
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2) return ffi::Error::InvalidArgument(where + "x [B, in], y [B, out] expected");
  p.batch = xd[0];
  p.in = xd[1];
  if (p.in > p.in_pad)
    return ffi::Error::InvalidArgument(where + "x has " + std::to_string(p.in) + " inputs, the weight " +
                                       std::to_string(p.in_pad));
  if (yd[0] != p.batch || yd[1] != p.out) return ffi::Error::InvalidArgument(where + "x, the weight and y disagree");
  if (p.batch == 0 || p.out == 0) return ffi::Error::Success();
  // x zero-padded to whole steps: padding values meet zeros, never data
  thread_local std::vector<float> xpad;
  xpad.assign(static_cast<size_t>(p.batch * p.in_pad), 0.f);
  for (int64_t b = 0; b < p.batch; ++b)
    std::memcpy(xpad.data() + b * p.in_pad, x.typed_data() + b * p.in, sizeof(float) * p.in);
  p.x = xpad.data();
  p.y = y->typed_data();
  p.row_scale = bits == 8 && !has_mins && p.in_pad == block;
#if defined(JAXSERVE_INT8_ACTIVATIONS)
  if (int8_activations && block == 32 && p.batch <= 4 && !p.row_scale) {
    thread_local QuantizedX qx;
    bits == 4 ? QuantizeX<4>(p, &qx) : QuantizeX<8>(p, &qx);
    WithScales(scales, mins, [&](const auto* s, const auto* m) {
      bits == 4 ? RunI8<4>(pool, p, qx, s, m, has_mins) : RunI8<8>(pool, p, qx, s, m, has_mins);
    });
    return ffi::Error::Success();
  }
#endif
  WithScales(scales, mins, [&](const auto* s, const auto* m) {
    bits == 4 ? Run<4>(pool, p, s, m, has_mins) : Run<8>(pool, p, s, m, has_mins);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [B, in]
                                  .Arg<ffi::AnyBuffer>()         // values [out, in_pad * bits / 8]
                                  .Arg<ffi::AnyBuffer>()         // scales [out, in_pad / block]
                                  .Arg<ffi::AnyBuffer>()         // mins, like scales (or a placeholder)
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("block")
                                  .Attr<bool>("has_mins")
                                  // x quantized to int8 a 32-block (VNNI, block-32 weights, batch <= 4; else
                                  // the float32 form): llama.cpp's decode arithmetic
                                  .Attr<bool>("int8_activations")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [B, out]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantDequantize, DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // values [out, in_pad * bits / 8]
                                  .Arg<ffi::AnyBuffer>()         // scales [out, in_pad / block]
                                  .Arg<ffi::AnyBuffer>()         // mins, like scales (or a placeholder)
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("block")
                                  .Attr<bool>("has_mins")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // w [out, in_pad]
);
