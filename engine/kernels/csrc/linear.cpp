// Native linears over compressed weights, taking float32 activations (rounded
// inside on some variants: to int8 in decode steps, to bfloat16 or int16 in
// the panels; kernels.h):
//
//   trioserve::q4_linear(x, blocks, isa)        4-bit groups of 32, w = q * d + m (either layout: lanes_avx2.h,
//                                               lanes_vnni.h)
//   trioserve::q8_linear(x, q, scale, isa)      int8 per output channel, w = q * scale
//   trioserve::q8g_linear(x, q, scale, isa)     int8 in groups of 32 (GGUF's Q8_0), w = q * scale[group]
//                                               (or Q8_0 lanes blocks as q, their steps inside: q8_lanes_avx2.h,
//                                               lanes_vnni.h)
//   trioserve::q4_dequantize(blocks)            4-bit groups to a float32 matrix (q4_dequantize_bf16: bfloat16)
//   trioserve::q8g_dequantize_bf16(q, scale)    int8 groups of 32 to a bfloat16 matrix
//   trioserve::q8g_lanes_rows(lanes, ids)       rows of Q8_0 lanes blocks to float32 (embeddings)
//   trioserve::q6k_linear(x, lanes, d, isa)     GGUF's Q6_K at its own width, w = (u - 32) sc d, as Q6_K lanes
//                                               blocks (q6k_lanes_vnni.h)
//   trioserve::q6k_dequantize_bf16(lanes, d)    Q6_K lanes blocks to a bfloat16 matrix
//   trioserve::isas()                           bit i set: ISA i runs on this CPU
//
// Why native: ATen's packed 4-bit and int8 kernels stream their weights at
// 4-5 GB/s on the CPUs we measured, a fifth of what one decode step could
// reach (docs/benchmarks.md); at one row a step is all weight streaming.
//
// No CPU feature is assumed at build time: each ISA variant is compiled for
// its own target (by function attribute, or in isa.h's per-ISA namespaces
// for the code written once for all of them: rows.h, attend.h), and a call
// names the variant it wants (0 scalar, 1 AVX2+FMA+F16C, 2 the same with
// int8 activations, 3 AVX-512 F/BW, 4 with BF16, 5 with BF16 and VNNI:
// kernels.h's Isa); one the CPU lacks is refused.
// The Python side (engine/kernels/native.py) picks the variant through the
// capability probes, so TRIOSERVE_CPU_ASSUME can force the lower ones.
//
// A 4-bit block is 20 bytes: float16 d, float16 m, then 16 bytes whose low
// nibbles are the group's elements 0..15 and high nibbles 16..31: byte for
// byte GGUF's Q4_1 block, so the default model's weights take the memory
// of its file.

#include "kernels.h"

namespace {

using namespace trioserve_native;

torch::Tensor q4_linear(const torch::Tensor& x_in, const torch::Tensor& blocks_in, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "q4_linear: x must be float32 [rows, in]");
  TORCH_CHECK(is_q4_blocks(blocks_in),
              "q4_linear: blocks must be uint8 [out, in / 32, 20], or lanes blocks [out / 16, in / 32, 320]");
  TORCH_CHECK(x_in.size(1) == blocks_in.size(1) * kGroup, "q4_linear: x has ", x_in.size(1), " inputs, the weight ",
              blocks_in.size(1) * kGroup);
  const torch::Tensor x = x_in.contiguous();
  const torch::Tensor blocks = blocks_in.contiguous();
  torch::Tensor y = torch::empty({x.size(0), q4_out(blocks)}, x.options());
  q4_blocks_matmul(x.data_ptr<float>(), x.size(0), x.size(1), blocks, y.data_ptr<float>(), isa);
  return y;
}

torch::Tensor q8_linear(const torch::Tensor& x_in, const torch::Tensor& q_in, const torch::Tensor& scale_in,
                        int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "q8_linear: x must be float32 [rows, in]");
  TORCH_CHECK(q_in.scalar_type() == at::kChar && q_in.dim() == 2, "q8_linear: q must be int8 [out, in]");
  TORCH_CHECK(scale_in.scalar_type() == at::kFloat && scale_in.dim() == 1 && scale_in.size(0) == q_in.size(0),
              "q8_linear: scale must be float32 [out]");
  TORCH_CHECK(x_in.size(1) == q_in.size(1), "q8_linear: x has ", x_in.size(1), " inputs, the weight ", q_in.size(1));
  const torch::Tensor x = x_in.contiguous();
  const torch::Tensor q = q_in.contiguous();
  const torch::Tensor scale = scale_in.contiguous();
  torch::Tensor y = torch::empty({x.size(0), q.size(0)}, x.options());
  q8_matmul(x.data_ptr<float>(), x.size(0), x.size(1), q.data_ptr<int8_t>(), scale.data_ptr<float>(), q.size(0),
            y.data_ptr<float>(), isa);
  return y;
}

