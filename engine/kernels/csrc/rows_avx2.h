// avx2int8's linears below kPanelFromRows rows (a decode step of a few
// sequences, its LM head, a short speculative verification): the panels'
// arithmetic without the panels, as rows_vnni.h is for avx512vnni.
//
// Why: from kPanelFromRows rows a decode step's 4-bit calls run the int8
// panels of panel_avx2.h and its Q8_0 calls (the LM head; a K-quant file's
// wider projections) the int16 panels of panel_avx2_int16.h. The row
// kernels before these summed in another order (8 lanes of partial products
// a channel, reduced at the end) and rounded the Q8_0 rows to int8 where the
// panels take int16, so a sequence's logits moved with the number of rows
// it ran with: a batch growing past 9 rows, or a speculative step's
// verification beside other sequences, could change a greedy token.
//
// Here a block's integer dot of each row and channel is summed across the
// vector's lanes into one exact int32 (avx2_lane_sums), and the float
// operations after it are the panels' own, in their order: the dot times
// d times the row's step added to the sum, then (4-bit) m times the row's
// rounded sum. An integer sum is exact in any order, so every row's result
// is bit for bit the panels', whichever kernel its call's row count takes.
// The weights are read where they lie, up to 8 rows and several channels a
// pass (kAvx2RowChannels), the pass after next fetched ahead.
//
// A 4-bit matrix of whole panels of 16 channels is held as lanes blocks on
// avx2int8 (lanes_avx2.h), whose one kernel runs every row count with these
// bits and no sums across lanes; the 4-bit kernel here serves the others.

#pragma once

namespace trioserve_native {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Channels a pass of R rows (in_passes): a pass's R x C sums fit one vector
// of 8 lanes, and each loaded block serves R rows, each row's activations C
// channels. At one row a channel's sum was one chain of FMAs, one a block,
// and a channel at a time the 4-bit loop ran at some 7.7 cycles a block on a
// Zen 3 with the weights in cache (4.8 four at a time). At one row 4
// channels, not 8: the default model's 30 layers from memory took 2.8-2.9
// ms against 3.2-3.3 with 8 streams to fetch (the AMX Xeon held to AVX2).
template <int R>
constexpr int kAvx2RowChannels = R <= 2 ? 4 : R <= 4 ? 2 : 1;

// C channels' rows are C streams through one stretch of memory, which the
// hardware prefetchers followed worse than one: four at a time without
// this, the default model's 30 layers at one row took about 1.2x the time
// of one at a time, with it about 0.75x (2 threads, weights from memory,
// the builds taking turns); one at a time without it, 4 rows took 2.3x the
// time they take with it. Each block (``g``) of a pass fetches the part of
// the pass kAheadPasses on that it reaches at the same block: ``bytes`` a
// block, at most two lines. Near the end of the weights the hint points
// past them, which a prefetch may do (it never faults).
constexpr int64_t kAheadPasses = 2;
inline void fetch_pass_ahead(const void* pass_start, int64_t pass_bytes, int64_t g, int64_t bytes) {
  const char* at = static_cast<const char*>(pass_start) + kAheadPasses * pass_bytes + g * bytes;
  _mm_prefetch(at, _MM_HINT_T0);
  _mm_prefetch(at + 64, _MM_HINT_T0);
}

// ``pass(C, n)`` over channels [n0, n1) for R rows: kAvx2RowChannels<R> a
// pass, the rest one at a time.
template <int R, typename Pass>
inline void in_passes(int64_t n0, int64_t n1, const Pass& pass) {
  constexpr int C = kAvx2RowChannels<R>;
  int64_t n = n0;
  for (; n + C <= n1; n += C) pass(std::integral_constant<int, C>{}, n);
  for (; n < n1; ++n) pass(std::integral_constant<int, 1>{}, n);
}

// A pass's sums are the float32 lanes of one vector, lane r * C + c for row
// r and channel c. Values per row or per channel reach their lanes by a
// permutation of a vector of the rows' or channels' values (none where that
// is the order already); lanes past R * C take row and channel 0 and are
// never stored.
template <int R, int C>
struct Lanes {
  static_assert(R * C <= 8, "a pass's sums fit one vector of 8");
  static constexpr int count = R * C;
  static constexpr int row(int l) { return l < count ? l / C : 0; }
  static constexpr int channel(int l) { return l < count ? l % C : 0; }
  // Each lane's element of a vector of pairs per channel (x0 y0 x1 y1 ...):
  // its channel's x (``second`` false) or y.
  static __m256i of_pairs(bool second) {
    const int s = second ? 1 : 0;
    return _mm256_setr_epi32(2 * channel(0) + s, 2 * channel(1) + s, 2 * channel(2) + s, 2 * channel(3) + s,
                             2 * channel(4) + s, 2 * channel(5) + s, 2 * channel(6) + s, 2 * channel(7) + s);
  }
  // The channels' values (``values``: channel c's at element c * stride)
  // in their lanes: one broadcast for one channel, else C loads and a
  // permutation. A gather (VGATHERDPS) did this before, one a block and
  // pass: the default model's Q8_0 head (one channel a pass from 5 rows)
  // took 2.44-2.45 ms at 5 rows and 3.34-3.44 at 8, now 2.06-2.10 and
  // 2.74-2.87 (the AMX Xeon held to AVX2, 2 threads).
  static __m256 of_channels(const float* values, int64_t stride) {
    if constexpr (C == 1) {
      return _mm256_broadcast_ss(values);
    } else {
      static_assert(C == 2 || C == 4);
      // In registers: four stores and a wider load would stall on forwarding.
      const __m128 pairs = _mm_unpacklo_ps(_mm_load_ss(values), _mm_load_ss(values + stride));
      __m128 first = pairs;
      if constexpr (C == 4)
        first = _mm_movelh_ps(pairs, _mm_unpacklo_ps(_mm_load_ss(values + 2 * stride), _mm_load_ss(values + 3 * stride)));
      return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(first),
                                      _mm256_setr_epi32(channel(0), channel(1), channel(2), channel(3), channel(4),
                                                        channel(5), channel(6), channel(7)));
    }
  }
  // The rows' values (``rows``: row r's at element r) in their lanes.
  static __m256 of_rows(const float* rows) {
    if constexpr (R == 1) return _mm256_broadcast_ss(rows);
    if constexpr (C == 1) return _mm256_loadu_ps(rows);
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(rows), _mm256_setr_epi32(row(0), row(1), row(2), row(3),
                                                                            row(4), row(5), row(6), row(7)));
  }
};

