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
// number of rows it is batched with, as with any GEMM. The bfloat16 panels
// below hold 64 channels in the lanes instead; a row's sums there run pair
// after pair of its inputs, the same at any row count from kPanelFromRows.

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
// thread). AVX2, with half the registers, fits a tile of only 2 x 4 here,
// no faster than its row kernel; its panels hold channels in the lanes
// instead (panel_avx2.h), from the same row count.
constexpr int64_t kPanelFromRows = 10;
// The rows of a block (see over_panels): half of a 1 MiB L2. At 2,048 rows
// of the default model's shapes the bfloat16 panels took 19 ms a layer
// with blocks against 26 without.
constexpr int64_t kRowBlockBytes = 512 << 10;

// ---- a tile: R rows by kTileChannels decoded channels ----------------------

// Four channels' accumulators of one row to its four sums, in one tree: pairs
// within each 128-bit lane, then the lanes (a quarter of four separate
// reductions' work).
__attribute__((target("avx512f,avx512bw"))) inline void store_four_sums(const __m512* acc, float* y,
                                                                       int64_t channels) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
  const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  if (channels == kTileChannels) {
    _mm_storeu_ps(y, sums);
  } else {
    float lanes[kTileChannels];
    _mm_storeu_ps(lanes, sums);
    for (int c = 0; c < channels; ++c) y[c] = lanes[c];
  }
}

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
  for (int r = 0; r < R; ++r) store_four_sums(acc[r], y + r * ldy, channels);
}

// ---- bfloat16 panels (AVX-512 BF16) -----------------------------------------
// Where the CPU has AVX512_BF16, the panel is rounded to bfloat16 as it is
// decoded and the rows once a call, and VDPBF16PS runs two products a lane
// an instruction (float32 sums), twice the float32 FMA's, from half the
// bytes. Weights and activations keep 8 bits of mantissa there, far finer
// than the 4-bit weights' own steps (the quality figures in
// docs/benchmarks.md are taken with it); the row kernels below
// kPanelFromRows stay float32. On avx512vnni machines these run a prompt's
// layers (engine/kernels/int4_native.py, call_isa).

constexpr int64_t kBf16Width = 32;  // bfloat16 values a vector

inline int64_t bf16_padded(int64_t k) { return (k + kBf16Width - 1) / kBf16Width * kBf16Width; }

// k float32 values to bfloat16 (round to nearest even), zeros up to kp.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void to_bf16_avx512(const float* src, int64_t k,
                                                                                uint16_t* dst, int64_t kp) {
  for (int64_t j = 0; j < kp; j += kBf16Width) {
    const int64_t lo_n = std::clamp<int64_t>(k - j, 0, 16), hi_n = std::clamp<int64_t>(k - j - 16, 0, 16);
    const __m512 lo = _mm512_maskz_loadu_ps(__mmask16((1u << lo_n) - 1), src + j);
    const __m512 hi = _mm512_maskz_loadu_ps(__mmask16((1u << hi_n) - 1), src + j + 16);
    _mm512_storeu_si512(dst + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Decoding one channel straight to bfloat16 (no float32 round trip).
__attribute__((target("avx512f,avx512bw,avx512bf16,f16c"))) inline void q4_decode_bf16_avx512(const uint8_t* row,
                                                                                        int64_t groups,
                                                                                        uint16_t* dst) {
  for (int64_t g = 0; g < groups; ++g) {
    const Block512 b = q4_block_avx512(row + g * kBlockBytes);
    _mm512_storeu_si512(dst + g * kGroup, (__m512i)_mm512_cvtne2ps_pbh(b.hi, b.lo));
  }
}

// As avx512_isa::q8_decode (rows.h), to bfloat16 with zeros up to kp; ``step`` is k or a
// multiple of 16.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void q8_decode_bf16_avx512(
    const int8_t* q, const float* scale, int64_t k, int64_t step, uint16_t* dst, int64_t kp) {
  for (int64_t j = 0; j < kp; j += kBf16Width) {
    const int64_t lo_n = std::clamp<int64_t>(k - j, 0, 16), hi_n = std::clamp<int64_t>(k - j - 16, 0, 16);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(__mmask16((1u << lo_n) - 1), q + j)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(__mmask16((1u << hi_n) - 1), q + j + 16)));
    const float lo_scale = lo_n ? scale[j / step] : 0.f, hi_scale = hi_n ? scale[(j + 16) / step] : 0.f;
    _mm512_storeu_si512(dst + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, _mm512_set1_ps(hi_scale)),
                                                              _mm512_mul_ps(lo, _mm512_set1_ps(lo_scale))));
  }
}

