// A whole decode step's decoder layers in one call: trioserve::decode_layers.
//
// At one row a step is some 200 small torch ops per layer besides the
// matmuls (norms, rotary, the cache write, the gather and attention, the
// activation); each costs a few microseconds of dispatch and allocation, and
// over 30 layers they took more time than the weights (docs/benchmarks.md,
// "A lean decode step"). Here the layer loop runs natively: the projections
// on the native linears of kernels.h, everything else as plain loops over
// buffers allocated once per call. Only batches whose every row decodes one
// token come here (engine/kernels/native_decode.py); prefill stays in torch.
//
// The math is the model's (engine/models/llama.py DecoderLayer.forward): RMSNorm,
// fused q/k/v, each q and k head's own RMSNorm where the layer has one
// (Qwen3), rotary with the rotate-half tables the model passes in, the
// new key and value stored into the cache first (rounded as the cache's
// dtype rounds them, float16 saturating), attention over the cache, o plus
// residual, RMSNorm, SwiGLU, down plus residual; a mixture-of-experts layer's
// MLP is its routed experts instead (moe_step.h). tests/test_native_decode_families.py
// holds the two to one definition for every family the engine loads, and
// engine/kernels/native_decode.py refuses a layer this does not compute.
//
// The per-row work is written once (attend.h) on isa.h's primitives and
// compiled per ISA below; attention over 64-wide heads has its own AVX2
// and AVX-512 paths (attend64), whose sums run in other orders.

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace trioserve_native {
namespace {

constexpr int64_t kHead64 = 64;

// Token after token of one sequence's context in a paged pool: each call
// the next token's head (no division per token).
template <typename T>
struct Tokens {
  const T* pool;
  const int64_t* table;
  int64_t block_size, token_stride;
  int64_t block = 0, offset = 0;
  const T* next() {
    const T* head = pool + (table[block] * block_size + offset) * token_stride;
    if (++offset == block_size) offset = 0, ++block;
    return head;
  }
};

// How far ahead of the products the keys and values are fetched. The cache
// is paged and larger than the CPU caches (at 32 streams a step reads about
// twice the weights' bytes of it), and without this the products waited on
// each token's load: on AVX-512 most of the loop's samples sat on the first
// use of a load, and 30 layers at 32 rows of 192 tokens took 14 ms against
// 16.5 with it.
constexpr int64_t kFetchAhead = 24;

// A 64-wide head's key into L1 and its value into L2 (the values are used
// in a second pass, after all the keys).
template <typename T>
inline void fetch_head64(const T* k, const T* v) {
  for (int64_t line = 0; line < int64_t(sizeof(T)) * kHead64; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(k) + line, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v) + line, _MM_HINT_T1);
  }
}

// The keys and values of a context kFetchAhead tokens ahead of the one in
// use: the first kFetchAhead fetched at construction, then one more each
// next() (one call per token used).
template <typename T>
struct FetchAhead {
  Tokens<T> keys, values;
  int64_t context, fetched = 0;
  FetchAhead(Tokens<T> k, Tokens<T> v, int64_t n) : keys(k), values(v), context(n) {
    for (; fetched < std::min(kFetchAhead, context); ++fetched) fetch_head64(keys.next(), values.next());
  }
  void next() {
    if (fetched < context) fetch_head64(keys.next(), values.next()), ++fetched;
  }
};

}  // namespace

namespace scalar_isa {
#include "attend.h"
#include "moe_router.h"
}  // namespace scalar_isa