// Each vector's total of its 8 int32 lanes, in element i for ``p[i]``
// (``L`` vectors; the elements from L hold nothing).
template <int L>
inline __m256i avx2_lane_sums(const __m256i (&p)[L]) {
  if constexpr (L <= 4) {
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = i < L ? p[i] : _mm256_setzero_si256();
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
    return _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
  } else {
    __m256i q[8];
    for (int i = 0; i < 8; ++i) q[i] = i < L ? p[i] : _mm256_setzero_si256();
    // Elements 0-3: vectors 0-3's lanes 0-3 and 4-7 (the two halves), then vectors 4-7's.
    const __m256i lo = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
    const __m256i hi = _mm256_hadd_epi32(_mm256_hadd_epi32(q[4], q[5]), _mm256_hadd_epi32(q[6], q[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
}

// The rows' step dx and step times rounded sum sx of every group (``step``:
// [rows, groups, 2] from the pass's first row), 8 of each a group
// ([groups, 2, 8]; rows past R zeros), read by every pass: in the thread's
// scratch (thread_scratch), which a row kernel's call holds nothing else in.
template <int R>
inline float* row_steps(const float* step, int64_t groups) {
  float* table = reinterpret_cast<float*>(thread_scratch(kScratchStage, groups * 16 * sizeof(float)));
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < 8; ++r) {
      table[g * 16 + r] = r < R ? step[r * 2 * groups + 2 * g] : 0.f;
      table[g * 16 + 8 + r] = r < R ? step[r * 2 * groups + 2 * g + 1] : 0.f;
    }
  return table;
}

// Adds one block to the pass's sums: ``dots[l]`` the block's int32 partial
// dots of lane l (any split over the vector's lanes), d, dx, m and sx in
// their lanes, through the panels' add_scaled_dot_avx2.
template <int L, bool Offset>
inline void add_block_exact(const __m256i (&dots)[L], __m256 d, __m256 dx, __m256 m, __m256 sx, __m256& acc) {
  acc = add_scaled_dot_avx2<Offset>(acc, avx2_lane_sums<L>(dots), d, dx, m, sx);
}

template <int R, int C>
inline void store_lanes(__m256 acc, int64_t n, float* y, int64_t ldy) {
  float out[8];
  _mm256_storeu_ps(out, acc);
  for (int l = 0; l < R * C; ++l) y[(l / C) * ldy + n + l % C] = out[l];
}

// The C channels' float16 d and m of 4-bit block g (channels from n), as
// float32 in their lanes: the four pairs converted at once, then put where
// each channel's lanes are.
template <int R, int C>
inline void block_scales(const uint8_t* w, int64_t groups, int64_t n, int64_t g, __m256& d, __m256& m) {
  static_assert(C <= 4);
  using L = Lanes<R, C>;
  __m128i pair[4];
  for (int c = 0; c < 4; ++c) {
    int32_t bits = 0;
    if (c < C) std::memcpy(&bits, w + ((n + c) * groups + g) * kBlockBytes, 4);
    pair[c] = _mm_cvtsi32_si128(bits);
  }
  const __m128i halves = _mm_unpacklo_epi64(_mm_unpacklo_epi32(pair[0], pair[1]), _mm_unpacklo_epi32(pair[2], pair[3]));
  const __m256 dm = _mm256_cvtph_ps(halves);  // d0 m0 d1 m1 d2 m2 d3 m3
  d = _mm256_permutevar8x32_ps(dm, L::of_pairs(false));
  m = _mm256_permutevar8x32_ps(dm, L::of_pairs(true));
}

// 4-bit blocks against rows rounded to int8 (quantize_rows_q8): VPMADDUBSW
// multiplies the nibbles by the activations and adds pairs in int16 (at most
// 2 x 15 x 127), VPMADDWD adds those pairs in int32.
template <int R, int C>
inline void q4_channels_avx2_int8(const int8_t* qx, const float* steps, int64_t k, const uint8_t* w, int64_t groups,
                                  int64_t n, float* y, int64_t ldy) {
  constexpr int L = R * C;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 dx = Lanes<R, C>::of_rows(steps + g * 16), sx = Lanes<R, C>::of_rows(steps + g * 16 + 8);
    __m256 d, m;
    block_scales<R, C>(w, groups, n, g, d, m);
    fetch_pass_ahead(w + n * groups * kBlockBytes, C * groups * kBlockBytes, g, C * kBlockBytes);
    __m256i dots[L];
    for (int c = 0; c < C; ++c) {
      const uint8_t* p = w + ((n + c) * groups + g) * kBlockBytes;
      // Elements 0..15 (the low nibbles) in the low half, 16..31 (the high ones) in the high half.
      const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)));
      const __m256i wq = _mm256_and_si256(_mm256_blend_epi32(raw, _mm256_srli_epi16(raw, 4), 0xF0), low);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * k + g * kGroup));
        dots[r * C + c] = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv), ones);
      }
    }
    add_block_exact<L, true>(dots, d, dx, m, sx, acc);
  }
  store_lanes<R, C>(acc, n, y, ldy);
}

