// A GGUF file's blocks put into the forms the kernels hold, at load, one
// pass over the bytes each (engine/loading/gguf_weights.py, compressed.py,
// engine/kernels/int4_native.py, q4k_blocks.py, q8_lanes.py, q6k_lanes.py
// call them):
//
//   trioserve::q4k_steps(data) -> (scale, zero)
//       Q4_K rows (uint8 [out, n * 144]) as Int4Weight's float32 step
//       ``d sc`` and offset ``8 d sc - dmin min`` of each sub-block of 32
//       ([out, n * 8]).
//   trioserve::q4k_values(data) -> q
//       and its values (uint8 [out, n * 256], 0..15).
//   trioserve::q4k_lanes_into(data, scale, zero, lanes)
//       Q4_K rows and their steps (q4k_steps's) as 4-bit lanes blocks
//       (q4_lanes_into's), straight from the file's nibbles: the values
//       never made.
//   trioserve::q4_lanes_into(q, scale, zero, group_size, lanes)
//       Int4Weight's values and steps (group_size a multiple of 32) as the
//       4-bit lanes blocks (uint8 [out / 16, in / 32, 320],
//       int4_native.to_lanes's layout), written into ``lanes``.
//   trioserve::q6k_to_q8g_into(data, q, scale)
//       Q6_K rows (uint8 [out, n * 210], every d finite) rounded into int8
//       groups of 32 (GGUF's Q8_0, as rtn.quantize_int8_groups rounds: a
//       group's largest magnitude to 127), written into q (int8 [out, n *
//       256]) and its float32 steps (scale [out, n * 8]).
//   trioserve::q8_lanes_into(q, scale, blocks)
//       int8 groups of 32 as Q8_0 lanes blocks (uint8 [out / 16, in / 32,
//       576], q8_lanes.Q8Lanes.of's layout).
//   trioserve::q6k_lanes_into(data, lanes, d)
//       Q6_K rows as Q6_K lanes blocks and their d (q6k_lanes.to_lanes's
//       layout: lanes uint8 [out / 16, blocks, 3328], d float16 [out / 16,
//       blocks, 16]).
//   trioserve::q8g_round_into(dense, q, scale) -> bool
//       float32 rows rounded into int8 groups of 32 the same way; false
//       where a group was not finite (left for numpy's arithmetic).
//
// Why native: numpy took these a few hundred MB/s (a 1B model's Q4_K_M
// file: 3.3 CPU seconds of a 7.4-second start in the Q4_K decode and the
// lanes packing alone); here each is one pass at memory speed.
//
// Every result has the bits of the numpy path it replaces (the tests
// compare them on random blocks): the same float32 operations in the same
// order, each rounded once. The code is plain C++ for the baseline x86-64
// target (SSE2): no FMA to contract a product and a sum into one rounding,
// and no CPU feature needed but F16C's float16 conversion, taken at run
// time where the CPU has it (the same bits as the fallback), so it runs
// alike under TRIOSERVE_CPU_ASSUME=avx2 and on any x86-64 CPU. It runs on the calling thread, as the numpy it replaces did
// (gguf_weights._CHUNK_BYTES says why).

#include <torch/all.h>
#include <torch/library.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kChannels = 16;  // a lanes panel
constexpr int64_t kQ4kBytes = 144;  // a Q4_K super-block of 256: d, dmin, 12 bytes of (sc, min), 128 of nibbles
constexpr int64_t kQ6kBytes = 210;  // a Q6_K super-block of 256: 128 low nibbles, 64 high pairs, 16 int8 sc, d
constexpr int64_t kSuper = 256;
constexpr int64_t kLanesWords = 80;  // a 4-bit lanes block: 64 words of nibbles, then 16 d and 16 m (float16)
constexpr int64_t kQ8LanesBytes = 576;  // q8_lanes: 16 channels' 32 values, then their 16 float32 steps
constexpr int64_t kQ6kLanesBytes = 3328;  // q6k_lanes: a panel and super-block, without its d
constexpr int64_t kQ6kPairBytes = kQ6kLanesBytes / 4;  // two groups of 32 inputs

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// float32 to float16 bits, to nearest even, inf beyond the range: torch's
// .half(). c10's conversion in integer arithmetic, a few nanoseconds each,
// was most of q4_lanes_into's time; F16C's VCVTPS2PH rounds alike (to
// nearest even, its immediate), eight at a time, on every CPU that has it
// (all with AVX2), chosen at run time so the library still needs none.
void halves_c10(const float* in, uint16_t* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = c10::Half(in[i]).x;
}

