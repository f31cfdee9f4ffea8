// avx512vnni's weights in groups of 32 stored with their channels in the
// lanes: the 4-bit lanes blocks of lanes_avx2.h and the Q8_0 lanes blocks of
// q8_lanes_avx2.h, byte for byte the layouts avx2int8 holds (laid out at
// load: engine/kernels/int4_native.py, to_lanes; engine/kernels/q8_lanes.py),
// read here as they lie by one zmm kernel at every row count.
//
// Why: with GGUF's layout the row kernels of rows_vnni.h read 16 channels'
// blocks at once from 16 rows a row's bytes apart (16 strided streams, the
// 20-byte blocks straddling cache lines), gather d and m, and add each
// channel's VPDPBUSD sums across its lanes; from memory they read 11.5 GB/s
// on one Zen 4 thread where a float sum reads 25.7, while the same kernel
// over a matrix in cache reads 22: starved, not compute-bound. The panels
// of panel_vnni.h copy and transpose every weight into the lanes at every
// call. In lanes blocks a panel's 16 channels lie side by side: one zmm load
// is 16 channels x 4 bytes, each channel's dot stays in its own 32-bit lane
// (VPDPBUSD against a row's 4 inputs broadcast), d and m are one 256-bit
// load each, and a thread reads one contiguous stream (docs/benchmarks.md,
// "Lanes blocks on AVX-512 VNNI").
//
// 4-bit lanes blocks (320 bytes a panel and group): for q = 0..3, 64 bytes
// whose 32-bit lane c is channel c's nibble bytes 4q..4q+3 (the two 32-byte
// vectors of avx2int8 are the two halves of one zmm): low nibbles inputs
// 4q..4q+3, high ones 16 + 4q..; then 16 float16 d, then 16 float16 m.
//
// Q8_0 lanes blocks (576 bytes): for each pair p of inputs 32 bytes, channel
// c's values 2p and 2p + 1 at bytes 2c and 2c + 1; then 16 float32 steps.
// That is avx2int8's layout (VPMOVSXBW widens 8 channels' pairs); here one
// VPERMW a 64 bytes puts pairs p and p + 1 of a channel side by side, its 4
// inputs in its 32-bit lane. One layout for both ISAs keeps one Q8Lanes,
// one embedding lookup (q8g_lanes_rows) and one rule of loading; the
// permute is shared by the rows of a tile and, at one row, costs far less
// than the bytes' time from memory.
//
// The int8 weights are signed and meet the activations shifted to unsigned
// (q + 128, as rows_vnni.h and panel_vnni.h take them): each block's dot
// starts at -128 times the channel's sum of the block's weights, summed here
// per block (VPDPBUSD of ones) as the other kernels do. Precomputing it
// would add 64 bytes to every 576-byte block (11% more bytes read, in a
// kernel bound by them) or change the layout avx2int8 shares; weights
// shifted to unsigned against signed activations would need the rows'
// integer sums instead and bytes of their own. The per-block sum is 8
// instructions a block, shared by the tile's rows.
//
// Bits: a block's dot is an exact int32 however it is summed, and the float
// operations after it are vnni_tile's, in its order, per channel: the dot
// times the row's step, times d added to the sum, then (4-bit) m times the
// row's rounded sum. So a row's result is what rows_vnni.h and panel_vnni.h
// give over GGUF's layout, whatever rows run with it.
//
// A prompt's rows outside batch-invariant mode run on avx512bf16 (float32
// activations: int4_native.call_isa, int8_native): its bfloat16 panels of
// panel.h decode each channel from the lanes, and below kPanelFromRows a
// Q8_0 matrix's float32 row kernel (rows.h) runs over each panel unpacked.

#pragma once

#include <algorithm>