TRIOSERVE_ISA_BEGIN_AVX2
namespace avx2_isa {
#include "attend.h"
#include "moe_router.h"

constexpr int kHeadsAtOnce = 3;  // 12 value accumulators, 3 weights and a value of 16 registers
constexpr int64_t kTokensAtOnce = 8;  // sums8

// The horizontal sums of v[0..7], in order.
inline __m256 sums8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// attend() for 64-wide heads, G of them (at most kHeadsAtOnce; q, out: G *
// 64 floats): each token's key widened once for the G heads (attend()
// widens it per head) and its products summed across lanes 8 tokens at a
// time (sums8) rather than token by token; the keys and values fetched
// kFetchAhead tokens ahead; the values' products kept in registers, half a
// head (one 64-byte line of float16) a pass over the context, where
// attend() loads and stores each head's output per token. ``scores`` holds
// G * padded floats (padded: the context rounded up to 8). 30 layers at 32
// rows of 192 tokens on a 2-core Zen 3, best of 25 in five runs: 11.1-16.4
// ms against 15.5-20.7 with a reduction per token, no fetching ahead and
// the value pass one register short (without fetching ahead, 14.6-19.6).
template <typename T, int G>
void attend_heads64(const float* q, Tokens<T> keys, Tokens<T> values, int64_t context, float scale, int64_t padded,
                    float* scores, float* out) {
  FetchAhead<T> ahead(keys, values, context);
  const Vec scaled = vset(scale);
  for (int64_t t0 = 0; t0 < context; t0 += 8) {
    Vec part[G][8];
    const int64_t n = std::min<int64_t>(8, context - t0);
    for (int i = 0; i < 8; ++i) {
      if (i >= n) {
        for (int g = 0; g < G; ++g) part[g][i] = vzero();
        continue;
      }
      ahead.next();
      const T* k = keys.next();
      Vec kv[8];
      for (int j = 0; j < 8; ++j) kv[j] = vload(k + 8 * j);
      for (int g = 0; g < G; ++g) {
        const float* qg = q + g * kHead64;
        Vec even = vmul(vload(qg), kv[0]), odd = vmul(vload(qg + 8), kv[1]);
        for (int j = 2; j < 8; j += 2) {
          even = vfma(vload(qg + 8 * j), kv[j], even);
          odd = vfma(vload(qg + 8 * j + 8), kv[j + 1], odd);
        }
        part[g][i] = vadd(even, odd);
      }
    }
    for (int g = 0; g < G; ++g) vstore(scores + g * padded + t0, vmul(sums8(part[g]), scaled));
  }
  for (int g = 0; g < G; ++g) softmax(scores + g * padded, context);
  for (int64_t half = 0; half < kHead64; half += 32) {
    Vec o[G][4];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) o[g][j] = vzero();
    Tokens<T> tokens = values;
    for (int64_t t = 0; t < context; ++t) {
      const T* v = tokens.next() + half;
      Vec p[G];
      for (int g = 0; g < G; ++g) p[g] = vset(scores[g * padded + t]);
      for (int j = 0; j < 4; ++j) {  // one value vector at a time: 12 sums, 3 weights and it fit the registers
        const Vec vj = vload(v + 8 * j);
        for (int g = 0; g < G; ++g) o[g][j] = vfma(p[g], vj, o[g][j]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < 4; ++j) vstore(out + g * kHead64 + half + 8 * j, o[g][j]);
  }
}

#include "attend64.h"
}  // namespace avx2_isa
TRIOSERVE_ISA_END

TRIOSERVE_ISA_BEGIN_AVX512
namespace avx512_isa {
#include "attend.h"
#include "moe_router.h"

// ---- attention for 64-wide heads, a few query heads at a time ---------------
// attend() above reduces every (token, query head) dot product across its
// vector at once and loads and stores the output per token: at 32 decode
// rows its reductions and dependent chains took a quarter of a step. Here up
// to four query heads of a KV head take each key's four vectors together,
// the products of 16 tokens are summed across their lanes in one transpose
// tree (sums16), and the outputs stay in registers over the whole context.
// The same sums in a different order than attend(): a row's result does not
// depend on the batch it runs in (each row runs alone through the same code).

// The horizontal sums of v[0..15], in order.
inline __m512 sums16(const __m512* v) {
  __m512 w[8], z[4], u[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr int kHeadsAtOnce = 4;
constexpr int64_t kTokensAtOnce = 16;  // sums16

// G query heads (q, out: G * 64 floats) over one sequence's context, as
// attend() does for a group; ``scores`` holds G * padded floats (padded:
// the context rounded up to 16).
template <typename T, int G>
void attend_heads64(const float* q, Tokens<T> keys, Tokens<T> values, int64_t context, float scale,
                   int64_t padded, float* scores, float* out) {
  __m512 qv[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) qv[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + g * kHead64 + 16 * j), _mm512_set1_ps(scale));
  // Each token's key and value, kFetchAhead tokens before the key is used;
  // the values are used in the second pass, after all the keys.
  FetchAhead<T> ahead(keys, values, context);
  for (int64_t t0 = 0; t0 < context; t0 += 16) {
    __m512 part[G][16];
    const int64_t n = std::min<int64_t>(16, context - t0);
    for (int i = 0; i < 16; ++i) {
      if (i >= n) {
        for (int g = 0; g < G; ++g) part[g][i] = _mm512_setzero_ps();
        continue;
      }
      ahead.next();
      const T* k = keys.next();
      const __m512 k0 = vload(k), k1 = vload(k + 16), k2 = vload(k + 32), k3 = vload(k + 48);
      for (int g = 0; g < G; ++g)
        part[g][i] = _mm512_fmadd_ps(qv[g][3], k3, _mm512_fmadd_ps(qv[g][2], k2,
                     _mm512_fmadd_ps(qv[g][1], k1, _mm512_mul_ps(qv[g][0], k0))));
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * padded + t0, sums16(part[g]));
  }
  for (int g = 0; g < G; ++g) softmax(scores + g * padded, context);  // attend.h's
  __m512 o[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) o[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < context; ++t) {
    const T* v = values.next();
    const __m512 v0 = vload(v), v1 = vload(v + 16), v2 = vload(v + 32), v3 = vload(v + 48);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * padded + t]);
      o[g][0] = _mm512_fmadd_ps(p, v0, o[g][0]);
      o[g][1] = _mm512_fmadd_ps(p, v1, o[g][1]);
      o[g][2] = _mm512_fmadd_ps(p, v2, o[g][2]);
      o[g][3] = _mm512_fmadd_ps(p, v3, o[g][3]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + g * kHead64 + 16 * j, o[g][j]);
}

#include "attend64.h"
}  // namespace avx512_isa
TRIOSERVE_ISA_END

}  // namespace trioserve_native

