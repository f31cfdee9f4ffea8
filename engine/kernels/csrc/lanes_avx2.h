// avx2int8's 4-bit weights stored with their channels in the lanes ("lanes
// blocks"), laid out so at load (engine/kernels/int4_native.py, to_lanes):
// the kernels of a decode step read them as they lie, at any row count.
//
// Why: with the weights in GGUF's layout (a channel's 32 nibbles a block),
// a block's integer dot of a row and channel lies across the 8 lanes of a
// vector, and the panels' exact arithmetic (a block's dot times d dx, an
// int32 a block) needs it summed across them: the row kernels of
// rows_avx2.h spend about as many instructions on those sums as on the
// products, so a verification of 4 or 5 rows took 2-3x a one-row step, and
// the panels of panel_avx2.h transpose every panel into the lanes again at
// every call (a tenth of a 32-row step). Stored with 8 channels in a
// vector's lanes, a row's 4 inputs are broadcast against them and each
// channel's dot stays in its lane: nothing is summed across lanes and
// nothing is staged, and the nibbles keep their 4 bits (the same 20 bytes
// a channel and block as GGUF's, no extra memory).
//
// A panel is 16 channels (kLanesChannels), its blocks one after another
// (``[out / 16, in / 32, 320]`` bytes); a block holds, for q = 0..3 and
// then the two vectors v of 8 channels, 32 bytes: lane c (4 bytes) is
// channel 8v + c's bytes 4q .. 4q + 3 of its block, whose low nibbles are
// inputs 4q .. 4q + 3 and high nibbles inputs 16 + 4q .. 16 + 4q + 3. Then
// the 16 channels' float16 d, then their 16 m.
//
// The arithmetic is the int8 panels' (panel_avx2.h), in their order after
// each block's exact int32: a row's result has the same bits as there and
// in the row kernels, whatever rows it runs with.

#pragma once

#include <algorithm>

namespace trioserve_native {

constexpr int64_t kLanesChannels = kAvx2PanelChannels;               // channels a panel
constexpr int64_t kLanesBlockBytes = kLanesChannels * kBlockBytes;   // 320: as many bytes as GGUF's blocks
constexpr int64_t kLanesNibbleBytes = kLanesChannels * kGroup / 2;   // 256, then d and m
// Rows a tile: 8 int16 sums, the nibbles, an unpacked vector, a broadcast
// and the mask. Tiles of 6 (12 sums) kept some sums on the stack: the
// default model's 30 layers at 32 rows took 30.0 ms in tiles of 6, 26.4
// in tiles of 4, 27.2 in tiles of 3, the same within noise up to 9 rows.
constexpr int kLanesTileRows = 4;
// Each block fetches the block this many on (its 5 lines): the panels of a
// thread's run lie one after another, and without it the default model's
// 30 layers at one row took 1.1x the time of GGUF's blocks read by
// rows_avx2.h's kernel (which fetch ahead too), at 4 rows 1.5x the time they
// take with it. 4 blocks ahead measured as 8, 16 slower (the AMX Xeon held
// to AVX2, 2 threads, weights from memory).
constexpr int64_t kLanesAhead = 8;

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Rows [0, R) of the rounded activations (``qx``, ``k`` apart; ``step`` their
// [R, groups, 2] steps) against one panel: y's 16 channels from ``y``.
template <int R>
inline void tile_lanes_avx2(const int8_t* qx, const float* step, int64_t k, const uint8_t* panel, int64_t groups,
                            float* y, int64_t ldy) {
  constexpr int V = kAvx2PanelVectors;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < groups; ++b) {
    const uint8_t* block = panel + b * kLanesBlockBytes;
    const int8_t* xb = qx + b * kGroup;
    // Past the weights' end near the last panel: a prefetch never faults.
    for (int64_t line = 0; line < kLanesBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + kLanesAhead * kLanesBlockBytes + line), _MM_HINT_T0);
    __m256i dot[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) dot[r][v] = _mm256_setzero_si256();
    for (int q = 0; q < 4; ++q) {
      for (int v = 0; v < V; ++v) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (q * V + v) * 32));
        // Inputs 4q.. (low nibbles), then 16 + 4q.. (high ones): an
        // integer sum, exact in any order (at most 8 x 2 x 15 x 127).
        for (int half = 0; half < 2; ++half) {
          const __m256i w = _mm256_and_si256(half ? _mm256_srli_epi16(raw, 4) : raw, low);
          for (int r = 0; r < R; ++r) {
            // A row's 4 inputs broadcast, multiplied and added in place, in
            // assembly: from the intrinsics GCC hoisted every broadcast
            // ahead and kept the sums on the stack (as tile_avx2_i16's).
            __m256i product;
            asm("vpbroadcastd %[four], %[p]\n\tvpmaddubsw %[p], %[w], %[p]\n\tvpaddw %[p], %[d], %[d]"
                : [d] "+x"(dot[r][v]), [p] "=&x"(product)
                : [w] "x"(w), [four] "m"(*reinterpret_cast<const int32_t*>(xb + r * k + 16 * half + 4 * q)));
          }
        }
      }
    }
    const __m128i* halves = reinterpret_cast<const __m128i*>(block + kLanesNibbleBytes);
    for (int v = 0; v < V; ++v) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(halves + v));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(halves + V + v));
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(step[(r * groups + b) * 2]);
        const __m256 sx = _mm256_set1_ps(step[(r * groups + b) * 2 + 1]);
        acc[r][v] = add_scaled_dot_avx2<true>(acc[r][v], _mm256_madd_epi16(dot[r][v], ones), d, dx, m, sx);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + r * ldy + 8 * v, acc[r][v]);
}

