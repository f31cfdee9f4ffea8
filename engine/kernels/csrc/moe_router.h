// A mixture-of-experts router's logits for one row, written once against
// isa.h's vector primitives and included by decode.cpp in each ISA's
// namespace (as attend.h is). The router is a float32 [experts, dim]
// matrix: at 64 experts of 2048 it is 512 KiB a layer, a few percent of an
// expert's bytes, and in float32 its top-k is the one the layers in torch
// pick (the float router of engine/models/moe.py).

// logits[e] = x . router[e] for every expert, each sum in one order that
// depends on ``dim`` only, never on the batch.
inline void router_logits(const float* x, const float* router, int64_t experts, int64_t dim, float* logits) {
  for (int64_t e = 0; e < experts; ++e) {
    const float* w = router + e * dim;
    Vec acc = vzero();
    int64_t j = 0;
    for (; j + kWidth <= dim; j += kWidth) acc = vfma(vload(x + j), vload(w + j), acc);
    float sum = vsum(acc);
    for (; j < dim; ++j) sum += x[j] * w[j];
    logits[e] = sum;
  }
}