__attribute__((target("avx,f16c"))) void halves_f16c(const float* in, uint16_t* out, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = c10::Half(in[i]).x;
}

using Halves = void (*)(const float*, uint16_t*, int);

Halves halves() { return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx") ? halves_f16c : halves_c10; }

void check_rows(const torch::Tensor& t, at::ScalarType type, const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), what);
}

// gguf-py's Q4_K.get_scale_min: the 12 bytes of 6-bit (sc, min) pairs.
inline void scale_min(const uint8_t* p, uint8_t sc[8], uint8_t mins[8]) {
  for (int i = 0; i < 4; ++i) {
    sc[i] = p[i] & 0x3F;
    mins[i] = p[4 + i] & 0x3F;
    sc[4 + i] = (p[8 + i] & 0x0F) | ((p[i] >> 2) & 0x30);
    mins[4 + i] = (p[8 + i] >> 4) | ((p[4 + i] >> 2) & 0x30);
  }
}

int64_t q4k_blocks(const torch::Tensor& data, const char* what) {
  check_rows(data, at::kByte, what);
  TORCH_CHECK(data.size(1) % kQ4kBytes == 0, what, ": a row of ", data.size(1), " bytes is not whole blocks");
  return data.size(1) / kQ4kBytes;
}

std::tuple<torch::Tensor, torch::Tensor> q4k_steps(const torch::Tensor& data) {
  const int64_t n = q4k_blocks(data, "q4k_steps: data must be contiguous uint8 [out, blocks * 144]");
  const int64_t out = data.size(0);
  torch::Tensor scale = torch::empty({out, n * 8}, data.options().dtype(at::kFloat));
  torch::Tensor zero = torch::empty_like(scale);
  const uint8_t* src = data.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  float* zp = zero.data_ptr<float>();
  for (int64_t b = 0; b < out * n; ++b) {
    const uint8_t* block = src + b * kQ4kBytes;
    const float d = half_at(block), dmin = half_at(block + 2);
    uint8_t sc[8], mins[8];
    scale_min(block + 4, sc, mins);
    for (int i = 0; i < 8; ++i) {
      const float step = d * static_cast<float>(sc[i]);
      const float offset = dmin * static_cast<float>(mins[i]);
      sp[b * 8 + i] = step;
      zp[b * 8 + i] = step * 8.0f - offset;
    }
  }
  return {scale, zero};
}

torch::Tensor q4k_values(const torch::Tensor& data) {
  const int64_t n = q4k_blocks(data, "q4k_values: data must be contiguous uint8 [out, blocks * 144]");
  const int64_t out = data.size(0);
  torch::Tensor q = torch::empty({out, n * kSuper}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  for (int64_t b = 0; b < out * n; ++b) {
    // A chunk of 32 bytes: its low nibbles are sub-block 2j, its high ones 2j + 1.
    const uint8_t* nibbles = src + b * kQ4kBytes + 16;
    uint8_t* values = qp + b * kSuper;
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 32; ++i) {
        values[64 * j + i] = nibbles[32 * j + i] & 0x0F;
        values[64 * j + 32 + i] = nibbles[32 * j + i] >> 4;
      }
    }
  }
  return q;
}

