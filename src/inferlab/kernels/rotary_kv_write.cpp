// Rotary embedding for Q and K plus the K/V write into the paged pool, in one pass over a step's fused QKV rows.
//
// Replaces about ten torch ops per layer (rotate-half's chunk/neg/cat, two products and a sum, the cache dtype
// casts, head-major transposes and two index_copy_ calls), which at batch 1 cost more than the layer's attention.
// Rounds where the unfused ops round in bf16: each product, then their sum.
//
// qkv [T, (H + 2 * KVH) * D] (Q heads, then K heads, then V heads); cos, sin [T, D] in qkv's dtype; pool
// [KVH, N, BS, D]; slots [S] int64, S <= T (rows past S are padding: rotated, never stored).

#include "cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <tuple>

namespace {

using inferlab::load;
using inferlab::round_to;
using inferlab::store;

template <typename T>
void impl(const T* qkv, const T* cos, const T* sin, T* q_out, T* k_out, T* kc, T* vc, const int64_t* slots,
          int64_t rows, int64_t stored, int64_t H, int64_t KVH, int64_t D, int64_t N, int64_t BS) {
  const int64_t W = (H + 2 * KVH) * D, half = D / 2;
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 14) / W), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * W;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t head = 0; head < H + KVH; ++head) {
        const T* x = row + head * D;
        T* dst = head < H ? q_out + (t * H + head) * D : k_out + (t * KVH + head - H) * D;
        for (int64_t i = 0; i < D; ++i) {
          // rotate_half(x)[i] = -x[i + D/2] for the first half, x[i - D/2] for the second.
          const float rot = i < half ? -load(x, i + half) : load(x, i - half);
          store(dst, i, round_to(round_to(load(x, i) * load(c, i), x) + round_to(rot * load(s, i), x), x));
        }
      }
      if (t < stored) {
        const int64_t slot = slots[t], blk = slot / BS, off = slot % BS;
        for (int64_t h = 0; h < KVH; ++h) {
          const int64_t at = ((h * N + blk) * BS + off) * D;
          std::memcpy(kc + at, k_out + (t * KVH + h) * D, D * sizeof(T));
          std::memcpy(vc + at, row + (H + KVH + h) * D, D * sizeof(T));
        }
      }
    }
  });
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rotary_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                                         torch::Tensor k_cache, torch::Tensor v_cache,
                                                         torch::Tensor slots, int64_t H, int64_t KVH) {
  TORCH_CHECK(qkv.dim() == 2 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  const int64_t T = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && k_cache.size(0) == KVH && D % 2 == 0, "head counts disagree");
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D, "cos/sin must be [T, D]");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(), "one dtype for qkv, cos/sin and the pool");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the pool must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.size(0) <= T, "slots: int64, at most one per row");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = slots.contiguous();
  auto q = torch::empty({T, H, D}, qkv.options());
  auto k = torch::empty({T, KVH, D}, qkv.options());
  const int64_t N = k_cache.size(1), BS = k_cache.size(2), S = slots.size(0);
  if (qkv.scalar_type() == torch::kBFloat16) {
    impl(qkv.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
         q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
         v_cache.data_ptr<at::BFloat16>(), slots.data_ptr<int64_t>(), T, S, H, KVH, D, N, BS);
  } else {
    TORCH_CHECK(qkv.scalar_type() == torch::kFloat, "float32 or bfloat16 only");
    impl(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
         k.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(), T, S,
         H, KVH, D, N, BS);
  }
  return {q, k};
}