namespace {

using namespace trioserve_native;

// The weights of one layer, in this order, in the flat list the op takes;
// an empty tensor is "none" (a bias, a q or k norm), or "not int8" (a
// scale). A dense layer has no router: an empty kRouter and kRouting. A
// mixture-of-experts layer has empty kGateUp to kDownScale, its float32
// router [experts, dim] and int64 routing [2] (top k, renormalise), and
// after its kParts each expert's kExpertParts (moe_step.h): its layers
// take more of the list than a dense one's.
enum Part : int64_t {
  kInputNorm, kQkv, kQkvScale, kQkvBias, kQNorm, kKNorm, kO, kOScale, kOBias, kPostNorm, kGateUp, kGateUpScale,
  kDown, kDownScale, kRouter, kRouting, kParts
};

// A linear weight's output channels, in either 4-bit layout or int8.
// Q8_0 lanes blocks (q8_lanes_avx2.h: avx512vnni holds a projection's int8
// groups so, lanes_vnni.h) are uint8 [out / 16, in / 32, 576].
bool is_q8_lanes(const torch::Tensor& w) {
  return w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == kQ8LanesBlockBytes;
}
// Q6_K lanes blocks (q6k_lanes_vnni.h: avx512vnni holds a file's Q6_K
// projections so) are uint8 [out / 16, in / 256, 3328], their float16 d
// [out / 16, in / 256, 16] as the scale.
bool is_q6k_lanes(const torch::Tensor& w) {
  return w.dim() == 3 && w.scalar_type() == at::kByte && w.size(2) == kQ6kLanesBytes;
}
int64_t out_channels(const torch::Tensor& w) {
  return is_q8_lanes(w) || is_q6k_lanes(w) ? w.size(0) * kLanesChannels : w.dim() == 3 ? q4_out(w) : w.size(0);
}

struct Linear {
  // uint8 [out, in / 32, 20] 4-bit blocks (or [out / 16, in / 32, 320]
  // lanes blocks: lanes_avx2.h, lanes_vnni.h), or Q8_0 lanes blocks
  // [out / 16, in / 32, 576] (their steps inside), or Q6_K lanes blocks
  // [out / 16, in / 256, 3328] with their float16 d [out / 16, in / 256, 16]
  // as the scale, or int8 [out, in] with a float32
  // scale per channel ([out]) or per group of 32 inputs ([out, in / 32]:
  // GGUF's Q8_0, what a file's wider matrices are held in)
  const torch::Tensor& weight;
  const torch::Tensor& scale;
  const torch::Tensor& bias;

