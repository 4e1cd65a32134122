// Loads and stores of 16 floats from/to float, bfloat16 and float16 memory.
//
// Two implementations of the same element-wise contract:
//  * AVX-512 (F+BW+VL): explicit intrinsics; tails use masked loads/stores.
//  * portable: scalar code written so that gcc -O3 -fno-math-errno
//    auto-vectorises it (AVX2 machines, other architectures).
// Float -> bfloat16 is round-to-nearest-even with NaN -> 0x7fc0, bit for bit
// what c10::BFloat16 does, so a bf16 copy written here equals param.to(bf16).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    !defined(ZFUNC_PORTABLE)
#define ZFUNC_AVX512 1
#include <immintrin.h>
#elif defined(__F16C__)
#include <immintrin.h>
#endif

namespace zf {

// Storage types of 2-byte floats (bit patterns; the math is always float).
struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };
// "No low-precision copy" marker for the templates.
struct none {};

// ------------------------------------------------------------ scalar rules

inline uint32_t f32_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float bits_f32(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return bits_f32(uint32_t(x.bits) << 16); }

inline uint16_t f32_to_bf16_bits(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

#if defined(__F16C__)
inline float to_f32(f16 x) { return _cvtsh_ss(x.bits); }
inline uint16_t f32_to_f16_bits(float x) {
  return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#else
// IEEE binary16 <-> binary32 in integer arithmetic (round to nearest even).
inline float to_f32(f16 x) {
  uint32_t h = x.bits, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {                                                     // zero / subnormal
    if (man == 0) return bits_f32(sign);
    float f = float(man) * (1.0f / 16777216.0f);                        // man * 2^-24, exact
    return sign ? -f : f;
  }
  return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}
inline uint16_t f32_to_f16_bits(float x) {
  uint32_t u = f32_bits(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ff));  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to inf (or is inf)
  if (a < 0x38800000u) {  // result subnormal or zero: round a * 2^24 to an integer
    float f = bits_f32(a) * 16777216.0f;  // exact scaling
    uint32_t i = uint32_t(f), r = f - float(i) > 0.5f || (f - float(i) == 0.5f && (i & 1));
    return uint16_t(sign | (i + r));
  }
  uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
  return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}
#endif

template <class T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) { return bf16{f32_to_bf16_bits(x)}; }
template <> inline f16 from_f32<f16>(float x) { return f16{f32_to_f16_bits(x)}; }

// ------------------------------------------------------------ AVX-512 rules
#ifdef ZFUNC_AVX512
using vf = __m512;
constexpr int kLanes = 16;

template <bool Masked> inline __m256i ld16x16(const void* p, __mmask16 k) {
  return Masked ? _mm256_maskz_loadu_epi16(k, p) : _mm256_loadu_si256((const __m256i*)p);
}
template <bool Masked> inline void st16x16(void* p, __m256i h, __mmask16 k) {
  if (Masked) _mm256_mask_storeu_epi16(p, k, h);
  else _mm256_storeu_si256((__m256i*)p, h);
}

template <bool Masked> inline vf vload(const float* p, __mmask16 k) {
  return Masked ? _mm512_maskz_loadu_ps(k, p) : _mm512_loadu_ps(p);
}
template <bool Masked> inline vf vload(const bf16* p, __mmask16 k) {
  __m512i w = _mm512_cvtepu16_epi32(ld16x16<Masked>(p, k));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
template <bool Masked> inline vf vload(const f16* p, __mmask16 k) {
  return _mm512_cvtph_ps(ld16x16<Masked>(p, k));
}

template <bool Masked> inline void vstore(float* p, vf x, __mmask16 k) {
  if (Masked) _mm512_mask_storeu_ps(p, k, x);
  else _mm512_storeu_ps(p, x);
}
template <bool Masked> inline void vstore(bf16* p, vf x, __mmask16 k) {
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  st16x16<Masked>(p, _mm512_cvtepi32_epi16(r), k);
}
template <bool Masked> inline void vstore(f16* p, vf x, __mmask16 k) {
  st16x16<Masked>(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), k);
}
inline __mmask16 tail_mask(int64_t n) { return __mmask16((1u << n) - 1u); }
#endif

}  // namespace zf
