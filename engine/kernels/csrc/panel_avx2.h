// The many-row forms of the native linears on AVX2: float32 panels with
// their channels in the lanes (kAvx2: a prompt's rows, for int8 weights;
// 4-bit ones take the int16 panels of panel_avx2_int16.h), and int8 ones
// for 4-bit weights (kAvx2Int8: a decode step's rows), below.
//
// Why: on AVX2 the row kernels decode every weight again for each 4 rows,
// and a tile of inputs in the lanes fits only 2 rows x 4 channels in 16
// registers (no faster than the rows: panel.h). With 16 channels in the
// lanes of two vectors and one input of a row broadcast against them, 6
// rows take 12 accumulators, every loaded weight vector feeds 6 FMAs and
// every broadcast 2, and nothing is reduced across lanes at the end: the
// shape of the classic float32 GEMM kernels for this register file. A
// prompt's rows then run on the compressed weights without dequantizing
// whole matrices first: over 4-bit blocks (as these ran them before the
// int16 panels), on one Zen 5 held to AVX2, 119-124 G products a second on
// two threads at 128 to 2,048 rows (about the FMA units' peak), against
// 79-101 for torch's GEMM (MKL capped to AVX2) over the dequantized matrices
// (docs/benchmarks.md).
//
// A row's sums run input after input, the same at any row count from
// kPanelFromRows; they differ in the last bits from the row kernels'
// (two partial sums of 8 lanes, then one reduction).

#pragma once

#include <algorithm>

