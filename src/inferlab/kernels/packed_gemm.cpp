// bf16 matrix products on inferlab's packed weight layout: one kernel for every step size on the CPU (and, at the
// end, one for fp32 activations on a CPU without bf16 arithmetic).
//
// The layout (pack_bf16 in layers/packed_linear.py): W [N, K] as [ceil(N / 32), K / 2, 32, 2], i.e. for each tile of
// 32 output rows, K / 2 runs of two 64-byte lines, each line holding 16 of those outputs' weights for inputs k and
// k + 1 side by side. That line is exactly the operand AVX512-BF16's vdpbf16ps multiplies by a broadcast pair of
// activations, adding into 16 fp32 sums at once: no horizontal sums (the plain [N, K] layout needs one per output),
// and a tile of 2 blocks x 8 tokens keeps its 16 sums in registers while the weights stream once per 8 tokens.
//
// Measured on the 2-core AVX-512 BF16 EPYC (`python benchmarks/linear_kernels.py`: SmolLM2-135M's four layer shapes
// x 30 layers against oneDNN's own packed bf16 GEMM in the same run): 1 token 7.5 vs 11.8 ms, 16 tokens 13.8 vs
// 14.9, 64 tokens 36.4 vs 39.3, 512 tokens 261 vs 286; and level with the plain-layout gemv it replaced at 1-4
// tokens (a prototype run: 7.6-9.3 ms both).
//
// The tile's two blocks are interleaved line by line, so a thread's tiles are one sequential stream of memory: with
// each block's lines in a run of their own, a tile read two streams 18 KiB apart (at K = 576), each ending at the
// tile's end. Interleaving made the 30 layers 1.02-1.18x faster at 1 token, 1.24-1.27x at 2-4, 1.17x at 8, 1.10x
// at 16 and 1.02x at 64, both layouts on huge pages (three runs of `python benchmarks/linear_kernels.py --against
// REV`, docs/benchmarks.md, round 12). Each output still sums its products in the same order at every step size.
//
// Software prefetch at one token only, and only a short way ahead into L2. Each tile used to ask for all of its
// weights first (36-98 KiB, more than L1, so the early lines were evicted before use and the requests queued ahead
// of the loads); dropping that made the 30 layers 1.06-1.12x faster at 1 token in three runs, 0.93-1.26x at 2-16
// (the host's swing), and the LM head 1.11-1.32x (`python benchmarks/linear_kernels.py --against 7e1d74a`;
// docs/benchmarks.md, round 11). At one token a line is one vdpbf16ps, so the loads outrun what the hardware
// prefetcher has asked for: a request kPrefetchAhead bytes down the stream (prefetcht1, one a line) took an
// engine's one-token step from 6.8-7.1 to 6.0-6.2 ms in a fast host state and left it level in a slow one; 4 KiB
// ahead or into L1 was slower, and at 2-8 tokens the same request cost 3-13% (docs/benchmarks.md, round 16).
// That was the EPYC. On a 2-core Xeon with AMX the same request at every tile size made the 30 layers 1.36x faster
// at 2 and 8 tokens, 1.17x at 4, 1.13x at 16, 1.05x at 64 and level at one (`python benchmarks/linear_kernels.py
// --against HEAD`, round 18): so tiles of up to `set_packed_prefetch_tokens(n)` tokens ask, chosen per host by
// kernels/__init__.py. What helps the W8A8 kernel from 16 tokens (each group of tokens asking for a share of the
// next tile) made this one 0.82-0.92x at 16-64 on the Zen 4 EPYC: 36 KiB asked for at once (round 30).

#include "cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 16;                    // outputs per line: one vdpbf16ps
constexpr int64_t kTileBlocks = 2;                // blocks per tile
constexpr int64_t kTile = kBlock * kTileBlocks;  // outputs per packed tile
constexpr int64_t kTokens = 8;      // tokens per register tile
constexpr int64_t kPrefetchAhead = 1024;  // bytes (see the header)
std::atomic<int64_t> prefetch_tokens{1};   // tiles of up to this many tokens prefetch (see the header)

#if defined(INFERLAB_AVX512_BF16)
inline void store16(at::BFloat16* p, __m512 v, __mmask16 mask) { inferlab::store_bf16x16(p, v, mask); }
inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }

