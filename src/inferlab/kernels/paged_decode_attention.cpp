// Decode attention straight from the paged KV pool, for the CPU.
//
// One query row per token: a decode, or one token of a prefill chunk, prefix-cache extend or speculative proposal
// attending to keys 0..its position (engine/model_runner.py runs those steps as rows). Work is split over (row,
// KV head) pairs (the vectorised bf16 and int8 paths: over runs of a sequence's consecutive rows, see row_runs, and
// each pair's keys in parts, see attend_in_parts); each reads its K/V rows in place through the block table (no
// gather into a contiguous copy), scores all the query heads that share the KV head against each row while it is
// in cache, and keeps an online softmax in fp32, one block of positions at a time. Every row gets the same
// arithmetic whatever else is in the batch, so the result is batch-invariant.
//
// Layout (see layers/attention.py): pool [kv_heads, num_blocks, block_size, head_dim]; q [B, heads, head_dim]. An
// int8 pool (layers/kv_int8.py) is [kv_heads, num_blocks, block_size * (head_dim + 4)]: a block's int8 rows, then
// their fp32 scales; each score is scaled by its key's scale and each softmax weight by its value's.

#include "cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

#if defined(INFERLAB_AVX512_BF16)
using inferlab::exp16;
using inferlab::first_lanes;
using inferlab::load16;
using inferlab::load_bf16x16;
using inferlab::sum_lanes_of_16;
#endif
using inferlab::int8_block_bytes;
using inferlab::load;
using inferlab::round_to;
using inferlab::store;

inline float load(const int8_t* p, int64_t i) { return p[i]; }

// s[j] = exp(s[j] - max) for j < n; returns their sum. With AVX2, 8 at a time on exp8: with the fp32 pool read in
// place (no widening copy), the generic loop below took 0.74 -> 0.59 ms a step at one sequence of 160 keys and
// 12.3 -> 10.5 at 16 on the AVX2 EPYC (`python benchmarks/decode_attention.py --against 872f68d --dtype float32`).
inline float exp_shifted(float* s, int64_t n, float max) {
#if defined(INFERLAB_AVX512_BF16)
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(max);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = first_lanes(n - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), mv));
    _mm512_mask_storeu_ps(s + j, mask, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
  }
  return _mm512_reduce_add_ps(sum);
#elif defined(INFERLAB_AVX2)
  __m256 sum = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(max);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i mask = inferlab::first_lanes8(n - j);
    const __m256 e = _mm256_and_ps(inferlab::exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, mask), mv)),
                                   _mm256_castsi256_ps(mask));
    _mm256_maskstore_ps(s + j, mask, e);
    sum = _mm256_add_ps(sum, e);
  }
  return inferlab::sum_lanes8(sum);
#else
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = expf(s[j] - max);
    sum += s[j];
  }
  return sum;
#endif
}

constexpr int64_t kPrefetchBlocks = 4;

// Blocks are scattered: while block `blk` computes, fetch the K and V blocks kPrefetchBlocks ahead (the first block,
// `first`, fetches the ones before too), up to the key `end`. Four ahead instead of one: batch 1 at 160 tokens
// 16.8 -> 12.0 us a layer, larger batches unchanged (measured). Into L2 (prefetcht1), not L1: 64 sequences of 192
// keys, the pool scattered on huge pages, 15.0-16.0 -> 10.6-11.0 ms for 30 layers (int8 pool), 21.5-21.8 -> 15.8-17.1
// (bf16); 2 or 8 blocks ahead were no better (docs/benchmarks.md, round 16). Each tile reads its lines once, so L2
// is near enough, and requests into L1 hold its few miss buffers while the loads wait. kc, vc: the (head's) pool in
// bytes; block_bytes: one block of one head.
inline void prefetch_ahead(const char* kc, const char* vc, const int64_t* table, int64_t blk, int64_t first,
                           int64_t end, int64_t BS, int64_t head_base, int64_t block_bytes) {
  for (int64_t ahead = blk == first ? 1 : kPrefetchBlocks; ahead <= kPrefetchBlocks; ++ahead) {
    if ((blk + ahead) * BS >= end) break;
    const int64_t next = (head_base + table[blk + ahead]) * block_bytes;
    for (int64_t off = 0; off < block_bytes; off += 64) {
      __builtin_prefetch(kc + next + off, 0, 2);
      __builtin_prefetch(vc + next + off, 0, 2);
    }
  }
}

// Rows j < n of a block widened to fp32 (an int8 pool's times their scales): a block is contiguous, n * D values.
template <typename P>
void widen_block(const P* block, int64_t n, int64_t D, int64_t BS, float* out) {
  if constexpr (std::is_same_v<P, int8_t>) {
    const float* scales = reinterpret_cast<const float*>(block + BS * D);
    for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[j * D + d] = load(block, j * D + d) * scales[j];
    }
  } else {
#pragma omp simd
    for (int64_t e = 0; e < n * D; ++e) out[e] = load(block, e);
  }
}

