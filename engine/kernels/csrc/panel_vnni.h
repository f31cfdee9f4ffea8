// The many-row linears on int8 activations (AVX512_VNNI): what the bfloat16
// panels of panel.h do on avx512bf16, with VPDPBUSD products.
//
// Why: in the bfloat16 panels a weight costs a float decode (widen, scale,
// round) and half a product instruction per row, and at 32 decode rows the
// 4-bit layers took 1.6x the time they take here (docs/benchmarks.md). Here
// each row is rounded to int8 in groups of 32 (quantize_rows_q8, as for the
// VNNI row kernel), a panel's weights stay bytes, and one VPDPBUSD
// multiplies 16 channels by 4 inputs of a row, summing in int32 (exact).
//
// The lanes hold channels, not inputs as in the row kernels: a block's 32
// inputs then sum in each lane's int32 over 8 instructions, and the block's
// scales (d per channel times dx per row) are applied once per block to 16
// channels at a time. With inputs in the lanes each block would need its own
// scale per row and channel, as many instructions as products.
//
// A panel is kVnniChannels channels of all blocks. Per block: 8 groups of 4
// inputs, each 16 channels x 4 bytes a vector; then per channel d, and the
// 4-bit m (float32) or, for int8 weights, -128 times the block's sum of
// weights (int32): VPDPBUSD multiplies unsigned by signed bytes, so int8
// weights meet activations shifted to unsigned (q + 128), and the shift's
// share is taken off where the sums start.
//
// The fused decode step (decode.cpp) calls these for decode rows; the
// model's layers, for a prompt, take the bfloat16 panels from 10 rows
// (engine/kernels/int4_native.py, call_isa: int8 activations in a prompt moved
// its first token).
//
// A row's result depends on that row alone (its sums run per row and
// channel, block after block); rows_vnni.h's row kernels, which serve
// calls of few rows, give the same bits.
//
// A matrix of whole panels of 16 channels is held as lanes blocks instead
// (int4_native.lanes_layout, int8_native.in_lanes), already in the lanes:
// lanes_vnni.h's tiles read it with these bits and no staging; these
// panels serve the matrices left in GGUF's layout.

#pragma once

#include <algorithm>
#include <vector>

namespace trioserve_native {

constexpr int kVnniVectors = 2;                       // vectors of 16 channels a tile
constexpr int64_t kVnniChannels = 16 * kVnniVectors;  // channels a panel
constexpr int kVnniTileRows = 6;                      // 12 int32 + 12 float32 accumulators
static_assert(kVnniTileRows == kTileRows, "the tiles run through over_tiles");
constexpr int64_t kVnniQuads = kGroup / 4;            // groups of 4 inputs a block
// Bytes of one block of a panel: the weights, then two words a channel.
constexpr int64_t kVnniBlockBytes = kGroup * kVnniChannels + 2 * kVnniChannels * 4;

enum class VnniWeights { kQ4, kQ8 };

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

// Four vectors of four channels' 16 bytes (a 128-bit lane each, its channel's
// groups 0..3 of 4 bytes) to four vectors of one group of 4 bytes for all 16
// channels, stored ``stride`` bytes apart.
inline void vnni_transpose16(const __m512i* lanes, uint8_t* dst, int64_t stride) {
  const __m512i by_group = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  __m512i p[4];
  for (int i = 0; i < 4; ++i) p[i] = _mm512_permutexvar_epi32(by_group, lanes[i]);  // lane q: group q of 4 channels
  const __m512i t0 = _mm512_shuffle_i32x4(p[0], p[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t1 = _mm512_shuffle_i32x4(p[2], p[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512i t2 = _mm512_shuffle_i32x4(p[0], p[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512i t3 = _mm512_shuffle_i32x4(p[2], p[3], _MM_SHUFFLE(3, 2, 3, 2));
  _mm512_storeu_si512(dst + 0 * stride, _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)));
  _mm512_storeu_si512(dst + 1 * stride, _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
  _mm512_storeu_si512(dst + 2 * stride, _mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(2, 0, 2, 0)));
  _mm512_storeu_si512(dst + 3 * stride, _mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane i: i * stride (a gather's offsets for 16 channels ``stride`` apart).
inline __m512i vnni_lane_offsets(int64_t stride) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(int32_t(stride)));
}

// 16 bytes at ``rows + c * row_bytes`` for each of four channels c0..c0+3
// (zeros past ``channels``), one 128-bit lane each.
inline __m512i vnni_four_rows(const uint8_t* rows, int64_t row_bytes, int c0, int64_t channels) {
  const auto at = [&](int c) {
    return c < channels ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + c * row_bytes)) : _mm_setzero_si128();
  };
  __m512i v = _mm512_castsi128_si512(at(c0));
  v = _mm512_inserti32x4(v, at(c0 + 1), 1);
  v = _mm512_inserti32x4(v, at(c0 + 2), 2);
  return _mm512_inserti32x4(v, at(c0 + 3), 3);
}

// Block b of 16 channels (``live`` of them; the rest zeros) of 4-bit rows
// (``rows``: the first channel's, ``row_bytes`` apart) into one vector's
// place of a panel block, with their d and m.
inline void vnni_decode_q4(const uint8_t* rows, int64_t row_bytes, int64_t live, int64_t b, uint8_t* dst, float* d,
                           float* m) {
  const uint8_t* base = rows + b * kBlockBytes;
  const __mmask16 mask = __mmask16((1u << live) - 1);
  // d and m: a float16 pair at the start of each channel's block.
  const __m512i offsets = vnni_lane_offsets(row_bytes);
  const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offsets, base, 1);
  _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
  _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))));
  // Low nibbles are the block's elements 0..15 (groups 0..3), high 16..31.
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i lo[4], hi[4];
  for (int i = 0; i < 4; ++i) {
    const __m512i v = vnni_four_rows(base + 4, row_bytes, 4 * i, live);
    lo[i] = _mm512_and_si512(v, low);
    hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  const int64_t stride = kVnniChannels * 4;  // bytes of one group of 4 inputs
  vnni_transpose16(lo, dst, stride);
  vnni_transpose16(hi, dst + 4 * stride, stride);
}

