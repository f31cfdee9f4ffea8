// Q6_K lanes blocks (q6k_lanes_vnni.h: the layout, laid out at load by
// engine/kernels/q6k_lanes.py) read on AVX2: avx2int8 holds a GGUF's Q6_K
// matrices so (a Q4_K_M file's ffn_down and some attn_v, its Q6_K LM head or
// tied table, its Q6_K experts), at the file's 6.5625 bits a weight, where
// before they were rounded into Q8_0 groups at load (one more rounding) and
// held so, the head as Q8_0 lanes blocks: 9 bits a weight. Included by q6k_lanes_vnni.h,
// after its constants, so its dispatch (q6k_lanes_by_isa) takes this too.
//
// A panel's 16 channels are two ymm halves (channels 0-7 in a vector's first
// 32 bytes, 8-15 in its last 32), decoded as the vnni kernel decodes a zmm,
// without VPTERNLOG: W[0..2] = A, B, C & 0x3F and W[3] = (A >> 2 & 0x30) |
// (B >> 4 & 0x0C) | (C >> 6 & 0x03).
//
// Arithmetic: the vnni kernel's integers and, after them, its float
// operations in its order, so a row's result has the same bits as there,
// and the same at every row count. The rows are rounded to int8 as every
// avx2int8 int8 kernel rounds them (quantize_rows_q8 with kAvx2Int8:
// quantize_row_q8_avx2, the same bytes and steps as avx512vnni's
// quantize_row_q8 with flip 0). Per sub-block and row, VPMADDUBSW multiplies
// the unsigned 6-bit values u by 4 inputs broadcast and adds pairs in int16
// (at most 2 x 63 x 128), two such products add in int16 (at most 32,256:
// never saturating), and VPMADDWD against the channel's int8 scale sc
// (widened to int16, in both halves of a lane) makes sc dot in int32. The
// offset, -32 sc0 xs0 - 32 sc1 xs1 (xs a sub-block's sum of the row's int8
// inputs), is one VPMADDWD of the pairs (sc0, sc1) against (-xs0, -xs1) and
// a shift by 5. So a group's t = sc0 (dot0 - 32 xs0) + sc1 (dot1 - 32 xs1)
// is the vnni kernel's exact int32 (integer sums in any order), then
//   acc = fma(float(t) * dx_b, d, acc)
// as there (tests/test_q6k_lanes.py compares the two bit for bit).
//
// Speed (scripts/q6k_lanes_bench.py --isa avx2int8 --rows 1 32; a 2-core
// Intel Xeon with AMX held to AVX2, against the Q8_0 lanes blocks of q8_lanes_avx2.h on int16
// activations, how avx2int8 held such a head before): in cache on
// one thread 1.18x their time a weight at 1 row (30.8 against 26.0 us a
// million weights), 1.10x at 32; from memory (2048 x 8192 matrices, 2
// threads) 0.76x at 1 row (745 against 980 us a call: 27% fewer bytes),
// 1.07x at 32 rows. About half of a one-row group's operations unpack the
// values and scales (54 a group and panel, against 56 a row for the
// products, the offset and the float sum). A group's 16 broadcasts of a
// row's inputs are in assembly beside their VPMADDUBSW: from the
// intrinsics GCC hoisted them and kept them on the stack (the tile alone in
// a loop, in cache: 76-78 -> 67 us a million weights at 4 rows, 40 -> 36
// at 2). Tiles of 4 rows: 16.7 us a million weights a row, 2 rows' 18.
// docs/performance.md, "The Q6_K kernel", has the figures.

#pragma once

#include <algorithm>

