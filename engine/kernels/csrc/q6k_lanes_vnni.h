// Q6_K weights read at the file's own width (a GGUF's Q6_K projections on
// avx512vnni: engine/kernels/q6k_lanes.py lays them out at load), 16
// channels in the lanes, by one zmm kernel at every row count.
//
// Q6_K lanes blocks: a panel of 16 channels and a super-block of 256 inputs
// is 3,328 bytes, its 16 float16 d apart ([panels, supers, 16]): 3,360
// bytes for 4,096 weights, GGUF's 210 a row and super-block, 6.5625 bits a
// weight. The super-block is 4 runs of 832 bytes (13 cache lines, every
// vector load 64-byte aligned), run P for groups 2P and 2P + 1 of 32 inputs,
// so a thread reads one sequential stream. Let W[q] (q = 0..3) be the 64
// bytes whose byte b of lane c (channel c) is the 6-bit value u of input
// 32g + 16s + 4q + b, sub-block 2g + s; for group g = 2P + e its sub-block
// s is 192 bytes at 832 P + 384 e + 192 s, three vectors holding four
// (the high bits of W[3] in the top two bits of the others):
//   A = W[0] | (W[3] & 0x30) << 2, B = W[1] | (W[3] & 0x0C) << 4,
//   C = W[2] | (W[3] & 0x03) << 6;
// then the int8 scales at 832 P + 768 + 32 e: 16 of sub-block 2g (channel c
// at byte c), then 16 of sub-block 2g + 1. Decoding four vectors is 3 ANDs,
// 3 shifts, 2 bit selects and an AND (VPTERNLOG), against 7 operations for
// two in a layout of low nibbles and a high-bit plane (the prototype's
// first layout, slower in cache).
//
// Arithmetic. The unsigned 6-bit values u (0..63; the weight is
// (u - 32) sc d) meet the rows' int8 activations (quantize_rows_q8, flip 0:
// the same rounding as every vnni kernel) in VPDPBUSD, one chain a
// sub-block, which starts at the offset: -32 times the row's sum of the
// sub-block (shared by all channels, computed once per row and call, so no
// subtraction per group). Per group b of 32 inputs, for each row
// and channel, t = sc0 (dot0 - 32 xs0) + sc1 (dot1 - 32 xs1) is an exact
// int32 (|t| <= 2 x 128 x 32 x 127 x 16 < 2^24, so exact in float too),
// and the float operations are vnni_lanes_tile's, in its order:
//   acc = fma(float(t) * dx_b, d, acc)
// (dx_b the row's step of group b, d the channel's super-block float16 d).
// Each row's lane runs those operations whatever rows share its tile, so a
// row's result has the same bits at every row count.
//
// Speed (docs/benchmarks.md, scripts/q6k_lanes_bench.py): on the Zen 4 we
// measured (small loops) zmm operations ran about two a cycle, and VPDPBUSD,
// VPMULLD, VPERMW, GF2P8AFFINEQB and the float products one a cycle between
// them. A group of a
// panel at one row is 8 VPDPBUSD, 18 unpacking operations and about 10 for
// the scales and the float sum, where the Q8_0 lanes kernel's is 16
// VPDPBUSD, 8 VPERMW and 4: so in cache they cost about the same a weight
// (building W[3] alone is 15% of it). Tried without gain on that core: two
// chains a sub-block (VPDPBUSD's latency is not the limit), the scales as
// float32 products, W[3] by GF2P8AFFINEQB (a multiply-pipe operation), no
// prefetch, the g loop unrolled, and the rows' activations packed a group
// at a time.
//
// These are not the bits the Q8_0 lanes blocks gave a Q6_K matrix before
// (its values rounded into Q8_0 groups of 32 at load, ~94% of them moved by
// up to half a Q8_0 step): here the file's values run, closer to W x over
// them (tests/test_q6k_lanes.py).
//
// avx2int8 reads the same blocks with the same bits on AVX2
// (q6k_lanes_avx2.h). Outside those two (a prompt's rows outside
// batch-invariant mode run avx512bf16, or avx2 on avx2int8, as the Q8_0
// lanes blocks do) each channel is decoded from the lanes into panel.h's
// bfloat16 (or float32) panels, or panel_avx2.h's float32 ones, at any row
// count.

#pragma once

#include <algorithm>

