// The row kernels of the native linears on float32 activations, written
// once against isa.h's primitives and included by kernels.h in avx2_isa and
// avx512_isa (scalar_isa's are in kernels.h: no vectors to split the sums
// over). y[r, n] = x[r] . w[n] for R rows of x (``ldx`` apart) and output
// channels [n0, n1) (y's rows ``ldy`` apart); each weight is decoded once
// for the R rows.
//
// A channel's sums run in two accumulators a row (two independent FMA
// chains), vector i of a group of inputs in accumulator i % 2, then one sum
// across the lanes, at every row count: a row's sums run in the same order
// however many rows share the pass, so a sequence's results do not depend
// on how many rows it is computed with (a speculative step's verified rows
// give exactly what plain one-row decoding gives). No include guard: once
// per ISA.

constexpr int kGroupVectors = int(kGroup / kWidth);  // a group of 32 inputs: 4 vectors on AVX2, 2 on AVX-512

// 4-bit blocks [out, groups, 20] (w = q d + m), decoded a block at a time (q4_block).
template <int R>
void q4_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t groups, int64_t n0, int64_t n1, float* y,
             int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * groups * kBlockBytes;
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t g = 0; g < groups; ++g) {
      Vec b[kGroupVectors];
      q4_block(row + g * kBlockBytes, b);
      for (int r = 0; r < R; ++r) {
        const float* xg = x + r * ldx + g * kGroup;
        for (int i = 0; i < kGroupVectors; ++i) acc[r][i % 2] = vfma(b[i], vload(xg + i * kWidth), acc[r][i % 2]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = vsum(vadd(acc[r][0], acc[r][1]));
  }
}

// int8 [out, k] times a scale per channel, for any k: two vectors of inputs
// a step, then the inputs past the last whole step one at a time.
template <int R>
void q8_rows(const float* x, int64_t ldx, const int8_t* w, const float* scale, int64_t k, int64_t n0, int64_t n1,
             float* y, int64_t ldy) {
  const int64_t body = k - k % (2 * kWidth);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * k;
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t j = 0; j < body; j += 2 * kWidth) {
      const Vec w0 = vload_i8(row + j), w1 = vload_i8(row + j + kWidth);
      for (int r = 0; r < R; ++r) {
        acc[r][0] = vfma(w0, vload(x + r * ldx + j), acc[r][0]);
        acc[r][1] = vfma(w1, vload(x + r * ldx + j + kWidth), acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float sum = vsum(vadd(acc[r][0], acc[r][1]));
      for (int64_t j = body; j < k; ++j) sum += float(row[j]) * x[r * ldx + j];
      y[r * ldy + n] = sum * scale[n];
    }
  }
}

// int8 in groups of 32 (GGUF's Q8_0): w = q scale[group], ``scale`` float32
// [out, k / 32]. The LM head of a model with tied embeddings runs on the
// embedding table's own values.
template <int R>
void q8g_rows(const float* x, int64_t ldx, const int8_t* w, const float* scale, int64_t k, int64_t n0, int64_t n1,
              float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* q = w + n * k + g * kGroup;
      const Vec d = vset(scale[n * groups + g]);
      Vec wv[kGroupVectors];
      for (int i = 0; i < kGroupVectors; ++i) wv[i] = vmul(vload_i8(q + i * kWidth), d);
      for (int r = 0; r < R; ++r) {
        const float* xg = x + r * ldx + g * kGroup;
        for (int i = 0; i < kGroupVectors; ++i) acc[r][i % 2] = vfma(wv[i], vload(xg + i * kWidth), acc[r][i % 2]);
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = vsum(vadd(acc[r][0], acc[r][1]));
  }
}

// One channel's weights decoded to float32, for the panels (panel.h,
// panel_avx2.h): 4-bit blocks, or int8 times one scale a run of ``step``
// values (the channel's, k; or a group's, a multiple of kWidth).
inline void q4_decode(const uint8_t* row, int64_t groups, float* dst) {
  for (int64_t g = 0; g < groups; ++g) {
    Vec b[kGroupVectors];
    q4_block(row + g * kBlockBytes, b);
    for (int i = 0; i < kGroupVectors; ++i) vstore(dst + g * kGroup + i * kWidth, b[i]);
  }
}

inline void q8_decode(const int8_t* q, const float* scale, int64_t k, int64_t step, float* dst) {
  const int64_t body = k - k % kWidth;
  for (int64_t j = 0; j < body; j += kWidth) vstore(dst + j, vmul(vload_i8(q + j), vset(scale[j / step])));
  for (int64_t j = body; j < k; ++j) dst[j] = float(q[j]) * scale[j / step];
}
