// Shared by inferlab's CPU kernels: reading bf16/fp32 as fp32, and rounding/storing back.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define INFERLAB_AVX512_BF16 1
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define INFERLAB_AVX2 1
#include <immintrin.h>
#endif

// Before a register tile's loops over its rows and vectors: GCC left such loops rolled until after it had decided
// to keep the tile's sums in a stack array, storing every sum to it on every pass of the k loop (8 stores a pass
// in the fp32 kernel's 4 x 2 tile; AVX2 cores store one or two vectors a cycle). Unrolled first, the sums stay in
// registers.
#define INFERLAB_UNROLL _Pragma("GCC unroll 16")

namespace inferlab {

// The int8 KV pool (layers/kv_int8.py): each (head, block) is BS rows of D int8 values, then their BS fp32 scales.
constexpr int64_t kKvScaleBytes = 4;
inline int64_t int8_block_bytes(int64_t BS, int64_t D) { return BS * (D + kKvScaleBytes); }

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to the storage dtype and back, as a separate torch op's output would be.
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const at::BFloat16*) { return static_cast<float>(static_cast<at::BFloat16>(v)); }

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(at::BFloat16* p, int64_t i, float v) { p[i] = static_cast<at::BFloat16>(v); }

#if defined(INFERLAB_AVX512_BF16)
// exp(x) for 16 floats (Cephes' expf: Cody-Waite reduction by ln 2, a degree-6 polynomial, 2^n by vscalefps), within
// ~2 ulp, instead of one glibc expf call per value. Inputs below -87.3 give ~0, as exp does; above ~88.7, inf
// (the clamp at 89 keeps the reduction exact for huge inputs).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 values widened to fp32.
inline __m512 load_bf16x16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 values of either activation dtype as fp32.
inline __m512 load16(const at::BFloat16* p) { return load_bf16x16(p); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// Up to 16 bf16 values (the lanes in `mask`) widened to fp32; the others read as 0.
inline __m512 load_bf16x16(const at::BFloat16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// The bf16 bits of 16 floats, rounded to nearest even exactly as at::BFloat16 rounds (subnormals kept, NaN to
// 0x7FC0); vcvtneps2bf16 would flush subnormals to zero.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// Rounded to bf16, stored in the lanes in `mask`.
inline void store_bf16x16(at::BFloat16* p, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}

// Rounded to bf16 and back: where a separate bf16 op would round.
inline __m512 round_bf16x16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }

// Lane i of the result is the sum of the 16 lanes of v[i]: 16 horizontal sums for 30 shuffles and 15 adds (a
// _mm512_reduce_add_ps each would take ~8 instructions). V: __m512 (fp32 adds) or __m512i (int32 adds, exact); the
// shuffles move bits alike.
template <typename V>
inline V sum_lanes_of_16(const V* in) {
  constexpr bool ints = std::is_same_v<V, __m512i>;
  const auto add = [](__m512 a, __m512 b) {
    if constexpr (ints)
      return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    else
      return _mm512_add_ps(a, b);
  };
  __m512 v[16], w[8], x[4], y[2];
  for (int i = 0; i < 16; ++i) {
    if constexpr (ints) v[i] = _mm512_castsi512_ps(in[i]); else v[i] = in[i];
  }
  for (int i = 0; i < 8; ++i)
    w[i] = add(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    x[i] = add(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = add(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  const __m512 z = add(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512i row_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512 out = _mm512_permutexvar_ps(row_order, z);
  if constexpr (ints) return _mm512_castps_si512(out); else return out;
}

inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
#endif

#if defined(INFERLAB_AVX2)
// exp(x) for 8 floats: exp16's clamp, reduction and polynomial. AVX2 has no vscalefps, so 2^n is built in the
// exponent field, as two factors 2^(n/2) 2^(n - n/2): n runs from -126 to 128, past what one field holds, and
// multiplying by a power of two rounds only where the result leaves the normal range, as vscalefps does.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(89.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
  const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, lo), hi);
}

// The lanes of a vector of 8 below n (all from 8 on): maskload/maskstore's mask for a row's last, partial vector.
inline __m256i first_lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float sum_lanes8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

}  // namespace inferlab
