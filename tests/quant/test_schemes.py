"""int8 / int4 (and bf16 weights) on random matrices: error bounds, the packed layout, and the layer's forward."""

from __future__ import annotations

import pytest
import torch

from inferlab.kernels import int_gemv_kernels
from inferlab.quant import Bf16Linear, Int4Linear, Int8Linear
from inferlab.quant.int4 import pack_int4, quantize_int4, unpack_int4
from inferlab.quant.int8 import quantize_int8
from inferlab.quant.linear import PACKED_MAX_KERNEL_TOKENS


def _weights(seed: int, n: int = 192, k: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] = 0.0  # an all-zero row
    w[5, :] = 0.7  # a constant row (constant groups for int4)
    w[7, 11] = 3.0  # an outlier that sets its row's (and group's) scale
    w[9] *= 1e-4  # a row far smaller than the rest
    return w


@pytest.mark.parametrize("seed", range(4))
def test_int8_error_bound(seed):
    w = _weights(seed)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and q.abs().max() <= 127
    deq = Int8Linear(q, scale).dequantize()
    s = scale.float()[:, None]
    # Rounding to the nearest step, plus the clamp where bf16 rounded the scale down (see quantize_int8).
    bound = s / 2 + w.abs() * 2**-8 + 1e-12
    assert ((deq - w).abs() <= bound).all()
    assert (deq[3] == 0).all()
    # Not vacuous: the error is a real fraction of a step, and the relative error is about what 8 bits give.
    assert (deq - w).abs().max() > 0.2 * s.min()
    assert (deq - w).norm() / w.norm() < 0.01


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_bound(seed, group_size):
    w = _weights(seed)
    q, d, m = quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and q.max() <= 15 and d.shape == m.shape == (192, 256 // group_size)
    assert d.dtype == m.dtype == torch.float16
    deq = Int4Linear.from_float(w, group_size).dequantize()
    df = d.float().repeat_interleave(group_size, dim=1)
    mf = m.float().repeat_interleave(group_size, dim=1)
    # Rounding to the nearest step; fp16's rounding of m, and of d where the largest value clamps at 15 (fp16's
    # relative 2^-11, or its absolute 2^-25 among subnormals, which the 1e-4 row's scales are).
    bound = df / 2 + 15 * torch.maximum(df * 2**-11, torch.tensor(2**-25)) + \
        torch.maximum(mf.abs() * 2**-11, torch.tensor(2**-25)) + 1e-12
    assert ((deq - w).abs() <= bound).all()
    assert (deq[3] == 0).all() and torch.allclose(deq[5], w[5], rtol=2**-11)  # zero and constant groups
    rel = ((deq - w).norm() / w.norm()).item()
    assert 0.02 < rel < 0.15  # what 4 bits with groups give on Gaussian weights; zero error would mean a no-op


def test_int4_smaller_groups_are_more_accurate():
    w = _weights(0)
    errs = [(Int4Linear.from_float(w, g).dequantize() - w).norm().item() for g in (32, 64, 128)]
    assert errs[0] < errs[1] < errs[2]


@pytest.mark.parametrize("group_size", [32, 64])
def test_pack_layout(group_size):
    """Byte j of a group holds element j (low nibble) and element G/2 + j (high nibble): Q4_1's order for G = 32."""
    q = torch.randint(0, 16, (6, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_int4(q, group_size)
    h = group_size // 2
    assert packed.shape == (6, 64)
    assert torch.equal(packed[:, :h], q[:, :h] | (q[:, h:group_size] << 4))
    assert torch.equal(packed[:, h:2 * h], q[:, group_size:group_size + h] | (q[:, group_size + h:2 * group_size] << 4))
    assert torch.equal(unpack_int4(packed, group_size), q)


def _layers(w):
    return [Int8Linear.from_float(w), Int4Linear.from_float(w, 32), Int4Linear.from_float(w, 64),
            Int4Linear.from_float(w, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Both sides of each path's kernel token limit (bf16 activations: 4, 16, 48; fp32: 64, 256).
@pytest.mark.parametrize("tokens", [1, 3, 5, 9, 40, 120, 300])
@pytest.mark.parametrize("packed", [False, True])
def test_forward_equals_dequantized_matmul(dtype, tokens, packed):
    w = _weights(2, n=203)  # not a multiple of the kernel's 4-row tiles
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
    # The last one's width (96) is not a multiple of 64: no kernel, always the dense path.
    for layer in _layers(w) + [Int4Linear.from_float(w[:, :96], 32)]:
        if packed:
            layer.pack_dense()
        xi = x[:, :layer.in_features].to(dtype)
        y = layer(xi)
        assert y.dtype == dtype and y.shape == (tokens, 203)
        ref = xi.double() @ layer.dequantize().double().T
        # The kernels see bf16 activations and return bf16 (about 3 significant digits): compare against the
        # output's scale; a wrong nibble or scale would be off by a whole quantization step (>> 2%).
        err = (y.double() - ref).abs().max() / ref.abs().max()
        # fp32 with no kernel at all is fp32 arithmetic on the same values; inferlab's int8 kernel rounds fp32
        # activations to 15 bits per token (gemv.cpp): each off by up to half of 1/16383 of the row's largest, ~1e-4
        # of the output's scale here. Where that kernel is not vectorised, torch's int8 kernel stands in
        # (quant/int8.py), on bf16 activations.
        exact = dtype == torch.float32 and not layer.kernel_available() and not (packed and tokens > 4)
        int8_kernel = (dtype == torch.float32 and layer.scheme == "int8" and not (packed and tokens > 4)
                       and int_gemv_kernels() is not None)
        assert err < (1e-5 if exact else 5e-4 if int8_kernel else 0.02), (layer, err)


def test_kernel_and_dense_paths_agree():
    w = _weights(3)
    x = torch.randn(4, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    for layer in _layers(w):
        small = layer(x)  # the kernel
        layer.max_kernel_tokens = 0
        dense = layer(x)  # dequantize + dense matmul
        assert torch.allclose(small.float(), dense.float(), atol=0.02 * dense.abs().max().item())


def test_forward_keeps_leading_dims():
    layer = Int8Linear.from_float(_weights(0))
    x = torch.randn(2, 3, 256)
    assert torch.allclose(layer(x), layer(x.reshape(6, 256)).reshape(2, 3, 192))


def test_casting_the_model_after_quantizing_keeps_the_kernel_working():
    w = _weights(0)
    for layer in _layers(w):
        before = layer(torch.ones(1, 256))
        layer.to(torch.float32)  # turns the bf16 scales into fp32; the kernel must still get bf16
        assert torch.equal(layer(torch.ones(1, 256)), before)


def test_dequantize_rows_matches_full_dequantize():
    w = _weights(1)
    rows = torch.tensor([4, 0, 191, 64, 4])
    for layer in _layers(w):
        assert torch.equal(layer.dequantize_rows(rows), layer.dequantize()[rows])


@pytest.mark.parametrize("group_size", [0, 3, 48, 512])
def test_bad_group_size_is_a_clear_error(group_size):
    with pytest.raises(ValueError, match="group size"):
        Int4Linear.from_float(torch.randn(64, 256), group_size)


def test_not_a_matrix_is_a_clear_error():
    with pytest.raises(ValueError, match="2-D"):
        Int8Linear.from_float(torch.randn(4, 4, 4))


def test_packed_copy_serves_large_steps_with_the_same_weights():
    w = _weights(6)
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    for layer in _layers(w):
        assert layer.packed is None and layer.kernel_token_limit() == layer.max_kernel_tokens
        if layer.pack_dense() == 0:
            pytest.skip("no packed bf16 copy here (torch without oneDNN, or a CPU it cannot multiply bf16 on)")
        assert layer.kernel_token_limit() == PACKED_MAX_KERNEL_TOKENS < 12
        ref = torch.nn.functional.linear(x, layer.dequantize(torch.bfloat16))
        assert torch.allclose(layer(x).float(), ref.float(), rtol=0.01, atol=0.01 * ref.abs().max().item())


@pytest.mark.skipif(int_gemv_kernels() is None,
                    reason="torch's kernel is already the one here: nothing to fall back from")
def test_int8_falls_back_to_torchs_kernel_without_ours(monkeypatch):
    import inferlab.quant.int8 as int8

    layer = Int8Linear.from_float(_weights(7))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(7))
    ours = layer(x)
    monkeypatch.setattr(int8, "int_gemv_kernels", lambda: None)
    layer.to(torch.float32)  # a module move makes the layer look its kernel up again
    assert layer.find_kernels() is int8._TorchInt8Kernel
    theirs = layer(x)
    assert not torch.equal(ours, theirs)  # really another kernel (bf16 activations)...
    assert torch.allclose(ours, theirs, rtol=0.02, atol=0.02 * ours.abs().max().item())  # ...same product


@pytest.mark.skipif(int_gemv_kernels() is None, reason="inferlab's integer kernels are not vectorised here")
def test_integer_kernels_round_each_row_alone():
    """What lets an fp32 model of int8/int4 (or bf16-weight) layers skip the row padding MKL's sgemm needs
    (models/llama.py: decide_row_padding): a row's result is the same bits at every step size the kernel takes."""
    w = _weights(8, n=203)
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(8))
    for layer in (Int8Linear.from_float(w), Int4Linear.from_float(w, 32), Bf16Linear.from_float(w)):
        assert layer.rounds_rows_alone()
        alone = torch.cat([layer(x[r:r + 1]) for r in range(13)])
        for n in range(2, 14):
            assert torch.equal(layer(x[:n]), alone[:n]), (layer.scheme, n)


# Steps of 1-2 tokens (a whole tile at a time), 3-4 (one block of tokens a line, by chunks of 64 input pairs: 256
# and 250 inputs are two), 5 (a block and a rest, by chunks), 9 and 120 (blocks over all of K); 203 outputs (a last
# tile of 11).
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 9, 120])
@pytest.mark.parametrize("in_features", [256, 250])
def test_bf16_weights_are_fp32_arithmetic_on_the_rounded_weights(tokens, in_features):
    w = _weights(9, n=203)[:, :in_features]
    layer = Bf16Linear.from_float(w)
    assert layer.qweight.dtype == torch.bfloat16 and layer.weight_bytes() == 224 * in_features * 2  # 7 tiles of 32
    assert torch.equal(layer.dequantize(), w.bfloat16().float())
    rows = torch.tensor([0, 31, 32, 202, 7])
    assert torch.equal(layer.dequantize_rows(rows), w.bfloat16().float()[rows])
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(tokens))
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (tokens, 203)
    ref = x.double() @ w.bfloat16().double().T
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 sums of exact products
    assert (y.double() - x.double() @ w.double().T).abs().max() > 1e-4 * ref.abs().max()  # the weights rounded
    # bf16 activations multiply the weight as it is (the scheme is for fp32 ones; quantize_model refuses a bf16
    # model), torch's own matmul
    assert torch.equal(layer(x.bfloat16()), torch.nn.functional.linear(x.bfloat16(), w.bfloat16()))


def test_bf16_weights_need_an_even_width():
    with pytest.raises(ValueError, match="bf16 weights need an even number of inputs"):
        Bf16Linear.from_float(torch.randn(8, 7))