// Tokens [0, MB) x the NB blocks of one tile. x: the tile's first token row; w: the tile's weights; y: the first
// token row's first output of the tile. `mask[j]` selects the valid outputs of block j.
template <int MB, int NB, bool Prefetch, typename Out>
inline void tile(const at::BFloat16* x, int64_t K, const uint16_t* w, Out* y, int64_t N, const __mmask16* mask) {
  __m512 acc[MB][NB];
  INFERLAB_UNROLL for (int m = 0; m < MB; ++m)
    INFERLAB_UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // pairs of bf16 activations
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    if constexpr (Prefetch) {  // past the tile's end, the thread's next tile: the stream goes on
      const char* ahead = reinterpret_cast<const char*>(w + kp * 2 * kTile) + kPrefetchAhead;
      INFERLAB_UNROLL for (int j = 0; j < NB; ++j) __builtin_prefetch(ahead + 64 * j, 0, 2);
    }
    __m512i wv[NB];
    INFERLAB_UNROLL for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + kp * 2 * kTile + j * 2 * kBlock);
    INFERLAB_UNROLL for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[m * (K / 2) + kp]);
      INFERLAB_UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)wv[j], xv);
    }
  }
  INFERLAB_UNROLL for (int m = 0; m < MB; ++m)
    INFERLAB_UNROLL for (int j = 0; j < NB; ++j)
      if (mask[j]) store16(y + m * N + j * kBlock, acc[m][j], mask[j]);
}

template <int MB, typename Out>
inline void tile_of(const at::BFloat16* x, int64_t K, const uint16_t* w, Out* y, int64_t N, const __mmask16* mask,
                    int64_t prefetch) {
  if (MB <= prefetch) {
    tile<MB, kTileBlocks, true, Out>(x, K, w, y, N, mask);
  } else {
    tile<MB, kTileBlocks, false, Out>(x, K, w, y, N, mask);
  }
}

template <typename Out>
void tile_rows(const at::BFloat16* x, int64_t M, int64_t K, const uint16_t* w, Out* y, int64_t N,
               const __mmask16* mask, int64_t prefetch) {
  int64_t m = 0;
  for (; m + kTokens <= M; m += kTokens) tile_of<kTokens, Out>(x + m * K, K, w, y + m * N, N, mask, prefetch);
  const at::BFloat16* xm = x + m * K;
  Out* ym = y + m * N;
  switch (M - m) {
    case 1: tile_of<1, Out>(xm, K, w, ym, N, mask, prefetch); break;
    case 2: tile_of<2, Out>(xm, K, w, ym, N, mask, prefetch); break;
    case 3: tile_of<3, Out>(xm, K, w, ym, N, mask, prefetch); break;
    case 4: tile_of<4, Out>(xm, K, w, ym, N, mask, prefetch); break;
    case 5: tile_of<5, Out>(xm, K, w, ym, N, mask, prefetch); break;
    case 6: tile_of<6, Out>(xm, K, w, ym, N, mask, prefetch); break;
    case 7: tile_of<7, Out>(xm, K, w, ym, N, mask, prefetch); break;
    default: break;
  }
}
#endif

#if defined(INFERLAB_AVX512_BF16)
template <typename Out>
void run(const at::BFloat16* xp, const torch::Tensor& packed, Out* yp, int64_t M, int64_t K, int64_t N) {
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t tiles = packed.size(0), tile_elems = K * kTile, prefetch = prefetch_tokens.load();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t left = N - t * kTile;  // outputs from this tile's first on
      const __mmask16 mask[kTileBlocks] = {inferlab::first_lanes(left),
                                           left > kBlock ? inferlab::first_lanes(left - kBlock) : __mmask16(0)};
      tile_rows<Out>(xp, M, K, w + t * tile_elems, yp + t * kTile, N, mask, prefetch);
    }
  });
}
#endif

// ------------------------------------------------------------------------------------------- fp32 activations

