// The plan decode_layers.cpp runs: built once in Python (models/llama.py, build_decode_plan), used every small step.
#pragma once

#include "kernels.h"

#include <torch/extension.h>

#include <tuple>
#include <vector>

// torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""): x [T, K] bf16 @ oneDNN's pre-packed weight.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w);

// How a projection multiplies, each kind set by the Python layer it stands for (bound as kernels.ProjKind):
//   PACKED (layers/packed_linear.py, PackedLinear): bf16, the weight packed for packed_linear at every step size.
//   INT8 (quant/int8.py: a = q, b = scales) and INT4 (quant/int4.py: a = q, b = d, c = m as int16 bits, group):
//   inferlab's kernel for steps of up to kernel_max_tokens rows, the packed bf16 copy of the dequantized weight
//   beyond (where there is one; else the plan only runs steps the kernel takes), as QuantLinear.forward does.
//   BF16 (quant/bf16.py: a = the bf16 weight in packed_linear's layout; fp32 activations): packed_linear_fp32 up to
//   kernel_max_tokens rows, as INT8.
//   W8A8 (quant/w8a8.py: a = the packed int8 weight, b = scales): w8a8_gemm.cpp's kernel at every step size.
// Where the CPU has AMX, `onednn` holds oneDNN's pre-packed bf16 copy (layers/packed_linear.py: onednn_min_rows),
// which takes every dense step of onednn_min_tokens rows or more instead of `packed`.
enum class ProjKind : int64_t { PACKED, INT8, INT4, W8A8, BF16 };

struct PlanLinear {
  ProjKind kind = ProjKind::PACKED;
  torch::Tensor a, b, c;
  int64_t group = 0;
  int64_t kernel_max_tokens = 0;
  torch::Tensor packed, onednn;
  int64_t onednn_min_tokens = 0;
  int64_t out_features = 0;

  torch::Tensor operator()(const torch::Tensor& x) const {
    const int64_t T = x.size(0);
    if (kind == ProjKind::W8A8) return w8a8_linear(x, a, b, out_features);
    if (kind != ProjKind::PACKED && T <= kernel_max_tokens) {
      if (kind == ProjKind::INT8) return int8_linear(x, a, b);
      if (kind == ProjKind::BF16) return packed_linear_fp32(x, a, out_features);
      return int4_linear(x, a, b, c, group);
    }
    if (takes_onednn(T)) return onednn_linear(x, onednn);
    TORCH_CHECK(packed.defined(), "a step of ", T, " tokens is past this projection's kernel");
    return packed_linear(x, packed, out_features, false);
  }

  bool takes_onednn(int64_t T) const {
    return kind != ProjKind::W8A8 && !(kind != ProjKind::PACKED && T <= kernel_max_tokens) && onednn.defined() &&
           T >= onednn_min_tokens;
  }
};

// A layer's options, each left undefined (false) where the family's layer does not have it:
//   q_norm, k_norm   Qwen3's and Gemma 3's RMSNorm over each Q and K head before rotary (models/qwen3.py)
//   post_attn_norm, post_ff_norm   Gemma 3's "sandwich": the attention's and the MLP's outputs are normed before
//                    the residual add; post_norm is then the norm before the MLP (models/gemma3.py)
//   local            the layer rotates with the second rotary table (Gemma 3's sliding-window layers)
struct PlanLayer {
  torch::Tensor input_norm, post_norm, k_cache, v_cache;
  PlanLinear qkv, o, gate_up, down;
  torch::Tensor q_norm, k_norm, post_attn_norm, post_ff_norm;
  bool local = false;
};

// gelu: the MLP's activation is GELU (tanh approximation, Gemma 3) instead of SiLU.
// onednn_row_quantum, onednn_exact_rows: a step of more than onednn_exact_rows rows whose projections take oneDNN
// runs on rows padded to a multiple of onednn_row_quantum, the padding rows writing no K/V and attending to one key
// (layers/packed_linear.py, ONEDNN_ROW_QUANTUM, says why).
struct DecodePlan {
  std::vector<PlanLayer> layers;
  double eps = 1e-5, scale = 1.0;
  int64_t heads = 0, kv_heads = 0;
  bool gelu = false;
  int64_t onednn_row_quantum = 1, onednn_exact_rows = 0;
};

// cos_local, sin_local: the second rotary table, for layers marked local (pass cos, sin again where none is).
std::tuple<torch::Tensor, torch::Tensor> decode_layers(const DecodePlan& plan, torch::Tensor x, torch::Tensor cos,
                                                       torch::Tensor sin, torch::Tensor cos_local,
                                                       torch::Tensor sin_local, torch::Tensor slots,
                                                       torch::Tensor block_tables, torch::Tensor context_lens);
