// The many-row form of the native linears (kernels.h): a panel of a few
// output channels is dequantized once into a float32 scratch, then every
// input row runs against it, a tile of rows by channels at a time.
//
// Why: the row kernels decode each weight again for every 8 rows (4 on
// AVX2), and each activation they load feeds one channel's FMA, so at 32
// rows they spend more time in the load ports and the decode than in the
// products. Here a weight is decoded once a call, and a tile of kTileRows x
// kTileChannels accumulators reuses every loaded vector four times or more,
// which is what lets 32 decode streams run near the float GEMM's speed
// without keeping a float copy of the weights (docs/benchmarks.md).
//
// The sums run in a different order than the row kernels' (whole rows, then
// one reduction), so a row's result may differ in the last bits with the
// number of rows it is batched with, as with any GEMM.

#pragma once

#include <algorithm>
#include <vector>

namespace trioserve_native {

// A panel is one tile wide: its channels are decoded just before use, and
// stay in L1 while all the rows pass (4 x 1536 float32 = 24 KiB at most for
// the models we run; larger inputs spill to L2, still far cheaper than
// decoding again).
constexpr int kTileChannels = 4;
constexpr int kTileRows = 6;  // 24 accumulators of 32 registers
// From this many rows a call runs here: at 8 the row kernel still serves
// all rows in one pass and measured faster; from 10 the panels win (by 1.2x
// at 12 rows, 1.5x at 16 on the 30 layers of the default model, one
// thread). AVX2, with half the registers, fits a tile of 2 x 4, and that
// measured no faster than its row kernel at any row count, so it has none.
constexpr int64_t kPanelFromRows = 10;

// ---- decoding one channel into float32 -------------------------------------

__attribute__((target("avx512f,avx512bw,f16c"))) inline void q4_decode_avx512(const uint8_t* row, int64_t groups,
                                                                        float* dst) {
  for (int64_t g = 0; g < groups; ++g) {
    const Block512 b = q4_block_avx512(row + g * kBlockBytes);
    _mm512_storeu_ps(dst + g * kGroup, b.lo);
    _mm512_storeu_ps(dst + g * kGroup + 16, b.hi);
  }
}

// int8 times one scale a run of ``step`` values (the channel's, or a group's).
__attribute__((target("avx512f,avx512bw,f16c"))) inline void q8_decode_avx512(const int8_t* q, const float* scale,
                                                                        int64_t k, int64_t step, float* dst) {
  const int64_t body = k - k % 16;
  for (int64_t j = 0; j < body; j += 16) {
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)));
    _mm512_storeu_ps(dst + j, _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(scale[j / step])));
  }
  for (int64_t j = body; j < k; ++j) dst[j] = float(q[j]) * scale[j / step];
}

// ---- a tile: R rows by kTileChannels decoded channels ----------------------

template <int R>
__attribute__((target("avx512f,avx512bw,f16c"))) void tile_avx512(const float* x, int64_t ldx, const float* w, int64_t k,
                                                             float* y, int64_t ldy, int64_t channels) {
  constexpr int C = kTileChannels;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t body = k - k % 16;
  for (int64_t j = 0; j < body; j += 16) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w + c * k + j);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + j);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (body < k) {  // the same step, masked to the inputs left
    const __mmask16 mask = __mmask16((1u << (k - body)) - 1);
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_maskz_loadu_ps(mask, w + c * k + body);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * ldx + body);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  static_assert(C == 4, "the reduction below sums four channels at once");
  for (int r = 0; r < R; ++r) {
    // Four accumulators to four sums in one tree: pairs within each 128-bit
    // lane, then the lanes (a quarter of four separate reductions' work).
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][0], acc[r][1]), _mm512_unpackhi_ps(acc[r][0], acc[r][1]));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[r][2], acc[r][3]), _mm512_unpackhi_ps(acc[r][2], acc[r][3]));
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    if (channels == C) {
      _mm_storeu_ps(y + r * ldy, sums);
    } else {
      float lanes[C];
      _mm_storeu_ps(lanes, sums);
      for (int c = 0; c < channels; ++c) y[r * ldy + c] = lanes[c];
    }
  }
}

// ---- the matmul --------------------------------------------------------------

// y[rows, out] = x[rows, k] @ W.T, where ``decode(n, dst)`` writes channel
// n's k float32 weights to dst (AVX-512 only: see kPanelFromRows). Output channels are split across torch's
// threads; each thread decodes its panels into its own scratch.
template <typename Decode>
inline void panel_matmul(const float* x, int64_t rows, int64_t k, int64_t out, float* y, const Decode& decode) {
  at::parallel_for(0, out, 16, [&](int64_t n0, int64_t n1) {
    // Channels past the task's last are zeros: a short panel runs the same tile.
    std::vector<float> panel(kTileChannels * k, 0.f);
    for (int64_t n = n0; n < n1; n += kTileChannels) {
      const int64_t channels = std::min<int64_t>(kTileChannels, n1 - n);
      for (int64_t c = 0; c < channels; ++c) decode(n + c, panel.data() + c * k);
      if (channels < kTileChannels) std::fill(panel.begin() + channels * k, panel.end(), 0.f);
      for (int64_t r0 = 0; r0 < rows;) {
        const int64_t left = std::min<int64_t>(kTileRows, rows - r0);
        const float* xr = x + r0 * k;
        float* yr = y + r0 * out + n;
        switch (left) {
          case 6: tile_avx512<6>(xr, k, panel.data(), k, yr, out, channels); break;
          case 5: tile_avx512<5>(xr, k, panel.data(), k, yr, out, channels); break;
          case 4: tile_avx512<4>(xr, k, panel.data(), k, yr, out, channels); break;
          case 3: tile_avx512<3>(xr, k, panel.data(), k, yr, out, channels); break;
          case 2: tile_avx512<2>(xr, k, panel.data(), k, yr, out, channels); break;
          default: tile_avx512<1>(xr, k, panel.data(), k, yr, out, channels); break;
        }
        r0 += left;
      }
    }
  });
}

}  // namespace trioserve_native