void check_lanes(const torch::Tensor& lanes, int64_t out, int64_t k, const char* what) {
  TORCH_CHECK(out % kChannels == 0, what, ": ", out, " rows are not whole panels of 16");
  TORCH_CHECK(lanes.scalar_type() == at::kByte && lanes.is_contiguous() && lanes.dim() == 3 &&
                  lanes.size(0) == out / kChannels && lanes.size(1) == k / kGroup && lanes.size(2) == 4 * kLanesWords,
              what, ": lanes must be contiguous uint8 [out / 16, in / 32, 320]");
}

void q4k_lanes_into(const torch::Tensor& data, const torch::Tensor& scale, const torch::Tensor& zero,
                    torch::Tensor lanes) {
  const int64_t n = q4k_blocks(data, "q4k_lanes_into: data must be contiguous uint8 [out, blocks * 144]");
  const int64_t out = data.size(0), k = n * kSuper, groups = n * 8, row_bytes = data.size(1);
  check_rows(scale, at::kFloat, "q4k_lanes_into: scale must be contiguous float32 [out, in / 32]");
  check_rows(zero, at::kFloat, "q4k_lanes_into: zero must be contiguous float32 [out, in / 32]");
  TORCH_CHECK(scale.size(0) == out && scale.size(1) == groups && zero.sizes() == scale.sizes(),
              "q4k_lanes_into: scale and zero must be [out, in / 32]");
  check_lanes(lanes, out, k, "q4k_lanes_into");
  const uint8_t* src = data.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  uint32_t* dst = reinterpret_cast<uint32_t*>(lanes.data_ptr<uint8_t>());
  const Halves to_halves = halves();
  float dm[2 * kChannels];
  for (int64_t p = 0; p < out / kChannels; ++p) {
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t* block = dst + (p * groups + g) * kLanesWords;
      // Group g is sub-block g % 8 of super-block g / 8: the low (even) or
      // high (odd) nibbles of its chunk of 32 bytes. A lanes block's byte i
      // holds values i and i + 16 of the group (int4_native._nibbles).
      const int64_t offset = (g / 8) * kQ4kBytes + 16 + 32 * ((g % 8) / 2);
      const bool high = g % 2;
      for (int64_t c = 0; c < kChannels; ++c) {
        const int64_t row = p * kChannels + c;
        const uint8_t* chunk = src + row * row_bytes + offset;
        uint8_t bytes[16];
        if (high) {
          for (int i = 0; i < 16; ++i) bytes[i] = static_cast<uint8_t>((chunk[i] >> 4) | (chunk[i + 16] & 0xF0));
        } else {
          for (int i = 0; i < 16; ++i) bytes[i] = static_cast<uint8_t>((chunk[i] & 0x0F) | (chunk[i + 16] << 4));
        }
        uint32_t words[4];
        std::memcpy(words, bytes, sizeof(words));
        for (int i = 0; i < 4; ++i) block[16 * i + c] = words[i];
        const float d = sp[row * groups + g];
        dm[c] = d;
        dm[kChannels + c] = zp[row * groups + g] - 8.0f * d;
      }
      to_halves(dm, reinterpret_cast<uint16_t*>(block + 64), 2 * kChannels);  // the 16 d, then the 16 m
    }
  }
}

