// Decode attention over a sequence's paged keys and values, written once
// against the vector primitives of isa.h and included by decode.cpp in
// each ISA's namespace: one body compiled three ways. The decode step's
// other per-row work (RMSNorm, rotary, the cache write, SwiGLU) is here too,
// vectorized the same way: run one row at a time on one thread between the
// parallel matmuls, it had the other thread waiting.

// s[0..n) replaced by its softmax.
inline void softmax(float* s, int64_t n) {
  float top = -INFINITY;
  for (int64_t t = 0; t < n; ++t) top = s[t] > top ? s[t] : top;
  float total = 0.f;
  const Vec shift = vset(top);
  int64_t t = 0;
  for (; t + kWidth <= n; t += kWidth) {
    const Vec e = vexp(vadd(vload(s + t), vneg(shift)));
    vstore(s + t, e);
    total += vsum(e);
  }
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - top);
    total += s[t];
  }
  const float norm = 1.f / total;
  for (t = 0; t < n; ++t) s[t] *= norm;
}

// The ``group`` query heads that share one KV head (``q``, ``out``: their
// ``group * head_dim`` floats, head after head) over one sequence's
// context: each key and value is read once for the whole group.
// ``key``/``value`` point at this KV head's first element of token slot 0;
// ``token_stride`` elements separate consecutive slots. ``scores`` holds
// ``group * context`` floats of scratch.
template <typename T>
void attend(const float* q, int64_t group, const T* key, const T* value, const int64_t* table, int64_t context,
            int64_t block_size, int64_t token_stride, int64_t head_dim, float scale, float* scores, float* out) {
  for (int64_t t0 = 0; t0 < context; t0 += block_size) {  // block by block: no division per token
    const T* block = key + table[t0 / block_size] * block_size * token_stride;
    for (int64_t t = t0; t < std::min(context, t0 + block_size); ++t) {
      const T* k = block + (t - t0) * token_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * head_dim;
        Vec acc = vzero();
        for (int64_t j = 0; j < head_dim; j += kWidth) acc = vfma(vload(qg + j), vload(k + j), acc);
        scores[g * context + t] = vsum(acc) * scale;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * context, context);
  for (int64_t j = 0; j < group * head_dim; j += kWidth) vstore(out + j, vzero());
  for (int64_t t0 = 0; t0 < context; t0 += block_size) {
    const T* block = value + table[t0 / block_size] * block_size * token_stride;
    for (int64_t t = t0; t < std::min(context, t0 + block_size); ++t) {
      const T* v = block + (t - t0) * token_stride;
      for (int64_t g = 0; g < group; ++g) {
        const Vec p = vset(scores[g * context + t]);
        float* o = out + g * head_dim;
        for (int64_t j = 0; j < head_dim; j += kWidth) vstore(o + j, vfma(p, vload(v + j), vload(o + j)));
      }
    }
  }
}

// out[j] = silu(gate[j]) * up[j] = gate[j] / (1 + e^-gate[j]) * up[j].
inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) {
    const Vec g = vload(gate + j);
    const Vec e = vexp(vneg(g));
    vstore(out + j, vdiv(vmul(g, vload(up + j)), vadd(e, vset(1.f))));
  }
  for (; j < n; ++j) out[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
}

// y = x / sqrt(mean(x^2) + eps) * weight over one row of n.
inline void rms_norm_row(const float* x, const float* weight, int64_t n, float eps, float* y) {
  Vec acc = vzero();
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) {
    const Vec v = vload(x + j);
    acc = vfma(v, v, acc);
  }
  float squares = vsum(acc);
  for (; j < n; ++j) squares += x[j] * x[j];
  const float inv = 1.f / std::sqrt(squares / float(n) + eps);
  const Vec scale = vset(inv);
  for (j = 0; j + kWidth <= n; j += kWidth) vstore(y + j, vmul(vmul(vload(x + j), scale), vload(weight + j)));
  for (; j < n; ++j) y[j] = x[j] * inv * weight[j];
}

// One head (``head_dim`` floats, in place) rotated by the rotate-half tables
// of its position: v[i] * cos[i] + v[i +- half] * sin[i] (``sin`` carries
// the sign of rotate-half's first half). Two products and a sum, each
// rounded, as torch's rotary (engine/layers/rotary.py) computes them: GCC would fuse
// the intrinsics into an FMA, and a prompt's keys (rotated by torch) would
// then differ in the last bit from a decode step's, which moved near-ties in
// greedy tokens between a request run alone and in a batch.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
inline void rotate_half(float* v, const float* cos, const float* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  int64_t j = 0;
  if (half % kWidth == 0) {
    for (; j < half; j += kWidth) {
      const Vec a = vload(v + j), b = vload(v + half + j);
      vstore(v + j, vadd(vmul(a, vload(cos + j)), vmul(b, vload(sin + j))));
      vstore(v + half + j, vadd(vmul(b, vload(cos + half + j)), vmul(a, vload(sin + half + j))));
    }
    return;
  }
  for (; j < half; ++j) {
    const float a = v[j], b = v[half + j];
    v[j] = a * cos[j] + b * sin[j];
    v[half + j] = b * cos[half + j] + a * sin[half + j];
  }
}
#pragma GCC pop_options

// n floats into the cache's dtype: float16 saturating at +-65504 (as
// engine/layers/kv_cache.py's to_cache), rounded to nearest even as c10's
// conversions are.
template <typename T>
inline void store_cache(T* dst, const float* src, int64_t n) {
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
    return;
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    const Vec top = vset(65504.f), bottom = vset(-65504.f);
    for (; j + kWidth <= n; j += kWidth) vstore_half(dst + j, vmin(top, vmax(bottom, vload(src + j))));
    for (; j < n; ++j) dst[j] = T(std::min(std::max(src[j], -65504.f), 65504.f));
  } else {
    for (; j < n; ++j) dst[j] = T(src[j]);
  }
}