// The same for int8 rows in groups of 32 (``rows``: the first channel's k
// bytes, ``k`` apart; ``scale``: its k / 32 scales, then the next channel's);
// the second word is -128 times the block's sum of weights.
inline void vnni_decode_q8(const int8_t* rows, int64_t k, const float* scale, int64_t live, int64_t b, uint8_t* dst,
                           float* d, int32_t* shift) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(rows) + b * kGroup;
  __m512i lo[4], hi[4];
  for (int i = 0; i < 4; ++i) {
    lo[i] = vnni_four_rows(base, k, 4 * i, live);
    hi[i] = vnni_four_rows(base + 16, k, 4 * i, live);
  }
  const int64_t stride = kVnniChannels * 4;
  vnni_transpose16(lo, dst, stride);
  vnni_transpose16(hi, dst + 4 * stride, stride);
  __m512i sum = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t q = 0; q < kVnniQuads; ++q) sum = _mm512_dpbusd_epi32(sum, ones, _mm512_loadu_si512(dst + q * stride));
  _mm512_storeu_si512(shift, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
  for (int c = 0; c < 16; ++c) d[c] = c < live ? scale[c * (k / kGroup) + b] : 0.f;
}

// Rows [r0, r0 + R) of the rounded activations against one panel: y's
// channels [n, n + channels) (``y`` points at channel n of row r0).
template <int R, VnniWeights kind>
inline void vnni_tile(const QuantizedRows& xq, int64_t r0, int64_t k, const uint8_t* panel, int64_t groups, float* y,
                      int64_t ldy, int64_t channels) {
  constexpr int C = kVnniVectors;
  const int8_t* qx = xq.q.data() + r0 * k;
  const float* step = xq.step.data() + r0 * groups * 2;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < groups; ++b) {
    const uint8_t* block = panel + b * kVnniBlockBytes;
    const uint8_t* words = block + kGroup * kVnniChannels;  // d, then m or the shift
    __m512i dot[R][C];
    for (int c = 0; c < C; ++c) {
      const __m512i start = kind == VnniWeights::kQ8 ? _mm512_loadu_si512(words + 4 * (kVnniChannels + 16 * c))
                                                     : _mm512_setzero_si512();
      for (int r = 0; r < R; ++r) dot[r][c] = start;
    }
    for (int64_t q = 0; q < kVnniQuads; ++q) {
      __m512i wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(block + (q * C + c) * 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, qx + r * k + b * kGroup + q * 4, 4);
        const __m512i xv = _mm512_set1_epi32(four);
        for (int c = 0; c < C; ++c)  // the unsigned bytes first: 4-bit weights, or the shifted activations
          dot[r][c] = kind == VnniWeights::kQ4 ? _mm512_dpbusd_epi32(dot[r][c], wv[c], xv)
                                               : _mm512_dpbusd_epi32(dot[r][c], xv, wv[c]);
      }
    }
    const float* d = reinterpret_cast<const float*>(words);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(step[(r * groups + b) * 2]);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][c]), dx), _mm512_loadu_ps(d + 16 * c),
                                    acc[r][c]);
        if constexpr (kind == VnniWeights::kQ4) {  // + m times the row's rounded sum over the block
          const __m512 sx = _mm512_set1_ps(step[(r * groups + b) * 2 + 1]);
          acc[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(d + kVnniChannels + 16 * c), sx, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t live = std::clamp<int64_t>(channels - 16 * c, 0, 16);
      if (live) _mm512_mask_storeu_ps(y + r * ldy + 16 * c, __mmask16((1u << live) - 1), acc[r][c]);
    }
}

#pragma GCC pop_options