namespace trioserve_native {

// Rows a tile: a row's t and its two accumulators, the 4 decoded vectors, a
// sub-block's scales and the products' temporaries.
constexpr int kQ6kAvx2TileRows = 4;

// Each row's two sub-block sums of a group of 32 rounded inputs, negated, as
// int16 pairs in one int32 (-xs0 low, -xs1 high; |xs| <= 16 x 127): [rows,
// k / 32], VPMADDWD's operand for the offset.
inline std::vector<int32_t> q6k_sub_sum_pairs(const QuantizedRows& xq, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  std::vector<int32_t> pairs(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < groups; ++b) {
      const int8_t* q = xq.q.data() + r * k + b * kGroup;
      int32_t s0 = 0, s1 = 0;
      for (int64_t i = 0; i < 16; ++i) s0 += q[i];
      for (int64_t i = 0; i < 16; ++i) s1 += q[16 + i];
      pairs[r * groups + b] = int32_t(uint32_t(uint16_t(-s0)) | uint32_t(uint16_t(-s1)) << 16);
    }
  return pairs;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Rows [0, R) of the rounded activations (``qx`` k apart, ``step`` their
// [R, groups, 2] steps, ``pairs`` their q6k_sub_sum_pairs [R, groups])
// against one Q6_K lanes panel (``panel``, its d at ``d``): y's 16 channels.
template <int R>
inline void q6k_lanes_tile_avx2(const int8_t* qx, const float* step, const int32_t* pairs, int64_t k,
                                const uint8_t* panel, const uint16_t* d, float* y, int64_t ldy) {
  const int64_t supers = k / kQ6kSuper, groups = k / kGroup;
  const __m256i six = _mm256_set1_epi8(0x3F), m30 = _mm256_set1_epi8(0x30), m0c = _mm256_set1_epi8(0x0C),
                m03 = _mm256_set1_epi8(0x03);
  // Byte c of a 16-byte row (broadcast to both 128-bit lanes) into the high
  // byte of both int16 of lane c (channels 0-7: half 0; 8-15: half 1), zero
  // below: an arithmetic shift by 8 then widens it with its sign.
  const __m256i spread[2] = {
      _mm256_setr_epi8(-1, 0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1, 4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6,
                       -1, 7, -1, 7),
      _mm256_setr_epi8(-1, 8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1, 12, -1, 12, -1, 13, -1, 13, -1,
                       14, -1, 14, -1, 15, -1, 15)};
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* base = panel + s * kQ6kLanesBytes;
    __m256 dv[2];
    for (int v = 0; v < 2; ++v)
      dv[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + s * kLanesChannels + 8 * v)));
    for (int g = 0; g < kQ6kGroups; ++g) {
      const int64_t b = s * kQ6kGroups + g;
      const uint8_t* run = base + g / 2 * kQ6kPairBytes;
      const uint8_t* values = run + g % 2 * 384;
      const uint8_t* scales = run + 768 + g % 2 * 32;
      // As the vnni kernel: the run kQ6kAheadBytes on, 7 lines at its first
      // group and 6 at its second (a prefetch never faults).
      if constexpr (kQ6kAheadBytes > 0)
        for (int line = g % 2 * 7; line < (g % 2 ? 13 : 7); ++line)
          _mm_prefetch(reinterpret_cast<const char*>(run + kQ6kAheadBytes) + 64 * line, _MM_HINT_T0);
      for (int v = 0; v < 2; ++v) {
        // Sub-block h's scale of each channel of half v, in both int16 of its
        // lane; and the pair (sc0, sc1) a lane, for the offset.
        __m256i sc[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i row = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * h)));
          sc[h] = _mm256_srai_epi16(_mm256_shuffle_epi8(row, spread[v]), 8);
        }
        const __m256i sc_pair = _mm256_blend_epi16(sc[0], sc[1], 0xAA);
        __m256i t[R];
        for (int r = 0; r < R; ++r)
          t[r] = _mm256_slli_epi32(_mm256_madd_epi16(sc_pair, _mm256_set1_epi32(pairs[r * groups + b])), 5);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* at = values + 192 * h + 32 * v;
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
          const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 64));
          const __m256i cc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 128));
          // bits 4..5 from A's top, 2..3 from B's, 0..1 from C's (16-bit
          // shifts: what crosses into a byte is cleared by the masks)
          const __m256i w3 = _mm256_or_si256(
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 2), m30), _mm256_and_si256(_mm256_srli_epi16(bb, 4), m0c)),
              _mm256_and_si256(_mm256_srli_epi16(cc, 6), m03));
          const __m256i w[4] = {_mm256_and_si256(a, six), _mm256_and_si256(bb, six), _mm256_and_si256(cc, six), w3};
          for (int r = 0; r < R; ++r) {
            const int8_t* x = qx + r * k + b * kGroup + 16 * h;
            __m256i p[2];
            for (int i = 0; i < 2; ++i) {
              // Two products' pairs added in int16, weights (unsigned)
              // first; each row's 4 inputs broadcast where they are used, in
              // assembly: from the intrinsics GCC hoisted a group's 16
              // broadcasts ahead and kept them on the stack (as
              // lanes_avx2.h's tile).
              __m256i other;
              asm("vpbroadcastd %[x0], %[p]\n\tvpmaddubsw %[p], %[w0], %[p]\n\t"
                  "vpbroadcastd %[x1], %[o]\n\tvpmaddubsw %[o], %[w1], %[o]\n\tvpaddw %[o], %[p], %[p]"
                  : [p] "=&x"(p[i]), [o] "=&x"(other)
                  : [w0] "x"(w[2 * i]), [w1] "x"(w[2 * i + 1]),
                    [x0] "m"(*reinterpret_cast<const int32_t*>(x + 8 * i)),
                    [x1] "m"(*reinterpret_cast<const int32_t*>(x + 8 * i + 4)));
            }
            t[r] = _mm256_add_epi32(t[r], _mm256_add_epi32(_mm256_madd_epi16(p[0], sc[h]), _mm256_madd_epi16(p[1], sc[h])));
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m256 dx = _mm256_set1_ps(step[(r * groups + b) * 2]);
          acc[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(t[r]), dx), dv[v], acc[r][v]);  // as vnni's
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(y + r * ldy + 8 * v, acc[r][v]);
}

#pragma GCC pop_options

// y[rows, out] = x[rows, k] @ W.T for W in Q6_K lanes blocks ([out / 16,
// k / 256, 3328], their d [out / 16, k / 256, 16] float16) on AVX2 with
// int8 activations (kAvx2Int8), each thread a run of panels at a few rows
// (over_lanes_panels), tiles of kQ6kAvx2TileRows rows: the same bits as
// q6k_lanes_matmul_vnni, at every row count.
inline void q6k_lanes_matmul_avx2(const float* x, int64_t rows, int64_t k, const uint8_t* w, const uint16_t* d,
                                  int64_t out, float* y) {
  if (rows == 0) return;
  const int64_t supers = k / kQ6kSuper, groups = k / kGroup, panel_bytes = supers * kQ6kLanesBytes;
  const int64_t d_stride = supers * kLanesChannels;
  const QuantizedRows xq = quantize_rows_q8(x, rows, k, 0, kAvx2Int8);
  const std::vector<int32_t> pairs = q6k_sub_sum_pairs(xq, rows, k);
  const auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      over_tiles<kQ6kAvx2TileRows>(rows, [&](auto r_tag, int64_t r0) {
        q6k_lanes_tile_avx2<decltype(r_tag)::value>(xq.q.data() + r0 * k, xq.step.data() + r0 * groups * 2,
                                                    pairs.data() + r0 * groups, k, w + p * panel_bytes,
                                                    d + p * d_stride, y + r0 * out + p * kLanesChannels, out);
      });
  };
  over_lanes_panels(out / kLanesChannels, rows, run);
}

}  // namespace trioserve_native