namespace trioserve_native {

constexpr int kAvx2PanelVectors = 2;                      // vectors of 8 channels a panel
constexpr int64_t kAvx2PanelChannels = 8 * kAvx2PanelVectors;
constexpr int kAvx2TileRows = 6;                          // 12 accumulators of 16 registers

// An 8 x 8 transpose of 32-bit words: word i of a[c] to word c of a[i].
__attribute__((target("avx2"))) inline void transpose_8x8_avx2(__m256 (&a)[8]) {
  __m256 b[8];
  for (int i = 0; i < 4; ++i) {
    b[2 * i] = _mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    a[4 * i + 0] = _mm256_shuffle_ps(b[4 * i], b[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    a[4 * i + 1] = _mm256_shuffle_ps(b[4 * i], b[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    a[4 * i + 2] = _mm256_shuffle_ps(b[4 * i + 1], b[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    a[4 * i + 3] = _mm256_shuffle_ps(b[4 * i + 1], b[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // a[i], lane L: words 0..3 (i < 4) or 4..7 of word (i % 4) + 4 * (L / 4)
  for (int i = 0; i < 4; ++i) {
    b[i] = _mm256_permute2f128_ps(a[i], a[4 + i], 0x20);
    b[4 + i] = _mm256_permute2f128_ps(a[i], a[4 + i], 0x31);
  }
  for (int i = 0; i < 8; ++i) a[i] = b[i];
}

// 8 channels' float32 rows (``rows``, ``k`` apart) into vector ``v`` of each
// input of a panel: 8 x 8 transposes; inputs past the last multiple of 8
// one at a time.
__attribute__((target("avx2,fma"))) inline void rows_to_lanes_avx2(const float* rows, int64_t k, int v, float* panel) {
  constexpr int64_t C = kAvx2PanelChannels;
  const int64_t body = k - k % 8;
  for (int64_t j = 0; j < body; j += 8) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(rows + c * k + j);
    transpose_8x8_avx2(a);
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (j + i) * C + 8 * v, a[i]);
  }
  for (int64_t j = body; j < k; ++j)
    for (int c = 0; c < 8; ++c) panel[j * C + 8 * v + c] = rows[c * k + j];
}

// ---- a tile: R rows by one panel ---------------------------------------------

// A tile's R x 2 accumulators to y's rows, masked to the panel's channels (a
// copy through memory made the compiler keep every accumulator on the stack
// in the tile's loop).
template <int R>
__attribute__((target("avx2"))) inline void store_tile_avx2(const __m256 (&acc)[R][kAvx2PanelVectors], float* y,
                                                           int64_t ldy, int64_t channels) {
  static_assert(kAvx2PanelVectors == 2);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i live0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(channels)), lane);
  const __m256i live1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(channels - 8)), lane);
  for (int r = 0; r < R; ++r) {
    _mm256_maskstore_ps(y + r * ldy, live0, acc[r][0]);
    _mm256_maskstore_ps(y + r * ldy + 8, live1, acc[r][1]);
  }
}

template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t ldx, const float* panel, int64_t k, float* y,
                                                  int64_t ldy, int64_t channels) {
  constexpr int V = kAvx2PanelVectors;
  constexpr int64_t C = kAvx2PanelChannels;
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; ++j) {
    __m256 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(panel + j * C + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * ldx + j]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  store_tile_avx2<R>(acc, y, ldy, channels);
}

// ---- the matmul --------------------------------------------------------------

// y[rows, out] = x[rows, k] @ W.T, where ``decode(n, dst)`` writes channel
// n's k float32 weights to dst. The work is split by (row block, panel), as
// panel_matmul's bfloat16 branch: a block's rows stay in L2 while its
// panels pass, each panel decoded once a block.
template <typename Decode>
inline void panel_matmul_avx2(const float* x, int64_t rows, int64_t k, int64_t out, float* y, const Decode& decode) {
  const int64_t block_rows =
      std::max<int64_t>(kAvx2TileRows, kRowBlockBytes / (k * 4) / kAvx2TileRows * kAvx2TileRows);
  over_blocks_and_panels(rows, block_rows, out, kAvx2PanelChannels, [&](int64_t b0, int64_t block, int64_t n,
                                                                        int64_t channels) {
    float* stage = reinterpret_cast<float*>(thread_scratch(kScratchStage, 8 * k * 4));
    float* panel = reinterpret_cast<float*>(thread_scratch(kScratchPanel, kAvx2PanelChannels * k * 4));
    decode_panel<float, 8, kAvx2PanelVectors>(n, channels, k, stage, decode,
                                              [&](const float* rows, int v) { rows_to_lanes_avx2(rows, k, v, panel); });
    over_tiles<kAvx2TileRows>(block, [&](auto r_tag, int64_t r0) {
      tile_avx2<decltype(r_tag)::value>(x + (b0 + r0) * k, k, panel, k, y + (b0 + r0) * out + n, out, channels);
    });
  });
}

// ---- int8 activations (kAvx2Int8): a decode step's rows ----------------------
// panel_vnni.h's arithmetic without VPDPBUSD, for 4-bit weights: a panel
// holds, per block, 8 groups of 4 inputs, each 16 channels x 4 nibble bytes
// in two vectors, then each channel's d and m (float32). VPMADDUBSW
// multiplies a vector by a row's 4 rounded inputs broadcast and adds pairs in
// int16 (at most 2 x 15 x 127); the block's 8 of them add in int16 too (at
// most 30,480, so exact), and one VPMADDWD against ones sums each channel's
// pairs in int32. The scales (d per channel times dx per row, and m times
// the row's rounded sum) are applied once per block to 8 channels at a time.
// In the row kernel (q4_rows_avx2_int8, rows_avx2.h) every block of every
// channel needs a VPMADDWD and a reduction across the lanes per row.
//
// A row's sums run per row and channel, block after block, the same at any
// row count: below kPanelFromRows the row kernel runs the same operations.
// Weights held as lanes blocks (lanes_avx2.h) skip these panels: they are
// in the lanes already.

// 12 int16 sums, 2 weight vectors and a broadcast in the block's loop (the
// float32 accumulators wait in memory between blocks): 1.25-1.35x the tiles
// of 4 rows that spilled their sums at 10 to 64 rows, and as fast as or
// faster than tiles of 4 or 5 once those stopped spilling (one Zen 5, AVX2
// only; docs/benchmarks.md).
constexpr int kAvx2Int8TileRows = 6;
constexpr int64_t kAvx2Quads = kGroup / 4;  // groups of 4 inputs a block
// Bytes of one block of a panel: the nibbles, then d and m for each channel.
constexpr int64_t kAvx2Int8BlockBytes = kGroup * kAvx2PanelChannels + 2 * kAvx2PanelChannels * 4;

// Word w of channel c (``words[c]``, 8 channels) to lane c of group w's
// vector ``v`` in a panel block (groups ``dst`` onwards): a 4 x 4 transpose
// of words in each 128-bit lane, channels c and c + 4 side by side.
__attribute__((target("avx2"))) inline void words_to_lanes_avx2(const __m128i* words, int v, uint8_t* dst) {
  __m256i a[4];
  for (int i = 0; i < 4; ++i) a[i] = _mm256_set_m128i(words[i + 4], words[i]);
  const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  const __m256i groups[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                             _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
  for (int i = 0; i < 4; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (i * kAvx2PanelVectors + v) * 32), groups[i]);
}

// Block b of 8 channels (``live`` of them; the rest zeros) of 4-bit rows
// (``rows``: the first channel's, ``row_bytes`` apart) into vector ``v`` of a
// panel block, with their d and m.
__attribute__((target("avx2,fma,f16c"))) inline void avx2_decode_q4_int8(const uint8_t* rows, int64_t row_bytes,
                                                                       int64_t live, int64_t b, int v,
                                                                       uint8_t* block) {
  const __m128i low = _mm_set1_epi8(0x0F);
  float* d = reinterpret_cast<float*>(block + kGroup * kAvx2PanelChannels) + 8 * v;
  float* m = d + kAvx2PanelChannels;
  __m128i lo[8], hi[8];  // a channel's 4 words: groups 0..3 (low nibbles), 4..7 (high ones)
  for (int c = 0; c < 8; ++c) {
    if (c < live) {
      const uint8_t* p = rows + c * row_bytes + b * kBlockBytes;
      const __m128 dm = block_dm(p);
      d[c] = _mm_cvtss_f32(dm);
      m[c] = _mm_cvtss_f32(_mm_movehdup_ps(dm));
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
      lo[c] = _mm_and_si128(qs, low);
      hi[c] = _mm_and_si128(_mm_srli_epi16(qs, 4), low);
    } else {
      d[c] = m[c] = 0.f;
      lo[c] = hi[c] = _mm_setzero_si128();
    }
  }
  words_to_lanes_avx2(lo, v, block);
  words_to_lanes_avx2(hi, v, block + 4 * kAvx2PanelVectors * 32);
}

// One block's exact int32 dots ``dot`` (8 lanes: channels, or a row
// kernel's rows x channels) into ``acc``: the dot times d dx, then, with
// ``Offset``, m times the row's step times its rounded sum (``sx``). Every
// avx2int8 kernel of weights in groups of 32 (these panels, the row
// kernels of rows_avx2.h, the lanes kernel of lanes_avx2.h) applies its
// scales through this, so a row's bits are the same whichever runs it.
template <bool Offset>
__attribute__((target("avx2,fma"))) inline __m256 add_scaled_dot_avx2(__m256 acc, __m256i dot, __m256 d, __m256 dx,
                                                                     __m256 m, __m256 sx) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, dx), acc);
  if constexpr (Offset) acc = _mm256_fmadd_ps(m, sx, acc);
  return acc;
}

