// One query head's decode attention over its sequence's paged keys and
// values. Included by decode.cpp once per ISA, inside that ISA's
// `#pragma GCC target` region and namespace, which define Vec, kWidth and
// vzero / vset / vload / vfma / vsum / vstore for float, c10::Half and
// c10::BFloat16 sources; so one body is compiled three ways.

// ``key``/``value`` point at this KV head's first element of token slot 0;
// ``token_stride`` elements separate consecutive slots. ``scores`` holds
// ``context`` floats of scratch. ``out`` gets the head's ``head_dim`` outputs.
template <typename T>
void attend(const float* q, const T* key, const T* value, const int64_t* table, int64_t context, int64_t block_size,
            int64_t token_stride, int64_t head_dim, float scale, float* scores, float* out) {
  float top = -INFINITY;
  for (int64_t t = 0; t < context; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const T* k = key + slot * token_stride;
    Vec acc = vzero();
    for (int64_t j = 0; j < head_dim; j += kWidth) acc = vfma(vload(q + j), vload(k + j), acc);
    scores[t] = vsum(acc) * scale;
    top = scores[t] > top ? scores[t] : top;
  }
  float total = 0.f;
  for (int64_t t = 0; t < context; ++t) {
    scores[t] = std::exp(scores[t] - top);
    total += scores[t];
  }
  for (int64_t j = 0; j < head_dim; j += kWidth) vstore(out + j, vzero());
  const float norm = 1.f / total;
  for (int64_t t = 0; t < context; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const T* v = value + slot * token_stride;
    const Vec p = vset(scores[t] * norm);
    for (int64_t j = 0; j < head_dim; j += kWidth) vstore(out + j, vfma(p, vload(v + j), vload(out + j)));
  }
}
