// kAvx2's many-row form for 4-bit weights (a prompt's rows), and
// kAvx2Int8's for Q8_0 ones (a decode step's LM head): activations rounded
// to 16 bits per group of 32 inputs, products in VPMADDWD.
//
// Why: a prompt on AVX2 runs at the FMA units' peak in float32 (the panels
// of panel_avx2.h: 8 products an instruction), and the prompt is what sets
// a batch's TTFT there. VPMADDWD multiplies 16 pairs of int16 an
// instruction into 8 int32 sums and issues as often as the FMA on the cores
// we measured, so the same panel shape runs twice the products a cycle at
// most. The 4-bit weights are integers (0..15) already; the activations
// take 15 bits and a sign per group of 32 (a step of amax / 32767), where
// int8 activations (panel_avx2.h's decode panels, and llama.cpp's) take 7
// and moved the default model's near-tie answers (int4_native.call_isa).
// That is finer than the bfloat16 panels AVX-512 runs prompts on (8 bits
// of mantissa a value).
//
// A panel block holds one group of 32 inputs of 16 channels: for each pair
// of inputs, two vectors of 8 channels' (q[2p], q[2p + 1]) as int16 pairs,
// then each channel's d and m (float32; Q8_0 has no m). A row's pair of
// rounded inputs is broadcast against them; the group's 16 VPMADDWD add in
// int32 (at most 32 x 32767 x 15, exact; 32 x 32767 x 128 for Q8_0), and the
// scales are applied once a group: d times the row's step dx, and m times
// the rounded sum. The sums of a row run group after group, the same at any
// row count from kPanelFromRows.

#pragma once

#include <algorithm>

namespace trioserve_native {

constexpr int kAvx2I16TileRows = 6;                 // 12 int32 sums, 2 weight vectors, a broadcast
// Blocks a narrow tile fetches ahead, into L2, a line every other pair.
// The default model's Q8_0 head, 20 copies taken in turn (from memory), at
// 1 / 2 / 5 rows: 1.79-2.00 / 2.23-2.31 / 3.00-3.20 ms over GGUF's groups
// (rows_avx2.h); lanes blocks without fetching 2.21 / 2.66 / 3.93, all 9
// lines at a block's start into L1 2 blocks on 1.85-2.02 / 2.13-2.18 /
// 2.63-2.78, into L2 16 on 1.83-1.88 / 1.98-2.03 / 2.42-2.48, spread as
// here 8 on 1.82 / 1.76 / 2.07 (the AMX Xeon held to AVX2, 2 threads).
constexpr int64_t kAvx2I16Ahead = 8;
constexpr int64_t kAvx2I16Pairs = kGroup / 2;       // pairs of inputs a group
// Bytes of one block of a panel: the int16 weights, then d and m for each channel.
constexpr int64_t kAvx2I16BlockBytes = kGroup * kAvx2PanelChannels * 2 + 2 * kAvx2PanelChannels * 4;
// The same block with int8 weights and no m (Q8_0 lanes blocks, q8_lanes_avx2.h):
// 576 bytes, as many as the 16 channels' Q8_0 groups.
constexpr int64_t kAvx2I16NarrowBlockBytes = kGroup * kAvx2PanelChannels + kAvx2PanelChannels * 4;

// A row's int16 groups and, per group, dx and dx times the rounded sum.
struct RoundedRows16 {
  std::vector<int16_t> q;   // [rows, k]
  std::vector<float> step;  // [rows, groups, 2]
};

// One row of k inputs to int16 (round to nearest even), a group at a time.
__attribute__((target("avx2,fma"))) inline void round_row_i16_avx2(const float* x, int64_t k, int16_t* q,
                                                                 float* step) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    __m256i r[4];
    round_group_avx2(x + g * kGroup, 32767.f, r, step + 2 * g);
    // packs interleaves the two vectors by 128-bit lane; 0xD8 puts the
    // 64-bit pieces back in order.
    for (int i = 0; i < 2; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * kGroup + 16 * i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2 * i], r[2 * i + 1]), 0xD8));
  }
}

inline RoundedRows16 round_rows_i16(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  RoundedRows16 out{std::vector<int16_t>(rows * k), std::vector<float>(rows * groups * 2)};
  parallel_chunks(rows, 64, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      round_row_i16_avx2(x + r * k, k, out.q.data() + r * k, out.step.data() + r * groups * 2);
  });
  return out;
}