// The panel holds its channels in the lanes (as panel_vnni.h's do): for each
// pair of inputs p, kBf16Vectors vectors of 16 channels' (w[2p], w[2p + 1]),
// and a row's pair is broadcast against them. Each loaded vector then feeds
// kTileRows products and each broadcast kBf16Vectors, with no reduction
// across lanes at the end. A tile of inputs in the lanes (rows by four
// channels, as tile_avx512) ran VDPBF16PS at 4.1-5.3 G a second on one
// Zen 5 core in a bench of the tile alone, this at 7.8 (docs/benchmarks.md).
constexpr int kBf16Vectors = 4;                         // vectors of 16 channels a tile: 24 accumulators
constexpr int64_t kBf16Channels = 16 * kBf16Vectors;    // channels a panel

template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tile_bf16_avx512(const uint16_t* x, int64_t ldx,
                                                                           const uint16_t* panel, int64_t pairs,
                                                                           float* y, int64_t ldy, int64_t channels) {
  constexpr int V = kBf16Vectors;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[V];
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(panel + (p * V + v) * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const int64_t live = std::clamp<int64_t>(channels - 16 * v, 0, 16);
      if (live) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, __mmask16((1u << live) - 1), acc[r][v]);
    }
}

// 16 channels' bfloat16 rows (``rows``, ``kp`` apart) into vector ``v`` of
// each pair of a panel: a 16 x 16 transpose of 32-bit pairs, 16 pairs at a
// time (``kp`` is a multiple of 32).
__attribute__((target("avx512f,avx512bw"))) inline void bf16_to_lanes(const uint16_t* rows, int64_t kp, int v,
                                                                      uint16_t* panel) {
  constexpr int V = kBf16Vectors;
  for (int64_t p0 = 0; p0 < kp / 2; p0 += 16) {
    __m512i a[16], b[16];
    for (int c = 0; c < 16; ++c) b[c] = _mm512_loadu_si512(rows + c * kp + 2 * p0);
    for (int i = 0; i < 8; ++i) {  // pairs of channels, 32-bit interleaved
      a[2 * i] = _mm512_unpacklo_epi32(b[2 * i], b[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_epi32(b[2 * i], b[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // b[4i + j], lane L: channels 4i..4i+3 of pair 4L + j
      b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
      b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
      b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
      b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {  // the four 128-bit lanes of pair 4L + j side by side
      const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
      const __m512i c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
      const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
      const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
      const __m512i by_lane[4] = {_mm512_shuffle_i32x4(c0, c2, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_i32x4(c1, c3, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_i32x4(c0, c2, _MM_SHUFFLE(3, 1, 3, 1)),
                                  _mm512_shuffle_i32x4(c1, c3, _MM_SHUFFLE(3, 1, 3, 1))};
      for (int lane = 0; lane < 4; ++lane)
        _mm512_storeu_si512(panel + ((p0 + 4 * lane + j) * V + v) * 32, by_lane[lane]);
    }
  }
}

// ---- the matmul --------------------------------------------------------------

// Calls ``tile(R, r0)`` for rows [r0, r0 + R) in tiles of MaxRows.
template <int MaxRows = kTileRows, typename Tile>
inline void over_tiles(int64_t rows, const Tile& tile) {
  for (int64_t r0 = 0; r0 < rows;) {
    const int64_t left = std::min<int64_t>(MaxRows, rows - r0);
    with_count<MaxRows>(left, [&](auto r_tag) { tile(r_tag, r0); });
    r0 += left;
  }
}

// Runs ``f(b0, block, n, channels)`` for rows [b0, b0 + block) against the
// panel of channels [n, n + channels), for every block of ``block_rows``
// rows and panel of ``panel_channels`` channels, over torch's threads
// (parallel_chunks), the panels of a block next to each other. Split so
// rather than by whole panels a thread: the 9 panels of a 576-channel
// matrix of 64-channel panels left one thread a fifth more work than the
// other.
template <typename F>
inline void over_blocks_and_panels(int64_t rows, int64_t block_rows, int64_t out, int64_t panel_channels, const F& f) {
  const int64_t blocks = (rows + block_rows - 1) / block_rows;
  const int64_t panels = (out + panel_channels - 1) / panel_channels;
  parallel_chunks(blocks * panels, 1, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b0 = i / panels * block_rows, n = i % panels * panel_channels;
      f(b0, std::min(block_rows, rows - b0), n, std::min(panel_channels, out - n));
    }
  });
}

// The panel of channels [n, n + channels), ``Lanes`` channels a vector for
// ``Vectors`` vectors: each vector's channels decoded to rows of ``width``
// values in ``stage`` (``decode(n, dst)``), zeros past the last channel
// (lanes never stored, kept finite), then ``to_lanes(stage, v)`` puts them in
// the panel's lanes.
template <typename T, int Lanes, int Vectors, typename Decode, typename ToLanes>
inline void decode_panel(int64_t n, int64_t channels, int64_t width, T* stage, const Decode& decode,
                         const ToLanes& to_lanes) {
  for (int v = 0; v < Vectors; ++v) {
    const int64_t live = std::clamp<int64_t>(channels - Lanes * v, 0, Lanes);
    for (int64_t c = 0; c < live; ++c) decode(n + Lanes * v + c, stage + c * width);
    std::fill(stage + live * width, stage + Lanes * width, T(0));
    to_lanes(stage, v);
  }
}

// Output channels split across torch's threads (parallel_chunks); each thread decodes
// kTileChannels channels at a time (``decode(n, dst)``: channel n's ``width``
// weights as T) into its own panel, and ``tile(R, r0, n, panel, channels)``
// runs rows [r0, r0 + R) against it. A prefill chunk's rows would not stay
// in L2 while each panel runs past them, so they go in blocks that do, each
// panel decoded again per block (a few percent of the products).
template <typename T, typename Decode, typename Tile>
inline void over_panels(int64_t rows, int64_t out, int64_t width, const Decode& decode, const Tile& tile) {
  const int64_t row_bytes = width * int64_t(sizeof(T));
  const int64_t block_rows = std::max<int64_t>(kTileRows, kRowBlockBytes / row_bytes / kTileRows * kTileRows);
  parallel_chunks(out, 16, kTileChannels, [&](int64_t n0, int64_t n1) {
    // Channels past the chunk's last are zeros: a short panel runs the same tile.
    std::vector<T> panel(kTileChannels * width, T(0));
    for (int64_t b0 = 0; b0 < rows; b0 += block_rows) {
      const int64_t block = std::min(block_rows, rows - b0);
      for (int64_t n = n0; n < n1; n += kTileChannels) {
        const int64_t channels = std::min<int64_t>(kTileChannels, n1 - n);
        for (int64_t c = 0; c < channels; ++c) decode(n + c, panel.data() + c * width);
        if (channels < kTileChannels) std::fill(panel.begin() + channels * width, panel.end(), T(0));
        over_tiles(block, [&](auto r_tag, int64_t r0) { tile(r_tag, b0 + r0, n, panel.data(), channels); });
      }
    }
  });
}

// y[rows, out] = x[rows, k] @ W.T, where ``decode(n, dst)`` writes channel
// n's k float32 weights to dst (AVX-512 only: see kPanelFromRows), and
// ``decode_bf16(n, dst)`` its weights in bfloat16 with zeros up to
// bf16_padded(k), used instead where ``isa`` is kAvx512Bf16 or above (the rows are
// then rounded to bfloat16 once, up front; kAvx512Vnni's 4-bit and Q8_0
// weights take panel_vnni.h's panels instead).
template <typename Decode, typename DecodeBf16>
inline void panel_matmul(const float* x, int64_t rows, int64_t k, int64_t out, float* y, int64_t isa,
                         const Decode& decode, const DecodeBf16& decode_bf16) {
  if (isa < kAvx512Bf16) {
    over_panels<float>(rows, out, k, decode, [&](auto r_tag, int64_t r0, int64_t n, const float* panel, int64_t channels) {
      tile_avx512<decltype(r_tag)::value>(x + r0 * k, k, panel, k, y + r0 * out + n, out, channels);
    });
    return;
  }
  const int64_t kp = bf16_padded(k), pairs = kp / 2;
  std::vector<uint16_t> xb(rows * kp);
  parallel_chunks(rows, 1, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) to_bf16_avx512(x + r * k, k, xb.data() + r * kp, kp);
  });
  const int64_t block_rows = std::max<int64_t>(kTileRows, kRowBlockBytes / (kp * 2) / kTileRows * kTileRows);
  over_blocks_and_panels(rows, block_rows, out, kBf16Channels, [&](int64_t b0, int64_t block, int64_t n,
                                                                   int64_t channels) {
    // Each channel decoded to a bfloat16 row, 16 at a time (their rows stay
    // in L1), then into the lanes.
    uint16_t* stage = reinterpret_cast<uint16_t*>(thread_scratch(kScratchStage, 16 * kp * 2));
    uint16_t* panel = reinterpret_cast<uint16_t*>(thread_scratch(kScratchPanel, kBf16Channels * kp * 2));
    decode_panel<uint16_t, 16, kBf16Vectors>(n, channels, kp, stage, decode_bf16,
                                             [&](const uint16_t* rows, int v) { bf16_to_lanes(rows, kp, v, panel); });
    over_tiles(block, [&](auto r_tag, int64_t r0) {
      tile_bf16_avx512<decltype(r_tag)::value>(xb.data() + (b0 + r0) * kp, kp, panel, pairs,
                                               y + (b0 + r0) * out + n, out, channels);
    });
  });
}

}  // namespace trioserve_native