// s[j] = q . k_j for the n key rows of a block (fp32, D apart). With AVX2 and D a multiple of 64 known at compile
// time, eight keys at a time: eight independent chains of FMAs, their lanes summed by one hadd tree (nine shuffles
// and adds for the eight sums, where a horizontal sum takes five for one); elsewhere a loop the compiler
// vectorises, each key's products summed in one chain.
template <int64_t DIM>
inline void score_rows(const float* q, const float* k, int64_t n, int64_t D, float* s) {
#if defined(INFERLAB_AVX2)
  if constexpr (DIM > 0 && DIM % 64 == 0) {
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const int64_t nj = std::min<int64_t>(8, n - j0);
      __m256 acc[8];
      for (int64_t j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < DIM; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        for (int64_t j = 0; j < 8; ++j)
          if (j < nj) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j0 + j) * DIM + c), acc[j]);
      }
      // hadd(a, b) = [a01 a23 b01 b23 | a45 a67 b45 b67]: two levels leave each key's two 128-bit halves' sums.
      const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
      _mm256_maskstore_ps(s + j0, inferlab::first_lanes8(nj), sums);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const float* kr = k + j * D;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < D; ++d) sum += q[d] * kr[d];
    s[j] = sum;
  }
}

// a = a * corr + sum_j w[j] v_j over the n value rows of a block. With AVX2 and D a multiple of 64 known at compile
// time, 64 dims at a time in eight registers across the block's rows (the loop below keeps `a` in memory: it may
// alias the rows, as far as the compiler knows, so every row loads and stores it).
template <int64_t DIM>
inline void add_weighted_rows(float* a, float corr, const float* w, const float* v, int64_t n, int64_t D) {
#if defined(INFERLAB_AVX2)
  if constexpr (DIM > 0 && DIM % 64 == 0) {
    const __m256 cv = _mm256_set1_ps(corr);
    for (int64_t h = 0; h < DIM; h += 64) {
      __m256 acc[8];
      for (int64_t r = 0; r < 8; ++r) acc[r] = _mm256_mul_ps(_mm256_loadu_ps(a + h + 8 * r), cv);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 wj = _mm256_set1_ps(w[j]);
        for (int64_t r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + j * DIM + h + 8 * r), acc[r]);
      }
      for (int64_t r = 0; r < 8; ++r) _mm256_storeu_ps(a + h + 8 * r, acc[r]);
    }
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) a[d] *= corr;
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = v + j * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] += w[j] * vr[d];
  }
}

// DIM > 0 fixes the head size at compile time (full unrolling into vector registers); 0 reads it at run time.
// P: the pool's element: T, int8_t, or bf16 under an fp32 query.
template <typename T, typename P, int64_t DIM>
void decode(const T* q, const P* kc, const P* vc, const int64_t* tables, const int64_t* lens, T* out,
            int64_t B, int64_t H, int64_t KVH, int64_t N, int64_t BS, int64_t D_, int64_t max_blocks, float scale) {
  const int64_t D = DIM > 0 ? DIM : D_;
  const int64_t G = H / KVH;
  const int64_t block_elems = std::is_same_v<P, int8_t> ? int8_block_bytes(BS, D) : BS * D;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    // kf, vf: a block's rows widened, for pools other than fp32 (which is read in place).
    const int64_t widened = std::is_same_v<P, float> ? 0 : BS * D;
    std::vector<float> qf(G * D), acc(G * D), kf(widened), vf(widened), scores(G * BS), m(G), l(G);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, h = i % KVH;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(q, (b * H + h * G + g) * D + d) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = lens[b];
      for (int64_t start = 0; start < len; start += BS) {
        const int64_t n = std::min(BS, len - start);
        const int64_t base = (h * N + tables[b * max_blocks + start / BS]) * block_elems;
        prefetch_ahead(reinterpret_cast<const char*>(kc), reinterpret_cast<const char*>(vc),
                       tables + b * max_blocks, start / BS, 0, len, BS, h * N, block_elems * sizeof(P));
        // The block's K and V rows as fp32: an fp32 pool's in place, others widened once.
        const float* kb = kf.data();
        const float* vb = vf.data();
        if constexpr (std::is_same_v<P, float>) {
          kb = kc + base;
          vb = vc + base;
        } else {
          widen_block(kc + base, n, D, BS, kf.data());
          widen_block(vc + base, n, D, BS, vf.data());
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * BS;
          score_rows<DIM>(qf.data() + g * D, kb, n, D, sg);
          float bm = m[g];
          for (int64_t j = 0; j < n; ++j) bm = std::max(bm, sg[j]);
          const float corr = expf(m[g] - bm);  // 0 on the first block (m = -inf)
          const float sum = exp_shifted(sg, n, bm);
          l[g] = l[g] * corr + sum;
          m[g] = bm;
          add_weighted_rows<DIM>(acc.data() + g * D, corr, sg, vb, n, D);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) store(out, (b * H + h * G + g) * D + d, acc[g * D + d] * inv);
      }
    }
  });
}

#if defined(INFERLAB_AVX512_BF16)
// The bf16 path, written for the ~20 GB/s the pool can be read at: up to 16 keys of a block are one tile. Scores:
// vdpbf16ps of the bf16 query against each key row (exact products, fp32 sums), the 16 row vectors summed across
// their lanes by one shuffle tree (30 shuffles for 16 dot products instead of a horizontal sum each); softmax in
// fp32 on the 16 scores at once; P.V in fp32 with the accumulators in registers for each 64 dims. 16 sequences of
// 192 tokens, 30 layers, blocks scattered over the pool: 11.0 ms with the generic loop above (6.4 GB/s), 7.2-9.0
// here; with the pool in cache 2.4 ms, so the rest is waiting on memory (measured, /tmp harness, not committed).
constexpr int64_t kTile = 16;