// Block ``block`` of a panel's 8 channels of vector ``v`` back into GGUF's
// 20-byte blocks (``blocks``: 8 of them), for the kernels that decode those.
inline void lanes_to_blocks(const uint8_t* block, int v, uint8_t* blocks) {
  for (int c = 0; c < 8; ++c) {
    uint8_t* p = blocks + c * kBlockBytes;
    const int64_t channel = 8 * v + c;
    std::memcpy(p, block + kLanesNibbleBytes + 2 * channel, 2);
    std::memcpy(p + 2, block + kLanesNibbleBytes + 2 * kLanesChannels + 2 * channel, 2);
    for (int q = 0; q < 4; ++q) std::memcpy(p + 4 + 4 * q, block + (q * kAvx2PanelVectors + v) * 32 + 4 * c, 4);
  }
}

#pragma GCC pop_options

// ``run(p0, p1)`` over panels [0, panels) of a lanes layout (this one's, or
// q8_lanes_avx2.h's) on torch's threads: for a few rows one contiguous run
// of panels a thread, which the prefetchers stream best (as over_rows); for
// more, chunks taken in turn (parallel_chunks).
template <typename Run>
inline void over_lanes_panels(int64_t panels, int64_t rows, const Run& run) {
  if (rows < kPanelFromRows) at::parallel_for(0, panels, 1, run);
  else parallel_chunks(panels, 1, 1, run);
}

// y[rows, out] = x[rows, k] @ W.T for W in lanes blocks [out / 16, k / 32,
// 320] on AVX2 (AVX-512's: lanes_vnni.h): on kAvx2Int8 at any row count (int8 activations, as its panels),
// on kAvx2 from kPanelFromRows rows (a prompt's: the int16 panels of
// panel_avx2_int16.h, each panel block decoded from the lanes).
inline void q4_lanes_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y,
                            int64_t isa) {
  const int64_t groups = k / kGroup, panel_bytes = groups * kLanesBlockBytes;
  if (isa == kAvx2 && rows >= kPanelFromRows) {
    const RoundedRows16 xq = round_rows_i16(x, rows, k);
    panels_avx2<kAvx2I16TileRows>(
        rows, k, w, groups * kBlockBytes, out, 2, kAvx2I16BlockBytes,
        [&](const uint8_t* panel, int64_t, int64_t, int64_t b, int v, uint8_t* block) {
          uint8_t blocks[8 * kBlockBytes];
          lanes_to_blocks(panel + b * kLanesBlockBytes, v, blocks);
          avx2_decode_q4_i16(blocks, kBlockBytes, 8, 0, v, block);
        },
        [&](auto r_tag, int64_t r0, int64_t n, int64_t channels, const uint8_t* panel) {
          tile_avx2_i16<decltype(r_tag)::value, true>(xq, r0, k, panel, groups, y + r0 * out + n, out, channels);
        });
    return;
  }
  TORCH_CHECK(isa == kAvx2Int8, "trioserve native linear: 4-bit lanes blocks run on isa ", int64_t(kAvx2Int8),
              " (avx2int8), or ", int64_t(kAvx2), " (avx2) from ", kPanelFromRows, " rows; not isa ", isa, " at ",
              rows, " rows");
  const QuantizedRows xq = quantize_rows_q8(x, rows, k, 0, kAvx2Int8);
  const auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      over_tiles<kLanesTileRows>(rows, [&](auto r_tag, int64_t r0) {
        tile_lanes_avx2<decltype(r_tag)::value>(xq.q.data() + r0 * k, xq.step.data() + r0 * groups * 2, k,
                                                w + p * panel_bytes, groups, y + r0 * out + p * kLanesChannels, out);
      });
  };
  over_lanes_panels(out / kLanesChannels, rows, run);
}

// A 4-bit weight tensor in either layout: GGUF's blocks [out, in / 32, 20],
// or lanes blocks [out / 16, in / 32, 320]; the layout is in the shape, so a
// kernel never reads one as the other.
inline bool is_lanes(const torch::Tensor& blocks) { return blocks.size(2) == kLanesBlockBytes; }
inline bool is_q4_blocks(const torch::Tensor& blocks) {
  return blocks.scalar_type() == at::kByte && blocks.dim() == 3 &&
         (blocks.size(2) == kBlockBytes || blocks.size(2) == kLanesBlockBytes);
}
inline int64_t q4_out(const torch::Tensor& blocks) { return blocks.size(0) * (is_lanes(blocks) ? kLanesChannels : 1); }

}  // namespace trioserve_native
