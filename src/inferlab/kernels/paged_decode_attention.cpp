// Decode attention straight from the paged KV pool, for the CPU.
//
// One query token per sequence. Work is split over (sequence, KV head) pairs; each pair reads its K/V rows in
// place through the block table (no gather into a contiguous copy), scores all the query heads that share the KV
// head against each row while it is in cache, and keeps an online softmax in fp32, one block of positions at a
// time. Every pair does the same arithmetic whatever else is in the batch, so the result is batch-invariant.
//
// Layout (see layers/attention.py): pool [kv_heads, num_blocks, block_size, head_dim]; q [B, heads, head_dim].

#include "cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
// exp(x) for 16 floats (Cephes' expf: Cody-Waite reduction by ln 2, a degree-6 polynomial, 2^n by vscalefps), within
// ~2 ulp, instead of one glibc expf call per score. A small gain (16 sequences of ~160 tokens: 8.0 -> 7.4 ms a
// step over 30 layers, within noise); the kernel's time is in walking blocks one at a time (docs/benchmarks.md).
// Inputs below -87.3 give ~0, as exp does.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
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
#endif

// s[j] = exp(s[j] - max) for j < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float max) {
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(max);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), mv));
    _mm512_mask_storeu_ps(s + j, mask, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
  }
  return _mm512_reduce_add_ps(sum);
#else
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = expf(s[j] - max);
    sum += s[j];
  }
  return sum;
#endif
}

using inferlab::load;
using inferlab::round_to;
using inferlab::store;

constexpr int64_t kPrefetchBlocks = 4;

// DIM > 0 fixes the head size at compile time (full unrolling into vector registers); 0 reads it at run time.
template <typename T, int64_t DIM>
void decode(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
            int64_t B, int64_t H, int64_t KVH, int64_t N, int64_t BS, int64_t D_, int64_t max_blocks, float scale) {
  const int64_t D = DIM > 0 ? DIM : D_;
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), kf(BS * D), vf(BS * D), scores(G * BS), m(G), l(G);
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
        const int64_t base = (h * N + tables[b * max_blocks + start / BS]) * BS * D;
        // Blocks are scattered: fetch kPrefetchBlocks ahead while this one computes (the first block fetches the
        // ones before too). Four ahead instead of one: batch 1 at 160 tokens 16.8 -> 12.0 us a layer, larger
        // batches unchanged (measured).
        for (int64_t ahead = start == 0 ? 1 : kPrefetchBlocks; ahead <= kPrefetchBlocks; ++ahead) {
          if (start + ahead * BS >= len) break;
          const int64_t next = (h * N + tables[b * max_blocks + start / BS + ahead]) * BS * D;
          const char* nk = reinterpret_cast<const char*>(kc + next);
          const char* nv = reinterpret_cast<const char*>(vc + next);
          for (int64_t off = 0; off < static_cast<int64_t>(BS * D * sizeof(T)); off += 64) {
            __builtin_prefetch(nk + off);
            __builtin_prefetch(nv + off);
          }
        }
        // The block's K and V rows, widened to fp32 once (a block is contiguous: n * D values).
#pragma omp simd
        for (int64_t e = 0; e < n * D; ++e) kf[e] = load(kc, base + e);
#pragma omp simd
        for (int64_t e = 0; e < n * D; ++e) vf[e] = load(vc, base + e);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float* sg = scores.data() + g * BS;
          for (int64_t j = 0; j < n; ++j) {
            const float* kr = kf.data() + j * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * kr[d];
            sg[j] = s;
          }
          float bm = m[g];
          for (int64_t j = 0; j < n; ++j) bm = std::max(bm, sg[j]);
          const float corr = expf(m[g] - bm);  // 0 on the first block (m = -inf)
          const float sum = exp_shifted(sg, n, bm);
          l[g] = l[g] * corr + sum;
          m[g] = bm;
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] *= corr;
          for (int64_t j = 0; j < n; ++j) {
            const float w = sg[j];
            const float* vr = vf.data() + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) store(out, (b * H + h * G + g) * D + d, acc[g * D + d] * inv);
      }
    }
  });
}

template <typename T>
void dispatch(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out, int64_t B,
              int64_t H, int64_t KVH, int64_t N, int64_t BS, int64_t D, int64_t max_blocks, float scale) {
  if (D == 64) {
    decode<T, 64>(q, kc, vc, tables, lens, out, B, H, KVH, N, BS, D, max_blocks, scale);
  } else if (D == 128) {
    decode<T, 128>(q, kc, vc, tables, lens, out, B, H, KVH, N, BS, D, max_blocks, scale);
  } else {
    decode<T, 0>(q, kc, vc, tables, lens, out, B, H, KVH, N, BS, D, max_blocks, scale);
  }
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [KVH, N, BS, D]; block_tables [B, max_blocks] int64; context_lens [B] int64.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and the pool must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block tables and lengths must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the pool must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), N = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head counts or dims disagree");
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == torch::kBFloat16) {
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
