// Decode attention over a sequence's paged keys and values. Included by
// decode.cpp once per ISA, inside that ISA's
// `#pragma GCC target` region and namespace, which define Vec, kWidth and
// vzero / vset / vload / vfma / vsum / vstore (vload for float, c10::Half
// and c10::BFloat16 sources), vadd / vneg / vmul / vdiv and vexp; so one
// body is compiled three ways.

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
