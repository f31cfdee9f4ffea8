// The row kernels of the native linears; see linear.cpp for what and why.

#pragma once

// torch's C++ API without its Python bindings: the library registers ops
// (TORCH_LIBRARY), so the build needs no Python headers.
#include <torch/all.h>
#include <torch/library.h>
#include <c10/util/Half.h>
#include <ATen/Parallel.h>

#include "isa.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace trioserve_native {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlockBytes = 20;  // float16 d, float16 m, 16 bytes of nibbles
// Input rows one pass over a weight row serves: more reuse of each decoded
// weight, while the accumulators still fit in registers (AVX-512 has 32
// vector registers, AVX2 16).
constexpr int kMaxRows = 8;
constexpr int kMaxRowsAvx2 = 4;

// ``f(std::integral_constant<int, n>{})`` for a count n known at run time
// (1 to Max; less is 1, more Max): a tile's rows, a pass's heads, as a
// constant of the kernel's template.
template <int Max, typename F>
inline void with_count(int64_t n, const F& f) {
  static_assert(Max >= 1, "counts from 1");
  if constexpr (Max > 1) {
    if (n < Max) return with_count<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

// kAvx2Int8 is kAvx2 whose kernels for weights in groups of 32 multiply
// rounded activations at any row count: 4-bit ones int8 activations
// (VPMADDUBSW and VPMADDWD: the int8 panels of panel_avx2.h from
// kPanelFromRows rows, below them the row kernels of rows_avx2.h), Q8_0
// ones int16 activations (VPMADDWD: the int16 panels of panel_avx2_int16.h,
// and rows_avx2.h's row kernels below them). The row kernels give the
// panels' bits, so a row's result does not depend on how many rows run
// with it. Python calls them so for decode steps, and the 4-bit one below
// kPanelFromRows rows too (int4_native.call_isa,
// int8_native.Int8GroupNativeLinear). Its 4-bit weights of whole panels of
// 16 channels are held as lanes blocks instead, one kernel with the same
// bits at every row count (lanes_avx2.h), and a Q8_0 LM head likewise as
// Q8_0 lanes blocks on the int16 tile (q8_lanes_avx2.h). Its kernels of int8 per channel run as
// kAvx2's. kAvx2 runs its row kernels below kPanelFromRows rows and from
// there panels (a prompt's rows, from the model's layers): for 4-bit weights
// on activations rounded to int16 in groups of 32 (panel_avx2_int16.h), for
// int8 ones the float32 panels of panel_avx2.h. kAvx512Bf16 runs the
// AVX-512 row kernels, and from kPanelFromRows rows the bfloat16 panels of
// panel.h in place of the float32 ones. kAvx512Vnni is kAvx512Bf16 whose
// kernels for weights in groups of 32 (4-bit, and int8 in groups: GGUF's
// Q8_0) multiply int8 activations with VPDPBUSD in the panels of
// panel_vnni.h, and up to kVnniRowsMax rows in the row kernels of
// rows_vnni.h, which give the panels' bits: a row's result does not depend
// on how many rows run with it, at any batch size (Python calls them for
// decode steps and their LM head; a prompt's 4-bit calls below 10 rows
// too, and from 10 rows the bfloat16 panels: int4_native.call_isa). An
// Its 4-bit and Q8_0 weights of whole panels of 16 channels are held as
// lanes blocks, avx2int8's layouts, read as they lie by one kernel at every
// row count with the same bits (lanes_vnni.h). An
// earlier row kernel summed in another order than the panels (the scales
// applied per row and pair of blocks), so a batch's size could move a
// sequence's result and a speculative step's verification had to stay
// below 10 rows to match one-token steps. Its kernels of int8 per channel
// run as on kAvx512Bf16, and Python runs a prompt's Q8_0 calls on
// kAvx512Bf16 (float32 activations: int8_native.Int8GroupNativeLinear).
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx2Int8 = 2, kAvx512 = 3, kAvx512Bf16 = 4, kAvx512Vnni = 5 };

inline int64_t supported_isas() {
  int64_t bits = 1 << kScalar;
  __builtin_cpu_init();
  // F16C converts the 4-bit blocks' float16 scales; every AVX-512 CPU has it.
  const bool f16c = __builtin_cpu_supports("f16c");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) bits |= (1 << kAvx2) | (1 << kAvx2Int8);
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && f16c) {
    bits |= 1 << kAvx512;
    if (__builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16")) {
      bits |= 1 << kAvx512Bf16;
      if (__builtin_cpu_supports("avx512vnni")) bits |= 1 << kAvx512Vnni;
    }
  }
  return bits;
}

