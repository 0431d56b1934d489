// Rotary embedding for Q and K plus the K/V write into the paged pool, in one pass over a step's fused QKV rows.
//
// Replaces about ten torch ops per layer (rotate-half's chunk/neg/cat, two products and a sum, the cache dtype
// casts, head-major transposes and two index_copy_ calls), which at batch 1 cost more than the layer's attention.
// Rounds where the unfused ops round in bf16: each product, then their sum.
//
// qkv [T, (H + 2 * KVH) * D] (Q heads, then K heads, then V heads); cos, sin [T, D] in qkv's dtype; pool
// [KVH, N, BS, D] in qkv's dtype, bf16 under fp32 qkv (rows rounded to bf16 as they are stored), or int8
// [KVH, N, BS * (D + 4)] (layers/kv_int8.py); slots [S] int64, S <= T (rows past S are padding: rotated, never
// stored).

#include "cpu_common.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace {

using inferlab::int8_block_bytes;
using inferlab::load;
using inferlab::round_to;
using inferlab::store;

// Row x of D values into row `off` of an int8 block: scale = max|x| / 127, values round(x / scale) (half to even,
// as torch.round), the scale after the block's BS rows. Bit for bit layers/kv_int8.py's quantize_rows.
template <typename T>
void store_int8_row(const T* x, int8_t* block, int64_t off, int64_t D, int64_t BS) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(load(x, d)));
  const float s = amax / 127.f;
  int8_t* q = block + off * D;
  for (int64_t d = 0; d < D; ++d)
    q[d] = s > 0.f ? static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(load(x, d) / s)))) : 0;
  std::memcpy(block + BS * D + off * sizeof(float), &s, sizeof(float));
}

// P: the pool's element, T (rows copied as they are), bf16 under fp32 (each value rounded) or int8_t (rows
// rounded, store_int8_row).
template <typename T, typename P>
void impl(const T* qkv, const T* cos, const T* sin, T* q_out, T* k_out, P* kc, P* vc, const int64_t* slots,
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
          if constexpr (std::is_same_v<P, int8_t>) {
            const int64_t at = (h * N + blk) * int8_block_bytes(BS, D);
            store_int8_row(k_out + (t * KVH + h) * D, kc + at, off, D, BS);
            store_int8_row(row + (H + KVH + h) * D, vc + at, off, D, BS);
          } else if constexpr (std::is_same_v<P, T>) {
            const int64_t at = ((h * N + blk) * BS + off) * D;
            std::memcpy(kc + at, k_out + (t * KVH + h) * D, D * sizeof(T));
            std::memcpy(vc + at, row + (H + KVH + h) * D, D * sizeof(T));
          } else {
            const int64_t at = ((h * N + blk) * BS + off) * D;
            const T* k = k_out + (t * KVH + h) * D;
            const T* v = row + (H + KVH + h) * D;
            for (int64_t d = 0; d < D; ++d) {
              store(kc + at, d, load(k, d));
              store(vc + at, d, load(v, d));
            }
          }
        }
      }
    }
  });
}

template <typename T>
void run(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& q,
         torch::Tensor& k, torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, int64_t H,
         int64_t KVH, int64_t D, int64_t BS) {
  const int64_t T_ = qkv.size(0), N = k_cache.size(1), S = slots.size(0);
  if (k_cache.scalar_type() == torch::kChar)
    impl(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), q.data_ptr<T>(), k.data_ptr<T>(),
         k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), slots.data_ptr<int64_t>(), T_, S, H, KVH, D, N, BS);
  else if (k_cache.scalar_type() != qkv.scalar_type())  // a bf16 pool under fp32
    impl(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), q.data_ptr<T>(), k.data_ptr<T>(),
         k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), slots.data_ptr<int64_t>(), T_, S, H,
         KVH, D, N, BS);
  else
    impl(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), q.data_ptr<T>(), k.data_ptr<T>(),
         k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), slots.data_ptr<int64_t>(), T_, S, H, KVH, D, N, BS);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> rotary_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                                         torch::Tensor k_cache, torch::Tensor v_cache,
                                                         torch::Tensor slots, int64_t H, int64_t KVH) {
  const bool int8_pool = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(qkv.dim() == 2 && k_cache.dim() == (int8_pool ? 3 : 4) && v_cache.sizes() == k_cache.sizes(),
              "bad shapes");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (H + 2 * KVH);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && k_cache.size(0) == KVH && D % 2 == 0, "head counts disagree");
  TORCH_CHECK(int8_pool ? k_cache.size(2) % (D + inferlab::kKvScaleBytes) == 0 : k_cache.size(3) == D,
              "the pool's rows are not the heads' size");
  const int64_t BS = int8_pool ? k_cache.size(2) / (D + inferlab::kKvScaleBytes) : k_cache.size(2);
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D, "cos/sin must be [T, D]");
  const bool bf16_under_fp32 = qkv.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((int8_pool || bf16_under_fp32 || qkv.scalar_type() == k_cache.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "one dtype for qkv, cos/sin and the pool (or an int8 pool, or a bf16 one under fp32)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the pool must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.size(0) <= T, "slots: int64, at most one per row");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = slots.contiguous();
  auto q = torch::empty({T, H, D}, qkv.options());
  auto k = torch::empty({T, KVH, D}, qkv.options());
  if (qkv.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(qkv, cos, sin, q, k, k_cache, v_cache, slots, H, KVH, D, BS);
  } else {
    TORCH_CHECK(qkv.scalar_type() == torch::kFloat, "float32 or bfloat16 only");
    run<float>(qkv, cos, sin, q, k, k_cache, v_cache, slots, H, KVH, D, BS);
  }
  return {q, k};
}
