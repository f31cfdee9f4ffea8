// A mixture-of-experts layer's MLP inside the fused decode step (decode.cpp
// includes this in its anonymous namespace, after Linear and over_rows_of).
//
// The math is engine/models/moe.py's GroupedExperts for routing qwen3_moe
// and mixtral: the float router's logits, the softmax over all experts, the
// top k (ties to the lower expert, as the scan below finds them first),
// renormalised to sum to one where the layer says (``norm_topk_prob``;
// Mixtral always), then each chosen expert's gate/up, SiLU(gate) * up and
// down, and each row's k outputs weighted and summed in routing-rank order.
//
// The (row, rank) pairs are grouped by expert, as llama.cpp's mul_mat_id
// does: each expert with rows runs its two linears once over its gathered
// rows, so an expert's weights are read once a step however many rows chose
// it. A row's result does not depend on the batch: the routing is per row,
// the linears give a row the same bits at every row count (the int8
// kernels a fused step runs), and the sum is per row in rank order.

// The weights of a mixture's layer after its kParts: per expert its gate/up
// (gate's rows then up's), its scale, down, its scale.
constexpr int64_t kExpertParts = 4;

// A mixture-of-experts layer's routing: the router [experts, dim] float32
// and the int64 [2] (top k, renormalise) the layer's kRouting holds.
struct Routing {
  const float* router;
  int64_t experts, top_k;
  bool renormalise;
};

// One row's experts (``chosen``, best first) and their weights from its
// router logits (``p``, overwritten by their softmax).
inline void route_row(float* p, const Routing& how, int64_t* chosen, float* weight) {
  float top = -INFINITY;
  for (int64_t e = 0; e < how.experts; ++e) top = std::max(top, p[e]);
  float total = 0.f;
  for (int64_t e = 0; e < how.experts; ++e) total += (p[e] = std::exp(p[e] - top));
  for (int64_t e = 0; e < how.experts; ++e) p[e] /= total;
  for (int64_t j = 0; j < how.top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < how.experts; ++e) {
      if (std::find(chosen, chosen + j, e) != chosen + j) continue;
      if (best < 0 || p[e] > p[best]) best = e;
    }
    chosen[j] = best;
    weight[j] = p[best];
  }
  if (!how.renormalise) return;
  float sum = 0.f;
  for (int64_t j = 0; j < how.top_k; ++j) sum += weight[j];
  for (int64_t j = 0; j < how.top_k; ++j) weight[j] /= sum;
}

// out[r] = sum_j weight[r, j] * ys[at[r, j]], the products rounded apart
// from the sums (as torch's mul then add_), in rank order.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
inline void combine_row(const float* ys, const int64_t* at, const float* weight, int64_t k, int64_t dim, float* out) {
  const float* y0 = ys + at[0] * dim;
  for (int64_t i = 0; i < dim; ++i) out[i] = y0[i] * weight[0];
  for (int64_t j = 1; j < k; ++j) {
    const float* y = ys + at[j] * dim;
    const float w = weight[j];
    for (int64_t i = 0; i < dim; ++i) {
      const float product = y[i] * w;
      out[i] += product;
    }
  }
}
#pragma GCC pop_options

// The MLP of a mixture's layer for ``rows`` normed rows ``x`` [rows, dim]
// into ``out`` [rows, dim]; ``experts`` points at the first expert's
// kExpertParts weights.
inline void moe_mlp(const float* x, int64_t rows, int64_t dim, const Routing& how, const torch::Tensor* experts,
                    int64_t isa, float* out) {
  const int64_t k = how.top_k, pairs = rows * k;
  std::vector<int64_t> chosen(pairs);
  std::vector<float> weight(pairs);
  constexpr int64_t kRouteGrain = 4;  // rows: a row's router is some 10 us at 64 experts of 2048
  over_rows_of(rows, kRouteGrain, [&](int64_t r) {
    std::vector<float> p(how.experts);
    TRIOSERVE_BY_ISA(isa, router_logits(x + r * dim, how.router, how.experts, dim, p.data()));
    route_row(p.data(), how, chosen.data() + r * k, weight.data() + r * k);
  });
  // Each pair's place among the pairs sorted by expert, then by row.
  std::vector<int64_t> start(how.experts + 1, 0), at(pairs);
  for (int64_t i = 0; i < pairs; ++i) ++start[chosen[i] + 1];
  for (int64_t e = 0; e < how.experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> cursor(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) at[i] = cursor[chosen[i]]++;
  const int64_t inter = out_channels(experts[0]) / 2;
  std::vector<float> xs(pairs * dim), gate_up(pairs * 2 * inter), act(pairs * inter), ys(pairs * dim);
  constexpr int64_t kCopyGrain = 16;
  over_rows_of(pairs, kCopyGrain, [&](int64_t i) { std::copy_n(x + (i / k) * dim, dim, xs.data() + at[i] * dim); });
  // The experts with rows, one parallel region for all of them: each
  // thread takes whole experts (its linears then run inline, on one
  // thread), where a region per linear (16 a layer at one row) each waited
  // for the other thread on a busy machine. Which thread runs an expert
  // changes none of its bits.
  std::vector<int64_t> used;
  for (int64_t e = 0; e < how.experts; ++e)
    if (start[e + 1] > start[e]) used.push_back(e);
  parallel_chunks(int64_t(used.size()), 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = used[i], first = start[e], count = start[e + 1] - first;
      const torch::Tensor* w = experts + e * kExpertParts;
      float* gu = gate_up.data() + first * 2 * inter;
      float* a = act.data() + first * inter;
      Linear{w[0], w[1], torch::Tensor()}(xs.data() + first * dim, count, dim, gu, isa);
      for (int64_t r = 0; r < count; ++r) {
        const float* g = gu + r * 2 * inter;
        TRIOSERVE_BY_ISA(isa, silu_mul(g, g + inter, a + r * inter, inter));
      }
      Linear{w[2], w[3], torch::Tensor()}(a, count, inter, ys.data() + first * dim, isa);
    }
  });
  constexpr int64_t kCombineGrain = 8;
  over_rows_of(rows, kCombineGrain, [&](int64_t r) {
    combine_row(ys.data(), at.data() + r * k, weight.data() + r * k, k, dim, out + r * dim);
  });
}