namespace trioserve_native {

constexpr int64_t kQ6kSuper = 256;                                     // inputs a super-block
constexpr int64_t kQ6kGroups = kQ6kSuper / kGroup;                     // groups of 32 a super-block
constexpr int64_t kQ6kLowBytes = kQ6kSuper * kLanesChannels / 2;       // 2048
constexpr int64_t kQ6kHighBytes = kQ6kSuper * kLanesChannels / 4;      // 1024
constexpr int64_t kQ6kScaleBytes = kQ6kSuper / 16 * kLanesChannels;    // 256
constexpr int64_t kQ6kLanesBytes = kQ6kLowBytes + kQ6kHighBytes + kQ6kScaleBytes;  // 3328
constexpr int64_t kQ6kPairBytes = kQ6kLanesBytes / 4;  // two groups of 32: 832 bytes, 13 lines
constexpr int kQ6kTileRows = 4;  // 4 rows x 2 panels: 8 int32 chains, 8 t and 8 float32 accumulators
// Prefetched this far ahead: two super-blocks, the prototype's setting.
constexpr int64_t kQ6kAheadBytes = 2 * kQ6kLanesBytes;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

// Rows [0, R) of the rounded activations (``qx`` k apart, ``step`` their
// [R, groups, 2] steps, ``xs32`` -32 times their sums a sub-block [R, k / 16])
// against C Q6_K lanes panels (``panel``, ``panel_bytes`` apart; their d at
// ``d``, ``d_stride`` float16 apart): y's channels [0, 16 C) (``live`` stored).
template <int R, int C>
inline void q6k_lanes_tile(const int8_t* qx, const float* step, const int32_t* xs32, int64_t k, const uint8_t* panel,
                           int64_t panel_bytes, const uint16_t* d, int64_t d_stride, float* y, int64_t ldy,
                           int64_t live) {
  const int64_t supers = k / kQ6kSuper, groups = k / kGroup;
  const __m512i six = _mm512_set1_epi8(0x3F), m30 = _mm512_set1_epi8(0x30), m3c = _mm512_set1_epi8(0x3C);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* base[C];
    __m512 dv[C];
    for (int c = 0; c < C; ++c) {
      base[c] = panel + c * panel_bytes + s * kQ6kLanesBytes;
      dv[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + c * d_stride + s * kLanesChannels)));
    }
    for (int g = 0; g < kQ6kGroups; ++g) {
      const int64_t b = s * kQ6kGroups + g;
      const int64_t at = g / 2 * kQ6kPairBytes + g % 2 * 384, scale_at = g / 2 * kQ6kPairBytes + 768 + g % 2 * 32;
      for (int c = 0; c < C; ++c) {
        // The run kQ6kAheadBytes on, 7 lines at its first group and 6 at
        // its second (a prefetch never faults, past the weights' end too).
        const char* ahead = reinterpret_cast<const char*>(base[c] + g / 2 * kQ6kPairBytes + kQ6kAheadBytes);
        if constexpr (kQ6kAheadBytes > 0)
          for (int line = g % 2 * 7; line < (g % 2 ? 13 : 7); ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      }
      __m512i t[R][C];
      for (int h = 0; h < 2; ++h) {
        // One sub-block at a time: its chain starts at -32 times the row's
        // sum of the sub-block (the unsigned values' offset, exact in int32
        // either way), and its product with sc is added to t before the next
        // starts, so a row and panel hold 3 sums (t, dot, acc), not 4: at 8
        // rows the 4 spilled.
        __m512i dot[R][C];
        for (int r = 0; r < R; ++r) {
          const __m512i start = _mm512_set1_epi32(xs32[r * (k / 16) + 2 * b + h]);
          for (int c = 0; c < C; ++c) dot[r][c] = start;
        }
        __m512i w[4][C];
        for (int c = 0; c < C; ++c) {
          const uint8_t* v = base[c] + at + 192 * h;
          const __m512i a = _mm512_loadu_si512(v), bb = _mm512_loadu_si512(v + 64), cc = _mm512_loadu_si512(v + 128);
          w[0][c] = _mm512_and_si512(a, six);
          w[1][c] = _mm512_and_si512(bb, six);
          w[2][c] = _mm512_and_si512(cc, six);
          // bits 4..5 from A's top, 2..3 from B's, 0..1 from C's (16-bit
          // shifts: what crosses into a byte is cleared by the last AND)
          const __m512i ab = _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 2), _mm512_srli_epi16(bb, 4), m30, 0xE4);
          w[3][c] = _mm512_and_si512(_mm512_ternarylogic_epi32(ab, _mm512_srli_epi16(cc, 6), m3c, 0xE4), six);
        }
        for (int q = 0; q < 4; ++q)
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, qx + r * k + b * kGroup + 16 * h + 4 * q, 4);
            const __m512i xv = _mm512_set1_epi32(four);
            for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], w[q][c], xv);  // weights (unsigned) first
          }
        for (int c = 0; c < C; ++c) {
          const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base[c] + scale_at + 16 * h)));
          for (int r = 0; r < R; ++r)
            t[r][c] = h == 0 ? _mm512_mullo_epi32(dot[r][c], sc) : _mm512_add_epi32(t[r][c], _mm512_mullo_epi32(dot[r][c], sc));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 dx = _mm512_set1_ps(step[(r * groups + b) * 2]);
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t[r][c]), dx), dv[c], acc[r][c]);  // as vnni_tile
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t n = std::clamp<int64_t>(live - 16 * c, 0, 16);
      if (n) _mm512_mask_storeu_ps(y + r * ldy + 16 * c, __mmask16((1u << n) - 1), acc[r][c]);
    }
}

