// All decoder layers of a decode-only step in one call from Python.
//
// At batch 1 a SmolLM2-135M step runs ~13 kernels in each of 30 layers, and each one reached from Python through
// nn.Module calls, dtype checks and pybind cost ~5-8 us: ~2.5 ms of a ~9 ms int4 step was that glue (measured by
// timing the layers against the kernels inside them). At 16 sequences the glue was ~3.4 ms of a 36 ms step (measured).
//
// This is a second implementation of the Python decoder layers, kept paired with them: the loop below mirrors
// models/llama.py (LlamaDecoderLayer.forward with LlamaAttention, PagedAttention._decode and LlamaMLP on their
// kernel paths, layers/norm.py's RMSNorm), and PlanLinear (decode_layers.h) mirrors the forward() of the layer
// each ProjKind names. The same kernels run in the same order with the same arguments, so the result is
// bit-identical; only the glue is gone. Python builds a DecodePlan once (LlamaModel.build_decode_plan: the weights
// in whichever form each projection holds them, and each layer's slice of the KV pool) and uses it for every
// decode-only step its projections can take (all of them with packed weights). A change to either side must keep
// tests/models/test_decode_plan.py passing: greedy generations token-identical with the plan and without it.

#include "decode_layers.h"

#include "kernels.h"

// x: [T, hidden] embeddings of T decode tokens (one per sequence) -> (hidden, residual) after the last layer,
// before the final norm (the model's own RMSNorm adds them).
std::tuple<torch::Tensor, torch::Tensor> decode_layers(const DecodePlan& plan, torch::Tensor x, torch::Tensor cos,
                                                       torch::Tensor sin, torch::Tensor slots,
                                                       torch::Tensor block_tables, torch::Tensor context_lens) {
  const int64_t T = x.size(0), H = plan.heads, KVH = plan.kv_heads;
  c10::optional<torch::Tensor> residual;
  torch::Tensor h;
  for (const PlanLayer& l : plan.layers) {
    std::tie(h, x) = add_rms_norm(x, residual, l.input_norm, plan.eps);
    residual = x;
    const torch::Tensor qkv = l.qkv(h);
    const auto qk = rotary_kv_write(qkv, cos, sin, l.k_cache, l.v_cache, slots, H, KVH);
    const torch::Tensor o = paged_decode_attention(std::get<0>(qk), l.k_cache, l.v_cache, block_tables,
                                                   context_lens, plan.scale);
    std::tie(h, x) = add_rms_norm(l.o(o.view({T, -1})), residual, l.post_norm, plan.eps);
    residual = x;
    x = l.down(silu_mul(l.gate_up(h)));
  }
  return {x, *residual};
}