struct Block {
  float d;
  float m;
  const uint8_t* qs;
};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline Block block_at(const uint8_t* p) {
  return Block{half_at(p), half_at(p + 2), p + 4};
}

// A block's d and m as lanes 0 and 1.
__attribute__((target("f16c"))) inline __m128 block_dm(const uint8_t* p) {
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

// A 4-bit block decoded to float32: its elements 0..15, then 16..31.
struct Block512 {
  __m512 lo, hi;
};

__attribute__((target("avx512f,avx512bw,f16c"))) inline Block512 q4_block_avx512(const uint8_t* p) {
  const __m128 dm = block_dm(p);
  const __m512 d = _mm512_broadcastss_ps(dm);
  const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)));
  return {_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F))), d, m),
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m)};
}

// The same in AVX2: elements 0..7, 8..15, 16..23, 24..31.
struct Block256 {
  __m256 v[4];
};

__attribute__((target("avx2,fma,f16c"))) inline Block256 q4_block_avx2(const uint8_t* p) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128 dm = block_dm(p);
  const __m256 d = _mm256_broadcastss_ps(dm);
  const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
  const __m128i lo = _mm_and_si128(qs, low);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low);
  const __m128i quarters[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  Block256 b;
  for (int i = 0; i < 4; ++i) b.v[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(quarters[i])), d, m);
  return b;
}

// ---- scratch ------------------------------------------------------------------

// What a thread's panels are decoded into, kept by the thread across calls
// and left uninitialized (every byte read is written first). A vector per
// chunk, as before, zero-filled its bytes at every call: at 32 decode rows
// some 60 MB a step, 2% of its time in memset. ``slot`` tells apart the
// buffers one call holds at once.
enum ScratchSlot { kScratchPanel, kScratchStage, kScratchLanes, kScratchSlots };

inline uint8_t* thread_scratch(ScratchSlot slot, int64_t bytes) {
  struct Buffer {
    std::unique_ptr<uint8_t[]> data;
    int64_t bytes = 0;
  };
  thread_local Buffer buffers[kScratchSlots];
  Buffer& buffer = buffers[slot];
  if (buffer.bytes < bytes) {
    buffer.data.reset(new uint8_t[bytes]);  // default-initialized: no fill
    buffer.bytes = bytes;
  }
  return buffer.data.get();
}

// ---- splitting work over torch's threads ------------------------------------

// Runs f(begin, end) over [0, n) in chunks that torch's threads take one at a
// time from a shared counter, at least ``grain`` long and a multiple of
// ``align``. With a static split (at::parallel_for's), a thread the OS takes
// off its core for a while (the engine's event loop shares the cores) holds
// the whole region up by that long while the other thread waits at its end;
// here the other thread takes over the chunks left, so only the preempted
// thread's current chunk is late. Measured in the actor engine at 32 streams
// (docs/benchmarks.md): the step took 1.13-1.17x its time in the engine core
// alone with the static split, 1.05-1.08x with chunks. Which thread computes a
// chunk changes nothing in its result. The panels and the attention use it;
// the row kernels of few rows do not (over_rows).
template <typename F>
inline void parallel_chunks(int64_t n, int64_t grain, int64_t align, const F& f) {
  if (n <= 0) return;
  const int64_t threads = at::get_num_threads();
  // About eight chunks a thread: enough to even out a preemption, few enough
  // that taking one (an atomic add) stays far below its work.
  int64_t chunk = std::max<int64_t>(grain, (n + threads * 8 - 1) / (threads * 8));
  chunk = (chunk + align - 1) / align * align;
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (threads == 1 || chunks == 1) {
    f(int64_t(0), n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// ---- row kernels on float32 activations ------------------------------------
// q4_rows (4-bit blocks), q8_rows (int8 per channel) and q8g_rows (int8 in
// groups of 32, GGUF's Q8_0) in each ISA's namespace: written once in rows.h
// for AVX2 and AVX-512, here for scalar_isa. TRIOSERVE_FLOAT_ROWS calls the
// variant that runs an isa.

// A 4-bit block's 32 weights as the vectors of AVX2 (4) or AVX-512 (2), for rows.h.
__attribute__((target("avx2,fma,f16c"))) inline void q4_block(const uint8_t* p, __m256 (&v)[4]) {
  const Block256 b = q4_block_avx2(p);
  for (int i = 0; i < 4; ++i) v[i] = b.v[i];
}

__attribute__((target("avx512f,avx512bw,f16c"))) inline void q4_block(const uint8_t* p, __m512 (&v)[2]) {
  const Block512 b = q4_block_avx512(p);
  v[0] = b.lo;
  v[1] = b.hi;
}

namespace scalar_isa {

// A block's dot and sum of inputs, then d and m applied once.
template <int R>
void q4_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t groups, int64_t n0, int64_t n1,
             float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * groups * kBlockBytes;
    float acc[R] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const Block b = block_at(row + g * kBlockBytes);
      for (int r = 0; r < R; ++r) {
        const float* xg = x + r * ldx + g * kGroup;
        float dot = 0.f, sum = 0.f;
        for (int j = 0; j < 16; ++j) {
          dot += float(b.qs[j] & 0xF) * xg[j] + float(b.qs[j] >> 4) * xg[j + 16];
          sum += xg[j] + xg[j + 16];
        }
        acc[r] += b.d * dot + b.m * sum;
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r];
  }
}

template <int R>
void q8_rows(const float* x, int64_t ldx, const int8_t* w, const float* scale, int64_t k, int64_t n0,
             int64_t n1, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * k;
    float acc[R] = {};
    for (int64_t j = 0; j < k; ++j)
      for (int r = 0; r < R; ++r) acc[r] += float(row[j]) * x[r * ldx + j];
    for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r] * scale[n];
  }
}