void check_q8g(const torch::Tensor& q, const torch::Tensor& scale, const char* what) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(1) % kGroup == 0, what,
              ": q must be int8 [out, in], in a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.size(0) == q.size(0) &&
                  scale.size(1) * kGroup == q.size(1),
              what, ": scale must be float32 [out, in / 32]");
}

torch::Tensor q8g_linear(const torch::Tensor& x_in, const torch::Tensor& q_in, const torch::Tensor& scale_in,
                         int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "q8g_linear: x must be float32 [rows, in]");
  if (q_in.scalar_type() == at::kByte) {  // Q8_0 lanes blocks (q8_lanes_avx2.h); their steps inside
    TORCH_CHECK(q_in.dim() == 3 && q_in.size(2) == kQ8LanesBlockBytes, "q8g_linear: lanes blocks must be uint8 [out / ",
                kLanesChannels, ", in / 32, ", kQ8LanesBlockBytes, "]");
    TORCH_CHECK(isa == kAvx2Int8 || isa >= kAvx512, "q8g_linear: Q8_0 lanes blocks run on isa ", int64_t(kAvx2Int8),
                " (avx2int8), not isa ", isa, " (nor on AVX-512's from isa ", int64_t(kAvx512), ": lanes_vnni.h)");
    TORCH_CHECK(x_in.size(1) == q_in.size(1) * kGroup, "q8g_linear: x has ", x_in.size(1), " inputs, the weight ",
                q_in.size(1) * kGroup);
    const torch::Tensor x = x_in.contiguous();
    const torch::Tensor lanes = q_in.contiguous();
    const int64_t out = lanes.size(0) * kLanesChannels;
    torch::Tensor y = torch::empty({x.size(0), out}, x.options());
    q8g_lanes_by_isa(x.data_ptr<float>(), x.size(0), x.size(1), lanes.data_ptr<uint8_t>(), out, y.data_ptr<float>(),
                     isa);
    return y;
  }
  check_q8g(q_in, scale_in, "q8g_linear");
  TORCH_CHECK(x_in.size(1) == q_in.size(1), "q8g_linear: x has ", x_in.size(1), " inputs, the weight ", q_in.size(1));
  const torch::Tensor x = x_in.contiguous();
  const torch::Tensor q = q_in.contiguous();
  const torch::Tensor scale = scale_in.contiguous();
  torch::Tensor y = torch::empty({x.size(0), q.size(0)}, x.options());
  q8g_matmul(x.data_ptr<float>(), x.size(0), x.size(1), q.data_ptr<int8_t>(), scale.data_ptr<float>(), q.size(0),
             y.data_ptr<float>(), isa);
  return y;
}

// Rows ``ids`` of a Q8_0 table held as lanes blocks (q8_lanes_avx2.h),
// dequantized: float32 [n, in], a tied model's embeddings.
torch::Tensor q8g_lanes_rows(const torch::Tensor& lanes_in, const torch::Tensor& ids_in) {
  TORCH_CHECK(lanes_in.scalar_type() == at::kByte && lanes_in.dim() == 3 && lanes_in.size(2) == kQ8LanesBlockBytes,
              "q8g_lanes_rows: lanes blocks must be uint8 [out / ", kLanesChannels, ", in / 32, ",
              kQ8LanesBlockBytes, "]");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong && ids_in.dim() == 1, "q8g_lanes_rows: ids must be int64 [n]");
  const torch::Tensor lanes = lanes_in.contiguous();
  const torch::Tensor ids = ids_in.contiguous();
  const int64_t out = lanes.size(0) * kLanesChannels, k = lanes.size(1) * kGroup, n = ids.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)  // here, not inside the parallel loop, which may not throw
    TORCH_CHECK(id[r] >= 0 && id[r] < out, "q8g_lanes_rows: id ", id[r], " is outside the table's ", out, " rows");
  torch::Tensor y = torch::empty({n, k}, torch::dtype(torch::kFloat32));
  q8g_lanes_dequantize(lanes.data_ptr<uint8_t>(), k, id, n, y.data_ptr<float>());
  return y;
}

