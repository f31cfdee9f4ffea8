// attend() for 64-wide heads on a vector ISA's own path (decode.cpp's
// attend_heads64: up to kHeadsAtOnce query heads at a time, their products
// summed across the lanes kTokensAtOnce tokens at a time): a KV head's group
// of query heads in passes of up to kHeadsAtOnce over the same keys and
// values. Included in avx2_isa and avx512_isa after their attend_heads64;
// no include guard.

template <typename T>
void attend64(const float* q, int64_t group, const T* key, const T* value, const int64_t* table, int64_t context,
              int64_t block_size, int64_t token_stride, float scale, std::vector<float>& scores, float* out) {
  const int64_t padded = (context + kTokensAtOnce - 1) / kTokensAtOnce * kTokensAtOnce;
  scores.resize(kHeadsAtOnce * padded);
  // Copied per pass: each starts at the context's first token.
  const Tokens<T> keys{key, table, block_size, token_stride}, values{value, table, block_size, token_stride};
  for (int64_t g0 = 0; g0 < group; g0 += kHeadsAtOnce) {
    with_count<kHeadsAtOnce>(std::min<int64_t>(kHeadsAtOnce, group - g0), [&](auto g_tag) {
      attend_heads64<T, decltype(g_tag)::value>(q + g0 * kHead64, keys, values, context, scale, padded, scores.data(),
                                                out + g0 * kHead64);
    });
  }
}