  int64_t out() const { return out_channels(weight); }

  void operator()(const float* x, int64_t rows, int64_t k, float* y, int64_t isa) const {
    if (is_q8_lanes(weight)) q8g_lanes_by_isa(x, rows, k, weight.data_ptr<uint8_t>(), out(), y, isa);
    else if (is_q6k_lanes(weight))
      q6k_lanes_by_isa(x, rows, k, weight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>()),
                       out(), y, isa);
    else if (weight.dim() == 3) q4_blocks_matmul(x, rows, k, weight, y, isa);
    else if (scale.dim() == 2) q8g_matmul(x, rows, k, weight.data_ptr<int8_t>(), scale.data_ptr<float>(), out(), y, isa);
    else q8_matmul(x, rows, k, weight.data_ptr<int8_t>(), scale.data_ptr<float>(), out(), y, isa);
    if (bias.numel() == 0) return;
    const float* b = bias.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < out(); ++n) y[r * out() + n] += b[n];
  }
};

void check_linear(const torch::Tensor& w, const torch::Tensor& scale, const torch::Tensor& bias, int64_t in,
                  const char* what) {
  if (is_q8_lanes(w)) {
    TORCH_CHECK(w.size(1) * kGroup == in && scale.numel() == 0, what, ": Q8_0 lanes blocks must be uint8 [out / 16, ",
                in / kGroup, ", 576], without a scale");
  } else if (is_q6k_lanes(w)) {
    TORCH_CHECK(w.size(1) * kQ6kSuper == in && scale.scalar_type() == at::kHalf && scale.dim() == 3 &&
                    scale.size(0) == w.size(0) && scale.size(1) == w.size(1) && scale.size(2) == kLanesChannels,
                what, ": Q6_K lanes blocks must be uint8 [out / 16, ", in / kQ6kSuper, ", 3328] with their d float16 [out / 16, ",
                in / kQ6kSuper, ", 16] as the scale");
  } else if (w.dim() == 3) {
    TORCH_CHECK(is_q4_blocks(w) && w.size(1) * kGroup == in, what, ": 4-bit blocks must be uint8 [out, ",
                in / kGroup, ", 20] or lanes blocks [out / 16, ", in / kGroup, ", 320]");
  } else {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) == in, what, ": int8 weight must be [out, ",
                in, "]");
    const bool per_channel = scale.dim() == 1 && scale.numel() == w.size(0);
    const bool per_group = scale.dim() == 2 && in % kGroup == 0 && scale.size(0) == w.size(0) && scale.size(1) * kGroup == in;
    TORCH_CHECK(scale.scalar_type() == at::kFloat && (per_channel || per_group), what,
                ": scale must be float32 [out] or [out, in / 32]");
  }
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous() && bias.is_contiguous(), what, ": tensors must be contiguous");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == out_channels(w)), what,
              ": bias must be float32 [out]");
}

