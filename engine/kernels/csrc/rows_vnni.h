// avx512vnni's linears at a few rows (a one-stream decode step, its LM
// head, a short speculative verification): the panels' arithmetic without
// the panels.
//
// Why: the panels of panel_vnni.h stage every weight into their layout
// (channels in the lanes) on every call. From a few rows that staging is
// shared by the rows; at one row it is most of the work: the default
// model's fused layers took 4.55 ms of a one-stream step on a 2-core Xeon
// with AMX, where avx2int8's row kernel (no staging, 256-bit products)
// took 2.93 (docs/benchmarks.md). Here the weights are read where they lie, four
// channels' blocks a vector (one channel a 128-bit lane for 4-bit blocks,
// a 256-bit half for Q8_0), and VPDPBUSD's sums are added across each
// channel's lanes (vnni_channel_sums) into one int32 a channel and block.
//
// Every result is bit for bit what the panels give: a block's integer dot
// is exact however it is summed, and the float operations after it are the
// panels' own, in their order, per channel (vnni_tile): the dot times the
// row's step, times d added to the sum, then (4-bit) m times the row's
// rounded sum. So a row's logits do not depend on how many rows run with
// it, whichever kernel a call's row count takes.
//
// Only matrices without whole panels of 16 channels still come here: the
// others are held as lanes blocks and read as they lie by lanes_vnni.h,
// with these bits (from memory these read 11.5 GB/s on one Zen 4 thread:
// 16 strided streams and a gather a block).

#pragma once

#include <algorithm>

namespace trioserve_native {

// Calls of up to this many rows take the row kernels, more the panels: the
// default model's 30 layers on the 2-core Xeon (2 threads, best of 15)
// took 2.0 ms at one row against the panels' 4.2-4.5, 3.4 at five against
// 5.5-5.8, 4.6-5.0 at eight against 6.4-6.7; the panels run nine rows in
// 6.6-7.1 (docs/benchmarks.md). Each further row here adds about 0.4 ms
// of products, while the panels share their staging among the rows.
constexpr int kVnniRowsMax = 8;
constexpr int64_t kVnniRowChannels = 16;  // channels a pass: one vector of results

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

// Channel c's total in element c, from four vectors of four int32 partial
// sums a 128-bit lane: ``p[j]``'s lane l holds channel 4l + j's.
inline __m512i vnni_channel_sums(const __m512i (&p)[4]) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// A later pass's weights (``bytes`` from ``ahead``) into L1 over a pass's
// ``groups`` blocks, a share a block: each pass reads its channels'
// blocks across 16 rows at once, which the hardware prefetchers follow
// poorly (as kernels.h's fetch_pass_ahead).
inline void vnni_fetch_share(const uint8_t* ahead, int64_t bytes, int64_t groups, int64_t b) {
  const int64_t share = (bytes + groups - 1) / groups;
  for (int64_t at = b * share; at < std::min(bytes, (b + 1) * share); at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + at), _MM_HINT_T0);
}

// The R rounded rows against 4-bit channels [n, n + live) (live <= 16),
// ``groups`` blocks of kBlockBytes a channel; ``ahead``: a later pass's
// weights, ``ahead_bytes`` of them.
template <int R>
inline void vnni_rows_q4(const QuantizedRows& xq, int64_t k, const uint8_t* w, int64_t groups,
                         int64_t n, int64_t live, const uint8_t* ahead, int64_t ahead_bytes, float* y,
                         int64_t ldy) {
  const int64_t row_bytes = groups * kBlockBytes;
  const int8_t* qx = xq.q.data();
  const float* step = xq.step.data();
  const uint8_t* first = w + n * row_bytes;
  const __mmask16 mask = __mmask16((1u << live) - 1);
  const __m512i offsets = vnni_lane_offsets(row_bytes);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const auto nibbles = [&](int64_t c, int64_t b) {
    return c < live ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(first + c * row_bytes + b * kBlockBytes + 4))
                    : _mm_setzero_si128();
  };
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < groups; ++b) {
    vnni_fetch_share(ahead, ahead_bytes, groups, b);
    // Vector j, lane l: channel 4l + j's 16 bytes (elements 0..15 in the
    // low nibbles, 16..31 in the high ones).
    __m512i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      __m512i v = _mm512_castsi128_si512(nibbles(j, b));
      v = _mm512_inserti32x4(v, nibbles(4 + j, b), 1);
      v = _mm512_inserti32x4(v, nibbles(8 + j, b), 2);
      v = _mm512_inserti32x4(v, nibbles(12 + j, b), 3);
      lo[j] = _mm512_and_si512(v, low);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    // d and m: the float16 pair at the start of each channel's block.
    const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offsets, first + b * kBlockBytes, 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = qx + r * k + b * kGroup;
      const __m512i x0 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb)));
      const __m512i x1 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + 16)));
      __m512i p[4];
      for (int j = 0; j < 4; ++j)
        p[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[j], x0), hi[j], x1);
      const __m512i dot = vnni_channel_sums(p);
      const __m512 dx = _mm512_set1_ps(step[(r * groups + b) * 2]);
      const __m512 sx = _mm512_set1_ps(step[(r * groups + b) * 2 + 1]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), dx), d, acc[r]);  // as vnni_tile
      acc[r] = _mm512_fmadd_ps(m, sx, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + n, mask, acc[r]);
}

