// avx2int8's Q8_0 LM head stored with its channels in the lanes ("Q8_0
// lanes blocks"), laid out so at load (engine/kernels/q8_lanes.py): the int16
// tile of panel_avx2_int16.h reads it as it lies, at any row count.
//
// Why: in GGUF's layout a group's integer dot of a row and channel lies
// across a vector's lanes, and the exact arithmetic (a group's dot times d
// dx, an int32 a group) needs it summed across them: the row kernel of
// rows_avx2.h (q8g_channels_avx2_i16) spends about as many instructions on
// those sums as on the products, so the default model's 49,152 x 576 head
// took 3.0 ms at 5 rows (a speculative verification) against 1.8 at one
// (from memory, as a decode step reads it; lanes blocks: 2.1 and 1.8), and
// from 10 rows the int16 panels staged every panel again at every call.
// With 16 channels' pairs side by side, a row's pair of inputs is broadcast
// against them and each channel's dot stays in its lane, as the int16
// panels have it, without staging.
//
// A panel is 16 channels (kLanesChannels), its groups one after another
// (``[out / 16, in / 32, 576]`` bytes); a group holds, for each pair p of
// its 32 inputs, 32 bytes: channel c's values 2p and 2p + 1 at bytes 2c and
// 2c + 1 (channels 0-7 in the first 16 bytes, one VPMOVSXBW each), then the
// 16 channels' float32 steps. The same bytes as Q8_0's groups of the 16
// channels (32 values and a step each), so no memory is added.
//
// The arithmetic is q8g_channels_avx2_i16's and the int16 panels' (rows
// rounded to int16 per group, a group's exact int32 times d dx): a row's
// result has the same bits in any call.

#pragma once

namespace trioserve_native {

constexpr int64_t kQ8LanesBlockBytes = kAvx2I16NarrowBlockBytes;  // 576
constexpr int64_t kQ8LanesValueBytes = kGroup * kLanesChannels;    // 512, then the steps

// y[rows, out] = x[rows, k] @ (q * step per group of 32).T for Q8_0 lanes
// blocks [out / 16, k / 32, 576], on activations rounded to int16 per group.
inline void q8g_lanes_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t out, float* y) {
  const int64_t groups = k / kGroup, panel_bytes = groups * kQ8LanesBlockBytes;
  const RoundedRows16 xq = round_rows_i16(x, rows, k);
  const auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      over_tiles<kAvx2I16TileRows>(rows, [&](auto r_tag, int64_t r0) {
        tile_avx2_i16<decltype(r_tag)::value, false, true>(xq, r0, k, w + p * panel_bytes, groups,
                                                           y + r0 * out + p * kLanesChannels, out, kLanesChannels);
      });
  };
  over_lanes_panels(out / kLanesChannels, rows, run);
}

// Rows ``ids`` (each below ``out``) of Q8_0 lanes blocks, dequantized into
// y [n, k] float32: a value times its group's step, as Python's
// Int8GroupWeight.dequantize has it (a tied model's embeddings).
inline void q8g_lanes_dequantize(const uint8_t* w, int64_t k, const int64_t* ids, int64_t n, float* y) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t c = ids[r] % kLanesChannels;
      const uint8_t* panel = w + ids[r] / kLanesChannels * groups * kQ8LanesBlockBytes;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = panel + g * kQ8LanesBlockBytes;
        float step;
        std::memcpy(&step, block + kQ8LanesValueBytes + 4 * c, 4);
        for (int64_t i = 0; i < kGroup; ++i)
          y[r * k + g * kGroup + i] = float(int8_t(block[i / 2 * 2 * kLanesChannels + 2 * c + i % 2])) * step;
      }
    }
  });
}

}  // namespace trioserve_native