// One tile's online-softmax step for a row's G query heads, s[g] head g's scores (lanes past `valid` ignored):
// updates each head's running max m and sum l, sets corr (what a head's accumulator is scaled by; on the first
// tile, m = -inf, exp16's clamp makes it ~1e-38, which scales a zero accumulator and sum) and turns s[g] into the
// tile's weights exp(s - m), 0 past `valid`. The G corrections are one exp16: a scalar expf each was ~10% of the
// int8 path's time with the pool in cache (perf).
template <int64_t G>
inline void softmax_tiles(__m512 (&s)[G], __mmask16 valid, float* m, float* l, float* corr) {
  static_assert(G <= 16);
  alignas(64) float was[16] = {}, now[16] = {}, c[16];
  for (int64_t g = 0; g < G; ++g) {
    was[g] = m[g];
    now[g] = std::max(m[g], _mm512_mask_reduce_max_ps(valid, s[g]));
  }
  _mm512_store_ps(c, exp16(_mm512_sub_ps(_mm512_load_ps(was), _mm512_load_ps(now))));
  for (int64_t g = 0; g < G; ++g) {
    s[g] = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s[g], _mm512_set1_ps(now[g]))));
    l[g] = l[g] * c[g] + _mm512_reduce_add_ps(s[g]);
    m[g] = now[g];
    corr[g] = c[g];
  }
}

// acc[g] = acc[g] * corr[g] + sum_j p[g][j] * v_j over a tile's n value rows, with the accumulators in registers
// for each 64 dims; row(j, c, v) widens dims 64c..64c+63 of row j to fp32 in v[0..3].
template <int64_t G, int64_t C, typename Row>
inline void accumulate_pv(float (&acc)[G][64 * C], const float (&p)[G][kTile], const float* corr, int64_t n,
                          const Row& row) {
  for (int64_t c = 0; c < C; ++c) {
    __m512 a[G][4];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < 4; ++r)
        a[g][r] = _mm512_mul_ps(_mm512_load_ps(&acc[g][64 * c + 16 * r]), _mm512_set1_ps(corr[g]));
    for (int64_t j = 0; j < n; ++j) {
      __m512 v[4];
      row(j, c, v);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(p[g][j]);
        for (int64_t r = 0; r < 4; ++r) a[g][r] = _mm512_fmadd_ps(w, v[r], a[g][r]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < 4; ++r) _mm512_store_ps(&acc[g][64 * c + 16 * r], a[g][r]);
  }
}

// The int8 pool's P.V on VNNI. A tile's value rows are widened to int16 once for every row and query head, in
// pairs of keys interleaved dim by dim (vi[j / 2]: for each 16 dims, keys j and j + 1 side by side), so that one
// vpdpwssd multiplies 16 dims by two keys' weights and sums both in int32. Each head's weights (already times
// their value rows' scales, 0 past the tile's valid keys) are rounded to int16 against their largest, as the
// queries are for the scores (an error under 1/65,534 of it, far below the values' own int8 rounding of 1/254);
// the tile's int32 sums are then scaled back and added to the fp32 accumulators: 32 multiply-adds an instruction
// against 16 in fp32, and no widening to fp32 per key.
template <int64_t G, int64_t C>
inline void accumulate_pv_int16(float (&acc)[G][64 * C], const float (&p)[G][kTile], const float* corr, int64_t n,
                                const int16_t (&vi)[kTile / 2][64 * C * 2]) {
  alignas(64) int16_t w[G][kTile];
  float w_scale[G];
  for (int64_t g = 0; g < G; ++g) {
    const __m512 pg = _mm512_load_ps(p[g]);
    const float top = _mm512_reduce_max_ps(pg);  // weights are >= 0
    const float to_int = top > 0.f ? 32767.f / top : 0.f;
    _mm256_store_si256(reinterpret_cast<__m256i*>(w[g]),
                       _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(pg, _mm512_set1_ps(to_int)))));
    w_scale[g] = top / 32767.f;
  }
  for (int64_t c = 0; c < C; ++c) {
    __m512i a[G][4];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < 4; ++r) a[g][r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < (n + 1) / 2; ++j) {
      __m512i v[4];
      for (int64_t r = 0; r < 4; ++r) v[r] = _mm512_load_si512(&vi[j][2 * (64 * c + 16 * r)]);
      for (int64_t g = 0; g < G; ++g) {
        int32_t pair;
        std::memcpy(&pair, &w[g][2 * j], sizeof(pair));
        const __m512i wp = _mm512_set1_epi32(pair);
        for (int64_t r = 0; r < 4; ++r) a[g][r] = _mm512_dpwssd_epi32(a[g][r], wp, v[r]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < 4; ++r) {
        float* out = &acc[g][64 * c + 16 * r];
        _mm512_store_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[g][r]), _mm512_set1_ps(w_scale[g]),
                                             _mm512_mul_ps(_mm512_load_ps(out), _mm512_set1_ps(corr[g]))));
      }
  }
}

// Value rows j and j + 1 of a tile (b null: a zero row) widened to int16 and interleaved for vpdpwssd: out holds,
// for each 16 dims, the two keys' values side by side. unpacklo/hi_epi16 interleave within each 128-bit lane, so
// each 32-dim half is first permuted by quadwords (dims 0-3, 16-19, 4-7, 20-23, ...): then the low unpack is dims
// 0-15 in order and the high one dims 16-31.
template <int64_t D>
inline void interleave_value_pair(const int8_t* a, const int8_t* b, int16_t* out) {
  const __m512i order = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);
  const auto widened = [&](const int8_t* row, int64_t h) {
    return _mm512_permutexvar_epi64(
        order, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * h))));
  };
  for (int64_t h = 0; h < D / 32; ++h) {
    const __m512i x = widened(a, h);
    const __m512i y = b == nullptr ? _mm512_setzero_si512() : widened(b, h);
    _mm512_store_si512(out + 64 * h, _mm512_unpacklo_epi16(x, y));
    _mm512_store_si512(out + 64 * h + 32, _mm512_unpackhi_epi16(x, y));
  }
}