// Rows in chunks of at least ``grain`` over torch's threads: a few rows run
// inline, below what a parallel region costs.
template <typename F>
void over_rows_of(int64_t rows, int64_t grain, const F& f) {
  parallel_chunks(rows, grain, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

#include "moe_step.h"

// Each layer's first weight in the op's list (moe_step.h: a mixture's layer
// takes its experts' weights too), and the list's end last.
std::vector<int64_t> layer_starts(const std::vector<torch::Tensor>& weights, int64_t layers) {
  std::vector<int64_t> starts{0};
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t at = starts.back();
    TORCH_CHECK(at + kParts <= int64_t(weights.size()), "decode_layers: ", kParts, " weights per layer expected");
    const torch::Tensor& router = weights[at + kRouter];
    starts.push_back(at + kParts + (router.numel() == 0 ? 0 : router.size(0) * kExpertParts));
  }
  return starts;
}

// The weight of a layer's q or k head norm, or none.
const float* head_norm(const torch::Tensor& w) { return w.numel() == 0 ? nullptr : w.data_ptr<float>(); }

// (Each head of q and k first normed by its own RMSNorm where the layer
// has ``q_norm`` and ``k_norm``: Qwen3.)
// Rotary on each row's q and k heads (in place in ``qkv``), the new key and
// value stored at the row's slot, then attention over the row's context:
// ``out`` [rows, heads * head_dim]. ``key``/``value`` are one layer's pools.
// Every row's slot is written before any row attends: in a verification the
// rows of one sequence read each other's.
template <typename T>
void attention_step(float* qkv, T* key, T* value, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    int64_t block_size, const float* cos, const float* sin, const int64_t* slots,
                    const int64_t* tables, int64_t table_stride, const int64_t* context_lens, float scale,
                    int64_t isa, float* out, const float* q_norm = nullptr, const float* k_norm = nullptr,
                    float eps = 0.f) {
  const int64_t group = heads / kv_heads, q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t qkv_out = q_width + 2 * kv_width, token_stride = kv_width;
  constexpr int64_t kRotaryGrain = 8;  // rows: a row's rotary and store are some 200 ns
  over_rows_of(rows, kRotaryGrain, [&](int64_t r) {
    float* row = qkv + r * qkv_out;
    const float *c = cos + r * head_dim, *s = sin + r * head_dim;
    for (int64_t h = 0; h < heads + kv_heads && q_norm != nullptr; ++h)  // in place: a row's sum comes first
      TRIOSERVE_BY_ISA(isa, rms_norm_row(row + h * head_dim, h < heads ? q_norm : k_norm, head_dim, eps,
                                         row + h * head_dim));
    for (int64_t h = 0; h < heads + kv_heads; ++h)
      TRIOSERVE_BY_ISA(isa, rotate_half(row + h * head_dim, c, s, head_dim));
    TRIOSERVE_BY_ISA(isa, store_cache<T>(key + slots[r] * kv_width, row + q_width, kv_width));
    TRIOSERVE_BY_ISA(isa, store_cache<T>(value + slots[r] * kv_width, row + q_width + kv_width, kv_width));
  });
  parallel_chunks(rows * kv_heads, 1, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, kv = item % kv_heads, context = context_lens[r];
      scores.resize(group * context);
      // Query heads kv * group .. (kv + 1) * group - 1 share KV head kv.
      const float* q = qkv + r * qkv_out + kv * group * head_dim;
      const T* k = key + kv * head_dim;
      const T* v = value + kv * head_dim;
      const int64_t* table = tables + r * table_stride;
      float* o = out + r * heads * head_dim + kv * group * head_dim;
      if (isa >= kAvx512 && head_dim == kHead64)
        avx512_isa::attend64<T>(q, group, k, v, table, context, block_size, token_stride, scale, scores, o);
      else if (isa >= kAvx512 && head_dim % avx512_isa::kWidth == 0)
        avx512_isa::attend<T>(q, group, k, v, table, context, block_size, token_stride, head_dim, scale, scores.data(), o);
      else if (isa >= kAvx2 && head_dim == kHead64)
        avx2_isa::attend64<T>(q, group, k, v, table, context, block_size, token_stride, scale, scores, o);
      else if (isa >= kAvx2 && head_dim % avx2_isa::kWidth == 0)
        avx2_isa::attend<T>(q, group, k, v, table, context, block_size, token_stride, head_dim, scale, scores.data(), o);
      else
        scalar_isa::attend<T>(q, group, k, v, table, context, block_size, token_stride, head_dim, scale, scores.data(), o);
    }
  });
}

