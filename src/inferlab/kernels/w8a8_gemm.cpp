// int8 weights x int8 activations on VNNI, for steps of many tokens (prefill chunks, large decode batches), where
// the bf16 GEMM (packed_gemm.cpp) is compute-bound: vpdpbusd multiplies 64 byte pairs per instruction into int32
// lanes, twice the pairs of vdpbf16ps.
//
// The numbers: w = q * scale[n] (quant/int8.py's per-output-channel int8, q in -127..127), and each token's
// activations rounded to int8 per group of 32 inputs, a = round(x / s), s = max|x| / 127 (llama.cpp's Q8_0).
// Groups of 32, not one scale per token: measured on SmolLM2-135M (all 120 layer matmuls, corpus perplexity, bf16
// 10.622, int8 weights alone 10.662), activations per token 11.005 (+3.6%), per 192 inputs 10.729, per 64 10.702,
// per 32 10.653 (+0.3%, level with weight-only int8). Each group's int32 sum becomes fp32 and is scaled by its s.
//
// The layout (pack_w8a8 in quant/w8a8.py): [ceil(N / 16), K / 4, 16, 4] bytes, q + 128 as uint8: for each block of
// 16 outputs, K / 4 lines of 64 bytes, each the 16 outputs' weights for inputs k..k+3, exactly the operand vpdpbusd
// multiplies by a broadcast quad of activations (the unsigned one: vpdpbusd takes u8 x s8). The +128 comes back
// out per token: sum_k (q + 128) a = sum_k q a + 128 sum_k a, so y = scale[n] (sum_g s_g dot_g - corr) with
// corr = 128 sum_g s_g sum(a_g), one number per token.
//
// A tile of 3 blocks x 4 tokens keeps 12 int32 and 12 fp32 accumulators in registers; tiles of outputs are split
// over the threads and every tile runs all the step's tokens, so its weights (48 bytes a input) stay in L2. Asking
// for the whole tile first was 0-12% slower at 1-64 tokens. From 16 tokens on, each group of 4 asks instead for its
// share of the thread's next tile, into L2, so that tile's first group does not wait on memory: the 30 layers
// 1.04-1.06x faster at 16 tokens, 1.06-1.09x at 64, 1.00-1.02x at 1-8 and 128-256 in two runs on the Zen 4 EPYC
// (`python benchmarks/linear_kernels.py --against REV --only w8a8`, docs/benchmarks.md, round 30).

#include "cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;      // outputs per packed block
constexpr int64_t kTileBlocks = 3;  // blocks per tile: 48 outputs (SmolLM2's and Gemma 3's widths are multiples)
constexpr int64_t kTokens = 4;      // tokens per register tile
constexpr int64_t kGroup = 32;      // inputs per activation scale
constexpr int64_t kPrefetchFrom = 16;  // tokens a step from which a tile asks for the next one (see the header)

#if defined(INFERLAB_AVX512_BF16)
using inferlab::load16;

// The activations of M tokens: a [M, K] int8, s [M, K / 32] (each group's scale), corr [M] (see above).
// Rounded by x * (127 / max|x|) in fp32, half to even (vcvtps2dq in the default rounding mode).
template <typename T>
void quantize_groups(const T* x, int64_t M, int64_t K, int8_t* a, float* s, float* corr) {
  const int64_t groups = K / kGroup;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float c = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t base = m * K + g * kGroup;
        const __m512 v0 = load16(x + base), v1 = load16(x + base + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a + base), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a + base + 16), _mm512_cvtepi32_epi8(q1));
        s[m * groups + g] = amax / 127.f;
        c += s[m * groups + g] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      }
      corr[m] = 128.f * c;
    }
  });
}