void check_q6k(const torch::Tensor& lanes, const torch::Tensor& d, const char* what) {
  TORCH_CHECK(lanes.scalar_type() == at::kByte && lanes.dim() == 3 && lanes.size(2) == kQ6kLanesBytes, what,
              ": lanes must be uint8 [out / ", kLanesChannels, ", in / ", kQ6kSuper, ", ", kQ6kLanesBytes, "]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.dim() == 3 && d.size(0) == lanes.size(0) &&
                  d.size(1) == lanes.size(1) && d.size(2) == kLanesChannels,
              what, ": d must be float16 [out / ", kLanesChannels, ", in / ", kQ6kSuper, ", ", kLanesChannels, "]");
}

// GGUF's Q6_K rows held as Q6_K lanes blocks (engine/kernels/q6k_lanes.py),
// their d apart: y = x @ W.T on ``isa`` (q6k_lanes_vnni.h).
torch::Tensor q6k_linear(const torch::Tensor& x_in, const torch::Tensor& lanes_in, const torch::Tensor& d_in,
                         int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "q6k_linear: x must be float32 [rows, in]");
  check_q6k(lanes_in, d_in, "q6k_linear");
  TORCH_CHECK(x_in.size(1) == lanes_in.size(1) * kQ6kSuper, "q6k_linear: x has ", x_in.size(1),
              " inputs, the weight ", lanes_in.size(1) * kQ6kSuper);
  const torch::Tensor x = x_in.contiguous(), lanes = lanes_in.contiguous(), d = d_in.contiguous();
  const int64_t out = lanes.size(0) * kLanesChannels;
  torch::Tensor y = torch::empty({x.size(0), out}, x.options());
  q6k_lanes_by_isa(x.data_ptr<float>(), x.size(0), x.size(1), lanes.data_ptr<uint8_t>(),
                   reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), out, y.data_ptr<float>(), isa);
  return y;
}

// The bfloat16 weight [out, k] of Q6_K lanes blocks (each weight (u - 32)
// (d sc) in float32, rounded to nearest even): a prompt's rows on torch's
// bfloat16 GEMM, as q8g_dequantize_bf16. Needs AVX512_BF16.
torch::Tensor q6k_dequantize_bf16(const torch::Tensor& lanes_in, const torch::Tensor& d_in) {
  check_isa(kAvx512Bf16);
  check_q6k(lanes_in, d_in, "q6k_dequantize_bf16");
  const torch::Tensor lanes = lanes_in.contiguous(), d = d_in.contiguous();
  const int64_t supers = lanes.size(1), out = lanes.size(0) * kLanesChannels, k = supers * kQ6kSuper;
  torch::Tensor w = torch::empty({out, k}, torch::dtype(torch::kBFloat16));
  const uint8_t* src = lanes.data_ptr<uint8_t>();
  const uint16_t* ds = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    // k is a multiple of 256, so a channel's bfloat16 row has no padding.
    for (int64_t n = begin; n < end; ++n)
      q6k_lanes_channel_bf16(src + n / kLanesChannels * supers * kQ6kLanesBytes, ds + n / kLanesChannels * supers * kLanesChannels,
                             supers, n % kLanesChannels, dst + n * k);
  });
  return w;
}

// The float32 weight [out, k] of 4-bit blocks: for many rows, where a GEMM
// over the plain weight beats the GEMV-shaped kernel, one matrix at a time.
torch::Tensor q4_dequantize(const torch::Tensor& blocks_in) {
  TORCH_CHECK(blocks_in.scalar_type() == at::kByte && blocks_in.dim() == 3 && blocks_in.size(2) == kBlockBytes,
              "q4_dequantize: blocks must be uint8 [out, in / 32, 20]");
  const torch::Tensor blocks = blocks_in.contiguous();
  const int64_t out = blocks.size(0), groups = blocks.size(1);
  torch::Tensor w = torch::empty({out, groups * kGroup}, torch::dtype(torch::kFloat32));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  at::parallel_for(0, out * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Block b = block_at(src + i * kBlockBytes);
      float* o = dst + i * kGroup;
      for (int j = 0; j < 16; ++j) {
        o[j] = float(b.qs[j] & 0xF) * b.d + b.m;
        o[j + 16] = float(b.qs[j] >> 4) * b.d + b.m;
      }
    }
  });
  return w;
}

