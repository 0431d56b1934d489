// Linear layers for small steps on the CPU (decode: one to a few tokens): weight-only int8 and int4 (bf16 weights
// have their own layout and kernel, packed_gemm.cpp).
//
// Why our own: torch 2.13's CPU kernels for quantized weights (aten._weight_int8pack_mm, _weight_int4pack_mm_for_cpu)
// read the weight at ~9 GB/s for one token while torch's bf16 gemv reads at ~20-26 GB/s, so 2-4x fewer bytes bought
// only 1.1-1.2x. These kernels stream the quantized weight once per step and dequantize in registers:
//
//   int8: w = q * scale[n], one scale per output row. Each token's activations become int16 first (a = round(x *
//         16383 / max|x|): 15 bits, finer than bf16's 8-bit mantissa for all but the row's smallest values), q
//         widens to int16 in registers, and vpdpwssd (AVX512-VNNI; vpmaddwd + vpaddd without it) multiplies 32
//         pairs per instruction into int32 lanes, exact; y = lanes summed in fp32 * scale[n] * max|x| / 16383.
//         Widening q to fp32 for fp32 FMAs instead took three instructions per 16 weights and left the kernel
//         compute-bound: Gemma 3's 262k x 640 int8 head ran at 21 GB/s where bf16's ran at 34 (measured).
//   int4: w = d[n, g] * q + m[n, g], q in 0..15, one fp16 (d, m) pair per group of G input columns: GGUF's Q4_1,
//         nibble order included (byte j of a group holds element j in its low nibble and element G/2 + j in its
//         high one), so Q4_1 files load without repacking. A nibble becomes the bf16 number 128 + q by OR-ing
//         0x4300 into its 16-bit lane (exact: 128..143 need four mantissa bits) and AVX512-BF16's vdpbf16ps
//         multiplies pairs of them with the bf16 activations, accumulating in fp32; the offset leaves through the
//         group's activation sum: sum_k w_k x_k = d * dot(128 + q, x) + (m - 128 d) * sum_k x_k.
//         That path still serves group sizes of 64 and more. For G = 32 (Q4_1's own, and the default) the
//         activations are rounded to int8 per group of 32 first, as llama.cpp's Q8_1 (s = max|x| / 127), and
//         vpdpbusd multiplies 64 nibble-activation pairs per instruction into int32 lanes, exact:
//         sum_k w_k x_k = sum_g d s dot(q, a) + m s sum(a). Half the instructions per weight byte: SmolLM2-135M's
//         layers at one token went from 2.8-3.8 to 2.1 ms (22 -> 32 GB/s on two cores), corpus perplexity
//         10.633 -> 10.630 with every prefill chunk on the kernel (bf16 weights: 10.622; `inferlab eval
//         --quantization int4 --no-pack-weights --max-num-batched-tokens 32`).
//
// A tile of NB output rows x MB tokens shares every weight load, so one pass over the weight serves the whole step.
// Row tiles are split over the threads. Without AVX-512 (BW, BF16) at build time, int8 and int4 at G = 32 take
// AVX2 versions of the same integer sums (where the CPU has AVX2), and the rest scalar loops that compute the same
// sums slowly; `gemv_simd()` and `int_gemv_simd()` tell Python which it got, so it can prefer another path.

#include "cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define INFERLAB_GEMV_SIMD 1
#define INFERLAB_GEMV_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// An AVX2-only CPU (an EPYC before Zen 4, an Intel core before Ice Lake): the integer kernels, int8 and int4 with
// int8 activations, have 256-bit versions (vpmaddubsw and vpmaddwd make the same exact integer sums); the kernels
// that multiply bf16 (int4 with G >= 64) stay scalar.
#include <immintrin.h>
#define INFERLAB_GEMV_SIMD 0
#define INFERLAB_GEMV_AVX2 1
#else
#define INFERLAB_GEMV_SIMD 0
#define INFERLAB_GEMV_AVX2 0
#endif