// w = q * scale[group]: ``scale`` is float32 [out, k / 32].
template <int R>
void q8g_rows(const float* x, int64_t ldx, const int8_t* w, const float* scale, int64_t k, int64_t n0,
              int64_t n1, float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    float acc[R] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* q = w + n * k + g * kGroup;
      const float d = scale[n * groups + g];
      for (int r = 0; r < R; ++r) {
        float dot = 0.f;
        for (int j = 0; j < kGroup; ++j) dot += float(q[j]) * x[r * ldx + g * kGroup + j];
        acc[r] += d * dot;
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r];
  }
}

}  // namespace scalar_isa

TRIOSERVE_ISA_BEGIN_AVX2
namespace avx2_isa {
#include "rows.h"
}  // namespace avx2_isa
TRIOSERVE_ISA_END

TRIOSERVE_ISA_BEGIN_AVX512
namespace avx512_isa {
#include "rows.h"
}  // namespace avx512_isa
TRIOSERVE_ISA_END

// ``call`` (a row kernel, with its arguments) for R rows on the variant that
// runs ``isa``: AVX-512 passes of up to kMaxRows rows, AVX2 and scalar of up
// to kMaxRowsAvx2 (over_rows).
#define TRIOSERVE_FLOAT_ROWS(isa, R, call) \
  do {                                     \
    if ((isa) >= kAvx512) {                \
      avx512_isa::call;                    \
    } else if constexpr (R <= kMaxRowsAvx2) { \
      if ((isa) >= kAvx2) avx2_isa::call;  \
      else scalar_isa::call;               \
    }                                      \
  } while (0)

// ---- 4-bit against int8 activations (AVX512_VNNI) --------------------------
// At one row the float kernel above is bound by its instructions, not by
// memory: per block it widens 16 bytes to 32 floats, scales them and runs two
// FMAs, about three times the time the block's 20 bytes take to stream. Here
// each row is first rounded to int8 in groups of 32 (a scale per group, as
// llama.cpp's Q8 activations), so that a block's nibbles only need masking
// and one VPDPBUSD multiplies 64 nibbles by 64 activations, summing in int32
// (exact); the block's float16 d and m are applied once per block:
//   sum_j (q_j d + m) x_j  ~  d dx sum_j q_j qx_j + m dx sum_j qx_j,
// that is, the weights against the rounded activations, the m term too
// (llama.cpp's Q8_1 sums). With the activations' exact sum for the m term
// instead, q_j d (biased away from zero by -m) would meet the rounding
// errors alone: a larger error (the default model's perplexity at 1.7% over
// float32's with the exact sum, 0.4% with the rounded one). The rounding of the activations
// (at most half a step, amax / 254, per value) is the only difference from
// the float kernel: docs/benchmarks.md has its quality.

// A row's int8 groups and, per group, its step dx and the rounded values'
// sum dx sum_j qx_j (two floats).
struct QuantizedRows {
  std::vector<int8_t> q;    // [rows, k]
  std::vector<float> step;  // [rows, groups, 2]: dx, dx times the sum of qx
};

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i round_q8(__m512 v, __m512 inv) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));  // to nearest, within -127..127
}