// 8 channels' 32 inputs of one group as int16 (``words[c][h]``: channel c's
// inputs 16h .. 16h + 15, 8 pairs) into vector ``v`` of each pair of a panel
// block: the pairs transposed into the lanes (transpose_8x8_avx2, as
// rows_to_lanes_avx2 does with floats).
__attribute__((target("avx2"))) inline void pairs_to_lanes_avx2(const __m256i (&words)[8][2], int v, uint8_t* block) {
  for (int h = 0; h < 2; ++h) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_castsi256_ps(words[c][h]);
    transpose_8x8_avx2(a);  // a[i]: pair 8h + i of the 8 channels
    for (int i = 0; i < 8; ++i)
      _mm256_storeu_ps(reinterpret_cast<float*>(block + ((8 * h + i) * kAvx2PanelVectors + v) * 32), a[i]);
  }
}

// Block b of 8 channels (``live`` of them; the rest zeros) of 4-bit rows
// (``rows``: the first channel's, ``row_bytes`` apart) into vector ``v`` of a
// panel block, with their d and m: the nibbles widened to int16.
__attribute__((target("avx2,fma,f16c"))) inline void avx2_decode_q4_i16(const uint8_t* rows, int64_t row_bytes,
                                                                      int64_t live, int64_t b, int v,
                                                                      uint8_t* block) {
  const __m128i low = _mm_set1_epi8(0x0F);
  float* d = reinterpret_cast<float*>(block + kGroup * kAvx2PanelChannels * 2) + 8 * v;
  float* m = d + kAvx2PanelChannels;
  __m256i words[8][2];
  for (int c = 0; c < 8; ++c) {
    if (c < live) {
      const uint8_t* p = rows + c * row_bytes + b * kBlockBytes;
      const __m128 dm = block_dm(p);
      d[c] = _mm_cvtss_f32(dm);
      m[c] = _mm_cvtss_f32(_mm_movehdup_ps(dm));
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
      words[c][0] = _mm256_cvtepu8_epi16(_mm_and_si128(qs, low));
      words[c][1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(qs, 4), low));
    } else {
      d[c] = m[c] = 0.f;
      words[c][0] = words[c][1] = _mm256_setzero_si256();
    }
  }
  pairs_to_lanes_avx2(words, v, block);
}

// Group b of 8 Q8_0 channels (``live`` of them; the rest zeros: ``rows``
// the first one's k int8 values, ``k`` apart, ``scale`` its [groups] steps,
// the next channels' after) into vector ``v`` of a panel block: the values
// (-128 to 127) widened to int16, d the group's step, and no m.
__attribute__((target("avx2,fma,f16c"))) inline void avx2_decode_q8_i16(const int8_t* rows, int64_t k,
                                                                      const float* scale, int64_t live, int64_t b,
                                                                      int v, uint8_t* block) {
  const int64_t groups = k / kGroup;
  float* d = reinterpret_cast<float*>(block + kGroup * kAvx2PanelChannels * 2) + 8 * v;
  __m256i words[8][2];
  for (int c = 0; c < 8; ++c) {
    if (c < live) {
      const int8_t* q = rows + c * k + b * kGroup;
      d[c] = scale[c * groups + b];
      words[c][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      words[c][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    } else {
      d[c] = 0.f;
      words[c][0] = words[c][1] = _mm256_setzero_si256();
    }
  }
  pairs_to_lanes_avx2(words, v, block);
}

// Rows [r0, r0 + R) of the rounded activations against one panel: y's
// channels [n, n + channels) (``y`` points at channel n of row r0);
// ``Offset``: the panel's weights have an m (add_scaled_block_avx2).
// ``Narrow``: the panel is a Q8_0 lanes panel as it lies in memory
// (q8_lanes_avx2.h: int8 pairs, widened here, and each block fetches the
// one kAvx2I16Ahead blocks on), not one staged here in int16.
template <int R, bool Offset, bool Narrow = false>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_i16(const RoundedRows16& xq, int64_t r0, int64_t k,
                                                          const uint8_t* panel, int64_t groups, float* y,
                                                          int64_t ldy, int64_t channels) {
  constexpr int V = kAvx2PanelVectors;
  constexpr int64_t block_bytes = Narrow ? kAvx2I16NarrowBlockBytes : kAvx2I16BlockBytes;
  constexpr int64_t weight_bytes = kGroup * kAvx2PanelChannels * (Narrow ? 1 : 2);
  const int16_t* qx = xq.q.data() + r0 * k;
  const float* step = xq.step.data() + r0 * groups * 2;
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < groups; ++b) {
    const uint8_t* block = panel + b * block_bytes;
    // Near the last panel this points past the weights, as a prefetch may (it never faults).
    [[maybe_unused]] const char* ahead = reinterpret_cast<const char*>(block + kAvx2I16Ahead * block_bytes);
    const float* d = reinterpret_cast<const float*>(block + weight_bytes);  // d, then m
    __m256i dot[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) dot[r][v] = _mm256_setzero_si256();
    for (int64_t p = 0; p < kAvx2I16Pairs; ++p) {
      if constexpr (Narrow) {  // the block's 9 lines, one every other pair: the values', then the steps'
        if (p % 2 == 0) _mm_prefetch(ahead + 32 * p, _MM_HINT_T1);
        else if (p == 1) _mm_prefetch(ahead + weight_bytes, _MM_HINT_T1);
      }
      __m256i wv[V];
      for (int v = 0; v < V; ++v) {
        if constexpr (Narrow)
          wv[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + p * 32 + 16 * v)));
        else
          wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (p * V + v) * 32));
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, qx + r * k + b * kGroup + 2 * p, 4);
        const __m256i xv = _mm256_set1_epi32(pair);
        for (int v = 0; v < V; ++v) {
          // In assembly so the sum is added in place: with the intrinsics
          // and tile_avx2_int8's barrier, GCC added each product into a
          // fresh register and copied it back (a third more instructions).
          __m256i product;
          asm("vpmaddwd %[x], %[w], %[p]\n\tvpaddd %[p], %[d], %[d]"
              : [d] "+x"(dot[r][v]), [p] "=&x"(product)
              : [w] "x"(wv[v]), [x] "x"(xv));
        }
      }
    }
    add_scaled_block_avx2<R, Offset>(dot, d, step, groups, b, acc);
  }
  store_tile_avx2<R>(acc, y, ldy, channels);
}