namespace {

using inferlab::load;
using inferlab::store;

constexpr int64_t kTileRows = 4;  // NB: output rows per tile

// Each thread's first tile asks for its own weights and the next kPrefetchBytes, and every later tile for the lines
// that enter that window (its own size, kPrefetchBytes past its start): the loop body spends a dozen instructions
// per cache line converting and multiplying, which fills the out-of-order window before many loads are in flight,
// so without this one core streamed ~7.5 GB/s; with it ~18 GB/s, ~25 GB/s on two cores (SmolLM2-135M's layers,
// int8, one token). The early request is what counts; 4 KiB ahead rather than 1 took the int8 LM head (49152 x 576,
// one token, two cores) from 0.62-0.76 to 0.52-0.56 ms and left the int4 layers as they were; 8 KiB was slower
// for both (measured in one process, alternating). Each tile used to ask for the whole window again (4.5 requests
// a line at K = 576), and perf put as many samples on the loop around the tiles, those requests in it, as on the
// multiplies (int4, one token).
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_range(const char* p, int64_t n, const char* end) {
  n = std::min<int64_t>(n, end - p);
  for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Runs rows(n0, kTileRows) for every full tile of output rows and rows(n, 1) for each row left over, tiles spread
// over the threads, each tile's weights (row_bytes a row) prefetched first.
template <typename Rows>
void for_each_tile(int64_t N, int64_t row_bytes, const void* w, const Rows& rows) {
  const char* base = static_cast<const char*>(w);
  const char* end = base + N * row_bytes;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows, tile_bytes = kTileRows * row_bytes;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t t = begin; t < stop; ++t) {
      const int64_t n0 = t * kTileRows;
      const char* tile = base + n0 * row_bytes;
      if (t == begin) {
        prefetch_range(tile, tile_bytes + kPrefetchBytes, end);
      } else if (tile + kPrefetchBytes < end) {
        prefetch_range(tile + kPrefetchBytes, tile_bytes, end);
      }
      if (n0 + kTileRows <= N) {
        rows(n0, std::integral_constant<int, kTileRows>());
      } else {
        for (int64_t n = n0; n < N; ++n) rows(n, std::integral_constant<int, 1>());
      }
    }
  });
}

// Runs tile(m0, MB) over the step's tokens in blocks of up to Block (at most 4), MB a compile-time constant (the
// register tiles need it); a tile's weight rows stay in L1 between blocks.
template <int64_t Block = 4, typename Tile>
void for_each_token_block(int64_t M, const Tile& tile) {
  for (int64_t m0 = 0; m0 < M; m0 += Block) {
    switch (std::min<int64_t>(Block, M - m0)) {
      case 1: tile(m0, std::integral_constant<int, 1>()); break;
      case 2: tile(m0, std::integral_constant<int, 2>()); break;
      case 3: tile(m0, std::integral_constant<int, 3>()); break;
      default: tile(m0, std::integral_constant<int, 4>()); break;
    }
  }
}

inline float fp16_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// The int8 kernel's activations: per token, int16 of at most 14 bits and a sign (kActMax), so an int32 lane, which
// sums 2 * K / 32 products of at most 127 * 16383, cannot overflow below K = 16,384; rows zero-padded to Kp (a
// multiple of 32); inv[m] turns the integer sums back into the activations' units.
constexpr float kActMax = 16383.f;

template <typename T>
void quantize_int16(const T* x, int64_t M, int64_t K, int64_t Kp, int16_t* a, float* inv) {
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(load(x, m * K + k)));
    const float s = amax > 0.f ? kActMax / amax : 0.f;
    inv[m] = amax / kActMax;
    for (int64_t k = 0; k < K; ++k) a[m * Kp + k] = static_cast<int16_t>(std::nearbyint(load(x, m * K + k) * s));
    for (int64_t k = K; k < Kp; ++k) a[m * Kp + k] = 0;
  }
}

inline uint16_t bf16_bits(float v) {
  const at::BFloat16 b(v);  // round to nearest even, like a torch .to(bfloat16)
  return b.x;
}

// ---------------------------------------------------------------------------------------------------------- int8

#if INFERLAB_GEMV_SIMD
inline __m512i dot_i16(__m512i acc, __m512i w, __m512i a) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, a);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, a));
#endif
}

template <int MB, int NB>
inline void int8_tile(const int16_t* a, int64_t Kp, int64_t K, const int8_t* w, float* out /*[MB][NB]*/) {
  __m512i acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[NB];
    for (int n = 0; n < NB; ++n)
      wv[n] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * K + k)));
    for (int m = 0; m < MB; ++m) {
      const __m512i av = _mm512_loadu_si512(a + m * Kp + k);
      for (int n = 0; n < NB; ++n) acc[m][n] = dot_i16(acc[m][n], wv[n], av);
    }
  }
  if (k < K) {  // the activations are zero-padded to Kp; the weights' last columns are read under a mask
    const __mmask32 mask = static_cast<__mmask32>((1u << (K - k)) - 1);
    __m512i wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + n * K + k));
    for (int m = 0; m < MB; ++m) {
      const __m512i av = _mm512_loadu_si512(a + m * Kp + k);
      for (int n = 0; n < NB; ++n) acc[m][n] = dot_i16(acc[m][n], wv[n], av);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) out[m * NB + n] = _mm512_reduce_add_ps(_mm512_cvtepi32_ps(acc[m][n]));
}
#endif