// One row of k inputs; ``flip`` 0x80 stores each int8 q as the unsigned byte
// q + 128 (for VPDPBUSD against signed int8 weights, panel_vnni.h).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void quantize_row_q8(const float* x, int64_t k, int8_t* q,
                                                                              float* step, uint8_t flip) {
  const __m128i flip_bits = _mm_set1_epi8(char(flip));
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* p = x + g * kGroup;
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qa = round_q8(a, inv), qb = round_q8(b, inv);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup), _mm_xor_si128(_mm512_cvtsepi32_epi8(qa), flip_bits));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16),
                     _mm_xor_si128(_mm512_cvtsepi32_epi8(qb), flip_bits));
    const float dx = amax / 127.f;
    step[2 * g] = dx;
    step[2 * g + 1] = dx * float(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  }
}

// A group of 32 inputs ``p`` rounded in AVX2 to ``levels`` steps each side
// of zero (step amax / levels, to nearest even) in ``r``; the step and the
// step times the rounded values' exact sum go to ``step[0..1]``.
__attribute__((target("avx2,fma"))) inline void round_group_avx2(const float* p, float levels, __m256i (&r)[4],
                                                               float* step) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
  const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? levels / amax : 0.f);
  for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  const float dx = amax / levels;
  step[0] = dx;
  step[1] = dx * float(_mm_cvtsi128_si32(s));
}

// quantize_row_q8 (flip 0) in AVX2, to the same bytes and steps: the same
// largest magnitude, reciprocal and rounding (to nearest even), and an exact
// integer sum.
__attribute__((target("avx2,fma,f16c"))) inline void quantize_row_q8_avx2(const float* x, int64_t k, int8_t* q,
                                                                      float* step) {
  // _mm256_packs_epi32 then _epi16 interleave the four vectors by 128-bit
  // lane; this puts their 4-value pieces back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    __m256i r[4];
    round_group_avx2(x + g * kGroup, 127.f, r, step + 2 * g);
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup), _mm256_permutevar8x32_epi32(bytes, order));
  }
}

// ``isa`` kAvx2Int8 rounds on AVX2 (flip must be 0), any other on AVX-512.
inline QuantizedRows quantize_rows_q8(const float* x, int64_t rows, int64_t k, uint8_t flip = 0,
                                      int64_t isa = kAvx512Vnni) {
  const int64_t groups = k / kGroup;
  QuantizedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups * 2)};
  // A prefill chunk's rows across the threads; a decode step's 32 rows take
  // microseconds, less than a parallel region costs.
  parallel_chunks(rows, 64, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* q = out.q.data() + r * k;
      float* step = out.step.data() + r * groups * 2;
      if (isa == kAvx2Int8) quantize_row_q8_avx2(x + r * k, k, q, step);
      else quantize_row_q8(x + r * k, k, q, step, flip);
    }
  });
  return out;
}

// ---- 4-bit against int8 activations (AVX2) ---------------------------------
// int8 activations against 4-bit weights as avx512vnni's panels
// (panel_vnni.h) take them, without VPDPBUSD: VPMADDUBSW multiplies the 32
// nibbles (unsigned) by the 32 rounded activations (signed) and adds pairs in
// int16 (at most 2 x 15 x 127, so never saturating), VPMADDWD adds those
// pairs in int32; the block's dot is exact, and d dx and m dx sum qx are
// applied once per block (the row kernels are in rows_avx2.h, the panels in
// panel_avx2.h). At one row the float kernel (avx2_isa::q4_rows) widens every
// nibble to a float and runs two FMAs per 8 weights: on a Zen 1 core, which
// splits 256-bit operations in two, it took 20.7 ms for the default model's
// matmuls of a token against llama-server's whole 15.8 ms step.

}  // namespace trioserve_native

#include "panel.h"
#include "panel_vnni.h"
#include "rows_vnni.h"
#include "panel_avx2.h"
#include "panel_avx2_int16.h"
#include "rows_avx2.h"

