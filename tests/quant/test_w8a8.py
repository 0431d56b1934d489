"""W8A8 (quant/w8a8.py, kernels/w8a8_gemm.cpp): the layout, and the kernel against the product of the int8 weights
with the activations rounded per group of 32 — every tile shape, both activation dtypes."""

from __future__ import annotations

import pytest
import torch
from int8_activations import int8_groups
from torch import nn

from inferlab.kernels import gemv_kernels
from inferlab.quant import W8A8Linear, quantize_model
from inferlab.quant.int8 import Int8Linear, quantize_int8
from inferlab.quant.w8a8 import pack_w8a8, unpack_w8a8

needs_kernel = pytest.mark.skipif(gemv_kernels() is None,
                                  reason="inferlab's W8A8 kernel needs AVX-512 BF16 and a C++ compiler")


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[1] = 0.0  # an all-zero row
    w[2, 5] = 3.0  # an outlier that sets its row's scale
    return w


def test_layout_round_trips_and_dequantizes_as_int8():
    w = _weights(40, 96)
    q, s = quantize_int8(w)
    packed = pack_w8a8(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 24, 16, 4)  # 40 rows padded to 48
    assert packed[0, 2, 7, 1] == int(q[7, 9]) + 128  # block 0, inputs 8-11, output 7, input 9
    assert (packed[2, :, 8:] == 128).all()  # the padding rows hold q = 0
    assert torch.equal(unpack_w8a8(packed, 40), q)
    layer = W8A8Linear.from_float(w)
    assert torch.equal(layer.dequantize(), Int8Linear(q, s).dequantize())
    rows = torch.tensor([2, 39, 0])
    assert torch.equal(layer.dequantize_rows(rows), layer.dequantize()[rows])


def test_inputs_not_a_multiple_of_32_are_a_clear_error():
    with pytest.raises(ValueError, match="groups of 32 inputs, but this layer has 48"):
        W8A8Linear.from_float(torch.randn(16, 48))
    net = nn.Sequential(nn.Linear(64, 48, bias=False), nn.Linear(48, 16, bias=False))
    with pytest.raises(ValueError, match="1: w8a8 rounds activations in groups of 32"):
        quantize_model(net, "w8a8")
    assert isinstance(net[0], nn.Linear)  # nothing was changed


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [48, 40, 80, 96 + 16])  # full 3-block tiles; tails of 1 and 2 blocks, short blocks
def test_kernel_multiplies_the_int8_weights_by_the_rounded_activations(n, dtype):
    k = 576
    layer = W8A8Linear.from_float(_weights(n, k, seed=n))
    wq = layer.dequantize().double()
    kernels = layer.find_kernels()
    for tokens in (1, 3, 4, 5, 9, 16, 21):  # 4-token tiles and every remainder; from 16, tiles ask for the next
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, k, generator=g).to(dtype)
        x[0, :32] *= 100  # a group with an outlier: its own scale, not the row's
        x[-1, 32:64] = 0  # an all-zero group
        y = layer._kernel_mm(kernels, x)
        assert y.dtype == dtype and y.shape == (tokens, n)
        xf = x.float()
        scale = (xf.double().abs() @ wq.abs().T).max()
        exact_tol = 1e-5 if dtype == torch.float32 else 2**-8  # fp32 sums; bf16 rounds the result
        ref = int8_groups(xf) @ wq.T
        assert torch.allclose(y.double(), ref, rtol=exact_tol, atol=1e-5 * scale)
        # ...which is within int8 rounding (half of max|x| / 127 a value, per group) of the exact product
        half_step = (xf.reshape(tokens, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
        bound = half_step.reshape(tokens, k).double() @ wq.abs().T
        err = (y.double() - xf.double() @ wq.T).abs()
        assert (err <= bound + exact_tol * y.double().abs() + 1e-5 * scale).all()
        assert err.max() > 0.05 * bound.max()  # not vacuous: the activations really were rounded


@needs_kernel
def test_a_token_does_not_depend_on_the_others():
    layer = W8A8Linear.from_float(_weights(96, 256))
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(7, 256, generator=g).bfloat16(), torch.randn(7, 256, generator=g).bfloat16()
    b[5] = a[5]
    assert torch.equal(layer(a)[5], layer(b)[5])
    assert torch.equal(layer(a[5:6])[0], layer(a)[5])  # and not on the step's size