#if INFERLAB_GEMV_AVX2
using inferlab::sum_lanes8;

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// 8 values of either activation dtype as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// 16 columns a step. An int32 lane sums two products of at most 127 * 16383 a step, so the lanes are emptied into
// fp32 sums every kFlushColumns columns (K reaches 14,336 in Llama 3 8B's down projection; a lane would overflow
// past ~8,200).
constexpr int64_t kFlushColumns = 4096;

template <int MB, int NB>
inline void int8_tile(const int16_t* a, int64_t Kp, int64_t K, const int8_t* w, float* out /*[MB][NB]*/) {
  for (int i = 0; i < MB * NB; ++i) out[i] = 0.f;
  for (int64_t k0 = 0; k0 < K; k0 += kFlushColumns) {
    const int64_t k1 = std::min(K, k0 + kFlushColumns);
    __m256i acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 16) {
      __m256i wv[NB];
      for (int n = 0; n < NB; ++n) {
        if (k + 16 <= K) {
          wv[n] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * K + k)));
        } else {  // the last columns, copied out (the activations are zero-padded to Kp; the weights are not)
          alignas(16) int8_t tail[16] = {};
          std::memcpy(tail, w + n * K + k, K - k);
          wv[n] = _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
        }
      }
      for (int m = 0; m < MB; ++m) {
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * Kp + k));
        for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_add_epi32(acc[m][n], _mm256_madd_epi16(wv[n], av));
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) out[m * NB + n] += static_cast<float>(hsum8(acc[m][n]));
  }
}
#endif

template <int MB, int NB>
void int8_tile_any(const int16_t* a, int64_t Kp, int64_t K, const int8_t* w, float* out) {
#if INFERLAB_GEMV_SIMD || INFERLAB_GEMV_AVX2
  int8_tile<MB, NB>(a, Kp, K, w, out);
#else
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      int64_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += static_cast<int64_t>(a[m * Kp + k]) * w[n * K + k];
      out[m * NB + n] = static_cast<float>(s);
    }
#endif
}

// AVX2's int8 tile in blocks of 2 tokens: its 16 registers hold 2 x kTileRows accumulators beside the rows'
// widened weights; at 4 they spilled (30 layers of SmolLM2-135M, fp32, 2 threads: 4 tokens 16.0 -> 13.4 ms, 16
// tokens 38.2 -> 30.3, 64 tokens 196 -> 158; the int4 tile was as fast or faster at 4: ad-hoc A/B, round 23).
constexpr int64_t kInt8TokenBlock = INFERLAB_GEMV_AVX2 ? 2 : 4;

// y[m, n0 + n] for a tile of NB rows.
template <int NB, typename T, typename S>
void int8_rows(const int16_t* a, const float* inv, int64_t M, int64_t K, int64_t Kp, const int8_t* w, const S* scale,
               T* y, int64_t N, int64_t n0) {
  float out[4 * NB];
  for_each_token_block<kInt8TokenBlock>(M, [&](int64_t m0, auto mb) {
    constexpr int MB = decltype(mb)::value;
    int8_tile_any<MB, NB>(a + m0 * Kp, Kp, K, w, out);
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n)
        store(y, (m0 + m) * N + n0 + n, out[m * NB + n] * inv[m0 + m] * load(scale, n0 + n));
  });
}

template <typename T, typename S>
void int8_linear_impl(const T* x, const int8_t* w, const S* scale, T* y, int64_t M, int64_t K, int64_t N) {
  const int64_t Kp = (K + 31) / 32 * 32;
  std::vector<int16_t> a(M * Kp);
  std::vector<float> inv(M);
  quantize_int16(x, M, K, Kp, a.data(), inv.data());
  for_each_tile(N, K, w, [&](int64_t n0, auto nb) {
    int8_rows<decltype(nb)::value>(a.data(), inv.data(), M, K, Kp, w + n0 * K, scale, y, N, n0);
  });
}

// ---------------------------------------------------------------------------------------------------------- int4

// Element index of the low / high nibble of byte b of a row, for groups of G columns.
inline int64_t lo_elem(int64_t b, int64_t G) { return b / (G / 2) * G + b % (G / 2); }
inline int64_t hi_elem(int64_t b, int64_t G) { return lo_elem(b, G) + G / 2; }