template <int R>
void q4_rows_avx2_int8(const QuantizedRows& xq, int64_t r0, int64_t k, const uint8_t* w, int64_t groups, int64_t n0,
                       int64_t n1, float* y, int64_t ldy) {
  float* steps = row_steps<R>(xq.step.data() + r0 * groups * 2, groups);
  const int8_t* qx = xq.q.data() + r0 * k;
  in_passes<R>(n0, n1, [&](auto c_tag, int64_t n) {
    q4_channels_avx2_int8<R, decltype(c_tag)::value>(qx, steps, k, w, groups, n, y, ldy);
  });
}

// Q8_0 (int8 values in groups of 32, a float32 step a group) against rows
// rounded to int16 in groups of 32 (round_rows_i16), as the int16 panels
// take them: the values widened to int16, VPMADDWD's pairs in int32 (at most
// 32 x 32767 x 128 a block, exact).
template <int R, int C>
inline void q8g_channels_avx2_i16(const int16_t* qx, const float* steps, int64_t k, const int8_t* w,
                                  const float* scale, int64_t n, float* y, int64_t ldy) {
  constexpr int L = R * C;
  const int64_t groups = k / kGroup;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    fetch_pass_ahead(w + n * k, C * k, g, C * kGroup);
    const __m256 dx = Lanes<R, C>::of_rows(steps + g * 16);
    const __m256 d = Lanes<R, C>::of_channels(scale + n * groups + g, groups);  // each lane's channel's d
    __m256i dots[L];
    for (int c = 0; c < C; ++c) {
      const int8_t* q = w + (n + c) * k + g * kGroup;
      __m256i wv[2];
      for (int h = 0; h < 2; ++h)
        wv[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const int16_t* x = qx + r * k + g * kGroup;
        dots[r * C + c] =
            _mm256_add_epi32(_mm256_madd_epi16(wv[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                             _mm256_madd_epi16(wv[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
      }
    }
    add_block_exact<L, false>(dots, d, dx, d, dx, acc);
  }
  store_lanes<R, C>(acc, n, y, ldy);
}

template <int R>
void q8g_rows_avx2_i16(const RoundedRows16& xq, int64_t r0, int64_t k, const int8_t* w, const float* scale,
                       int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  float* steps = row_steps<R>(xq.step.data() + r0 * groups * 2, groups);
  const int16_t* qx = xq.q.data() + r0 * k;
  in_passes<R>(n0, n1, [&](auto c_tag, int64_t n) {
    q8g_channels_avx2_i16<R, decltype(c_tag)::value>(qx, steps, k, w, scale, n, y, ldy);
  });
}

#pragma GCC pop_options

}  // namespace trioserve_native