// acc += four u8 x s8 products per int32 lane. In asm with acc tied to the output register: with the intrinsic, GCC
// 13 copied every accumulator to a fresh register around each vpdpbusd and spilled the fp32 ones to the stack (two
// moves per multiply; the tile ran slower than the bf16 GEMM). Without VNNI, vpmaddubsw would saturate its int16
// pair sums (up to 2 * 255 * 127), so with u = q + 128: dot(u, s) = dot(|q|, s signed as q) + 128 sum(s), pairs
// at most 2 * 127 * 127 (checked against the scalar sums over random and extreme bytes, built without VNNI).
inline void dot_u8s8(__m512i& acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
#else
  const __m512i q = _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
  const __m512i sq = _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(q), _mm512_setzero_si512(), s);
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i qs = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(q), sq), ones);
  const __m512i ssum = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(1), s), ones);
  acc = _mm512_add_epi32(acc, _mm512_add_epi32(qs, _mm512_slli_epi32(ssum, 7)));
#endif
}

inline void store16(at::BFloat16* p, __m512 v, __mmask16 mask) { inferlab::store_bf16x16(p, v, mask); }
inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
inline __m512 load_scales16(const at::BFloat16* p, __mmask16 mask) { return inferlab::load_bf16x16(p, mask); }
inline __m512 load_scales16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

// Tokens [0, MB) x blocks [0, NB) of one tile. a, s, corr: the tile's first token's; w: its first block; y, scale:
// its first output's. `last_mask` selects the valid outputs of the tile's last block.
template <int MB, int NB, typename Out, typename S>
inline void tile(const int8_t* a, const float* s, const float* corr, int64_t K, const uint8_t* w,
                 int64_t block_bytes, const S* scale, Out* y, int64_t N, __mmask16 last_mask) {
  const int64_t groups = K / kGroup;
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) dot[m][j] = _mm512_setzero_si512();
    for (int64_t kq = g * kGroup / 4; kq < (g + 1) * kGroup / 4; ++kq) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * block_bytes + kq * 4 * kBlock);
      for (int m = 0; m < MB; ++m) {
        int32_t quad;
        std::memcpy(&quad, a + m * K + kq * 4, sizeof quad);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int j = 0; j < NB; ++j) dot_u8s8(dot[m][j], wv[j], xv);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 sv = _mm512_set1_ps(s[m * groups + g]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][j]), sv, acc[m][j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __mmask16 mask = j == NB - 1 ? last_mask : 0xFFFF;
    const __m512 sc = load_scales16(scale + j * kBlock, mask);
    for (int m = 0; m < MB; ++m)
      store16(y + m * N + j * kBlock, _mm512_mul_ps(_mm512_sub_ps(acc[m][j], _mm512_set1_ps(corr[m])), sc), mask);
  }
}

// next, next_bytes: the thread's next tile's weights, asked for into L2 a share before each group of tokens (none
// where next is null).
template <int NB, typename Out, typename S>
void tile_rows(const int8_t* a, const float* s, const float* corr, int64_t M, int64_t K, const uint8_t* w,
               int64_t block_bytes, const S* scale, Out* y, int64_t N, __mmask16 last_mask, const uint8_t* next,
               int64_t next_bytes) {
  const int64_t groups = K / kGroup;
  const int64_t share = next ? (next_bytes / 64 / (M / kTokens) + 1) * 64 : 0;
  int64_t m = 0;
  for (int64_t asked = 0; m + kTokens <= M; m += kTokens) {
    for (const int64_t end = std::min(next_bytes, asked + share); asked < end; asked += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + asked), _MM_HINT_T1);
    tile<kTokens, NB>(a + m * K, s + m * groups, corr + m, K, w, block_bytes, scale, y + m * N, N, last_mask);
  }
  const int8_t* am = a + m * K;
  const float *sm = s + m * groups, *cm = corr + m;
  Out* ym = y + m * N;
  switch (M - m) {
    case 1: tile<1, NB>(am, sm, cm, K, w, block_bytes, scale, ym, N, last_mask); break;
    case 2: tile<2, NB>(am, sm, cm, K, w, block_bytes, scale, ym, N, last_mask); break;
    case 3: tile<3, NB>(am, sm, cm, K, w, block_bytes, scale, ym, N, last_mask); break;
    default: break;
  }
}