// Activations for the int4 kernel: per token, K bf16 values in chunks of 64 (32 for the low nibbles of 32 weight
// bytes, then 32 for their high nibbles) and the fp32 sum of each group's (bf16) values.
template <typename T>
void prepare_int4_activations(const T* x, int64_t M, int64_t K, int64_t G, uint16_t* xp, float* xsum) {
  const int64_t groups = K / G;
  std::vector<uint16_t> xb(K);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) xb[k] = bf16_bits(load(x, m * K + k));
    uint16_t* row = xp + m * K;
    for (int64_t c = 0; c < K / 64; ++c) {
      if (G == 32) {  // 32 bytes = two groups: low nibbles are elements 0-15 of each, high ones 16-31
        std::memcpy(row + 64 * c, xb.data() + 64 * c, 16 * sizeof(uint16_t));
        std::memcpy(row + 64 * c + 16, xb.data() + 64 * c + 32, 16 * sizeof(uint16_t));
        std::memcpy(row + 64 * c + 32, xb.data() + 64 * c + 16, 16 * sizeof(uint16_t));
        std::memcpy(row + 64 * c + 48, xb.data() + 64 * c + 48, 16 * sizeof(uint16_t));
      } else {  // 32 bytes inside one group
        const int64_t lo = lo_elem(32 * c, G);
        std::memcpy(row + 64 * c, xb.data() + lo, 32 * sizeof(uint16_t));
        std::memcpy(row + 64 * c + 32, xb.data() + lo + G / 2, 32 * sizeof(uint16_t));
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k)
        s += static_cast<float>(c10::BFloat16(xb[k], c10::BFloat16::from_bits()));
      xsum[m * groups + g] = s;
    }
  }
}

#if INFERLAB_GEMV_SIMD
template <int MB, int NB>
inline void int4_tile(const uint16_t* xp, int64_t K, int64_t G, const uint8_t* w, const uint16_t* d,
                      float* out /*[MB][NB]*/) {
  const int64_t ldw = K / 2, ldd = K / G;
  const __m512i low4 = _mm512_set1_epi16(0x0F), bias = _mm512_set1_epi16(0x4300);
  const __m512i two_groups = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / 64; ++c) {
    __m512i lo[NB], hi[NB];
    __m512 dv[NB];
    for (int n = 0; n < NB; ++n) {
      const __m512i v =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * ldw + 32 * c)));
      lo[n] = _mm512_or_si512(_mm512_and_si512(v, low4), bias);
      hi[n] = _mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
      if (G == 32) {  // 32 bytes = two groups: fp32 lanes 0-7 belong to the first, 8-15 to the second
        int32_t pair;
        std::memcpy(&pair, d + n * ldd + 2 * c, sizeof pair);
        dv[n] = _mm512_permutexvar_ps(two_groups, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(pair))));
      } else {
        dv[n] = _mm512_set1_ps(_cvtsh_ss(d[n * ldd + 32 * c / (G / 2)]));
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xlo = (__m512bh)_mm512_loadu_si512(xp + m * K + 64 * c);
      const __m512bh xhi = (__m512bh)_mm512_loadu_si512(xp + m * K + 64 * c + 32);
      for (int n = 0; n < NB; ++n) {
        __m512 dp = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo[n], xlo);
        dp = _mm512_dpbf16_ps(dp, (__m512bh)hi[n], xhi);
        acc[m][n] = _mm512_fmadd_ps(dp, dv[n], acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) out[m * NB + n] = _mm512_reduce_add_ps(acc[m][n]);
}
#endif

// sum over groups of (m - 128 d) * xsum for one row and token: the part of the product that is not d * dot.
inline float int4_offsets(const uint16_t* d, const uint16_t* mn, const float* xsum, int64_t groups) {
#if INFERLAB_GEMV_SIMD
  const __m512 minus128 = _mm512_set1_ps(-128.f);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 mask = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
    const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + g));
    const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mn + g));
    acc = _mm512_fmadd_ps(_mm512_fmadd_ps(dv, minus128, mv), _mm512_maskz_loadu_ps(mask, xsum + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float s = 0.f;
  for (int64_t g = 0; g < groups; ++g) s += (fp16_to_float(mn[g]) - 128.f * fp16_to_float(d[g])) * xsum[g];
  return s;
#endif
}

template <int MB, int NB>
void int4_tile_any(const uint16_t* xp, int64_t K, int64_t G, const uint8_t* w, const uint16_t* d, float* out) {
#if INFERLAB_GEMV_SIMD
  int4_tile<MB, NB>(xp, K, G, w, d, out);
#else
  const int64_t ldw = K / 2, ldd = K / G;
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      float s = 0.f;
      for (int64_t c = 0; c < K / 64; ++c)
        for (int64_t i = 0; i < 32; ++i) {
          const int64_t b = 32 * c + i;
          const uint8_t byte = w[n * ldw + b];
          const float dg = fp16_to_float(d[n * ldd + b / (G / 2)]);
          const float xl = static_cast<float>(c10::BFloat16(xp[m * K + 64 * c + i], c10::BFloat16::from_bits()));
          const float xh = static_cast<float>(c10::BFloat16(xp[m * K + 64 * c + 32 + i], c10::BFloat16::from_bits()));
          s += dg * ((128.f + (byte & 0xF)) * xl + (128.f + (byte >> 4)) * xh);
        }
      out[m * NB + n] = s;
    }
#endif
}