template <typename T>
torch::Tensor decode_impl(const torch::Tensor& hidden, const std::vector<torch::Tensor>& weights,
                          const torch::Tensor& key_cache, const torch::Tensor& value_cache, const torch::Tensor& cos,
                          const torch::Tensor& sin, const torch::Tensor& slots, const torch::Tensor& tables,
                          const torch::Tensor& context_lens, int64_t heads, int64_t kv_heads, double eps_in,
                          double scale_in, int64_t isa) {
  const float eps = float(eps_in), scale = float(scale_in);
  const int64_t rows = hidden.size(0), dim = hidden.size(1), layers = key_cache.size(0);
  const int64_t block_size = key_cache.size(2), head_dim = key_cache.size(4);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t qkv_out = q_width + 2 * kv_width;
  const int64_t layer_stride = key_cache.stride(0);
  const std::vector<int64_t> starts = layer_starts(weights, layers);
  int64_t inter = 0;  // the widest dense MLP's
  for (int64_t l = 0; l < layers; ++l)
    if (weights[starts[l] + kRouter].numel() == 0)
      inter = std::max(inter, out_channels(weights[starts[l] + kGateUp]) / 2);

  torch::Tensor residual = hidden.clone();
  auto buffer = [&](int64_t n) { return torch::empty({rows, n}, hidden.options()); };
  torch::Tensor x = buffer(dim), qkv = buffer(qkv_out), attn = buffer(q_width), gate_up = buffer(2 * inter);
  torch::Tensor act = buffer(inter), proj = buffer(dim);
  float* res = residual.data_ptr<float>();
  float *xp = x.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(), *attnp = attn.data_ptr<float>();
  float *gup = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>(), *projp = proj.data_ptr<float>();
  const float *cosp = cos.data_ptr<float>(), *sinp = sin.data_ptr<float>();
  const int64_t* slotp = slots.data_ptr<int64_t>();

  // Rows a chunk of the per-row work takes at least: a row's norm is some
  // 100 ns, its SwiGLU a microsecond; a parallel region costs a few.
  constexpr int64_t kNormGrain = 16, kSiluGrain = 4;
  over_rows_of(rows, kNormGrain, [&](int64_t r) {
    TRIOSERVE_BY_ISA(isa, rms_norm_row(res + r * dim, weights[kInputNorm].data_ptr<float>(), dim, eps, xp + r * dim));
  });
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + starts[l];
    Linear{w[kQkv], w[kQkvScale], w[kQkvBias]}(xp, rows, dim, qkvp, isa);
    attention_step<T>(qkvp, key_cache.data_ptr<T>() + l * layer_stride, value_cache.data_ptr<T>() + l * layer_stride,
                      rows, heads, kv_heads, head_dim, block_size, cosp, sinp, slotp, tables.data_ptr<int64_t>(),
                      tables.size(1), context_lens.data_ptr<int64_t>(), scale, isa, attnp, head_norm(w[kQNorm]),
                      head_norm(w[kKNorm]), eps);
    Linear{w[kO], w[kOScale], w[kOBias]}(attnp, rows, q_width, projp, isa);
    over_rows_of(rows, kNormGrain, [&](int64_t r) {  // the residual, then the post-attention norm
      float* rr = res + r * dim;
      for (int64_t i = 0; i < dim; ++i) rr[i] += projp[r * dim + i];
      TRIOSERVE_BY_ISA(isa, rms_norm_row(rr, w[kPostNorm].data_ptr<float>(), dim, eps, xp + r * dim));
    });
    if (w[kRouter].numel() != 0) {
      const int64_t* routing = w[kRouting].data_ptr<int64_t>();
      const Routing how{w[kRouter].data_ptr<float>(), w[kRouter].size(0), routing[0], routing[1] != 0};
      moe_mlp(xp, rows, dim, how, w + kParts, isa, projp);
    } else {
      const int64_t width = out_channels(w[kGateUp]) / 2;
      Linear{w[kGateUp], w[kGateUpScale], torch::Tensor()}(xp, rows, dim, gup, isa);
      over_rows_of(rows, kSiluGrain, [&](int64_t r) {
        const float* g = gup + r * 2 * width;
        TRIOSERVE_BY_ISA(isa, silu_mul(g, g + width, actp + r * width, width));
      });
      Linear{w[kDown], w[kDownScale], torch::Tensor()}(actp, rows, width, projp, isa);
    }
    const float* next_norm = l + 1 < layers ? weights[starts[l + 1] + kInputNorm].data_ptr<float>() : nullptr;
    over_rows_of(rows, kNormGrain, [&](int64_t r) {  // the residual, then the next layer's input norm
      float* rr = res + r * dim;
      for (int64_t i = 0; i < dim; ++i) rr[i] += projp[r * dim + i];
      if (next_norm != nullptr) TRIOSERVE_BY_ISA(isa, rms_norm_row(rr, next_norm, dim, eps, xp + r * dim));
    });
  }
  return residual;
}