namespace trioserve_native {

// ---- dispatch ------------------------------------------------------------

inline bool use_panels(int64_t rows, int64_t isa) { return isa >= kAvx512 && rows >= kPanelFromRows; }
// kAvx2's panels (int16 activations for 4-bit weights, float32 for int8
// ones); kAvx2Int8's from the same row count are int8 ones, for 4-bit
// weights only (q4_matmul_avx2_int8: a decode step's rows).
inline bool use_avx2_panels(int64_t rows, int64_t isa) { return isa == kAvx2 && rows >= kPanelFromRows; }

inline void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= kScalar && isa <= kAvx512Vnni, "trioserve native linear: unknown isa ", isa);
  TORCH_CHECK(supported_isas() & (int64_t(1) << isa), "trioserve native linear: this CPU cannot run isa ", isa,
              isa == kAvx512Vnni   ? " (AVX-512 F/BW/VL, BF16 and VNNI)"
              : isa == kAvx512Bf16 ? " (AVX-512 F/BW and BF16)"
              : isa == kAvx512   ? " (AVX-512 F/BW)"
              : isa == kScalar   ? ""
                                 : " (AVX2, FMA and F16C)");
}

// Runs ``kernel<R>(x_rows, ..., n0, n1, y_rows)`` over all rows of x in
// chunks of at most kMaxRows, output channels split across torch's threads.
template <typename Kernel>
inline void over_rows(int64_t rows, int64_t out, int64_t isa, const Kernel& kernel) {
  // A chunk of output channels per task big enough that a task's weights
  // (a few KiB a channel) outweigh the cost of handing it out.
  const int64_t grain = 16;
  // avx2int8's row kernels (rows_avx2.h) hold R x C sums in one vector, so
  // take 8 rows a pass as AVX-512's do.
  const int64_t chunk = isa >= kAvx512 || isa == kAvx2Int8 ? kMaxRows : kMaxRowsAvx2;
  // A static split (one contiguous range a thread, which the prefetchers
  // stream best): at one row, taking chunks (parallel_chunks) made the
  // default model's fused layers 0.7-1.0 ms slower a token.
  at::parallel_for(0, out, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < rows;) {
      const int64_t left = std::min<int64_t>(chunk, rows - r0);
      with_count<kMaxRows>(left, [&](auto r_tag) { kernel(r_tag, r0, n0, n1); });
      r0 += left;
    }
  });
}

// The rows rounded to int8 in groups of 32 (quantize_rows_q8, as ``isa``
// rounds them), then ``kernel(R, xq, r0, n0, n1)`` over over_rows' tiles,
// instantiated for tiles of at most MaxRows rows.
template <int MaxRows, typename Kernel>
inline void over_int8_rows(const float* x, int64_t rows, int64_t k, int64_t out, int64_t isa, const Kernel& kernel) {
  const QuantizedRows xq = quantize_rows_q8(x, rows, k, 0, isa);
  over_rows(rows, out, isa, [&](auto r_tag, int64_t r0, int64_t n0, int64_t n1) {
    if constexpr (decltype(r_tag)::value <= MaxRows) kernel(r_tag, xq, r0, n0, n1);
  });
}

// y[rows, out] = x[rows, k] @ W.T for W in 4-bit blocks [out, k / 32, 20].
inline void q4_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y, int64_t isa) {
  const int64_t groups = k / kGroup;
  if (isa == kAvx512Vnni) {  // the panels' bits at every row count (kernels.h's header)
    if (rows <= kVnniRowsMax) q4_rows_vnni(x, rows, k, w, out, y);
    else q4_matmul_vnni(x, rows, k, w, out, y);
    return;
  }
  if (use_panels(rows, isa)) {
    panel_matmul(
        x, rows, k, out, y, isa,
        [&](int64_t n, float* dst) { avx512_isa::q4_decode(w + n * groups * kBlockBytes, groups, dst); },
        [&](int64_t n, uint16_t* dst) { q4_decode_bf16_avx512(w + n * groups * kBlockBytes, groups, dst); });
    return;
  }
  if (use_avx2_panels(rows, isa)) {
    q4_matmul_avx2_i16(x, rows, k, w, out, y);
    return;
  }
  if (isa == kAvx2Int8 && rows >= kPanelFromRows) {
    q4_matmul_avx2_int8(x, rows, k, w, out, y);
    return;
  }
  if (isa == kAvx2Int8) {
    over_int8_rows<kMaxRows>(x, rows, k, out, isa, [&](auto r_tag, const QuantizedRows& xq, int64_t r0,
                                                            int64_t n0, int64_t n1) {
      q4_rows_avx2_int8<decltype(r_tag)::value>(xq, r0, k, w, groups, n0, n1, y + r0 * out, out);
    });
    return;
  }
  over_rows(rows, out, isa, [&](auto r_tag, int64_t r0, int64_t n0, int64_t n1) {
    constexpr int R = decltype(r_tag)::value;
    const float* xr = x + r0 * k;
    float* yr = y + r0 * out;
    TRIOSERVE_FLOAT_ROWS(isa, R, q4_rows<R>(xr, k, w, groups, n0, n1, yr, out));
  });
}