void q4_lanes_into(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& zero, int64_t group_size,
                   torch::Tensor lanes) {
  check_rows(q, at::kByte, "q4_lanes_into: q must be contiguous uint8 [out, in]");
  check_rows(scale, at::kFloat, "q4_lanes_into: scale must be contiguous float32 [out, in / group_size]");
  check_rows(zero, at::kFloat, "q4_lanes_into: zero must be contiguous float32 [out, in / group_size]");
  const int64_t out = q.size(0), k = q.size(1);
  TORCH_CHECK(group_size > 0 && group_size % kGroup == 0 && k % group_size == 0,
              "q4_lanes_into: group size ", group_size, " must be a multiple of 32 dividing ", k);
  TORCH_CHECK(scale.size(0) == out && scale.size(1) == k / group_size && zero.sizes() == scale.sizes(),
              "q4_lanes_into: scale and zero must be [out, in / group_size]");
  check_lanes(lanes, out, k, "q4_lanes_into");
  const int64_t groups = k / kGroup, repeat = group_size / kGroup, steps = k / group_size;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  uint32_t* dst = reinterpret_cast<uint32_t*>(lanes.data_ptr<uint8_t>());
  const Halves to_halves = halves();
  float dm[2 * kChannels];
  for (int64_t p = 0; p < out / kChannels; ++p) {
    for (int64_t g = 0; g < groups; ++g) {
      uint32_t* block = dst + (p * groups + g) * kLanesWords;
      for (int64_t c = 0; c < kChannels; ++c) {
        const int64_t row = p * kChannels + c;
        // int4_native._nibbles: the group's 32 values as four uint64 words,
        // the high two shifted by 4 onto the low two (bit for bit, also for
        // a value above 15, whose bits then cross into the next byte).
        uint64_t w[4];
        std::memcpy(w, qp + row * k + g * kGroup, sizeof(w));
        const uint64_t packed[2] = {(w[2] << 4) | w[0], (w[3] << 4) | w[1]};
        uint32_t words[4];
        std::memcpy(words, packed, sizeof(words));
        for (int i = 0; i < 4; ++i) block[16 * i + c] = words[i];
        // int4_native._steps: d = scale, m = zero - 8 d, in float32.
        const float d = sp[row * steps + g / repeat];
        dm[c] = d;
        dm[kChannels + c] = zp[row * steps + g / repeat] - 8.0f * d;
      }
      to_halves(dm, reinterpret_cast<uint16_t*>(block + 64), 2 * kChannels);  // the 16 d, then the 16 m
    }
  }
}

// 1.5 * 2^23: added to a float32 below 2^22 in magnitude and taken away
// again, it leaves the value rounded to an integer, to nearest even (the
// default rounding mode's): np.rint without SSE4.1's ROUNDPS, which the
// baseline target lacks (std::nearbyint was a library call a value).
constexpr float kRoundMagic = 12582912.0f;

// rtn.quantize_int8_groups (compressed._round_into) of one group of 32
// float32 values: its largest magnitude over 127 as the step, each value
// over the step rounded to nearest even and clipped to +-127 (clipped
// first here: the same integers, and the trick above then holds). Returns
// whether the group was finite: numpy's NaN and infinity cases are not
// reproduced, so the caller redoes a group that was not. In SSE2, which
// every x86-64 CPU has: the compiler left the scalar loop scalar (its
// clip and its cast to int8), 5 ns a value.
inline bool round_group(const float* v, int8_t* q, float* step) {
  const __m128 magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
  __m128 amax = _mm_setzero_ps(), bad = _mm_setzero_ps();
  __m128 x[8];
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm_loadu_ps(v + 4 * i);
    amax = _mm_max_ps(amax, _mm_and_ps(x[i], magnitude));
    const __m128 zero_if_finite = _mm_mul_ps(x[i], _mm_setzero_ps());  // NaN for an infinity or a NaN
    bad = _mm_or_ps(bad, _mm_cmpunord_ps(zero_if_finite, zero_if_finite));
  }
  if (_mm_movemask_ps(bad)) return false;
  amax = _mm_max_ps(amax, _mm_shuffle_ps(amax, amax, _MM_SHUFFLE(1, 0, 3, 2)));
  amax = _mm_max_ps(amax, _mm_shuffle_ps(amax, amax, _MM_SHUFFLE(2, 3, 0, 1)));
  const float s = _mm_cvtss_f32(amax) / 127.0f;
  const __m128 divisor = _mm_set1_ps(s > 0.0f ? s : 1.0f);
  const __m128 low = _mm_set1_ps(-127.0f), high = _mm_set1_ps(127.0f), magic = _mm_set1_ps(kRoundMagic);
  __m128i words[8];
  for (int i = 0; i < 8; ++i) {
    const __m128 clipped = _mm_min_ps(_mm_max_ps(_mm_div_ps(x[i], divisor), low), high);
    words[i] = _mm_cvttps_epi32(_mm_sub_ps(_mm_add_ps(clipped, magic), magic));  // whole numbers: exact
  }
  for (int i = 0; i < 2; ++i) {
    const __m128i lo = _mm_packs_epi32(words[4 * i], words[4 * i + 1]);
    const __m128i hi = _mm_packs_epi32(words[4 * i + 2], words[4 * i + 3]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i), _mm_packs_epi16(lo, hi));
  }
  *step = s;
  return true;
}