// The row tensors both ops take, checked against the pools (``blocks`` of
// ``block_size`` slots): a bad slot or table would write or read out of them.
void check_rows(int64_t blocks, int64_t block_size, int64_t rows, const torch::Tensor& slots,
                const torch::Tensor& block_tables, const torch::Tensor& context_lens) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows && context_lens.scalar_type() == at::kLong &&
                  context_lens.numel() == rows && block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.size(0) == rows && slots.is_contiguous() && context_lens.is_contiguous() &&
                  block_tables.is_contiguous(),
              "trioserve decode: slots, context_lens [rows] and block_tables [rows, blocks] must be contiguous int64");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* table = block_tables.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= block_tables.size(1) * block_size, "trioserve decode: row ", r,
                " context ", lens[r], " exceeds its block table");
    TORCH_CHECK(slot[r] >= 0 && slot[r] < blocks * block_size, "trioserve decode: row ", r, " slot out of the cache");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b) {
      const int64_t block = table[r * block_tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < blocks, "trioserve decode: row ", r, " block ", block, " out of the cache");
    }
  }
}

}  // namespace

torch::Tensor decode_layers(const torch::Tensor& hidden, std::vector<torch::Tensor> weights,
                            const torch::Tensor& key_cache, const torch::Tensor& value_cache, const torch::Tensor& cos,
                            const torch::Tensor& sin, const torch::Tensor& slots, const torch::Tensor& block_tables,
                            const torch::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                            double scale, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(),
              "decode_layers: hidden must be contiguous float32 [rows, hidden]");
  const int64_t rows = hidden.size(0), dim = hidden.size(1);
  TORCH_CHECK(key_cache.dim() == 5 && key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.scalar_type() == value_cache.scalar_type(),
              "decode_layers: key and value caches must be contiguous [layers, blocks, block_size, kv_heads, head_dim]");
  const int64_t layers = key_cache.size(0), head_dim = key_cache.size(4);
  TORCH_CHECK(key_cache.size(3) == num_kv_heads && num_heads % num_kv_heads == 0 && head_dim % 2 == 0,
              "decode_layers: heads do not match the cache");
  const std::vector<int64_t> starts = layer_starts(weights, layers);
  TORCH_CHECK(starts.back() == int64_t(weights.size()), "decode_layers: ", kParts,
              " weights per layer expected, and a mixture's experts' after them");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.numel() == rows * head_dim &&
                  sin.scalar_type() == at::kFloat && sin.is_contiguous() && sin.numel() == rows * head_dim,
              "decode_layers: cos and sin must be contiguous float32 [rows, head_dim]");
  check_rows(key_cache.size(1), key_cache.size(2), rows, slots, block_tables, context_lens);
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + starts[l];
    TORCH_CHECK(w[kInputNorm].numel() == dim && w[kPostNorm].numel() == dim, "decode_layers: norm weights");
    for (const Part norm : {kQNorm, kKNorm})
      TORCH_CHECK((w[norm].numel() == 0 || (w[norm].numel() == head_dim && w[norm].scalar_type() == at::kFloat &&
                                            w[norm].is_contiguous())) &&
                      (w[norm].numel() == 0) == (w[kQNorm].numel() == 0),
                  "decode_layers: q and k norms must both be float32 [head_dim], or both none");
    check_linear(w[kQkv], w[kQkvScale], w[kQkvBias], dim, "decode_layers qkv");
    TORCH_CHECK(out_channels(w[kQkv]) == q_width + 2 * kv_width, "decode_layers: qkv rows");
    check_linear(w[kO], w[kOScale], w[kOBias], q_width, "decode_layers o");
    TORCH_CHECK(out_channels(w[kO]) == dim, "decode_layers: layer ", l, " shapes");
    if (w[kRouter].numel() == 0) {
      check_linear(w[kGateUp], w[kGateUpScale], torch::Tensor(), dim, "decode_layers gate_up");
      check_linear(w[kDown], w[kDownScale], torch::Tensor(), out_channels(w[kGateUp]) / 2, "decode_layers down");
      TORCH_CHECK(out_channels(w[kDown]) == dim && out_channels(w[kGateUp]) % 2 == 0, "decode_layers: layer ", l,
                  " shapes");
      continue;
    }
    const torch::Tensor &router = w[kRouter], &routing = w[kRouting];
    TORCH_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 && router.size(1) == dim &&
                    router.is_contiguous(),
                "decode_layers: a router must be contiguous float32 [experts, hidden]");
    TORCH_CHECK(routing.scalar_type() == at::kLong && routing.numel() == 2 && routing.is_contiguous() &&
                    routing.data_ptr<int64_t>()[0] >= 1 && routing.data_ptr<int64_t>()[0] <= router.size(0),
                "decode_layers: routing must be int64 [top k in 1..experts, renormalise]");
    const torch::Tensor* experts = w + kParts;
    const int64_t inter = out_channels(experts[0]) / 2;
    for (int64_t e = 0; e < router.size(0); ++e) {
      const torch::Tensor* x = experts + e * kExpertParts;
      check_linear(x[0], x[1], torch::Tensor(), dim, "decode_layers expert gate_up");
      check_linear(x[2], x[3], torch::Tensor(), inter, "decode_layers expert down");
      TORCH_CHECK(out_channels(x[0]) == 2 * inter && out_channels(x[2]) == dim, "decode_layers: layer ", l,
                  " expert ", e, " shapes");
    }
  }
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      return decode_impl<float>(hidden, weights, key_cache, value_cache, cos, sin, slots, block_tables, context_lens,
                                num_heads, num_kv_heads, eps, scale, isa);
    case at::kHalf:
      return decode_impl<c10::Half>(hidden, weights, key_cache, value_cache, cos, sin, slots, block_tables,
                                    context_lens, num_heads, num_kv_heads, eps, scale, isa);
    case at::kBFloat16:
      return decode_impl<c10::BFloat16>(hidden, weights, key_cache, value_cache, cos, sin, slots, block_tables,
                                        context_lens, num_heads, num_kv_heads, eps, scale, isa);
    default:
      TORCH_CHECK(false, "decode_layers: a ", key_cache.scalar_type(), " cache is not supported");
  }
}