template <int NB, typename T>
void int4_rows(const uint16_t* xp, const float* xsum, int64_t M, int64_t K, int64_t G, const uint8_t* w,
               const uint16_t* d, const uint16_t* mn, T* y, int64_t N, int64_t n0) {
  const int64_t groups = K / G;
  float out[4 * NB];
  for_each_token_block(M, [&](int64_t m0, auto mb) {
    constexpr int MB = decltype(mb)::value;
    int4_tile_any<MB, NB>(xp + m0 * K, K, G, w, d, out);
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n)
        store(y, (m0 + m) * N + n0 + n,
              out[m * NB + n] + int4_offsets(d + n * groups, mn + n * groups, xsum + (m0 + m) * groups, groups));
  });
}

// ------------------------------------------------------------------------------------ int4 x int8 activations

// Activations for the W4A8 kernel (G == 32, GGUF's Q8_1 for Q4_1): per token and group of 32 values, s = max|x| / 127
// and a = round(x / s) in int8, laid out in the weight's nibble order two chunks at a time (a chunk: 32 weight bytes,
// two groups; per 128 values, the low-nibble elements 0-15 of four groups, then the high-nibble ones, 16-31), rows
// padded to Ka = a multiple of 128; sxv holds each chunk's scales as 8 floats (its first group's four times, then
// its second's: the int32 lanes vpdpbusd fills for each), asum[g] = s * sum(a) for the minimum's term:
// sum_k w_k x_k = sum_g d_g s_g dot(q, a)_g + m_g asum_g.
inline int64_t a8_row_stride(int64_t K) { return (K + 127) / 128 * 128; }

// It runs on one thread before each int4 call's parallel part, 120 times a decode step: vectorised, the 30 layers
// ran 1.11x faster at one row, 1.12-1.16x at 2-4 than with the scalar loop below (`python
// benchmarks/linear_kernels.py --against 14a2758`), rounding as it does (vcvtps2dq in the default mode: half to
// even, as nearbyint), so bit-identical.
template <typename T>
void quantize_int8_groups(const T* x, int64_t M, int64_t K, int8_t* a, float* sxv, float* asum) {
  const int64_t groups = K / 32, Ka = a8_row_stride(K);
#if defined(INFERLAB_AVX512_BF16)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 v0 = inferlab::load16(x + m * K + g * 32), v1 = inferlab::load16(x + m * K + g * 32 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float s = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      int8_t* unit = a + m * Ka + (g / 4) * 128 + (g % 4) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(unit), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(unit + 64), _mm512_cvtepi32_epi8(q1));
      for (int i = 0; i < 4; ++i) sxv[m * groups * 4 + g * 4 + i] = s;
      asum[m * groups + g] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
  }
#elif INFERLAB_GEMV_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  // vpackssdw and vpacksswb interleave their 128-bit halves: this puts the 32 values back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load8(x + m * K + g * 32 + 8 * i);
      __m256 vmax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      const float s = amax / 127.f;
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      int8_t* unit = a + m * Ka + (g / 4) * 128 + (g % 4) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(unit), _mm256_castsi256_si128(bytes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(unit + 64), _mm256_extracti128_si256(bytes, 1));
      for (int i = 0; i < 4; ++i) sxv[m * groups * 4 + g * 4 + i] = s;
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      asum[m * groups + g] = s * static_cast<float>(hsum8(sum));
    }
  }
#else
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float v[32], amax = 0.f;
      for (int e = 0; e < 32; ++e) {
        v[e] = load(x, m * K + g * 32 + e);
        amax = std::max(amax, std::fabs(v[e]));
      }
      const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* unit = a + m * Ka + (g / 4) * 128 + (g % 4) * 16;
      int32_t sum = 0;
      for (int e = 0; e < 32; ++e) {
        const auto q = static_cast<int8_t>(std::nearbyint(v[e] * inv));
        unit[(e / 16) * 64 + e % 16] = q;
        sum += q;
      }
      for (int i = 0; i < 4; ++i) sxv[m * groups * 4 + g * 4 + i] = s;
      asum[m * groups + g] = s * static_cast<float>(sum);
    }
  }