// A block's exact int32 sums of R rows by a panel's 16 channels into the
// float32 accumulators (add_scaled_dot_avx2): d (``dm``: the block's d,
// then its m, per channel) times each row's step dx, plus (``Offset``: the
// weights have an m, as 4-bit blocks do and Q8_0 ones do not) m times the
// row's rounded sum (``step``: the rows' dx and rounded sums, [rows,
// groups, 2] from row r0).
template <int R, bool Offset = true>
__attribute__((target("avx2,fma"))) inline void add_scaled_block_avx2(const __m256i (&sums)[R][kAvx2PanelVectors],
                                                                    const float* dm, const float* step,
                                                                    int64_t groups, int64_t b,
                                                                    __m256 (&acc)[R][kAvx2PanelVectors]) {
  for (int r = 0; r < R; ++r) {
    const __m256 dx = _mm256_set1_ps(step[(r * groups + b) * 2]);
    const __m256 sx = _mm256_set1_ps(step[(r * groups + b) * 2 + 1]);
    for (int v = 0; v < kAvx2PanelVectors; ++v) {
      const __m256 d = _mm256_loadu_ps(dm + 8 * v);
      const __m256 m = Offset ? _mm256_loadu_ps(dm + kAvx2PanelChannels + 8 * v) : d;  // no m: not read
      acc[r][v] = add_scaled_dot_avx2<Offset>(acc[r][v], sums[r][v], d, dx, m, sx);
    }
  }
}