#pragma GCC pop_options

// -32 times each sub-block's sum of a row's rounded activations: [rows, k / 16].
inline std::vector<int32_t> q6k_sub_sums(const QuantizedRows& xq, int64_t rows, int64_t k) {
  std::vector<int32_t> sums(rows * (k / 16));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k / 16; ++j) {
      int32_t s = 0;
      for (int64_t i = 0; i < 16; ++i) s += xq.q[r * k + j * 16 + i];
      sums[r * (k / 16) + j] = -32 * s;
    }
  return sums;
}

// y[rows, out] = x[rows, k] @ W.T for W in Q6_K lanes blocks ([out / 16,
// k / 256, 3328], their d [out / 16, k / 256, 16] float16) on int8
// activations: up to kVnniRowsMax rows one panel and all rows a pass, each
// thread a contiguous run of panels; more rows in blocks that stay in L2,
// tiles of kQ6kTileRows rows against 2 panels. Same bits at every row count.
inline void q6k_lanes_matmul_vnni(const float* x, int64_t rows, int64_t k, const uint8_t* w, const uint16_t* d,
                                  int64_t out, float* y) {
  if (rows == 0) return;
  const int64_t supers = k / kQ6kSuper, panels = out / kLanesChannels, panel_bytes = supers * kQ6kLanesBytes;
  const int64_t d_stride = supers * kLanesChannels;
  const QuantizedRows xq = quantize_rows_q8(x, rows, k, 0);
  const std::vector<int32_t> xs = q6k_sub_sums(xq, rows, k);
  const auto tile = [&](auto r_tag, auto c_tag, int64_t r0, int64_t p) {
    constexpr int R = decltype(r_tag)::value, C = decltype(c_tag)::value;
    q6k_lanes_tile<R, C>(xq.q.data() + r0 * k, xq.step.data() + r0 * (k / kGroup) * 2, xs.data() + r0 * (k / 16), k,
                         w + p * panel_bytes, panel_bytes, d + p * d_stride, d_stride, y + r0 * out + p * kLanesChannels,
                         out, C * kLanesChannels);
  };
  if (rows <= kVnniRowsMax) {
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        with_count<kVnniRowsMax>(rows, [&](auto r_tag) { tile(r_tag, std::integral_constant<int, 1>{}, 0, p); });
    });
    return;
  }
  const int64_t block_rows = std::max<int64_t>(kQ6kTileRows, kRowBlockBytes / k / kQ6kTileRows * kQ6kTileRows);
  over_blocks_and_panels(rows, block_rows, out, 2 * kLanesChannels, [&](int64_t b0, int64_t block, int64_t n,
                                                                          int64_t channels) {
    over_tiles<kQ6kTileRows>(block, [&](auto r_tag, int64_t r0) {
      if (channels == 2 * kLanesChannels) tile(r_tag, std::integral_constant<int, 2>{}, b0 + r0, n / kLanesChannels);
      else tile(r_tag, std::integral_constant<int, 1>{}, b0 + r0, n / kLanesChannels);
    });
  });
}