// Rotary, the cache write and paged attention of one layer for a batch of
// decode rows, between the model's own projections (engine/kernels/native_attention.py):
// returns [rows, heads * head_dim]. ``key_cache``/``value_cache`` are one
// layer's [blocks, block_size, kv_heads, head_dim] pools.
torch::Tensor decode_attention(const torch::Tensor& qkv_in, const torch::Tensor& key_cache,
                               const torch::Tensor& value_cache, const torch::Tensor& cos, const torch::Tensor& sin,
                               const torch::Tensor& slots, const torch::Tensor& block_tables,
                               const torch::Tensor& context_lens, int64_t num_heads, double scale, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.scalar_type() == value_cache.scalar_type(),
              "decode_attention: key and value pools must be contiguous [blocks, block_size, kv_heads, head_dim]");
  const int64_t kv_heads = key_cache.size(2), head_dim = key_cache.size(3), rows = qkv_in.size(0);
  TORCH_CHECK(num_heads % kv_heads == 0 && head_dim % 2 == 0, "decode_attention: heads do not match the cache");
  TORCH_CHECK(qkv_in.scalar_type() == at::kFloat && qkv_in.dim() == 2 &&
                  qkv_in.size(1) == (num_heads + 2 * kv_heads) * head_dim,
              "decode_attention: qkv must be float32 [rows, (heads + 2 kv_heads) * head_dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.numel() == rows * head_dim &&
                  sin.scalar_type() == at::kFloat && sin.is_contiguous() && sin.numel() == rows * head_dim,
              "decode_attention: cos and sin must be contiguous float32 [rows, head_dim]");
  check_rows(key_cache.size(0), key_cache.size(1), rows, slots, block_tables, context_lens);
  torch::Tensor qkv = qkv_in.clone(at::MemoryFormat::Contiguous);  // rotated in place
  torch::Tensor out = torch::empty({rows, num_heads * head_dim}, qkv.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    attention_step<T>(qkv.data_ptr<float>(), key_cache.data_ptr<T>(), value_cache.data_ptr<T>(), rows, num_heads,
                      kv_heads, head_dim, key_cache.size(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
                      slots.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(), block_tables.size(1),
                      context_lens.data_ptr<int64_t>(), float(scale), isa, out.data_ptr<float>());
  };
  switch (key_cache.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(c10::Half{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "decode_attention: a ", key_cache.scalar_type(), " cache is not supported");
  }
  return out;
}

TORCH_LIBRARY_IMPL(trioserve, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_attention", &decode_attention);
}