void q6k_to_q8g_into(const torch::Tensor& data, torch::Tensor q, torch::Tensor scale) {
  check_rows(data, at::kByte, "q6k_to_q8g_into: data must be contiguous uint8 [out, blocks * 210]");
  TORCH_CHECK(data.size(1) % kQ6kBytes == 0, "q6k_to_q8g_into: a row of ", data.size(1), " bytes is not whole blocks");
  const int64_t out = data.size(0), n = data.size(1) / kQ6kBytes;
  check_rows(q, at::kChar, "q6k_to_q8g_into: q must be contiguous int8 [out, blocks * 256]");
  check_rows(scale, at::kFloat, "q6k_to_q8g_into: scale must be contiguous float32 [out, blocks * 8]");
  TORCH_CHECK(q.size(0) == out && q.size(1) == n * kSuper && scale.size(0) == out && scale.size(1) == n * 8,
              "q6k_to_q8g_into: q must be [out, blocks * 256] and scale [out, blocks * 8]");
  const uint8_t* src = data.data_ptr<uint8_t>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  float values[kSuper];
  for (int64_t b = 0; b < out * n; ++b) {
    const uint8_t* block = src + b * kQ6kBytes;
    const float d = half_at(block + 208);
    // gguf_weights._q6_k_into: value 128 h + 64 l + i of a block (half h,
    // low/high nibble l) is (u - 32) with u's low bits from byte 64 h + i
    // (nibble l) and its high two from byte 128 + 32 h + i % 32, bits 2 (2 l
    // + i / 32); its step is d sc[its sub-block of 16], then w = (u - 32) step.
    // The 256 values u - 32 first, as bytes (loops the compiler vectorizes),
    // then each sub-block of 16 times its step d sc.
    int8_t u[kSuper];
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 2; ++l) {
        for (int half = 0; half < 2; ++half) {  // i / 32: values 32 apart take their high bits 2 apart
          const uint8_t* low = block + 64 * h + 32 * half;
          const uint8_t* high = block + 128 + 32 * h;
          int8_t* into = u + 128 * h + 64 * l + 32 * half;
          const int low_shift = 4 * l, high_shift = 2 * (2 * l + half);
          for (int i = 0; i < 32; ++i) {
            into[i] = static_cast<int8_t>((((low[i] >> low_shift) & 0x0F) | (((high[i] >> high_shift) & 0x03) << 4)) - 32);
          }
        }
      }
    }
    for (int sub = 0; sub < 16; ++sub) {
      const float step = d * static_cast<float>(static_cast<int8_t>(block[192 + sub]));
      for (int i = 0; i < 16; ++i) values[16 * sub + i] = static_cast<float>(u[16 * sub + i]) * step;
    }
    for (int g = 0; g < 8; ++g) {
      TORCH_CHECK(round_group(values + kGroup * g, qp + b * kSuper + kGroup * g, sp + b * 8 + g),
                  "q6k_to_q8g_into: block ", b, " has a d that is not finite");
    }
  }
}

// Returns whether every group was finite; a group that was not is left for
// the caller (numpy's arithmetic) to round.
bool q8g_round_into(const torch::Tensor& dense, torch::Tensor q, torch::Tensor scale) {
  check_rows(dense, at::kFloat, "q8g_round_into: dense must be contiguous float32 [rows, in]");
  check_rows(q, at::kChar, "q8g_round_into: q must be contiguous int8 [rows, in]");
  check_rows(scale, at::kFloat, "q8g_round_into: scale must be contiguous float32 [rows, in / 32]");
  TORCH_CHECK(dense.sizes() == q.sizes() && dense.size(1) % kGroup == 0 && scale.size(0) == dense.size(0) &&
                  scale.size(1) == dense.size(1) / kGroup,
              "q8g_round_into: shapes must be dense [rows, in], q [rows, in], scale [rows, in / 32]");
  const float* v = dense.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  bool finite = true;
  for (int64_t g = 0; g < dense.numel() / kGroup; ++g) finite &= round_group(v + kGroup * g, qp + kGroup * g, sp + g);
  return finite;
}