namespace trioserve_native {

static_assert(kLanesBlockBytes == kLanesChannels * kBlockBytes && kLanesChannels == 16, "one zmm of channels");
// Each block fetches the block this many bytes on: a thread reads its panels
// one after another (as lanes_avx2.h's kLanesAhead).
constexpr int64_t kVnniLanesAheadBytes = 8 * kLanesBlockBytes;
constexpr int kVnniLanesTileRows = 6;  // the panels' tiles: 2 panels x 6 rows, 24 int32 + 12 float32 sums
constexpr int64_t kVnniLanesPanels = 2;  // lanes panels a tile from kVnniRowsMax + 1 rows

enum class LanesWeights { kQ4, kQ8 };

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

// Rows [0, R) of the rounded activations (``qx``, ``k`` apart; ``step``
// their [R, groups, 2] steps) against C lanes panels (``panel``, ``panel_bytes``
// apart): y's channels [0, 16 C) (``live`` of them stored) from ``y``.
template <int R, int C, LanesWeights kind>
inline void vnni_lanes_tile(const int8_t* qx, const float* step, int64_t k, const uint8_t* panel, int64_t panel_bytes,
                            int64_t groups, float* y, int64_t ldy, int64_t live) {
  constexpr int64_t block_bytes = kind == LanesWeights::kQ4 ? kLanesBlockBytes : kQ8LanesBlockBytes;
  // Two chains of sums where registers allow: VPDPBUSD's latency, not its
  // throughput, bounds one row's 8 a block.
  constexpr int S = R * C <= 4 ? 2 : 1;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i ones = _mm512_set1_epi8(1);
  alignas(64) static constexpr int16_t kQuads[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i quads = _mm512_load_si512(kQuads);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < groups; ++b) {
    const int8_t* xb = qx + b * kGroup;
    __m512i dot[S][R][C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = panel + c * panel_bytes + b * block_bytes;
      // Past the weights' end near the last panel: a prefetch never faults.
      for (int64_t line = 0; line < block_bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block + kVnniLanesAheadBytes + line), _MM_HINT_T0);
    }
    if constexpr (kind == LanesWeights::kQ4) {
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) dot[s][r][c] = _mm512_setzero_si512();
      for (int q = 0; q < 4; ++q) {
        __m512i lo[C], hi[C];
        for (int c = 0; c < C; ++c) {
          const __m512i raw = _mm512_loadu_si512(panel + c * panel_bytes + b * block_bytes + 64 * q);
          lo[c] = _mm512_and_si512(raw, low);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          int32_t four_lo, four_hi;
          std::memcpy(&four_lo, xb + r * k + 4 * q, 4);
          std::memcpy(&four_hi, xb + r * k + 16 + 4 * q, 4);
          const __m512i xl = _mm512_set1_epi32(four_lo), xh = _mm512_set1_epi32(four_hi);
          for (int c = 0; c < C; ++c) {  // the nibbles (unsigned) first
            dot[0][r][c] = _mm512_dpbusd_epi32(dot[0][r][c], lo[c], xl);
            dot[S - 1][r][c] = _mm512_dpbusd_epi32(dot[S - 1][r][c], hi[c], xh);
          }
        }
      }
    } else {
      // Pairs 2i and 2i + 1 of each channel side by side (its lane); the
      // block's sum of weights beside the products, -128 times it added at
      // the end (an exact int32 either way).
      __m512i sum[C];
      for (int c = 0; c < C; ++c) sum[c] = _mm512_setzero_si512();
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) dot[s][r][c] = _mm512_setzero_si512();
      for (int i = 0; i < kGroup / 4; ++i) {
        __m512i wv[C];
        for (int c = 0; c < C; ++c) {
          wv[c] = _mm512_permutexvar_epi16(quads, _mm512_loadu_si512(panel + c * panel_bytes + b * block_bytes + 64 * i));
          sum[c] = _mm512_dpbusd_epi32(sum[c], ones, wv[c]);
        }
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xb + r * k + 4 * i, 4);
          const __m512i xv = _mm512_set1_epi32(four);
          for (int c = 0; c < C; ++c)  // the shifted activations (unsigned) first
            dot[i % S][r][c] = _mm512_dpbusd_epi32(dot[i % S][r][c], xv, wv[c]);
        }
      }
      for (int c = 0; c < C; ++c) {
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum[c], 7));
        for (int r = 0; r < R; ++r) dot[0][r][c] = _mm512_add_epi32(dot[0][r][c], start);
      }
    }
    for (int c = 0; c < C; ++c) {
      const uint8_t* words = panel + c * panel_bytes + b * block_bytes + (kind == LanesWeights::kQ4 ? kLanesNibbleBytes : kQ8LanesValueBytes);
      const __m512 d = kind == LanesWeights::kQ4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words)))
                                                 : _mm512_loadu_ps(words);
      for (int r = 0; r < R; ++r) {
        const __m512i total = S > 1 ? _mm512_add_epi32(dot[0][r][c], dot[S - 1][r][c]) : dot[0][r][c];
        const __m512 dx = _mm512_set1_ps(step[(r * groups + b) * 2]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(total), dx), d, acc[r][c]);  // as vnni_tile
        if constexpr (kind == LanesWeights::kQ4) {
          const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 2 * kLanesChannels)));
          acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(step[(r * groups + b) * 2 + 1]), acc[r][c]);
        }
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