// y[rows, out] = x[rows, k] @ W.T for W in 4-bit blocks [out, k / 32, 20], on
// activations rounded to int16 per group (panels_avx2).
inline void q4_matmul_avx2_i16(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y) {
  const int64_t groups = k / kGroup, row_bytes = groups * kBlockBytes;
  const RoundedRows16 xq = round_rows_i16(x, rows, k);
  panels_avx2<kAvx2I16TileRows>(
      rows, k, w, row_bytes, out, 2, kAvx2I16BlockBytes,
      [&](const uint8_t* panel, int64_t, int64_t live, int64_t b, int v, uint8_t* block) {
        avx2_decode_q4_i16(panel + 8 * v * row_bytes, row_bytes, live, b, v, block);
      },
      [&](auto r_tag, int64_t r0, int64_t n, int64_t channels, const uint8_t* panel) {
        tile_avx2_i16<decltype(r_tag)::value, true>(xq, r0, k, panel, groups, y + r0 * out + n, out, channels);
      });
}

// y[rows, out] = x[rows, k] @ (q * scale per group of 32).T for int8 q
// [out, k] and float32 scale [out, k / 32] (GGUF's Q8_0), on activations
// rounded to int16 per group: a decode step's LM head on kAvx2Int8. The row
// kernel (q8g_rows_avx2_i16, rows_avx2.h, below kPanelFromRows rows) reads
// the whole table once for every 4 rows, and a table of 30 MB (the default
// model's) does not stay in the caches: at 32 rows that was 8 passes over
// memory a step. A panel's 16 channels are read once for all the rows.
inline void q8g_matmul_avx2_i16(const float* x, int64_t rows, int64_t k, const int8_t* w, const float* scale,
                                int64_t out, float* y) {
  const int64_t groups = k / kGroup;
  const RoundedRows16 xq = round_rows_i16(x, rows, k);
  panels_avx2<kAvx2I16TileRows>(
      rows, k, reinterpret_cast<const uint8_t*>(w), k, out, 2, kAvx2I16BlockBytes,
      [&](const uint8_t* panel, int64_t n, int64_t live, int64_t b, int v, uint8_t* block) {
        avx2_decode_q8_i16(reinterpret_cast<const int8_t*>(panel + 8 * v * k), k, scale + n * groups, live, b, v, block);
      },
      [&](auto r_tag, int64_t r0, int64_t n, int64_t channels, const uint8_t* panel) {
        tile_avx2_i16<decltype(r_tag)::value, false>(xq, r0, k, panel, groups, y + r0 * out + n, out, channels);
      });
}

}  // namespace trioserve_native
