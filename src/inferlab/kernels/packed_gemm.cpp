// bf16 matrix products on inferlab's packed weight layout: one kernel for every step size on the CPU.
//
// The layout (pack_bf16 in layers/packed_linear.py): W [N, K] as [ceil(N / 16), K / 2, 16, 2], i.e. for each block of
// 16 output rows, K / 2 lines of 64 bytes, each holding those 16 outputs' weights for inputs k and k + 1 side by
// side. That line is exactly the operand AVX512-BF16's vdpbf16ps multiplies by a broadcast pair of activations,
// adding into 16 fp32 sums at once: no horizontal sums (the plain [N, K] layout needs one per output), and a tile of
// 2 blocks x 8 tokens keeps its 16 sums in registers while the weights stream once per 8 tokens.
//
// Measured on the 2-core AVX-512 BF16 EPYC (`python benchmarks/linear_kernels.py`: SmolLM2-135M's four layer shapes
// x 30 layers against oneDNN's own packed bf16 GEMM in the same run): 1 token 7.5 vs 11.8 ms, 16 tokens 13.8 vs
// 14.9, 64 tokens 36.4 vs 39.3, 512 tokens 261 vs 286; and level with the plain-layout gemv it replaced at 1-4
// tokens (a prototype run: 7.6-9.3 ms both).
//
// No software prefetch: a tile's weights are two contiguous runs of 64-byte lines, which the hardware prefetcher
// follows. Each tile used to ask for all of its weights first (36-98 KiB, more than L1, so the early lines were
// evicted before use and the requests queued ahead of the loads). Dropping that made the 30 layers 1.06-1.12x
// faster at 1 token in three runs, 0.93-1.26x at 2-16 (the host's swing), and the LM head 1.11-1.32x
// (`python benchmarks/linear_kernels.py --against 7e1d74a`; docs/benchmarks.md, round 11).

#include "cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

constexpr int64_t kBlock = 16;      // outputs per packed block
constexpr int64_t kTileBlocks = 2;  // blocks per tile: 32 outputs
constexpr int64_t kTokens = 8;      // tokens per register tile

#if defined(INFERLAB_AVX512_BF16)
inline void store16(at::BFloat16* p, __m512 v, __mmask16 mask) { inferlab::store_bf16x16(p, v, mask); }
inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }

// Tokens [0, MB) x blocks [0, NB) of one tile. x: the tile's first token row; w: its first block; y: the first token
// row's first output of the tile. `last_mask` selects the valid outputs of the tile's last block.
template <int MB, int NB, typename Out>
inline void tile(const at::BFloat16* x, int64_t K, const uint16_t* w, int64_t block_elems, Out* y, int64_t N,
                 __mmask16 last_mask) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // pairs of bf16 activations
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * block_elems + kp * 2 * kBlock);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[m * (K / 2) + kp]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)wv[j], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j)
      store16(y + m * N + j * kBlock, acc[m][j], j == NB - 1 ? last_mask : 0xFFFF);
}

template <int NB, typename Out>
void tile_rows(const at::BFloat16* x, int64_t M, int64_t K, const uint16_t* w, int64_t block_elems, Out* y,
               int64_t N, __mmask16 last_mask) {
  int64_t m = 0;
  for (; m + kTokens <= M; m += kTokens)
    tile<kTokens, NB, Out>(x + m * K, K, w, block_elems, y + m * N, N, last_mask);
  const at::BFloat16* xm = x + m * K;
  Out* ym = y + m * N;
  switch (M - m) {
    case 1: tile<1, NB, Out>(xm, K, w, block_elems, ym, N, last_mask); break;
    case 2: tile<2, NB, Out>(xm, K, w, block_elems, ym, N, last_mask); break;
    case 3: tile<3, NB, Out>(xm, K, w, block_elems, ym, N, last_mask); break;
    case 4: tile<4, NB, Out>(xm, K, w, block_elems, ym, N, last_mask); break;
    case 5: tile<5, NB, Out>(xm, K, w, block_elems, ym, N, last_mask); break;
    case 6: tile<6, NB, Out>(xm, K, w, block_elems, ym, N, last_mask); break;
    case 7: tile<7, NB, Out>(xm, K, w, block_elems, ym, N, last_mask); break;
    default: break;
  }
}
#endif

#if defined(INFERLAB_AVX512_BF16)
template <typename Out>
void run(const at::BFloat16* xp, const torch::Tensor& packed, Out* yp, int64_t M, int64_t K, int64_t N) {
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t blocks = packed.size(0);
  const int64_t block_elems = K * kBlock;
  const int64_t tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
  const __mmask16 tail = inferlab::first_lanes(N - (blocks - 1) * kBlock);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * kTileBlocks, nb = std::min(kTileBlocks, blocks - b0);
      const __mmask16 last = b0 + nb == blocks ? tail : 0xFFFF;
      if (nb == kTileBlocks) {
        tile_rows<kTileBlocks, Out>(xp, M, K, w + b0 * block_elems, block_elems, yp + b0 * kBlock, N, last);
      } else {
        tile_rows<1, Out>(xp, M, K, w + b0 * block_elems, block_elems, yp + b0 * kBlock, N, last);
      }
    }
  });
}
#endif

}  // namespace

// x [M, K] bf16; packed [ceil(N / 16), K / 2, 16, 2] bf16 -> y [M, N] bf16 (fp32 sums, rounded once), or the fp32
// sums themselves with fp32_out (logits: no bf16 rounding and no separate conversion pass).
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kBlock && packed.size(3) == 2,
              "packed must be a contiguous bfloat16 [N / 16, K / 2, 16, 2] from pack_bf16");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K && (N + kBlock - 1) / kBlock == blocks, "x is [", M, ", ", K,
              "] but the packed weight holds ", blocks * kBlock, " x ", packed.size(1) * 2, " for ", N, " outputs");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(fp32_out ? torch::kFloat : torch::kBFloat16));
#if defined(INFERLAB_AVX512_BF16)
  if (fp32_out) {
    run(x.data_ptr<at::BFloat16>(), packed, y.data_ptr<float>(), M, K, N);
  } else {
    run(x.data_ptr<at::BFloat16>(), packed, y.data_ptr<at::BFloat16>(), M, K, N);
  }
#else
  TORCH_CHECK(false, "packed_linear needs a build with AVX-512 BF16 (see gemv_simd())");
#endif
  return y;
}