#endif
}

// Q4_1's minimums' term of one output: the sum over groups of min * the group's activation sum (the
// AVX-512 tile adds it in its own lanes instead, before its one horizontal sum).
inline float int4_a8_offsets(const uint16_t* mn, const float* asum, int64_t groups) {
#if INFERLAB_GEMV_AVX2
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g))),
                          _mm256_loadu_ps(asum + g), acc);
  float s = sum_lanes8(acc);
  for (; g < groups; ++g) s += fp16_to_float(mn[g]) * asum[g];
  return s;
#else
  float s = 0.f;
  for (int64_t g = 0; g < groups; ++g) s += fp16_to_float(mn[g]) * asum[g];
  return s;
#endif
}

#if INFERLAB_GEMV_SIMD
// u8 x s8 products summed in fours into int32 lanes; without VNNI, pairs summed in int16 first (at most
// 2 * 15 * 128: no saturation), then pairs of those.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

// Two 32-byte chunks (four groups) a step in 512-bit registers, an odd last chunk in their low halves.
template <int MB, int NB>
inline void int4_a8_tile(const int8_t* a, int64_t Ka, const float* sxv, const float* asum, int64_t K,
                         const uint8_t* w, const uint16_t* d, const uint16_t* mn, float* out /*[MB][NB]*/) {
  const int64_t ldw = K / 2, ldd = K / 32, chunks = K / 64;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i four_groups = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    __m512i lo[NB], hi[NB];
    __m512 dv[NB];
    for (int n = 0; n < NB; ++n) {
      const __m512i v = _mm512_loadu_si512(w + n * ldw + 32 * c);
      // bytes 0-31: chunk c, 32-63: chunk c + 1; the activations follow the same order (xlo: both chunks' low
      // halves). lo and hi must pair with 64-byte activation vectors [c lo | c+1 lo] and [c hi | c+1 hi].
      lo[n] = _mm512_and_si512(v, low4);
      hi[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      dv[n] = _mm512_permutexvar_ps(
          four_groups, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                           d + n * ldd + 2 * c)))));
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i xlo = _mm512_loadu_si512(a + m * Ka + 64 * c);
      const __m512i xhi = _mm512_loadu_si512(a + m * Ka + 64 * c + 64);
      const __m512 sx = _mm512_loadu_ps(sxv + (m * chunks + c) * 8);
      for (int n = 0; n < NB; ++n) {
        const __m512i i = dot_u8s8(dot_u8s8(_mm512_setzero_si512(), lo[n], xlo), hi[n], xhi);
        acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dv[n], sx), acc[m][n]);
      }
    }
  }
  if (c < chunks) {  // the odd last chunk (K = 576: 9 chunks) in the low halves, zeros above
    // The activations' row is padded to Ka with zeros, so the 64-byte loads past the chunk read zeros (and the
    // weight's upper half is zeroed): the upper lanes add 0 and the chunk sums in the same accumulators.
    __m512i lo[NB], hi[NB];
    __m512 dv[NB];
    for (int n = 0; n < NB; ++n) {
      const __m512i v = _mm512_zextsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * ldw + 32 * c)));
      lo[n] = _mm512_and_si512(v, low4);
      hi[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      int32_t pair;
      std::memcpy(&pair, d + n * ldd + 2 * c, sizeof pair);
      dv[n] = _mm512_permutexvar_ps(four_groups, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(pair))));
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i xlo = _mm512_loadu_si512(a + m * Ka + 64 * c);
      const __m512i xhi = _mm512_loadu_si512(a + m * Ka + 64 * c + 64);
      const __m512 sx = _mm512_maskz_loadu_ps(0x00FF, sxv + (m * chunks + c) * 8);
      for (int n = 0; n < NB; ++n) {
        const __m512i i = dot_u8s8(dot_u8s8(_mm512_setzero_si512(), lo[n], xlo), hi[n], xhi);
        acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dv[n], sx), acc[m][n]);
      }
    }
  }
  // The minimums' term (min x the group's activation sum, summed over groups) joins the sums' lanes, so one
  // horizontal sum an output serves both.
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      __m512 s = acc[m][n];
      for (int64_t g = 0; g < ldd; g += 16) {
        const __mmask16 mask = inferlab::first_lanes(ldd - g);
        s = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mn + n * ldd + g)),
                            _mm512_maskz_loadu_ps(mask, asum + m * ldd + g), s);
      }
      out[m * NB + n] = _mm512_reduce_add_ps(s);
    }
}
#endif

