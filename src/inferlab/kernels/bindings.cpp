// The Python module: one entry per kernel (each defined in its own file).

#include <torch/extension.h>

#include <tuple>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                      torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::tuple<torch::Tensor, torch::Tensor> rotary_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                                         torch::Tensor k_cache, torch::Tensor v_cache,
                                                         torch::Tensor slots, int64_t H, int64_t KVH);
bool quant_simd();
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                          int64_t group_size);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up (CPU)");
  m.def("rotary_kv_write", &rotary_kv_write, "rotary Q/K + K/V write into the paged pool (CPU)");
  m.def("quant_simd", &quant_simd, "whether the int8/int4 kernels were built with AVX-512 BF16");
  m.def("int8_linear", &int8_linear, "x @ (q * scale).T for int8 weights, per-row scales (CPU)");
  m.def("int4_linear", &int4_linear, "x @ (d * q + m).T for int4 weights in Q4_1 layout (CPU)");
}
