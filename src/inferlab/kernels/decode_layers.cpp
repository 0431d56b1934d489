// All decoder layers of a decode-only step in one call from Python.
//
// At batch 1 a SmolLM2-135M step runs ~13 kernels in each of 30 layers, and each one reached from Python through
// nn.Module calls, dtype checks and pybind cost ~5-8 us: ~2.5 ms of a ~9 ms int4 step was that glue (measured by
// timing the layers against the kernels inside them). At 16 sequences the glue was ~3.4 ms of a 36 ms step (measured).
//
// This is a second implementation of the Python decoder layers, kept paired with them: the loop below mirrors
// models/llama.py (LlamaDecoderLayer.forward with LlamaAttention, PagedAttention._decode and LlamaMLP on their
// kernel paths, layers/norm.py's RMSNorm), with the options Qwen3 (models/qwen3.py: QK-norm) and Gemma 3
// (models/gemma3.py: QK-norm, sandwich norms, GELU, a second rotary table) add, and PlanLinear (decode_layers.h) mirrors the forward() of the layer
// each ProjKind names. The same kernels run in the same order with the same arguments, so the result is
// bit-identical; only the glue is gone. Python builds a DecodePlan once (LlamaModel.build_decode_plan: the weights
// in whichever form each projection holds them, and each layer's slice of the KV pool) and uses it for every
// decode-only step its projections can take (all of them with packed weights). A change to either side must keep
// tests/models/test_decode_plan.py passing: greedy generations token-identical with the plan and without it.

#include "decode_layers.h"

#include "kernels.h"

namespace {

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return std::get<0>(add_rms_norm(x, c10::nullopt, weight, eps));  // RMSNorm(x) without a residual
}

// Qwen3Attention.project_qkv: each Q and K head normed as a row of a 2-D tensor, V as it is.
torch::Tensor qk_norm(const torch::Tensor& qkv, const PlanLayer& l, int64_t H, int64_t KVH, double eps) {
  const int64_t T = qkv.size(0), D = l.q_norm.size(0);
  const torch::Tensor q = rms_norm(qkv.narrow(1, 0, H * D).reshape({-1, D}), l.q_norm, eps);
  const torch::Tensor k = rms_norm(qkv.narrow(1, H * D, KVH * D).reshape({-1, D}), l.k_norm, eps);
  return torch::cat({q.view({T, -1}), k.view({T, -1}), qkv.narrow(1, (H + KVH) * D, KVH * D)}, 1);
}

// LlamaMLP's kernels.silu_mul, or Gemma3MLP's F.gelu(gate, approximate="tanh") * up on the same split.
torch::Tensor activation(const torch::Tensor& gate_up, bool gelu) {
  if (!gelu) return silu_mul(gate_up);
  const int64_t I = gate_up.size(1) / 2;
  return at::gelu(gate_up.narrow(1, 0, I), "tanh") * gate_up.narrow(1, I, I);
}

// t with `pad` more rows (along dim 0) of `value`.
torch::Tensor pad_rows(const torch::Tensor& t, int64_t pad, double value = 0) {
  std::vector<int64_t> p(2 * t.dim(), 0);
  p.back() = pad;
  return at::constant_pad_nd(t, p, value);
}

}  // namespace

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w) {
  // Through the dispatcher, boxed: the op is registered by torch's oneDNN integration, not declared in its headers.
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, w, c10::IValue(), c10::IValue("none"), c10::List<std::optional<at::Scalar>>(),
                          c10::IValue("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x: [T, hidden] embeddings of T decode tokens (one per sequence) -> (hidden, residual) after the last layer,
// before the final norm (the model's own RMSNorm adds them).
std::tuple<torch::Tensor, torch::Tensor> decode_layers(const DecodePlan& plan, torch::Tensor x, torch::Tensor cos,
                                                       torch::Tensor sin, torch::Tensor cos_local,
                                                       torch::Tensor sin_local, torch::Tensor slots,
                                                       torch::Tensor block_tables, torch::Tensor context_lens) {
  const int64_t rows = x.size(0), q = plan.onednn_row_quantum;
  const int64_t pad = rows > plan.onednn_exact_rows && !plan.layers.empty() &&
                      plan.layers.front().qkv.takes_onednn(rows) ? (q - rows % q) % q : 0;
  if (pad) {  // rows of zeros: no K/V written for them (slots stay one a real row), one key attended (block 0's)
    x = pad_rows(x, pad), cos = pad_rows(cos, pad), sin = pad_rows(sin, pad);
    cos_local = pad_rows(cos_local, pad), sin_local = pad_rows(sin_local, pad);
    block_tables = pad_rows(block_tables, pad), context_lens = pad_rows(context_lens, pad, 1);
  }
  const int64_t T = x.size(0), H = plan.heads, KVH = plan.kv_heads;
  const double eps = plan.eps;
  c10::optional<torch::Tensor> residual;
  torch::Tensor h;
  for (const PlanLayer& l : plan.layers) {
    std::tie(h, x) = add_rms_norm(x, residual, l.input_norm, eps);
    residual = x;
    torch::Tensor qkv = l.qkv(h);
    if (l.q_norm.defined()) qkv = qk_norm(qkv, l, H, KVH, eps);
    const auto qk = rotary_kv_write(qkv, l.local ? cos_local : cos, l.local ? sin_local : sin, l.k_cache,
                                    l.v_cache, slots, H, KVH);
    const torch::Tensor o = paged_decode_attention(std::get<0>(qk), l.k_cache, l.v_cache, block_tables,
                                                   context_lens, plan.scale);
    const torch::Tensor attn = l.o(o.view({T, -1}));
    if (l.post_attn_norm.defined()) {  // Gemma3DecoderLayer.forward
      std::tie(h, x) = add_rms_norm(rms_norm(attn, l.post_attn_norm, eps), residual, l.post_norm, eps);
      residual = x;
      x = rms_norm(l.down(activation(l.gate_up(h), plan.gelu)), l.post_ff_norm, eps);
    } else {  // LlamaDecoderLayer.forward
      std::tie(h, x) = add_rms_norm(attn, residual, l.post_norm, eps);
      residual = x;
      x = l.down(activation(l.gate_up(h), plan.gelu));
    }
  }
  return {x.narrow(0, 0, rows), residual->narrow(0, 0, rows)};
}