// Rows of one sequence's new tokens (a prefill chunk, a prefix-cache extend, speculative proposals) come as
// consecutive rows, each attending to keys 0..its position: row i + 1 has one key more than row i, through the same
// blocks. decode_bf16 takes such a run up to kMaxRows rows at a time, so each 16-key tile it reads from the pool
// serves every row (and every query head) of the run; row by row, the keys of a 3,000-token prefix went through
// the cache once per row. Rows join a run when their tables agree on every block the later row reads, which makes
// the grouping exact whatever sequence each row belongs to; each row's arithmetic (its keys, tile by tile, in the
// same order) is the same alone or in a run, so results stay batch-invariant. Decodes are runs of one row.
constexpr int64_t kMaxRows = 8;

struct RowRun {
  int64_t first, rows;
};

std::vector<RowRun> row_runs(const int64_t* tables, const int64_t* lens, int64_t B, int64_t max_blocks,
                             int64_t BS) {
  std::vector<RowRun> runs;
  for (int64_t b = 0; b < B; ++b) {
    if (!runs.empty()) {
      RowRun& r = runs.back();
      const int64_t prev = r.first + r.rows - 1, blocks = (lens[b] + BS - 1) / BS;
      if (r.rows < kMaxRows && lens[b] == lens[prev] + 1 && blocks <= max_blocks &&
          std::memcmp(tables + prev * max_blocks, tables + b * max_blocks, blocks * sizeof(int64_t)) == 0) {
        ++r.rows;
        continue;
      }
    }
    runs.push_back({b, 1});
  }
  return runs;
}

// A lone decode on SmolLM2 is three (run, KV head) pairs, which two threads took two and one: its keys cost ~1.3x
// what two decodes' did (benchmarks/decode_attention.py). So each pair's keys are attended in parts of whole
// blocks, ~kPartKeys keys each, spread over the threads by cost, and the parts' softmax states folded in order.
// Where a part begins depends on the key's position alone, and every part is computed and folded the same way
// whichever thread takes it, so a row's bits still depend on its own keys only.
constexpr int64_t kPartKeys = 128;

inline int64_t part_keys(int64_t BS) { return BS * std::max<int64_t>(1, kPartKeys / BS); }

// The batch's block tables and lengths, and the pool's shape.
struct Paged {
  const int64_t* tables;
  const int64_t* lens;
  int64_t KVH, N, BS, max_blocks;
  float scale;
};

// One (run, KV head) pair's online softmax over some of its keys: for each row and query head, the running max m,
// sum l and unnormalised output acc. A row with none of the keys keeps m = -inf.
template <int64_t G, int64_t D>
struct Softmax {
  alignas(64) float acc[kMaxRows][G][D];
  float m[kMaxRows][G], l[kMaxRows][G];

  void reset(int64_t R) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < G; ++g) {
        m[r][g] = -std::numeric_limits<float>::infinity();
        l[r][g] = 0.f;
        for (int64_t d = 0; d < D; ++d) acc[r][g][d] = 0.f;
      }
  }

  // This state over keys [0, k) and `next` over [k, k'): the state over [0, k'), both rescaled to the larger max as
  // between two tiles. (Every row has a key in the first part, so m is finite here.)
  void fold(const Softmax& next, int64_t R) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < G; ++g) {
        if (next.m[r][g] == -std::numeric_limits<float>::infinity()) continue;
        const float mx = std::max(m[r][g], next.m[r][g]);
        const float a = expf(m[r][g] - mx), b = expf(next.m[r][g] - mx);
        l[r][g] = l[r][g] * a + next.l[r][g] * b;
        m[r][g] = mx;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[r][g][d] = acc[r][g][d] * a + next.acc[r][g][d] * b;
      }
  }

  // out [rows, H, D]: the run's rows, this pair's G heads.
  template <typename T>
  void write(T* out, int64_t H, const RowRun& run, int64_t h) const {
    for (int64_t r = 0; r < run.rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[r][g];
        for (int64_t d = 0; d < D; ++d) store(out, ((run.first + r) * H + h * G + g) * D + d, acc[r][g][d] * inv);
      }
  }
};