// y[rows, out] = x[rows, k] @ W.T on int8 activations for W in lanes
// blocks (``kind``'s, [out / 16, k / 32, block bytes]): up to kVnniRowsMax
// rows one panel and all rows a pass, each thread one contiguous run of
// panels (as over_vnni_rows: the prefetchers stream it best); more rows in
// tiles of kVnniLanesTileRows against kVnniLanesPanels panels, in blocks of
// rows that stay in L2 (as vnni_panel_matmul, less its staging).
template <LanesWeights kind>
inline void vnni_lanes_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y) {
  if (rows == 0) return;
  const int64_t groups = k / kGroup, panels = out / kLanesChannels;
  const int64_t panel_bytes = groups * (kind == LanesWeights::kQ4 ? kLanesBlockBytes : kQ8LanesBlockBytes);
  const QuantizedRows xq = quantize_rows_q8(x, rows, k, kind == LanesWeights::kQ8 ? 0x80 : 0);
  const auto tile = [&](auto r_tag, auto c_tag, int64_t r0, int64_t p) {
    constexpr int R = decltype(r_tag)::value, C = decltype(c_tag)::value;
    vnni_lanes_tile<R, C, kind>(xq.q.data() + r0 * k, xq.step.data() + r0 * groups * 2, k, w + p * panel_bytes,
                                panel_bytes, groups, y + r0 * out + p * kLanesChannels, out, C * kLanesChannels);
  };
  if (rows <= kVnniRowsMax) {
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        with_count<kVnniRowsMax>(rows, [&](auto r_tag) { tile(r_tag, std::integral_constant<int, 1>{}, 0, p); });
    });
    return;
  }
  const int64_t block_rows = std::max<int64_t>(kVnniLanesTileRows, kRowBlockBytes / k / kVnniLanesTileRows * kVnniLanesTileRows);
  over_blocks_and_panels(rows, block_rows, out, kVnniLanesPanels * kLanesChannels, [&](int64_t b0, int64_t block,
                                                                                      int64_t n, int64_t channels) {
    over_tiles<kVnniLanesTileRows>(block, [&](auto r_tag, int64_t r0) {
      if (channels == kVnniLanesPanels * kLanesChannels) tile(r_tag, std::integral_constant<int, 2>{}, b0 + r0, n / kLanesChannels);
      else tile(r_tag, std::integral_constant<int, 1>{}, b0 + r0, n / kLanesChannels);
    });
  });
}

// Channel ``c`` of a 4-bit lanes panel (``panel``: its first block) as
// GGUF's 20-byte blocks (``groups`` of them at ``blocks``).
inline void q4_lanes_channel(const uint8_t* panel, int64_t groups, int64_t c, uint8_t* blocks) {
  for (int64_t b = 0; b < groups; ++b) {
    const uint8_t* block = panel + b * kLanesBlockBytes;
    uint8_t* p = blocks + b * kBlockBytes;
    std::memcpy(p, block + kLanesNibbleBytes + 2 * c, 2);
    std::memcpy(p + 2, block + kLanesNibbleBytes + 2 * kLanesChannels + 2 * c, 2);
    for (int q = 0; q < 4; ++q) std::memcpy(p + 4 + 4 * q, block + 64 * q + 4 * c, 4);
  }
}

// Channel ``c`` of a Q8_0 lanes panel as its k int8 values and k / 32 steps.
inline void q8_lanes_channel(const uint8_t* panel, int64_t groups, int64_t c, int8_t* q, float* scale) {
  for (int64_t b = 0; b < groups; ++b) {
    const uint8_t* block = panel + b * kQ8LanesBlockBytes;
    for (int64_t p = 0; p < kGroup / 2; ++p) std::memcpy(q + b * kGroup + 2 * p, block + p * 2 * kLanesChannels + 2 * c, 2);
    std::memcpy(scale + b, block + kQ8LanesValueBytes + 4 * c, 4);
  }
}

// 4-bit lanes blocks on kAvx512Vnni (int8 activations, any row count) or,
// from kPanelFromRows rows, on kAvx512Bf16's bfloat16 panels (a prompt's
// rows: int4_native.call_isa), each channel decoded from the lanes.
inline void q4_lanes_matmul_vnni(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y,
                                 int64_t isa) {
  if (isa == kAvx512Vnni) return vnni_lanes_matmul<LanesWeights::kQ4>(x, rows, k, w, out, y);
  TORCH_CHECK(isa >= kAvx512 && rows >= kPanelFromRows, "trioserve native linear: 4-bit lanes blocks run on isa ",
              int64_t(kAvx512Vnni), " (avx512vnni), or its panels from ", kPanelFromRows, " rows; not isa ", isa,
              " at ", rows, " rows");
  const int64_t groups = k / kGroup, panel_bytes = groups * kLanesBlockBytes;
  const auto channel = [&](int64_t n) {
    uint8_t* blocks = thread_scratch(kScratchLanes, groups * kBlockBytes);
    q4_lanes_channel(w + n / kLanesChannels * panel_bytes, groups, n % kLanesChannels, blocks);
    return blocks;
  };
  panel_matmul(
      x, rows, k, out, y, isa, [&](int64_t n, float* dst) { avx512_isa::q4_decode(channel(n), groups, dst); },
      [&](int64_t n, uint16_t* dst) { q4_decode_bf16_avx512(channel(n), groups, dst); });
}

