// The Python module: one entry per kernel (each defined in its own file).

#include "decode_layers.h"
#include "kernels.h"

#include <pybind11/stl.h>
#include <torch/extension.h>

// Every kernel lets go of the GIL while it runs: the server's engine thread spends most of a step inside them, and
// holding the GIL there stalled the event-loop thread (and then the engine waited for the GIL in turn).
// The types are module_local: two builds of the module (this tree's and an earlier revision's, for an A/B in one
// process: benchmarks/decode_attention.py --against) would otherwise both register them globally, and the second
// import would fail.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU)", nogil);
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm (CPU)", nogil);
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up (CPU)", nogil);
  m.def("rotary_kv_write", &rotary_kv_write, "rotary Q/K + K/V write into the paged pool (CPU)", nogil);
  m.def("gemv_simd", &gemv_simd, "whether the gemv and packed GEMM kernels were built with AVX-512 BF16");
  m.def("int_gemv_simd", &int_gemv_simd,
        "whether int8_linear and int4_linear at group size 32 were built vectorised (AVX-512 BF16 or AVX2)");
  m.def("int8_linear", &int8_linear, "x @ (q * scale).T for int8 weights, per-row scales (CPU)", nogil);
  m.def("int4_linear", &int4_linear, "x @ (d * q + m).T for int4 weights in Q4_1 layout (CPU)", nogil);
  m.def("packed_linear_fp32", &packed_linear_fp32,
        "x @ w.T for fp32 x and a bf16 weight in inferlab's packed layout, in fp32 (CPU; AVX2 or scalar)", nogil);
  m.def("packed_linear", &packed_linear, "x @ w.T for a bf16 weight in inferlab's packed layout (CPU)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"), pybind11::arg("fp32_out") = false, nogil);
  m.def("set_packed_prefetch_tokens", &set_packed_prefetch_tokens,
        "tiles of up to this many tokens in packed_linear prefetch their weights (kernels/__init__.py chooses)");
  m.def("w8a8_linear", &w8a8_linear,
        "x @ (q * scale).T for int8 weights in inferlab's W8A8 layout, activations rounded to int8 per 32 (CPU)",
        nogil);
  m.def("sample_rows", &sample_rows,
        "one token a row from softmax(logits / T) by inverting the CDF at 1 - u; T = 0 greedy (CPU)", nogil);
  pybind11::enum_<ProjKind>(m, "ProjKind", pybind11::module_local())
      .value("PACKED", ProjKind::PACKED)
      .value("INT8", ProjKind::INT8)
      .value("INT4", ProjKind::INT4)
      .value("W8A8", ProjKind::W8A8)
      .value("BF16", ProjKind::BF16);
  pybind11::class_<PlanLinear>(m, "PlanLinear", pybind11::module_local())
      .def(pybind11::init<>())
      .def_readwrite("kind", &PlanLinear::kind)
      .def_readwrite("a", &PlanLinear::a)
      .def_readwrite("b", &PlanLinear::b)
      .def_readwrite("c", &PlanLinear::c)
      .def_readwrite("group", &PlanLinear::group)
      .def_readwrite("kernel_max_tokens", &PlanLinear::kernel_max_tokens)
      .def_readwrite("packed", &PlanLinear::packed)
      .def_readwrite("onednn", &PlanLinear::onednn)
      .def_readwrite("onednn_min_tokens", &PlanLinear::onednn_min_tokens)
      .def_readwrite("out_features", &PlanLinear::out_features);
  pybind11::class_<PlanLayer>(m, "PlanLayer", pybind11::module_local())
      .def(pybind11::init<>())
      .def_readwrite("input_norm", &PlanLayer::input_norm)
      .def_readwrite("post_norm", &PlanLayer::post_norm)
      .def_readwrite("k_cache", &PlanLayer::k_cache)
      .def_readwrite("v_cache", &PlanLayer::v_cache)
      .def_readwrite("qkv", &PlanLayer::qkv)
      .def_readwrite("o", &PlanLayer::o)
      .def_readwrite("gate_up", &PlanLayer::gate_up)
      .def_readwrite("down", &PlanLayer::down)
      .def_readwrite("q_norm", &PlanLayer::q_norm)
      .def_readwrite("k_norm", &PlanLayer::k_norm)
      .def_readwrite("post_attn_norm", &PlanLayer::post_attn_norm)
      .def_readwrite("post_ff_norm", &PlanLayer::post_ff_norm)
      .def_readwrite("local", &PlanLayer::local);
  pybind11::class_<DecodePlan>(m, "DecodePlan", pybind11::module_local())
      .def(pybind11::init<>())
      .def_readwrite("layers", &DecodePlan::layers)
      .def_readwrite("eps", &DecodePlan::eps)
      .def_readwrite("scale", &DecodePlan::scale)
      .def_readwrite("heads", &DecodePlan::heads)
      .def_readwrite("kv_heads", &DecodePlan::kv_heads)
      .def_readwrite("gelu", &DecodePlan::gelu)
      .def_readwrite("onednn_row_quantum", &DecodePlan::onednn_row_quantum)
      .def_readwrite("onednn_exact_rows", &DecodePlan::onednn_exact_rows);
  m.def("decode_layers", &decode_layers, "all decoder layers of a decode-only step (CPU)", nogil);
}