// The same for Q8_0 channels (``w``: int8 [out, k], ``scale`` [out, k / 32])
// against rows rounded with their bytes shifted to unsigned (q + 128, as
// the panels take them): each block's dot starts at -128 times the
// channel's sum of weights, which takes the shift's share off.
template <int R>
inline void vnni_rows_q8(const QuantizedRows& xq, int64_t k, const int8_t* w, const float* scale,
                         int64_t n, int64_t live, const uint8_t* ahead, int64_t ahead_bytes, float* y,
                         int64_t ldy) {
  const int64_t groups = k / kGroup;
  const uint8_t* qx = reinterpret_cast<const uint8_t*>(xq.q.data());
  const float* step = xq.step.data();
  const int8_t* first = w + n * k;
  const __mmask16 mask = __mmask16((1u << live) - 1);
  const __m512i offsets = vnni_lane_offsets(groups);
  const __m512i ones = _mm512_set1_epi8(1);
  const auto block = [&](int64_t c, int64_t b) {
    return c < live ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + c * k + b * kGroup))
                    : _mm256_setzero_si256();
  };
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < groups; ++b) {
    vnni_fetch_share(ahead, ahead_bytes, groups, b);
    // Vector i: two channels' 32 bytes, a 256-bit half each, paired so that
    // adding each vector pair's halves leaves vector j's lane l with
    // channel 4l + j (vnni_channel_sums): (j, 4 + j) and (8 + j, 12 + j).
    __m512i q[8], start[8];
    for (int j = 0; j < 4; ++j) {
      q[2 * j] = _mm512_inserti64x4(_mm512_castsi256_si512(block(j, b)), block(4 + j, b), 1);
      q[2 * j + 1] = _mm512_inserti64x4(_mm512_castsi256_si512(block(8 + j, b)), block(12 + j, b), 1);
    }
    for (int i = 0; i < 8; ++i)
      start[i] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                  _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, q[i]), 7));
    const __m512 d = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, offsets, scale + n * groups + b, 4);
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * k + b * kGroup)));
      __m512i p[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i a = _mm512_dpbusd_epi32(start[2 * j], xv, q[2 * j]);
        const __m512i c = _mm512_dpbusd_epi32(start[2 * j + 1], xv, q[2 * j + 1]);
        p[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1)));
      }
      const __m512i dot = vnni_channel_sums(p);
      const __m512 dx = _mm512_set1_ps(step[(r * groups + b) * 2]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), dx), d, acc[r]);  // as vnni_tile
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + n, mask, acc[r]);
}

#pragma GCC pop_options

// ``pass(R, n, live, ahead, ahead_bytes)`` over all rows (at most
// kVnniRowsMax) and out channels, 16 a pass, each thread one contiguous
// range of passes (a static split, as over_rows: the prefetchers stream
// it best); ``channel_bytes``: a channel's weights, for the fetch ahead.
template <typename Pass>
inline void over_vnni_rows(int64_t rows, int64_t out, int64_t channel_bytes, const uint8_t* w, const Pass& pass) {
  const int64_t passes = (out + kVnniRowChannels - 1) / kVnniRowChannels;
  at::parallel_for(0, passes, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kVnniRowChannels, live = std::min(kVnniRowChannels, out - n);
      // The pass after next, as fetch_pass_ahead does on AVX2 (where it was
      // measured; here it was not measured apart).
      const int64_t next = std::min(out, n + 2 * kVnniRowChannels);
      const int64_t ahead_bytes = std::min(kVnniRowChannels, out - next) * channel_bytes;
      const uint8_t* ahead = w + next * channel_bytes;
      with_count<kVnniRowsMax>(rows, [&](auto r_tag) { pass(r_tag, n, live, ahead, ahead_bytes); });
    }
  });
}

// y[rows, out] = x[rows, k] @ W.T for W in 4-bit blocks [out, k / 32, 20],
// rows <= kVnniRowsMax: the bits of q4_matmul_vnni.
inline void q4_rows_vnni(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y) {
  TORCH_CHECK(rows >= 0 && rows <= kVnniRowsMax, "q4_rows_vnni: ", rows, " rows");
  if (rows == 0) return;
  const int64_t groups = k / kGroup;
  const QuantizedRows xq = quantize_rows_q8(x, rows, k);
  over_vnni_rows(rows, out, groups * kBlockBytes, w, [&](auto r_tag, int64_t n, int64_t live, const uint8_t* ahead,
                                                          int64_t ahead_bytes) {
    vnni_rows_q4<decltype(r_tag)::value>(xq, k, w, groups, n, live, ahead, ahead_bytes, y, out);
  });
}

// The same for Q8_0 (int8 q [out, k], float32 scale [out, k / 32]): the bits of q8g_matmul_vnni.
inline void q8g_rows_vnni(const float* x, int64_t rows, int64_t k, const int8_t* w, const float* scale, int64_t out,
                          float* y) {
  TORCH_CHECK(rows >= 0 && rows <= kVnniRowsMax, "q8g_rows_vnni: ", rows, " rows");
  if (rows == 0) return;
  const QuantizedRows xq = quantize_rows_q8(x, rows, k, 0x80);
  over_vnni_rows(rows, out, k, reinterpret_cast<const uint8_t*>(w), [&](auto r_tag, int64_t n, int64_t live,
                                                                        const uint8_t* ahead, int64_t ahead_bytes) {
    vnni_rows_q8<decltype(r_tag)::value>(xq, k, w, scale, n, live, ahead, ahead_bytes, y, out);
  });
}

}  // namespace trioserve_native
