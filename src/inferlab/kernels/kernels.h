// The entry points of inferlab's CPU kernels, each defined in its own file; bindings.cpp exposes them to Python
// and decode_layers.cpp chains them.
#pragma once

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
bool gemv_simd();
bool int_gemv_simd();
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                          int64_t group_size);
torch::Tensor packed_linear_fp32(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, bool fp32_out);
void set_packed_prefetch_tokens(int64_t n);
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N);
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor u);
