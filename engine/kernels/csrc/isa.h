// The float kernels' vector primitives, once per ISA variant: a namespace
// each (scalar_isa, avx2_isa, avx512_isa) defining the same names, Vec and
// kWidth, vzero / vset / vload (from float, c10::Half, c10::BFloat16, and
// int8 widened: vload_i8) / vstore / vstore_half, vadd / vneg / vmul /
// vdiv / vfma / vmin / vmax, vsum (a vector's lanes added) and vexp.
//
// Code written once against these names is compiled once per ISA by
// including its header inside each namespace, between that ISA's
// TRIOSERVE_ISA_BEGIN_* and TRIOSERVE_ISA_END (the function target it
// needs), as decode.cpp does with attend.h and kernels.h with rows.h:
//
//   TRIOSERVE_ISA_BEGIN_AVX2
//   namespace avx2_isa {
//   #include "attend.h"
//   }
//   TRIOSERVE_ISA_END
//
// scalar_isa stays outside any target: its vfma is a product then a sum,
// each rounded, where a target with FMA would let the compiler fuse them.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#define TRIOSERVE_ISA_BEGIN_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define TRIOSERVE_ISA_BEGIN_AVX512 _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,fma,f16c\")")
#define TRIOSERVE_ISA_END _Pragma("GCC pop_options")

// ``call`` (a function compiled per ISA, with its arguments) in the
// namespace of the variant that runs ``isa`` (kernels.h's Isa): avx512_isa
// from kAvx512 up, avx2_isa from kAvx2, else scalar_isa.
#define TRIOSERVE_BY_ISA(isa, call) \
  ((isa) >= kAvx512 ? avx512_isa::call : (isa) >= kAvx2 ? avx2_isa::call : scalar_isa::call)

namespace trioserve_native {

inline float widen(float v) { return v; }
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

namespace scalar_isa {
using Vec = float;
constexpr int64_t kWidth = 1;
inline Vec vzero() { return 0.f; }
inline Vec vset(float v) { return v; }
template <typename T>
inline Vec vload(const T* p) { return widen(*p); }
inline Vec vload_i8(const int8_t* p) { return float(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float vsum(Vec v) { return v; }
inline void vstore(float* p, Vec v) { *p = v; }
inline Vec vexp(Vec v) { return std::exp(v); }
inline Vec vadd(Vec a, Vec b) { return a + b; }
inline Vec vneg(Vec a) { return -a; }
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline Vec vdiv(Vec a, Vec b) { return a / b; }
// As std::min / std::max: a NaN in the second argument comes through.
inline Vec vmin(Vec a, Vec b) { return std::min(b, a); }
inline Vec vmax(Vec a, Vec b) { return std::max(b, a); }
inline void vstore_half(c10::Half* p, Vec v) { *p = c10::Half(v); }
}  // namespace scalar_isa

TRIOSERVE_ISA_BEGIN_AVX2
namespace avx2_isa {
using Vec = __m256;
constexpr int64_t kWidth = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec vload(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Vec vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b, rounded once
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vneg(Vec a) { return _mm256_sub_ps(_mm256_setzero_ps(), a); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }  // a NaN in b comes through
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vround(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for whole numbers n in the exponent's range.
inline Vec vpow2(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline void vstore_half(c10::Half* p, Vec v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#include "vexp.h"
}  // namespace avx2_isa
TRIOSERVE_ISA_END

TRIOSERVE_ISA_BEGIN_AVX512
namespace avx512_isa {
using Vec = __m512;
constexpr int64_t kWidth = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec vload(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vneg(Vec a) { return _mm512_sub_ps(_mm512_setzero_ps(), a); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }  // a NaN in b comes through
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vround(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2(Vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline void vstore_half(c10::Half* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#include "vexp.h"
}  // namespace avx512_isa
TRIOSERVE_ISA_END

}  // namespace trioserve_native