#if INFERLAB_GEMV_AVX2
// One 32-byte chunk (two groups) a step: vpmaddubsw multiplies nibble-activation pairs and adds neighbours into
// int16 (the low and high nibbles' sums added there too: at most 4 * 15 * 127, no saturation), vpmaddwd adds pairs
// of those into the int32 lanes, 0-3 the chunk's first group and 4-7 its second.
template <int MB, int NB>
inline void int4_a8_tile(const int8_t* a, int64_t Ka, const float* sxv, const float* asum, int64_t K,
                         const uint8_t* w, const uint16_t* d, const uint16_t* mn, float* out /*[MB][NB]*/) {
  const int64_t ldw = K / 2, ldd = K / 32, chunks = K / 64;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i two_groups = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[MB][NB];
  INFERLAB_UNROLL for (int m = 0; m < MB; ++m)
    INFERLAB_UNROLL for (int n = 0; n < NB; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t xo = (c / 2) * 128 + (c % 2) * 32;  // the chunk's low-nibble activations; its high ones at +64
    INFERLAB_UNROLL for (int n = 0; n < NB; ++n) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * ldw + 32 * c));
      const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      int32_t pair;
      std::memcpy(&pair, d + n * ldd + 2 * c, sizeof pair);
      const __m256 dv =
          _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(pair))), two_groups);
      INFERLAB_UNROLL for (int m = 0; m < MB; ++m) {
        const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * Ka + xo));
        const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * Ka + xo + 64));
        const __m256 sx = _mm256_loadu_ps(sxv + (m * chunks + c) * 8);
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
        acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), _mm256_mul_ps(dv, sx),
                                    acc[m][n]);
      }
    }
  }
  INFERLAB_UNROLL for (int m = 0; m < MB; ++m)
    INFERLAB_UNROLL for (int n = 0; n < NB; ++n)
      out[m * NB + n] = sum_lanes8(acc[m][n]) + int4_a8_offsets(mn + n * ldd, asum + m * ldd, ldd);
}
#endif

template <int MB, int NB>
void int4_a8_tile_any(const int8_t* a, int64_t Ka, const float* sxv, const float* asum, int64_t K, const uint8_t* w,
                      const uint16_t* d, const uint16_t* mn, float* out) {
#if INFERLAB_GEMV_SIMD || INFERLAB_GEMV_AVX2
  int4_a8_tile<MB, NB>(a, Ka, sxv, asum, K, w, d, mn, out);
#else
  const int64_t ldw = K / 2, ldd = K / 32;
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      float s = 0.f;
      for (int64_t g = 0; g < K / 32; ++g) {
        const int8_t* unit = a + m * Ka + (g / 4) * 128 + (g % 4) * 16;
        int32_t dot = 0;
        for (int64_t j = 0; j < 16; ++j) {
          const uint8_t byte = w[n * ldw + 16 * g + j];
          dot += (byte & 0xF) * unit[j] + (byte >> 4) * unit[64 + j];
        }
        s += static_cast<float>(dot) * (fp16_to_float(d[n * ldd + g]) * sxv[(m * K / 32 + g) * 4]);
      }
      out[m * NB + n] = s + int4_a8_offsets(mn + n * ldd, asum + m * ldd, ldd);
    }
#endif
}

// AVX2's int4 tile in blocks of 2 tokens: 2 x kTileRows sums beside a row's nibbles, scales and the activations
// fit its 16 registers; 3 and 4 tokens spilled them (see docs/benchmarks.md, round 27).
constexpr int64_t kInt4TokenBlock = INFERLAB_GEMV_AVX2 ? 2 : 4;

template <typename T>
void int4_a8_linear_impl(const T* x, const uint8_t* w, const uint16_t* d, const uint16_t* mn, T* y, int64_t M,
                         int64_t K, int64_t N) {
  const int64_t groups = K / 32, Ka = a8_row_stride(K);
  std::vector<int8_t> a(M * Ka);
  std::vector<float> sxv(M * groups * 4), asum(M * groups);
  quantize_int8_groups(x, M, K, a.data(), sxv.data(), asum.data());
  for_each_tile(N, K / 2, w, [&](int64_t n0, auto nb) {
    constexpr int NB = decltype(nb)::value;
    float out[4 * NB];
    for_each_token_block<kInt4TokenBlock>(M, [&](int64_t m0, auto mb) {
      constexpr int MB = decltype(mb)::value;
      int4_a8_tile_any<MB, NB>(a.data() + m0 * Ka, Ka, sxv.data() + m0 * groups * 4, asum.data() + m0 * groups, K,
                               w + n0 * K / 2, d + n0 * groups, mn + n0 * groups, out);
      for (int m = 0; m < MB; ++m)
        for (int n = 0; n < NB; ++n) store(y, (m0 + m) * N + n0 + n, out[m * NB + n]);
    });
  });
}