// Rows [r0, r0 + R) of the rounded activations against one panel: y's
// channels [n, n + channels) (``y`` points at channel n of row r0).
template <int R>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_int8(const QuantizedRows& xq, int64_t r0, int64_t k,
                                                           const uint8_t* panel, int64_t groups, float* y,
                                                           int64_t ldy, int64_t channels) {
  constexpr int V = kAvx2PanelVectors;
  const int8_t* qx = xq.q.data() + r0 * k;
  const float* step = xq.step.data() + r0 * groups * 2;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < groups; ++b) {
    const uint8_t* block = panel + b * kAvx2Int8BlockBytes;
    const float* d = reinterpret_cast<const float*>(block + kGroup * kAvx2PanelChannels);  // d, then m
    __m256i dot[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) dot[r][v] = _mm256_setzero_si256();
    for (int64_t q = 0; q < kAvx2Quads; ++q) {
      __m256i wv[V];
      for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (q * V + v) * 32));
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, qx + r * k + b * kGroup + q * 4, 4);
        const __m256i xv = _mm256_set1_epi32(four);
        for (int v = 0; v < V; ++v) {
          dot[r][v] = _mm256_add_epi16(dot[r][v], _mm256_maddubs_epi16(wv[v], xv));
          // An empty barrier a sum, in order: without it GCC hoisted every
          // row's broadcast ahead of the products and kept most of the sums
          // on the stack (loaded, added, stored each group of 4 inputs).
          asm volatile("" : "+x"(dot[r][v]));
        }
      }
    }
    __m256i sums[R][V];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) sums[r][v] = _mm256_madd_epi16(dot[r][v], ones);
    add_scaled_block_avx2<R>(sums, d, step, groups, b, acc);
  }
  store_tile_avx2<R>(acc, y, ldy, channels);
}

// The panels of the rounded rows (the int8 ones here, panel_avx2_int16.h's
// int16 ones) over weights of ``row_bytes`` bytes a channel (4-bit blocks,
// or Q8_0's int8 values), the rows in blocks of ``row_bytes_an_input``
// bytes an input: each panel's 16 channels staged (vnni_staged: one
// contiguous copy, the next panel's rows fetched meanwhile) and decoded a
// group of 32 inputs at a time, ``decode(panel, n, live, b, v, block)`` for
// vector v's 8 channels from n (``panel``: the panel's staged bytes, its
// first channel's row first, the others ``row_bytes`` apart) into blocks of
// ``block_bytes``; then ``tile(R, r0,
// n, channels, panel)`` for the block's rows in tiles of T.
template <int T, typename Decode, typename Tile>
inline void panels_avx2(int64_t rows, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t out,
                        int64_t row_bytes_an_input, int64_t block_bytes, const Decode& decode, const Tile& tile) {
  const int64_t groups = k / kGroup;
  const int64_t block_rows = std::max<int64_t>(T, kRowBlockBytes / (k * row_bytes_an_input) / T * T);
  over_blocks_and_panels(rows, block_rows, out, kAvx2PanelChannels, [&](int64_t b0, int64_t block, int64_t n,
                                                                        int64_t channels) {
    uint8_t* panel = thread_scratch(kScratchPanel, groups * block_bytes);  // every byte decoded before use
    uint8_t* stage = thread_scratch(kScratchStage, kAvx2PanelChannels * row_bytes);
    const uint8_t* rows_of = vnni_staged(w, row_bytes, out, n, channels, stage);
    for (int64_t g = 0; g < groups; ++g)
      for (int v = 0; v < kAvx2PanelVectors; ++v)
        decode(rows_of, n + 8 * v, std::clamp<int64_t>(channels - 8 * v, 0, 8), g, v, panel + g * block_bytes);
    over_tiles<T>(block, [&](auto r_tag, int64_t r0) { tile(r_tag, b0 + r0, n, channels, panel); });
  });
}

// y[rows, out] = x[rows, k] @ W.T for W in 4-bit blocks [out, k / 32, 20], on
// int8 activations (panels_avx2).
inline void q4_matmul_avx2_int8(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y) {
  const int64_t groups = k / kGroup;
  const QuantizedRows xq = quantize_rows_q8(x, rows, k, 0, kAvx2Int8);
  const int64_t row_bytes = groups * kBlockBytes;
  panels_avx2<kAvx2Int8TileRows>(
      rows, k, w, row_bytes, out, 1, kAvx2Int8BlockBytes,
      [&](const uint8_t* panel, int64_t, int64_t live, int64_t b, int v, uint8_t* block) {
        avx2_decode_q4_int8(panel + 8 * v * row_bytes, row_bytes, live, b, v, block);
      },
      [&](auto r_tag, int64_t r0, int64_t n, int64_t channels, const uint8_t* panel) {
        tile_avx2_int8<decltype(r_tag)::value>(xq, r0, k, panel, groups, y + r0 * out + n, out, channels);
      });
}

}  // namespace trioserve_native