void q8_lanes_into(const torch::Tensor& q, const torch::Tensor& scale, torch::Tensor blocks) {
  check_rows(q, at::kChar, "q8_lanes_into: q must be contiguous int8 [out, in]");
  check_rows(scale, at::kFloat, "q8_lanes_into: scale must be contiguous float32 [out, in / 32]");
  const int64_t out = q.size(0), k = q.size(1), groups = k / kGroup;
  TORCH_CHECK(out % kChannels == 0 && k % kGroup == 0 && scale.size(0) == out && scale.size(1) == groups,
              "q8_lanes_into: q must be whole panels of 16 rows and groups of 32, scale [out, in / 32]");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.dim() == 3 &&
                  blocks.size(0) == out / kChannels && blocks.size(1) == groups && blocks.size(2) == kQ8LanesBytes,
              "q8_lanes_into: blocks must be contiguous uint8 [out / 16, in / 32, 576]");
  const uint16_t* pairs = reinterpret_cast<const uint16_t*>(q.data_ptr<int8_t>());
  const float* sp = scale.data_ptr<float>();
  uint8_t* dst = blocks.data_ptr<uint8_t>();
  for (int64_t p = 0; p < out / kChannels; ++p) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* block = dst + (p * groups + g) * kQ8LanesBytes;
      uint16_t* values = reinterpret_cast<uint16_t*>(block);  // [pair of the group][channel]
      float* steps = reinterpret_cast<float*>(block + kChannels * kGroup);
      for (int64_t c = 0; c < kChannels; ++c) {
        const int64_t row = p * kChannels + c;
        const uint16_t* from = pairs + (row * k + g * kGroup) / 2;
        for (int j = 0; j < kGroup / 2; ++j) values[kChannels * j + c] = from[j];
        steps[c] = sp[row * groups + g];
      }
    }
  }
}