// y[rows, out] = x[rows, k] @ W.T on int8 activations, where
// ``decode(n, channels, panel, stage)`` writes the panel of channels
// [n, n + channels) (``stage``: its scratch of ``stage_bytes``). Rows go in
// blocks that stay in L2, as in over_panels.
template <VnniWeights kind, typename Decode>
inline void vnni_panel_matmul(const float* x, int64_t rows, int64_t k, int64_t out, float* y, int64_t stage_bytes,
                              const Decode& decode) {
  const int64_t groups = k / kGroup;
  const QuantizedRows xq = quantize_rows_q8(x, rows, k, kind == VnniWeights::kQ8 ? 0x80 : 0);
  const int64_t block_rows = std::max<int64_t>(kVnniTileRows, kRowBlockBytes / k / kVnniTileRows * kVnniTileRows);
  parallel_chunks(out, kVnniChannels, kVnniChannels, [&](int64_t n0, int64_t n1) {
    uint8_t* panel = thread_scratch(kScratchPanel, groups * kVnniBlockBytes);  // every byte decoded before use
    uint8_t* stage = thread_scratch(kScratchStage, stage_bytes);
    for (int64_t b0 = 0; b0 < rows; b0 += block_rows) {
      const int64_t block = std::min(block_rows, rows - b0);
      for (int64_t n = n0; n < n1; n += kVnniChannels) {
        const int64_t channels = std::min<int64_t>(kVnniChannels, n1 - n);
        decode(n, channels, panel, stage);
        over_tiles(block, [&](auto r_tag, int64_t r0) {
          vnni_tile<decltype(r_tag)::value, kind>(xq, b0 + r0, k, panel, groups, y + (b0 + r0) * out + n, out,
                                                  channels);
        });
      }
    }
  });
}

// The channels' rows of ``w`` (``row_bytes`` each, ``out`` of them) copied to
// ``stage`` (room for kVnniChannels rows; only the channels' are read) first:
// they are one contiguous run, which a copy streams at
// memory speed, while decoding across 16 rows at once as it reads them
// stalled on 16 streams of misses (at 32 rows the decode took longer than the
// products). The next panel's rows are fetched into L2 meanwhile, so that
// its copy finds them there while this panel's tiles run.
inline const uint8_t* vnni_staged(const uint8_t* w, int64_t row_bytes, int64_t out, int64_t n, int64_t channels,
                                  uint8_t* stage) {
  std::memcpy(stage, w + n * row_bytes, channels * row_bytes);
  const uint8_t* next = w + (n + channels) * row_bytes;
  const uint8_t* end = w + std::min(out, n + channels + kVnniChannels) * row_bytes;
  for (; next < end; next += 64) _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
  return stage;
}

// y[rows, out] = x[rows, k] @ W.T for W in 4-bit blocks [out, k / 32, 20].
inline void q4_matmul_vnni(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y) {
  const int64_t groups = k / kGroup, row_bytes = groups * kBlockBytes;
  vnni_panel_matmul<VnniWeights::kQ4>(x, rows, k, out, y, kVnniChannels * row_bytes,
                                      [&](int64_t n, int64_t channels, uint8_t* panel, uint8_t* stage) {
    const uint8_t* rows_of = vnni_staged(w, row_bytes, out, n, channels, stage);
    for (int64_t b = 0; b < groups; ++b) {
      uint8_t* block = panel + b * kVnniBlockBytes;
      float* words = reinterpret_cast<float*>(block + kGroup * kVnniChannels);
      for (int v = 0; v < kVnniVectors; ++v) {
        const int64_t live = std::clamp<int64_t>(channels - 16 * v, 0, 16);
        vnni_decode_q4(rows_of + 16 * v * row_bytes, row_bytes, live, b, block + 64 * v, words + 16 * v,
                       words + kVnniChannels + 16 * v);
      }
    }
  });
}

// y[rows, out] = x[rows, k] @ (q * scale per group of 32).T for int8 q
// [out, k] and float32 scale [out, k / 32] (GGUF's Q8_0).
inline void q8g_matmul_vnni(const float* x, int64_t rows, int64_t k, const int8_t* w, const float* scale, int64_t out,
                            float* y) {
  const int64_t groups = k / kGroup;
  vnni_panel_matmul<VnniWeights::kQ8>(x, rows, k, out, y, kVnniChannels * k,
                                      [&](int64_t n, int64_t channels, uint8_t* panel, uint8_t* stage) {
    const int8_t* rows_of =
        reinterpret_cast<const int8_t*>(vnni_staged(reinterpret_cast<const uint8_t*>(w), k, out, n, channels, stage));
    for (int64_t b = 0; b < groups; ++b) {
      uint8_t* block = panel + b * kVnniBlockBytes;
      float* words = reinterpret_cast<float*>(block + kGroup * kVnniChannels);
      for (int v = 0; v < kVnniVectors; ++v) {
        const int64_t live = std::clamp<int64_t>(channels - 16 * v, 0, 16);
        vnni_decode_q8(rows_of + 16 * v * k, k, scale + (n + 16 * v) * groups, live, b,
                       block + 64 * v, words + 16 * v, reinterpret_cast<int32_t*>(words + kVnniChannels + 16 * v));
      }
    }
  });
}

}  // namespace trioserve_native