// The same layout under fp32 activations (quant/bf16.py), for a CPU without bf16 arithmetic (AVX2). A 256-bit load
// of half a line holds 8 outputs' weights for inputs k and k + 1 side by side; a bf16 value is the top half of an
// fp32 one, so a shift gives the k weights in fp32 and a mask the k + 1 ones, each multiplied by a broadcast
// activation into 8 fp32 sums. Every output adds its products in one order, k then k + 1 a pair, one FMA each,
// whatever the block or chunk (fp32_tile_rows): a row comes out the same bits at every step size, and the scalar
// build (no AVX2) computes the same bits slowly.
//
// Whole tiles (one or two tokens) ask for the weights kFp32PrefetchAhead bytes down the stream, into L2: on the AVX2
// EPYC that made the 30 layers 1.16-1.23x faster at two tokens and the LM head 1.05-1.15x, one token 0.96-1.05x
// (the host's swing), in seven runs of `python benchmarks/linear_kernels.py --against 872f68d --rows 1 2` (0.5 to
// 4 KiB ahead did no better, nor two chains of sums at one token; docs/benchmarks.md, round 25). The blocks of more
// tokens re-read each line from the caches once a block; asking there too made 8 tokens 0.81x as fast, 64 0.55x.
//
// Steps of 3-7 tokens go through a tile a chunk of input pairs at a time, so the tile streams once and in order;
// sweeping each line over all of K a block read it in two strided passes (every other 64 bytes of the tile). On a
// Zen 1 EPYC (AVX2, 2 cores) that made the 30 layers 1.24x faster at 3 tokens, 1.17x at 4 and 1.12x at 6
// (`python benchmarks/linear_kernels.py --against 8f5417f --only bf16`, docs/benchmarks.md, round 27). From 8
// tokens the step is compute-bound there and chunks were 0.92x as fast (the activations' short runs): those keep
// the full sweep. fp32_tile is inlined so that GCC allocates a block's sums as it did before the chunks (a call
// left 5 register copies in the 4 x 2 loop and cost 7% from 8 tokens).
constexpr int64_t kFp32Tokens = 4;
constexpr int64_t kFp32PrefetchAhead = 2048;  // bytes
constexpr int64_t kFp32ChunkPairs = 64;       // input pairs a chunk: 8 KiB of a tile, in L1 for every block
constexpr int64_t kFp32ChunkTokens = 8;       // steps of fewer tokens go by chunks, more sweep all of K a block

// Tokens [0, MB) x NV vectors of 8 outputs from w (a tile's first line, or its second), over input pairs [kp0,
// kp1). The sums come from `sums` (row stride kTile floats) and go back there, or start at zero when `first`: a
// chunk of pairs continues the sums of the chunk before it exactly, so every output adds its products in one order.
#if defined(__AVX2__) && defined(__FMA__)
template <int MB, int NV>
__attribute__((always_inline)) inline void fp32_tile(const float* x, int64_t K, const uint16_t* w, int64_t kp0,
                                                     int64_t kp1, float* sums, bool first) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[MB][NV];
  INFERLAB_UNROLL for (int m = 0; m < MB; ++m)
    INFERLAB_UNROLL for (int v = 0; v < NV; ++v)
      acc[m][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + m * kTile + v * 8);
  for (int64_t kp = kp0; kp < kp1; ++kp) {
    const uint16_t* pair = w + kp * 2 * kTile;
    if constexpr (NV == 4) {  // a whole tile: the two lines of this pair, kFp32PrefetchAhead bytes on
      const char* ahead = reinterpret_cast<const char*>(pair) + kFp32PrefetchAhead;
      __builtin_prefetch(ahead, 0, 2);
      __builtin_prefetch(ahead + 64, 0, 2);
    }
    __m256 wk[NV], wk1[NV];
    INFERLAB_UNROLL for (int v = 0; v < NV; ++v) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + v * 16));
      wk[v] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
      wk1[v] = _mm256_castsi256_ps(_mm256_and_si256(p, high));
    }
    INFERLAB_UNROLL for (int m = 0; m < MB; ++m) {
      const __m256 x0 = _mm256_broadcast_ss(x + m * K + 2 * kp), x1 = _mm256_broadcast_ss(x + m * K + 2 * kp + 1);
      INFERLAB_UNROLL for (int v = 0; v < NV; ++v)
        acc[m][v] = _mm256_fmadd_ps(wk1[v], x1, _mm256_fmadd_ps(wk[v], x0, acc[m][v]));
    }
  }
  INFERLAB_UNROLL for (int m = 0; m < MB; ++m)
    INFERLAB_UNROLL for (int v = 0; v < NV; ++v) _mm256_storeu_ps(sums + m * kTile + v * 8, acc[m][v]);
}
#else
template <int MB, int NV>
inline void fp32_tile(const float* x, int64_t K, const uint16_t* w, int64_t kp0, int64_t kp1, float* sums,
                      bool first) {
  const auto* bf16 = reinterpret_cast<const at::BFloat16*>(w);
  for (int m = 0; m < MB; ++m)
    for (int64_t o = 0; o < NV * 8; ++o) {
      // output o of this pass: lane o % 8 of vector o / 8, whose pairs sit at 16 * (o / 8) + 2 * (o % 8)
      const int64_t at = 16 * (o / 8) + 2 * (o % 8);
      float acc = first ? 0.f : sums[m * kTile + o];
      for (int64_t kp = kp0; kp < kp1; ++kp) {
        acc = std::fma(inferlab::load(bf16, kp * 2 * kTile + at), x[m * K + 2 * kp], acc);
        acc = std::fma(inferlab::load(bf16, kp * 2 * kTile + at + 1), x[m * K + 2 * kp + 1], acc);
      }
      sums[m * kTile + o] = acc;
    }
}
#endif