// Attends every (run, KV head) pair's keys a part at a time (attend(run, h, k0, k1, state) sets `state` to keys
// [k0, k1) of the pair) and writes each pair's output (write(run, h, state)). The parts are handed to the threads
// as contiguous ranges of about equal cost; a pair whose parts two threads share keeps the first thread's fold and
// the later parts in scratch, and is folded after the parallel loop, in part order, like any other.
template <typename State, typename Attend, typename Write>
void attend_in_parts(const std::vector<RowRun>& runs, int64_t KVH, const int64_t* lens, int64_t part,
                     const Attend& attend, const Write& write) {
  const int64_t pairs = static_cast<int64_t>(runs.size()) * KVH;
  // Pair p's parts are units first[p] .. first[p + 1] - 1; cost[u] is unit u's cumulative cost at its midpoint.
  std::vector<int64_t> first(pairs + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const RowRun& run = runs[p / KVH];
    first[p + 1] = first[p] + (lens[run.first + run.rows - 1] + part - 1) / part;
  }
  const int64_t units = first[pairs];
  std::vector<double> cost(units);
  double total = 0;
  for (int64_t p = 0; p < pairs; ++p) {
    const RowRun& run = runs[p / KVH];
    const int64_t len = lens[run.first + run.rows - 1];
    for (int64_t u = first[p]; u < first[p + 1]; ++u) {
      // A tile is read once for the run's rows and scored for each: memory as one row, arithmetic as R.
      const double c = static_cast<double>(std::min(part, len - (u - first[p]) * part)) * (run.rows + 1);
      cost[u] = total + c / 2;
      total += c;
    }
  }
  const auto pair_of = [&](int64_t u) { return std::upper_bound(first.begin(), first.end(), u) - first.begin() - 1; };
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  std::vector<int64_t> bound(T + 1, units);  // thread t takes units bound[t] .. bound[t + 1] - 1
  for (int64_t t = 0; t < T; ++t)
    bound[t] = std::lower_bound(cost.begin(), cost.end(), total * static_cast<double>(t) / T) - cost.begin();
  // The pairs a thread boundary cuts: their parts are kept in scratch from `slot` (part k at slot + k; at slot, the
  // fold of the parts 0 .. folded - 1 that the pair's first thread took) and folded after the parallel loop.
  struct Cut {
    int64_t pair, slot, folded;
  };
  std::vector<Cut> cuts;
  int64_t slots = 0;
  for (int64_t t = 1; t < T; ++t) {
    const int64_t u = bound[t];
    if (u <= 0 || u >= units) continue;
    const int64_t p = pair_of(u);
    if (first[p] == u || (!cuts.empty() && cuts.back().pair == p)) continue;
    cuts.push_back({p, slots, u - first[p]});
    slots += first[p + 1] - first[p];
  }
  const auto slot_of = [&](int64_t p) -> int64_t {
    for (const Cut& c : cuts)
      if (c.pair == p) return c.slot;
    return -1;
  };
  std::vector<State> scratch(slots);
  at::parallel_for(0, T, 1, [&](int64_t t_begin, int64_t t_end) {
    State sum, next;
    for (int64_t t = t_begin; t < t_end; ++t)
      for (int64_t u = bound[t]; u < bound[t + 1];) {
        const int64_t p = pair_of(u), h = p % KVH, end = std::min(bound[t + 1], first[p + 1]), slot = slot_of(p);
        const RowRun& run = runs[p / KVH];
        if (u == first[p]) {
          attend(run, h, 0, part, sum);
          for (int64_t k = 1; k < end - first[p]; ++k) {
            attend(run, h, k * part, (k + 1) * part, next);
            sum.fold(next, run.rows);
          }
          if (slot < 0)
            write(run, h, sum);
          else
            scratch[slot] = sum;
        } else {
          for (int64_t k = u - first[p]; k < end - first[p]; ++k)
            attend(run, h, k * part, (k + 1) * part, scratch[slot + k]);
        }
        u = end;
      }
  });
  for (const Cut& c : cuts) {
    const RowRun& run = runs[c.pair / KVH];
    State& sum = scratch[c.slot];
    for (int64_t k = c.folded; k < first[c.pair + 1] - first[c.pair]; ++k) sum.fold(scratch[c.slot + k], run.rows);
    write(run, c.pair % KVH, sum);
  }
}

