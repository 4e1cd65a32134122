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
#include <type_traits>

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

// The scalar rules are written without branches (selects only) so that gcc
// vectorises the loops that use them.
inline uint16_t f32_to_bf16_bits(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(rounded);  // NaN
}

// IEEE binary16 <-> binary32 with round to nearest even, in integer and float
// arithmetic (no F16C needed; exact for every input, subnormals included).
inline float to_f32(f16 x) {
  const uint32_t h = x.bits, sign = (h & 0x8000u) << 16, em = h & 0x7fffu;
  // (em << 13) is the half's exponent+mantissa in float position with the
  // exponent bias off by 112: scaling by 2^112 fixes normals and subnormals alike.
  const float finite = bits_f32(em << 13) * 0x1p112f;
  const uint32_t mag = em >= 0x7c00u ? ((em << 13) | 0x7f800000u) : f32_bits(finite);
  return bits_f32(sign | mag);
}
inline uint16_t f32_to_f16_bits(float x) {
  const uint32_t u = f32_bits(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  // normal results: rebias the exponent and round the 13 dropped bits (a carry
  // into the exponent is the right answer, up to inf at 65520)
  const uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // subnormal results: 0.5f has an ulp of 2^-24, so a + 0.5f makes the FPU
  // round a * 2^24 to an integer, which lands in the low mantissa bits
  const float magic = bits_f32(0x3f000000u);  // 0.5f
  const uint32_t sub = f32_bits(bits_f32(a) + magic) - 0x3f000000u;
  const uint32_t big = a > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN or overflow to inf
  const uint32_t mag = a >= 0x477ff000u ? big : a < 0x38800000u ? sub : normal;
  return uint16_t(sign | mag);
}

// Element access through plain scalar types (gcc does not vectorise loads and
// stores of the one-member structs): float stays float, 2-byte floats are uint16_t.
template <class T>
using raw_t = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;

template <class T> inline float load_f32(const T* p, int64_t i) {
  const raw_t<T> x = reinterpret_cast<const raw_t<T>*>(p)[i];
  if constexpr (std::is_same_v<T, float>) return x;
  else return to_f32(T{x});
}
template <class T> inline void store_f32(T* p, int64_t i, float x) {
  raw_t<T>* q = reinterpret_cast<raw_t<T>*>(p);
  if constexpr (std::is_same_v<T, float>) q[i] = x;
  else if constexpr (std::is_same_v<T, bf16>) q[i] = f32_to_bf16_bits(x);
  else q[i] = f32_to_f16_bits(x);
}

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