// The same in bfloat16 (each weight computed in float32 as q * d + m, then
// rounded to nearest even, as the bfloat16 panels round it): for a prompt's
// rows on a CPU whose bfloat16 GEMM runs on AMX tiles, where torch's GEMM
// over this matrix beats the panels (engine/kernels/int4_native.py). Needs
// AVX512_BF16.
torch::Tensor q4_dequantize_bf16(const torch::Tensor& blocks_in) {
  check_isa(kAvx512Bf16);
  TORCH_CHECK(blocks_in.scalar_type() == at::kByte && blocks_in.dim() == 3 && blocks_in.size(2) == kBlockBytes,
              "q4_dequantize_bf16: blocks must be uint8 [out, in / 32, 20]");
  const torch::Tensor blocks = blocks_in.contiguous();
  const int64_t out = blocks.size(0), groups = blocks.size(1);
  torch::Tensor w = torch::empty({out, groups * kGroup}, torch::dtype(torch::kBFloat16));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) q4_decode_bf16_avx512(src + n * groups * kBlockBytes, groups, dst + n * groups * kGroup);
  });
  return w;
}

// The bfloat16 weight [out, k] of int8 in groups of 32 (each weight q *
// scale in float32, rounded to nearest even, as the bfloat16 panels round
// it): q4_dequantize_bf16's counterpart for the int8 groups a GGUF's wider
// matrices are held in (engine/kernels/int8_native.py). Needs AVX512_BF16.
torch::Tensor q8g_dequantize_bf16(const torch::Tensor& q_in, const torch::Tensor& scale_in) {
  check_isa(kAvx512Bf16);
  check_q8g(q_in, scale_in, "q8g_dequantize_bf16");
  const torch::Tensor q = q_in.contiguous();
  const torch::Tensor scale = scale_in.contiguous();
  const int64_t out = q.size(0), k = q.size(1);
  torch::Tensor w = torch::empty({out, k}, torch::dtype(torch::kBFloat16));
  const int8_t* src = q.data_ptr<int8_t>();
  const float* steps = scale.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) q8_decode_bf16_avx512(src + n * k, steps + n * (k / kGroup), k, kGroup, dst + n * k, k);
  });
  return w;
}

}  // namespace

TORCH_LIBRARY(trioserve, m) {
  m.def("q4_linear(Tensor x, Tensor blocks, int isa) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor q, Tensor scale, int isa) -> Tensor");
  m.def("isas() -> int", &supported_isas);
  m.def("q4_dequantize(Tensor blocks) -> Tensor");
  m.def("q4_dequantize_bf16(Tensor blocks) -> Tensor");
  m.def("q8g_linear(Tensor x, Tensor q, Tensor scale, int isa) -> Tensor");
  m.def("q8g_dequantize_bf16(Tensor q, Tensor scale) -> Tensor");
  m.def("q8g_lanes_rows(Tensor lanes, Tensor ids) -> Tensor");
  m.def("q6k_linear(Tensor x, Tensor lanes, Tensor d, int isa) -> Tensor");
  m.def("q6k_dequantize_bf16(Tensor lanes, Tensor d) -> Tensor");
  m.def("decode_attention(Tensor qkv, Tensor key_cache, Tensor value_cache, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, Tensor context_lens, int num_heads, float scale, int isa) -> Tensor");
  m.def("decode_layers(Tensor hidden, Tensor[] weights, Tensor key_cache, Tensor value_cache, Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, float eps, float scale, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(trioserve, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("q4_dequantize", &q4_dequantize);
  m.impl("q4_dequantize_bf16", &q4_dequantize_bf16);
  m.impl("q8g_linear", &q8g_linear);
  m.impl("q8g_dequantize_bf16", &q8g_dequantize_bf16);
  m.impl("q8g_lanes_rows", &q8g_lanes_rows);
  m.impl("q6k_linear", &q6k_linear);
  m.impl("q6k_dequantize_bf16", &q6k_dequantize_bf16);
}