// Keys [k0, k1) of one (run, KV head) pair, G query heads per KV head, D = 64 * C.
template <int64_t G, int64_t C>
void attend_bf16(const Paged& pg, const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const RowRun& run,
                 int64_t h, int64_t k0, int64_t k1, Softmax<G, 64 * C>& st) {
  constexpr int64_t D = 64 * C;
  const int64_t H = pg.KVH * G, R = run.rows, last = run.first + R - 1, BS = pg.BS;
  alignas(64) float p[kMaxRows][G][kTile];
  alignas(64) float vf[kTile][D];
  float corr[kMaxRows][G];
  st.reset(R);
  // The run's longest row reads every key any of its rows reads. Prefetching runs on past the part, to len: the
  // next part is usually this thread's too.
  const int64_t len = pg.lens[last], end = std::min(len, k1);
  const int64_t* table = pg.tables + last * pg.max_blocks;
  for (int64_t start = k0; start < end; start += BS) {
    const int64_t blk = start / BS;
    prefetch_ahead(reinterpret_cast<const char*>(kc), reinterpret_cast<const char*>(vc), table, blk, k0 / BS, len, BS,
                   h * pg.N, BS * D * sizeof(uint16_t));
    const int64_t base = (h * pg.N + table[blk]) * BS * D;
    for (int64_t t0 = 0; t0 < std::min(BS, end - start); t0 += kTile) {
      const int64_t n = std::min({kTile, BS - t0, end - start - t0});
      const uint16_t* kt = kc + base + t0 * D;
      const uint16_t* vt = vc + base + t0 * D;
      if (R > 1)  // the tile's V rows widened once for all the run's rows (exact: bf16 -> fp32)
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < 4 * C; ++c)
            _mm512_store_ps(&vf[j][16 * c], load_bf16x16(reinterpret_cast<const at::BFloat16*>(vt + j * D + 16 * c)));
      for (int64_t r = 0; r < R; ++r) {
        const int64_t nr = std::min(n, pg.lens[run.first + r] - start - t0);  // this row's keys in the tile
        if (nr <= 0) continue;  // an earlier row, done: its keys ended before this tile
        const __mmask16 valid = first_lanes(nr);
        const uint16_t* qr = q + (run.first + r) * H * D + h * G * D;
        __m512 s[G];
        for (int64_t g = 0; g < G; ++g) {
          __m512bh qv[2 * C];
          for (int64_t c = 0; c < 2 * C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + g * D + 32 * c);
          __m512 part[kTile];
          for (int64_t j = 0; j < kTile; ++j) {
            __m512 dp = _mm512_setzero_ps();
            if (j < nr)
              for (int64_t c = 0; c < 2 * C; ++c)
                dp = _mm512_dpbf16_ps(dp, qv[c], (__m512bh)_mm512_loadu_si512(kt + j * D + 32 * c));
            part[j] = dp;
          }
          s[g] = _mm512_mul_ps(sum_lanes_of_16(part), _mm512_set1_ps(pg.scale));
        }
        softmax_tiles<G>(s, valid, st.m[r], st.l[r], corr[r]);
        for (int64_t g = 0; g < G; ++g) _mm512_store_ps(p[r][g], s[g]);
        if (R > 1) {
          accumulate_pv<G, C>(st.acc[r], p[r], corr[r], nr, [&](int64_t j, int64_t c, __m512* v) {
            for (int64_t k = 0; k < 4; ++k) v[k] = _mm512_load_ps(&vf[j][64 * c + 16 * k]);
          });
        } else {
          accumulate_pv<G, C>(st.acc[r], p[r], corr[r], nr, [&](int64_t j, int64_t c, __m512* v) {
            const auto* vr = reinterpret_cast<const at::BFloat16*>(vt + j * D + 64 * c);
            for (int64_t k = 0; k < 4; ++k) v[k] = load_bf16x16(vr + 16 * k);
          });
        }
      }
    }
  }
}

template <int64_t G, int64_t C>
void decode_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* tables, const int64_t* lens,
                 at::BFloat16* out, int64_t B, int64_t KVH, int64_t N, int64_t BS, int64_t max_blocks, float scale) {
  using State = Softmax<G, 64 * C>;
  const Paged pg{tables, lens, KVH, N, BS, max_blocks, scale};
  attend_in_parts<State>(
      row_runs(tables, lens, B, max_blocks, BS), KVH, lens, part_keys(BS),
      [&](const RowRun& run, int64_t h, int64_t k0, int64_t k1, State& st) {
        attend_bf16<G, C>(pg, q, kc, vc, run, h, k0, k1, st);
      },
      [&](const RowRun& run, int64_t h, const State& st) { st.write(out, KVH * G, run, h); });
}

template <int64_t G>
bool decode_bf16_for_dim(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* tables,
                         const int64_t* lens, at::BFloat16* out, int64_t B, int64_t KVH, int64_t N, int64_t BS,
                         int64_t D, int64_t max_blocks, float scale) {
  const auto* q16 = reinterpret_cast<const uint16_t*>(q);
  const auto* k16 = reinterpret_cast<const uint16_t*>(kc);
  const auto* v16 = reinterpret_cast<const uint16_t*>(vc);
  switch (D) {
    case 64: decode_bf16<G, 1>(q16, k16, v16, tables, lens, out, B, KVH, N, BS, max_blocks, scale); return true;
    case 128: decode_bf16<G, 2>(q16, k16, v16, tables, lens, out, B, KVH, N, BS, max_blocks, scale); return true;
    case 256: decode_bf16<G, 4>(q16, k16, v16, tables, lens, out, B, KVH, N, BS, max_blocks, scale); return true;
    default: return false;
  }
}

// Whether the bf16 path took it (head sizes 64/128/256, up to 8 query heads per KV head).
bool decode_bf16_simd(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* tables,
                      const int64_t* lens, at::BFloat16* out, int64_t B, int64_t H, int64_t KVH, int64_t N,
                      int64_t BS, int64_t D, int64_t max_blocks, float scale) {
#define INFERLAB_GROUP(g) \
  case g: return decode_bf16_for_dim<g>(q, kc, vc, tables, lens, out, B, KVH, N, BS, D, max_blocks, scale);
  switch (H / KVH) {
    INFERLAB_GROUP(1) INFERLAB_GROUP(2) INFERLAB_GROUP(3) INFERLAB_GROUP(4)
    INFERLAB_GROUP(5) INFERLAB_GROUP(6) INFERLAB_GROUP(7) INFERLAB_GROUP(8)
    default: return false;
  }
#undef INFERLAB_GROUP
}