void q6k_lanes_into(const torch::Tensor& data, torch::Tensor lanes, torch::Tensor d) {
  check_rows(data, at::kByte, "q6k_lanes_into: data must be contiguous uint8 [out, blocks * 210]");
  TORCH_CHECK(data.size(1) % kQ6kBytes == 0, "q6k_lanes_into: a row of ", data.size(1), " bytes is not whole blocks");
  const int64_t out = data.size(0), n = data.size(1) / kQ6kBytes, row_bytes = data.size(1);
  TORCH_CHECK(out % kChannels == 0, "q6k_lanes_into: ", out, " rows are not whole panels of 16");
  TORCH_CHECK(lanes.scalar_type() == at::kByte && lanes.is_contiguous() && lanes.dim() == 3 &&
                  lanes.size(0) == out / kChannels && lanes.size(1) == n && lanes.size(2) == kQ6kLanesBytes,
              "q6k_lanes_into: lanes must be contiguous uint8 [out / 16, blocks, 3328]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 3 && d.size(0) == out / kChannels &&
                  d.size(1) == n && d.size(2) == kChannels,
              "q6k_lanes_into: d must be contiguous float16 [out / 16, blocks, 16]");
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = lanes.data_ptr<uint8_t>();
  uint8_t* d_dst = reinterpret_cast<uint8_t*>(d.data_ptr<at::Half>());
  for (int64_t p = 0; p < out / kChannels; ++p) {
    for (int64_t s = 0; s < n; ++s) {
      uint8_t* lane = dst + (p * n + s) * kQ6kLanesBytes;
      uint32_t* words = reinterpret_cast<uint32_t*>(lane);
      for (int64_t c = 0; c < kChannels; ++c) {
        const uint8_t* block = src + (p * kChannels + c) * row_bytes + s * kQ6kBytes;
        uint32_t ql[32], qh[16];
        std::memcpy(ql, block, sizeof(ql));
        std::memcpy(qh, block + 128, sizeof(qh));
        // q6k_lanes._panels_into: word f = 32 half + 16 nibble + w (of the
        // 64 a row and super-block, 4 values each) is u's word (g, h, q) =
        // (f / 8, f / 4 % 2, f % 4); its low bits from ql word (half, w),
        // its high bits from qh word (half, f % 32 % 8) shifted by 2 (f % 32 / 8).
        uint32_t u[64];
        for (int f = 0; f < 64; ++f) {
          const int half = f / 32, nibble = f / 16 % 2, w = f % 16, m = f % 32 / 8, word = f % 8;
          const uint32_t low = (ql[16 * half + w] >> (4 * nibble)) & 0x0F0F0F0Fu;
          const uint32_t high = (qh[8 * half + word] >> (2 * m)) & 0x03030303u;
          u[f] = low | (high << 4);
        }
        // Each (g, h)'s words A, B, C keep its word W[3] in their top two bits;
        // pair P = g / 2 of the super-block, e = g % 2: word ((e 2 + h) 3 + a) 16 + c
        // of the pair's 192, then its 64 bytes of scales at (e 2 + sub) 16 + c.
        for (int g = 0; g < 8; ++g) {
          for (int h = 0; h < 2; ++h) {
            const uint32_t* w4 = u + 8 * g + 4 * h;
            const uint32_t kept[3] = {w4[0] | ((w4[3] & 0x30303030u) << 2), w4[1] | ((w4[3] & 0x0C0C0C0Cu) << 4),
                                      w4[2] | ((w4[3] & 0x03030303u) << 6)};
            uint32_t* pair = words + (g / 2) * (kQ6kPairBytes / 4);
            for (int a = 0; a < 3; ++a) pair[(((g % 2) * 2 + h) * 3 + a) * kChannels + c] = kept[a];
          }
        }
        for (int P = 0; P < 4; ++P) {
          uint8_t* scales = lane + P * kQ6kPairBytes + 768;
          for (int j = 0; j < 4; ++j) scales[j * kChannels + c] = block[192 + 4 * P + j];
        }
        std::memcpy(d_dst + ((p * n + s) * kChannels + c) * 2, block + 208, 2);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trioserve, m) {
  m.def("q4k_steps(Tensor data) -> (Tensor, Tensor)");
  m.def("q4k_values(Tensor data) -> Tensor");
  m.def("q4k_lanes_into(Tensor data, Tensor scale, Tensor zero, Tensor(a!) lanes) -> ()");
  m.def("q4_lanes_into(Tensor q, Tensor scale, Tensor zero, int group_size, Tensor(a!) lanes) -> ()");
  m.def("q6k_to_q8g_into(Tensor data, Tensor(a!) q, Tensor(b!) scale) -> ()");
  m.def("q8_lanes_into(Tensor q, Tensor scale, Tensor(a!) blocks) -> ()");
  m.def("q6k_lanes_into(Tensor data, Tensor(a!) lanes, Tensor(b!) d) -> ()");
  m.def("q8g_round_into(Tensor dense, Tensor(a!) q, Tensor(b!) scale) -> bool");
}

TORCH_LIBRARY_IMPL(trioserve, CPU, m) {
  m.impl("q4k_steps", &q4k_steps);
  m.impl("q4k_values", &q4k_values);
  m.impl("q4k_lanes_into", &q4k_lanes_into);
  m.impl("q4_lanes_into", &q4_lanes_into);
  m.impl("q6k_to_q8g_into", &q6k_to_q8g_into);
  m.impl("q8_lanes_into", &q8_lanes_into);
  m.impl("q6k_lanes_into", &q6k_lanes_into);
  m.impl("q8g_round_into", &q8g_round_into);
}