template <typename T>
void int4_linear_impl(const T* x, const uint8_t* w, const uint16_t* d, const uint16_t* mn, T* y, int64_t M,
                      int64_t K, int64_t N, int64_t G) {
  const int64_t groups = K / G;
  std::vector<uint16_t> xp(M * K);
  std::vector<float> xsum(M * groups);
  prepare_int4_activations(x, M, K, G, xp.data(), xsum.data());
  for_each_tile(N, K / 2, w, [&](int64_t n0, auto nb) {
    int4_rows<decltype(nb)::value>(xp.data(), xsum.data(), M, K, G, w + n0 * K / 2, d + n0 * groups,
                                   mn + n0 * groups, y, N, n0);
  });
}

}  // namespace

bool gemv_simd() { return INFERLAB_GEMV_SIMD; }

bool int_gemv_simd() { return INFERLAB_GEMV_SIMD || INFERLAB_GEMV_AVX2; }

// x [M, K] fp32|bf16; qweight int8 [N, K]; scales [N] (fp32 or bf16) -> y [M, N] in x's dtype.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && x.size(1) == qweight.size(1), "x [M, K] and qweight [N, K]");
  TORCH_CHECK(qweight.scalar_type() == torch::kChar && qweight.is_contiguous(), "qweight must be contiguous int8");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == qweight.size(0) && scales.is_contiguous(), "scales [N]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  auto y = torch::empty({M, N}, x.options());
  auto run = [&](auto* xp, auto* yp) {
    if (scales.scalar_type() == torch::kBFloat16) {
      int8_linear_impl(xp, qweight.data_ptr<int8_t>(), scales.data_ptr<at::BFloat16>(), yp, M, K, N);
    } else {
      TORCH_CHECK(scales.scalar_type() == torch::kFloat, "scales must be float32 or bfloat16");
      int8_linear_impl(xp, qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), yp, M, K, N);
    }
  };
  if (x.scalar_type() == torch::kBFloat16) {
    run(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "float32 or bfloat16 only");
    run(x.data_ptr<float>(), y.data_ptr<float>());
  }
  return y;
}

// x [M, K] fp32|bf16 (rounded to bf16 for the products); qweight uint8 [N, K/2] (Q4_1 nibble order per group);
// scales, mins fp16 [N, K/G] (or int16 holding their bits) -> y [M, N] in x's dtype.
// K must be a multiple of 64, G 32 or a multiple of 64.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                          int64_t group_size) {
  const int64_t G = group_size;
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && qweight.size(1) * 2 == x.size(1), "x [M, K], qweight [N, K/2]");
  TORCH_CHECK(x.size(1) % 64 == 0 && (G == 32 || G % 64 == 0) && x.size(1) % G == 0,
              "int4 kernel needs K % 64 == 0 and a group size of 32 or a multiple of 64 dividing K");
  TORCH_CHECK(qweight.scalar_type() == torch::kByte && qweight.is_contiguous(), "qweight must be contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  for (const auto& t : {scales, mins})
    TORCH_CHECK((t.scalar_type() == torch::kHalf || t.scalar_type() == torch::kShort) && t.is_contiguous() &&
                    t.dim() == 2 && t.size(0) == N && t.size(1) == K / G,
                "scales and mins must be contiguous float16 (or its int16 bits) [N, K / group_size]");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const auto* w = qweight.data_ptr<uint8_t>();
  const auto* d = static_cast<const uint16_t*>(scales.data_ptr());
  const auto* mn = static_cast<const uint16_t*>(mins.data_ptr());
  auto run = [&](auto* xp, auto* yp) {
    if (G == 32) {
      int4_a8_linear_impl(xp, w, d, mn, yp, M, K, N);
    } else {
      int4_linear_impl(xp, w, d, mn, yp, M, K, N, G);
    }
  };
  if (x.scalar_type() == torch::kBFloat16) {
    run(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "float32 or bfloat16 only");
    run(x.data_ptr<float>(), y.data_ptr<float>());
  }
  return y;
}