// The int8 pool's path: decode_bf16's runs, parts, tiles, softmax and P.V. The scores are integer dot products on
// VNNI: each query head is rounded to int16 against its own largest element (an error under 1/65,534 of it, far below
// the keys' own int8 rounding of 1/254), each 16-key tile's K rows are widened to int16 once for the run (vpmovsxbw),
// and vpdpwssd sums 32 products an instruction, exactly in int32; a score is then scaled by its query's and its key's
// scale (one load: a block keeps its scales together). Each softmax weight is scaled by its value row's scale, and
// P.V runs in int16 too (accumulate_pv_int16). The pool read is half of bf16's.
template <typename T, int64_t G, int64_t C>
void attend_int8(const Paged& pg, const T* q, const int8_t* kc, const int8_t* vc, const RowRun& run, int64_t h,
                 int64_t k0, int64_t k1, Softmax<G, 64 * C>& st) {
  constexpr int64_t D = 64 * C;
  const int64_t H = pg.KVH * G, R = run.rows, last = run.first + R - 1, BS = pg.BS;
  const int64_t block_bytes = int8_block_bytes(BS, D);
  alignas(64) float p[kMaxRows][G][kTile];
  alignas(64) int16_t qi[kMaxRows][G][D];
  alignas(64) int16_t kw[kTile][D];
  alignas(64) int16_t vi[kTile / 2][2 * D];
  float q_scale[kMaxRows][G];
  float corr[kMaxRows][G];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      // In vectors: the scalar loop's chain of maxes was ~15% of this function's time in cache (perf). The same
      // bits: vcvtps2dq rounds to nearest even, as nearbyint does.
      const T* qh = q + ((run.first + r) * H + h * G + g) * D;
      __m512 x[4 * C], most = _mm512_setzero_ps();
      for (int64_t c = 0; c < 4 * C; ++c) {
        x[c] = load16(qh + 16 * c);
        most = _mm512_max_ps(most, _mm512_abs_ps(x[c]));
      }
      const float top = _mm512_reduce_max_ps(most);
      const __m512 to_int = _mm512_set1_ps(top > 0.f ? 32767.f / top : 0.f);
      for (int64_t c = 0; c < 4 * C; ++c)
        _mm256_store_si256(reinterpret_cast<__m256i*>(&qi[r][g][16 * c]),
                           _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[c], to_int))));
      q_scale[r][g] = top > 0.f ? pg.scale * top / 32767.f : 0.f;
    }
  st.reset(R);
  const int64_t len = pg.lens[last], end = std::min(len, k1);
  const int64_t* table = pg.tables + last * pg.max_blocks;
  for (int64_t start = k0; start < end; start += BS) {
    const int64_t blk = start / BS;
    prefetch_ahead(reinterpret_cast<const char*>(kc), reinterpret_cast<const char*>(vc), table, blk, k0 / BS, len, BS,
                   h * pg.N, block_bytes);
    const int8_t* kb = kc + (h * pg.N + table[blk]) * block_bytes;
    const int8_t* vb = vc + (h * pg.N + table[blk]) * block_bytes;
    const float* k_scales = reinterpret_cast<const float*>(kb + BS * D);
    const float* v_scales = reinterpret_cast<const float*>(vb + BS * D);
    for (int64_t t0 = 0; t0 < std::min(BS, end - start); t0 += kTile) {
      const int64_t n = std::min({kTile, BS - t0, end - start - t0});
      for (int64_t j = 0; j < n; ++j)
        for (int64_t c = 0; c < 2 * C; ++c) {
          const auto* row = reinterpret_cast<const __m256i*>(kb + (t0 + j) * D + 32 * c);
          _mm512_store_si512(&kw[j][32 * c], _mm512_cvtepi8_epi16(_mm256_loadu_si256(row)));
        }
      for (int64_t j = 0; j < n; j += 2)  // the tile's V rows, once for all the run's rows and heads
        interleave_value_pair<D>(vb + (t0 + j) * D, j + 1 < n ? vb + (t0 + j + 1) * D : nullptr, vi[j / 2]);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t nr = std::min(n, pg.lens[run.first + r] - start - t0);  // see attend_bf16
        if (nr <= 0) continue;
        const __mmask16 valid = first_lanes(nr);
        const __m512 ks = _mm512_maskz_loadu_ps(valid, k_scales + t0);
        const __m512 vs = _mm512_maskz_loadu_ps(valid, v_scales + t0);
        __m512 s[G];
        for (int64_t g = 0; g < G; ++g) {
          __m512i qv[2 * C];
          for (int64_t c = 0; c < 2 * C; ++c) qv[c] = _mm512_load_si512(&qi[r][g][32 * c]);
          __m512i part[kTile];
          for (int64_t j = 0; j < kTile; ++j) {
            __m512i dp = _mm512_setzero_si512();
            if (j < nr)
              for (int64_t c = 0; c < 2 * C; ++c)
                dp = _mm512_dpwssd_epi32(dp, qv[c], _mm512_load_si512(&kw[j][32 * c]));
            part[j] = dp;
          }
          s[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(sum_lanes_of_16(part)),
                               _mm512_mul_ps(ks, _mm512_set1_ps(q_scale[r][g])));
        }
        softmax_tiles<G>(s, valid, st.m[r], st.l[r], corr[r]);
        for (int64_t g = 0; g < G; ++g) _mm512_store_ps(p[r][g], _mm512_mul_ps(s[g], vs));
        accumulate_pv_int16<G, C>(st.acc[r], p[r], corr[r], nr, vi);
      }
    }
  }
}

template <typename T, int64_t G, int64_t C>
void decode_int8(const T* q, const int8_t* kc, const int8_t* vc, const int64_t* tables, const int64_t* lens, T* out,
                 int64_t B, int64_t KVH, int64_t N, int64_t BS, int64_t max_blocks, float scale) {
  using State = Softmax<G, 64 * C>;
  const Paged pg{tables, lens, KVH, N, BS, max_blocks, scale};
  attend_in_parts<State>(
      row_runs(tables, lens, B, max_blocks, BS), KVH, lens, part_keys(BS),
      [&](const RowRun& run, int64_t h, int64_t k0, int64_t k1, State& st) {
        attend_int8<T, G, C>(pg, q, kc, vc, run, h, k0, k1, st);
      },
      [&](const RowRun& run, int64_t h, const State& st) { st.write(out, KVH * G, run, h); });
}