// y[rows, out] = x[rows, k] @ (q * scale).T for int8 q [out, k] and float32 scale [out].
inline void q8_matmul(const float* x, int64_t rows, int64_t k, const int8_t* w, const float* scale, int64_t out,
                      float* y, int64_t isa) {
  if (isa == kAvx2Int8) isa = kAvx2;  // no int8 activations for weights per channel
  if (use_panels(rows, isa)) {
    panel_matmul(
        x, rows, k, out, y, isa, [&](int64_t n, float* dst) { avx512_isa::q8_decode(w + n * k, scale + n, k, k, dst); },
        [&](int64_t n, uint16_t* dst) { q8_decode_bf16_avx512(w + n * k, scale + n, k, k, dst, bf16_padded(k)); });
    return;
  }
  if (use_avx2_panels(rows, isa)) {
    panel_matmul_avx2(x, rows, k, out, y,
                      [&](int64_t n, float* dst) { avx2_isa::q8_decode(w + n * k, scale + n, k, k, dst); });
    return;
  }
  over_rows(rows, out, isa, [&](auto r_tag, int64_t r0, int64_t n0, int64_t n1) {
    constexpr int R = decltype(r_tag)::value;
    const float* xr = x + r0 * k;
    float* yr = y + r0 * out;
    TRIOSERVE_FLOAT_ROWS(isa, R, q8_rows<R>(xr, k, w, scale, k, n0, n1, yr, out));
  });
}

// y[rows, out] = x[rows, k] @ (q * scale per group of 32).T.
inline void q8g_matmul(const float* x, int64_t rows, int64_t k, const int8_t* w, const float* scale, int64_t out,
                       float* y, int64_t isa) {
  if (isa == kAvx512Vnni) {  // int8 activations, the panels' bits at every row count
    if (rows <= kVnniRowsMax) q8g_rows_vnni(x, rows, k, w, scale, out, y);
    else q8g_matmul_vnni(x, rows, k, w, scale, out, y);
    return;
  }
  if (use_panels(rows, isa)) {
    const int64_t groups = k / kGroup;
    panel_matmul(
        x, rows, k, out, y, isa,
        [&](int64_t n, float* dst) { avx512_isa::q8_decode(w + n * k, scale + n * groups, k, kGroup, dst); },
        [&](int64_t n, uint16_t* dst) {
          q8_decode_bf16_avx512(w + n * k, scale + n * groups, k, kGroup, dst, bf16_padded(k));
        });
    return;
  }
  if (use_avx2_panels(rows, isa)) {
    panel_matmul_avx2(x, rows, k, out, y, [&](int64_t n, float* dst) {
      avx2_isa::q8_decode(w + n * k, scale + n * (k / kGroup), k, kGroup, dst);
    });
    return;
  }
  if (isa == kAvx2Int8 && rows >= kPanelFromRows) {
    q8g_matmul_avx2_i16(x, rows, k, w, scale, out, y);
    return;
  }
  if (isa == kAvx2Int8) {  // the int16 panels' bits (rows_avx2.h)
    const RoundedRows16 xq = round_rows_i16(x, rows, k);
    over_rows(rows, out, isa, [&](auto r_tag, int64_t r0, int64_t n0, int64_t n1) {
      q8g_rows_avx2_i16<decltype(r_tag)::value>(xq, r0, k, w, scale, n0, n1, y + r0 * out, out);
    });
    return;
  }
  over_rows(rows, out, isa, [&](auto r_tag, int64_t r0, int64_t n0, int64_t n1) {
    constexpr int R = decltype(r_tag)::value;
    const float* xr = x + r0 * k;
    float* yr = y + r0 * out;
    TRIOSERVE_FLOAT_ROWS(isa, R, q8g_rows<R>(xr, k, w, scale, k, n0, n1, yr, out));
  });
}

}  // namespace trioserve_native

// Last: its dispatch takes either layout of 4-bit weights (q4_matmul's too).
#include "lanes_avx2.h"
#include "q8_lanes_avx2.h"
#include "lanes_vnni.h"
#include "q6k_lanes_vnni.h"