// Q8_0 lanes blocks on kAvx512Vnni (int8 activations, any row count), or
// on float32 activations as kAvx512Bf16 and kAvx512 run GGUF's groups (a
// prompt's rows: int8_native): the bfloat16 (or float32) panels from
// kPanelFromRows rows, each channel decoded from the lanes; below them the
// float32 row kernel over each panel unpacked, the same bits as over the
// groups.
inline void q8g_lanes_matmul_vnni(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y,
                                  int64_t isa) {
  if (isa == kAvx512Vnni) return vnni_lanes_matmul<LanesWeights::kQ8>(x, rows, k, w, out, y);
  TORCH_CHECK(isa >= kAvx512, "trioserve native linear: Q8_0 lanes blocks run on isa ", int64_t(kAvx2Int8),
              " (avx2int8) or from isa ", int64_t(kAvx512), " (avx512); not isa ", isa);
  const int64_t groups = k / kGroup, panel_bytes = groups * kQ8LanesBlockBytes;
  if (rows >= kPanelFromRows) {
    const auto channel = [&](int64_t n, int8_t*& q, float*& scale) {
      uint8_t* scratch = thread_scratch(kScratchLanes, k + groups * 4);
      q = reinterpret_cast<int8_t*>(scratch);
      scale = reinterpret_cast<float*>(scratch + k);
      q8_lanes_channel(w + n / kLanesChannels * panel_bytes, groups, n % kLanesChannels, q, scale);
    };
    panel_matmul(
        x, rows, k, out, y, isa,
        [&](int64_t n, float* dst) {
          int8_t* q;
          float* scale;
          channel(n, q, scale);
          avx512_isa::q8_decode(q, scale, k, kGroup, dst);
        },
        [&](int64_t n, uint16_t* dst) {
          int8_t* q;
          float* scale;
          channel(n, q, scale);
          q8_decode_bf16_avx512(q, scale, k, kGroup, dst, bf16_padded(k));
        });
    return;
  }
  at::parallel_for(0, out / kLanesChannels, 1, [&](int64_t p0, int64_t p1) {
    uint8_t* scratch = thread_scratch(kScratchLanes, kLanesChannels * (k + groups * 4));
    int8_t* q = reinterpret_cast<int8_t*>(scratch);
    float* scale = reinterpret_cast<float*>(scratch + kLanesChannels * k);
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t c = 0; c < kLanesChannels; ++c)
        q8_lanes_channel(w + p * panel_bytes, groups, c, q + c * k, scale + c * groups);
      for (int64_t r0 = 0; r0 < rows;) {
        const int64_t left = std::min<int64_t>(kMaxRows, rows - r0);
        with_count<kMaxRows>(left, [&](auto r_tag) {
          avx512_isa::q8g_rows<decltype(r_tag)::value>(x + r0 * k, k, q, scale, k, 0, kLanesChannels,
                                                       y + r0 * out + p * kLanesChannels, out);
        });
        r0 += left;
      }
    }
  });
}

// y[rows, out] = x[rows, k] @ W.T for 4-bit ``blocks`` in either layout
// (lanes blocks on avx2int8's kernels, lanes_avx2.h, or avx512vnni's).
inline void q4_blocks_matmul(const float* x, int64_t rows, int64_t k, const torch::Tensor& blocks, float* y,
                             int64_t isa) {
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  if (!is_lanes(blocks)) q4_matmul(x, rows, k, w, q4_out(blocks), y, isa);
  else if (isa >= kAvx512) q4_lanes_matmul_vnni(x, rows, k, w, q4_out(blocks), y, isa);
  else q4_lanes_matmul(x, rows, k, w, q4_out(blocks), y, isa);
}

// Q8_0 lanes blocks [out / 16, k / 32, 576] on the variant ``isa`` names.
inline void q8g_lanes_by_isa(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y,
                             int64_t isa) {
  if (isa == kAvx2Int8) q8g_lanes_matmul(x, rows, k, w, out, y);
  else q8g_lanes_matmul_vnni(x, rows, k, w, out, y, isa);
}

}  // namespace trioserve_native