// Whether the int8 SIMD path took it (head sizes 64/128/256, up to 8 query heads per KV head).
template <typename T>
bool decode_int8_simd(const T* q, const int8_t* kc, const int8_t* vc, const int64_t* tables, const int64_t* lens,
                      T* out, int64_t B, int64_t H, int64_t KVH, int64_t N, int64_t BS, int64_t D,
                      int64_t max_blocks, float scale) {
#define INFERLAB_DIM(g, c) \
  decode_int8<T, g, c>(q, kc, vc, tables, lens, out, B, KVH, N, BS, max_blocks, scale); return true;
#define INFERLAB_GROUP(g)                          \
  case g:                                          \
    switch (D) {                                   \
      case 64: INFERLAB_DIM(g, 1)                  \
      case 128: INFERLAB_DIM(g, 2)                 \
      case 256: INFERLAB_DIM(g, 4)                 \
      default: return false;                       \
    }
  switch (H / KVH) {
    INFERLAB_GROUP(1) INFERLAB_GROUP(2) INFERLAB_GROUP(3) INFERLAB_GROUP(4)
    INFERLAB_GROUP(5) INFERLAB_GROUP(6) INFERLAB_GROUP(7) INFERLAB_GROUP(8)
    default: return false;
  }
#undef INFERLAB_GROUP
#undef INFERLAB_DIM
}
#endif

template <typename T, typename P>
void dispatch(const T* q, const P* kc, const P* vc, const int64_t* tables, const int64_t* lens, T* out, int64_t B,
              int64_t H, int64_t KVH, int64_t N, int64_t BS, int64_t D, int64_t max_blocks, float scale) {
  if (D == 64) {
    decode<T, P, 64>(q, kc, vc, tables, lens, out, B, H, KVH, N, BS, D, max_blocks, scale);
  } else if (D == 128) {
    decode<T, P, 128>(q, kc, vc, tables, lens, out, B, H, KVH, N, BS, D, max_blocks, scale);
  } else {
    decode<T, P, 0>(q, kc, vc, tables, lens, out, B, H, KVH, N, BS, D, max_blocks, scale);
  }
}

// An int8 pool with a bf16 or fp32 query.
template <typename T>
void run_int8(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& tables,
              const torch::Tensor& lens, torch::Tensor& out, int64_t B, int64_t H, int64_t KVH, int64_t N,
              int64_t BS, int64_t D, float s) {
  const T* qp = q.data_ptr<T>();
  const int8_t* k8 = kc.data_ptr<int8_t>();
  const int8_t* v8 = vc.data_ptr<int8_t>();
#if defined(INFERLAB_AVX512_BF16)
  if (decode_int8_simd(qp, k8, v8, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), B, H,
                       KVH, N, BS, D, tables.size(1), s))
    return;
#endif
  dispatch(qp, k8, v8, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<T>(), B, H, KVH, N, BS, D,
           tables.size(1), s);
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [KVH, N, BS, D] in q's dtype (or bf16 under an fp32 q) or int8
// [KVH, N, BS * (D + 4)]; block_tables [B, max_blocks] int64; context_lens [B] int64.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  const bool int8_pool = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == (int8_pool ? 3 : 4) && v_cache.sizes() == k_cache.sizes(),
              "bad shapes");
  const bool bf16_under_fp32 = q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((int8_pool || bf16_under_fp32 || q.scalar_type() == k_cache.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the pool must share a dtype (or an int8 pool, or a bf16 one under an fp32 q)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and lengths must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the pool must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), N = k_cache.size(1);
  TORCH_CHECK(int8_pool ? k_cache.size(2) % (D + inferlab::kKvScaleBytes) == 0 : k_cache.size(3) == D,
              "the pool's rows are not the heads' size");
  TORCH_CHECK(H % KVH == 0, "head counts disagree");
  const int64_t BS = int8_pool ? k_cache.size(2) / (D + inferlab::kKvScaleBytes) : k_cache.size(2);
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  if (int8_pool) {
    if (q.scalar_type() == torch::kBFloat16) {
      run_int8<at::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, B, H, KVH, N, BS, D, s);
    } else {
      TORCH_CHECK(q.scalar_type() == torch::kFloat, "float32 or bfloat16 only");
      run_int8<float>(q, k_cache, v_cache, block_tables, context_lens, out, B, H, KVH, N, BS, D, s);
    }
    return out;
  }
  if (bf16_under_fp32) {  // the generic loop, each block's rows widened (exactly) to fp32 once
    dispatch(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
             block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH,
             N, BS, D, block_tables.size(1), s);
  } else if (q.scalar_type() == torch::kBFloat16) {
#if defined(INFERLAB_AVX512_BF16)
    if (decode_bf16_simd(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                         v_cache.data_ptr<at::BFloat16>(), block_tables.data_ptr<int64_t>(),
                         context_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H, KVH, N, BS, D,
                         block_tables.size(1), s))
      return out;
#endif
    dispatch(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
           block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H,
           KVH, N, BS, D, block_tables.size(1), s);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat, "float32 or bfloat16 only");
    dispatch(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
           block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH,
           N, BS, D, block_tables.size(1), s);
  }
  return out;
}