// Channel ``c`` (0..15) of a Q6_K lanes panel (``panel``, its d at ``d``,
// ``supers`` super-blocks) to its k float32 weights, each (u - 32) times
// (d sc) in float32: the arithmetic of gguf_weights.decode_q6_k's values
// dequantized (rtn.Int8GroupWeight). For the panels of a prompt's rows.
inline void q6k_lanes_channel(const uint8_t* panel, const uint16_t* d, int64_t supers, int64_t c, float* dst) {
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* base = panel + s * kQ6kLanesBytes;
    const float ds = float(c10::Half(d[s * kLanesChannels + c], c10::Half::from_bits()));
    for (int g = 0; g < kQ6kGroups; ++g) {
      const uint8_t* run = base + g / 2 * kQ6kPairBytes;
      for (int h = 0; h < 2; ++h) {
        const uint8_t* v = run + g % 2 * 384 + 192 * h + 4 * c;
        const float step = ds * float(int8_t(run[768 + g % 2 * 32 + 16 * h + c]));
        float* o = dst + s * kQ6kSuper + 32 * g + 16 * h;
        for (int b = 0; b < 4; ++b) {
          const uint8_t a = v[b], bb = v[64 + b], cc = v[128 + b];
          const int u3 = (a >> 6) << 4 | (bb >> 6) << 2 | cc >> 6;
          o[b] = float((a & 0x3F) - 32) * step;
          o[4 + b] = float((bb & 0x3F) - 32) * step;
          o[8 + b] = float((cc & 0x3F) - 32) * step;
          o[12 + b] = float(u3 - 32) * step;
        }
      }
    }
  }
}

// The same, in bfloat16 (each float32 weight rounded to nearest even, as the
// bfloat16 panels round theirs) with zeros up to bf16_padded(k).
inline void q6k_lanes_channel_bf16(const uint8_t* panel, const uint16_t* d, int64_t supers, int64_t c,
                                   uint16_t* dst) {
  const int64_t k = supers * kQ6kSuper;
  float* values = reinterpret_cast<float*>(thread_scratch(kScratchLanes, k * 4));
  q6k_lanes_channel(panel, d, supers, c, values);
  to_bf16_avx512(values, k, dst, bf16_padded(k));
}

}  // namespace trioserve_native

#include "q6k_lanes_avx2.h"

namespace trioserve_native {

// y[rows, out] = x[rows, k] @ W.T for W in Q6_K lanes blocks on the variant
// ``isa`` names: int8 activations on kAvx512Vnni (q6k_lanes_matmul_vnni) or
// kAvx2Int8 (q6k_lanes_matmul_avx2, the same bits), at any row count and
// batch-invariant; or float32 activations in panels at any row count, each
// channel decoded from the lanes: panel.h's (bfloat16 ones from
// kAvx512Bf16, float32 on kAvx512) or panel_avx2.h's float32 ones on kAvx2,
// a prompt's rows outside batch-invariant mode, as int8_native runs the
// Q8_0 lanes blocks.
inline void q6k_lanes_by_isa(const float* x, int64_t rows, int64_t k, const uint8_t* w, const uint16_t* d, int64_t out,
                             float* y, int64_t isa) {
  if (isa == kAvx512Vnni) return q6k_lanes_matmul_vnni(x, rows, k, w, d, out, y);
  if (isa == kAvx2Int8) return q6k_lanes_matmul_avx2(x, rows, k, w, d, out, y);
  TORCH_CHECK(isa >= kAvx512 || isa == kAvx2, "trioserve native linear: Q6_K lanes blocks run on isa ", int64_t(kAvx2),
              " (avx2) and from isa ", int64_t(kAvx2Int8), " (avx2int8); not isa ", isa);
  if (rows == 0) return;
  const int64_t supers = k / kQ6kSuper, panel_bytes = supers * kQ6kLanesBytes, d_stride = supers * kLanesChannels;
  const auto at = [&](int64_t n) { return n / kLanesChannels; };
  if (isa == kAvx2) {
    panel_matmul_avx2(x, rows, k, out, y, [&](int64_t n, float* dst) {
      q6k_lanes_channel(w + at(n) * panel_bytes, d + at(n) * d_stride, supers, n % kLanesChannels, dst);
    });
    return;
  }
  panel_matmul(
      x, rows, k, out, y, isa,
      [&](int64_t n, float* dst) {
        q6k_lanes_channel(w + at(n) * panel_bytes, d + at(n) * d_stride, supers, n % kLanesChannels, dst);
      },
      [&](int64_t n, uint16_t* dst) {
        q6k_lanes_channel_bf16(w + at(n) * panel_bytes, d + at(n) * d_stride, supers, n % kLanesChannels, dst);
      });
}

}  // namespace trioserve_native
