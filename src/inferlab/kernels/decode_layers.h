// The plan decode_layers.cpp runs: built once in Python (models/llama.py, decode_plan), used every small step.
#pragma once

#include "kernels.h"

#include <torch/extension.h>

#include <tuple>
#include <vector>

// x @ W.T with a weight oneDNN has packed (torch.ops.mkldnn._reorder_linear_weight), as the Python layers run it.
torch::Tensor onednn_packed_linear(const torch::Tensor& x, const torch::Tensor& packed);

// One projection. Steps of up to kernel_max_tokens rows use inferlab's kernel: kind 0 = bf16 weight [N, K];
// 1 = int8 (q, scales); 2 = int4 (q, d, m as int16 bits, group). Larger ones the oneDNN-packed bf16 weight.
struct PlanLinear {
  int64_t kind = 0;
  torch::Tensor a, b, c;
  int64_t group = 0;
  int64_t kernel_max_tokens = 0;
  torch::Tensor packed;  // undefined: the plan only runs steps the kernel takes

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (x.size(0) > kernel_max_tokens) {
      TORCH_CHECK(packed.defined(), "a step of ", x.size(0), " tokens is past this projection's kernel");
      return onednn_packed_linear(x, packed);
    }
    switch (kind) {
      case 0: return bf16_linear(x, a);
      case 1: return int8_linear(x, a, b);
      default: return int4_linear(x, a, b, c, group);
    }
  }
};

struct PlanLayer {
  torch::Tensor input_norm, post_norm, k_cache, v_cache;
  PlanLinear qkv, o, gate_up, down;
};

struct DecodePlan {
  std::vector<PlanLayer> layers;
  double eps = 1e-5, scale = 1.0;
  int64_t heads = 0, kv_heads = 0;
};

std::tuple<torch::Tensor, torch::Tensor> decode_layers(const DecodePlan& plan, torch::Tensor x, torch::Tensor cos,
                                                       torch::Tensor sin, torch::Tensor slots,
                                                       torch::Tensor block_tables, torch::Tensor context_lens);