// One tile for M tokens into sums [M, kTile]. One or two tokens take the whole tile at a time (4 or 8 sums: the
// stream of weights in order). More take one line (16 outputs) at a time in blocks of up to kFp32Tokens tokens (8
// sums, 4 weights and 2 activations: 14 of AVX2's 16 registers), under kFp32ChunkTokens a chunk of input pairs at a
// time (a block's line comes back from L1), from there over all of K.
void fp32_tile_rows(const float* x, int64_t M, int64_t K, const uint16_t* wt, int64_t lines, float* sums) {
  if (M == 1) return fp32_tile<1, 4>(x, K, wt, 0, K / 2, sums, true);
  if (M == 2) return fp32_tile<2, 4>(x, K, wt, 0, K / 2, sums, true);
  const int64_t chunk = M < kFp32ChunkTokens ? kFp32ChunkPairs : K / 2;
  for (int64_t kp0 = 0; kp0 < K / 2; kp0 += chunk) {
    const int64_t kp1 = std::min(K / 2, kp0 + chunk);
    for (int64_t j = 0; j < lines; ++j)
      for (int64_t m0 = 0; m0 < M; m0 += kFp32Tokens) {
        const float* xm = x + m0 * K;
        const uint16_t* wj = wt + j * 2 * kBlock;
        float* sm = sums + m0 * kTile + j * kBlock;
        switch (std::min(kFp32Tokens, M - m0)) {
          case 1: fp32_tile<1, 2>(xm, K, wj, kp0, kp1, sm, kp0 == 0); break;
          case 2: fp32_tile<2, 2>(xm, K, wj, kp0, kp1, sm, kp0 == 0); break;
          case 3: fp32_tile<3, 2>(xm, K, wj, kp0, kp1, sm, kp0 == 0); break;
          default: fp32_tile<4, 2>(xm, K, wj, kp0, kp1, sm, kp0 == 0); break;
        }
      }
  }
}

void run_fp32(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t tiles) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(M * kTile);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid = std::min(kTile, N - t * kTile);  // the last tile's rows past N are padding
      fp32_tile_rows(x, M, K, w + t * K * kTile, (valid + kBlock - 1) / kBlock, sums.data());
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(y + m * N + t * kTile, sums.data() + m * kTile, valid * sizeof(float));
    }
  });
}

// packed as pack_bf16 lays out a weight of N outputs and x's inputs.
void check_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kTile && packed.size(3) == 2,
              "packed must be a contiguous bfloat16 [N / 32, K / 2, 32, 2] from pack_bf16");
  const int64_t tiles = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == x.size(1) && (N + kTile - 1) / kTile == tiles, "x is [", x.size(0), ", ",
              x.size(1), "] but the packed weight holds ", tiles * kTile, " x ", packed.size(1) * 2, " for ", N,
              " outputs");
}

}  // namespace

void set_packed_prefetch_tokens(int64_t n) {
  TORCH_CHECK(n >= 0, "the packed GEMM's prefetch takes a number of tokens >= 0, got ", n);
  prefetch_tokens.store(n);
}

// x [M, K] bf16; packed [ceil(N / 32), K / 2, 32, 2] bf16 -> y [M, N] bf16 (fp32 sums, rounded once), or the fp32
// sums themselves with fp32_out (logits: no bf16 rounding and no separate conversion pass).
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be [M, K] bfloat16");
  check_packed(x, packed, N);
  x = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options().dtype(fp32_out ? torch::kFloat : torch::kBFloat16));
#if defined(INFERLAB_AVX512_BF16)
  const int64_t M = x.size(0), K = x.size(1);
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

// x [M, K] fp32; packed [ceil(N / 32), K / 2, 32, 2] bf16 from pack_bf16 -> y [M, N] fp32.
torch::Tensor packed_linear_fp32(torch::Tensor x, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be [M, K] float32");
  check_packed(x, packed, N);
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0);
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  run_fp32(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
           y.data_ptr<float>(), M, K, N, tiles);
  return y;
}