template <typename Out, typename S>
void run(const int8_t* a, const float* s, const float* corr, const uint8_t* w, int64_t blocks, const S* scale,
         Out* y, int64_t M, int64_t K, int64_t N) {
  const int64_t block_bytes = K * kBlock;
  const int64_t tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
  const __mmask16 tail = inferlab::first_lanes(N - (blocks - 1) * kBlock);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * kTileBlocks, nb = std::min(kTileBlocks, blocks - b0);
      const __mmask16 last = b0 + nb == blocks ? tail : 0xFFFF;
      const uint8_t* wt = w + b0 * block_bytes;
      const S* st = scale + b0 * kBlock;
      Out* yt = y + b0 * kBlock;
      const bool ask = M >= kPrefetchFrom && t + 1 < end;
      const uint8_t* next = ask ? wt + nb * block_bytes : nullptr;
      const int64_t next_bytes = ask ? std::min(kTileBlocks, blocks - b0 - nb) * block_bytes : 0;
      switch (nb) {
        case 3: tile_rows<3>(a, s, corr, M, K, wt, block_bytes, st, yt, N, last, next, next_bytes); break;
        case 2: tile_rows<2>(a, s, corr, M, K, wt, block_bytes, st, yt, N, last, next, next_bytes); break;
        default: tile_rows<1>(a, s, corr, M, K, wt, block_bytes, st, yt, N, last, next, next_bytes); break;
      }
    }
  });
}
#endif

}  // namespace

// x [M, K] fp32|bf16; packed uint8 [ceil(N / 16), K / 4, 16, 4] (q + 128, from pack_w8a8); scales [N] fp32|bf16
// -> y [M, N] in x's dtype. K must be a multiple of 32.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kByte && packed.is_contiguous() &&
                  packed.size(2) == kBlock && packed.size(3) == 4,
              "packed must be a contiguous uint8 [N / 16, K / 4, 16, 4] from pack_w8a8");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(K % kGroup == 0, "the W8A8 kernel needs a multiple of 32 inputs, got ", K);
  TORCH_CHECK(packed.size(1) * 4 == K && (N + kBlock - 1) / kBlock == blocks, "x is [", M, ", ", K,
              "] but the packed weight holds ", blocks * kBlock, " x ", packed.size(1) * 4, " for ", N, " outputs");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous() &&
                  (scales.scalar_type() == torch::kBFloat16 || scales.scalar_type() == torch::kFloat),
              "scales must be a contiguous float32 or bfloat16 [N]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat, "float32 or bfloat16 only");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
#if defined(INFERLAB_AVX512_BF16)
  std::vector<int8_t> a(M * K);
  std::vector<float> s(M * (K / kGroup)), corr(M);
  auto quantize = [&](auto* xp) { quantize_groups(xp, M, K, a.data(), s.data(), corr.data()); };
  auto multiply = [&](auto* yp) {
    if (scales.scalar_type() == torch::kBFloat16) {
      run(a.data(), s.data(), corr.data(), packed.data_ptr<uint8_t>(), blocks, scales.data_ptr<at::BFloat16>(), yp,
          M, K, N);
    } else {
      run(a.data(), s.data(), corr.data(), packed.data_ptr<uint8_t>(), blocks, scales.data_ptr<float>(), yp, M, K,
          N);
    }
  };
  if (x.scalar_type() == torch::kBFloat16) {
    quantize(x.data_ptr<at::BFloat16>());
    multiply(y.data_ptr<at::BFloat16>());
  } else {
    quantize(x.data_ptr<float>());
    multiply(y.data_ptr<float>());
  }
#else
  TORCH_CHECK(false, "w8a8_linear needs a build with AVX-512 BF16 (see gemv_simd())");
#endif
  return y;
}
