"""GGUF blocks loaded without requantization reproduce gguf's own reference dequantizer exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from int8_activations import int8_groups

from inferlab.kernels import int_gemv_kernels
from inferlab.quant import quantize_weight
from inferlab.quant.gguf_q4 import RawGGUFWeight, q4_1_blocks, q8_0_blocks

needs_int_kernels = pytest.mark.skipif(int_gemv_kernels() is None,
                                       reason="inferlab's int4 kernel needs AVX-512 BF16 or AVX2, and a C++ compiler")


def _raw(kind: str, n: int = 128, k: int = 256, seed: int = 0) -> RawGGUFWeight:
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
    return RawGGUFWeight(kind, quantize(w, GGMLQuantizationType[kind]), (n, k))


def _reference(raw: RawGGUFWeight) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw.data, GGMLQuantizationType[raw.ggml_type]))


@pytest.mark.parametrize("seed", range(3))
def test_q4_1_direct_is_exact(seed):
    raw = _raw("Q4_1", seed=seed)
    layer, how = quantize_weight(None, "int4", 32, raw)
    assert "directly" in how and layer.from_q4_1
    ref = _reference(raw)
    assert torch.equal(layer.dequantize(), ref)
    # The layer holds the file's own nibble bytes and fp16 (d, m): nothing was unpacked, rounded or repacked.
    n, k = raw.shape
    blocks = raw.data.reshape(n, k // 32, 20)
    assert torch.equal(layer.qweight, torch.from_numpy(blocks[..., 4:].reshape(n, k // 2).copy()))
    assert torch.equal(layer.d.view(torch.int16), torch.from_numpy(blocks[..., 0:2].copy().view(np.int16)[..., 0]))
    assert torch.equal(layer.m.view(torch.int16), torch.from_numpy(blocks[..., 2:4].copy().view(np.int16)[..., 0]))


@needs_int_kernels
@pytest.mark.parametrize("k", [256, 576, 192])  # 576 and 192: an odd number of 64-column chunks
def test_q4_1_kernel_multiplies_by_the_file_values(k):
    """The kernel's weight values, read by multiplying the identity (one value a group: its int8 form is exact),
    are gguf's up to the fp32 rounding of the kernel's sums d * s * dot(q, a) + m * s * sum(a); on other inputs it
    is the product of the file's values with the activations rounded to int8 per group of 32, as GGUF's Q8_1."""
    raw = _raw("Q4_1", n=130, k=k, seed=3)
    layer, _ = quantize_weight(None, "int4", 32, raw)
    ref = _reference(raw).double()
    values = layer._kernel_mm(layer.find_kernels(), torch.eye(raw.shape[1])).T.double()
    d, m = layer.d.double().repeat_interleave(32, dim=1), layer.m.double().repeat_interleave(32, dim=1)
    assert ((values - ref).abs() <= 2**-21 * (16 * d.abs() + m.abs())).all()
    for tokens in (1, 2, 3, 4, 5):
        x = torch.randn(tokens, raw.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(k + tokens))
        x = x.to(torch.bfloat16).float()
        x[0, :32] *= 100  # a group with an outlier: its own scale, not the row's
        y = layer._kernel_mm(layer.find_kernels(), x).double()
        scale = (x.double().abs() @ ref.abs().T).max()
        assert torch.allclose(y, int8_groups(x) @ ref.T, rtol=0, atol=1e-5 * scale)
        # ...which is within int8 rounding (half of max|x| / 127 a value, per group) of the exact product
        assert torch.allclose(y, x.double() @ ref.T, rtol=0, atol=0.01 * scale)


def test_q4_1_with_another_group_size_requantizes():
    raw = _raw("Q4_1")
    layer, how = quantize_weight(None, "int4", 64, raw)
    assert "requantized from GGUF Q4_1" in how and layer.group_size == 64 and not layer.from_q4_1
    assert (layer.dequantize() - _reference(raw)).abs().max() < 0.05


def test_q8_0_blocks_and_requantization():
    raw = _raw("Q8_0")
    q, d = q8_0_blocks(raw)
    assert torch.equal(q.float() * d.float().repeat_interleave(32, dim=1), _reference(raw))
    layer, how = quantize_weight(None, "int8", 32, raw)
    assert how == "requantized from GGUF Q8_0"
    rel = (layer.dequantize() - _reference(raw)).norm() / _reference(raw).norm()
    assert 0 < rel < 0.01


def test_malformed_raw_is_a_clear_error():
    raw = _raw("Q4_1")
    bad = RawGGUFWeight("Q4_1", raw.data[:, :-1], raw.shape)
    with pytest.raises(ValueError, match=r"uint8 \[128, 160\]"):
        q4_1_blocks(bad)
    with pytest.raises(ValueError, match="unknown GGML type"):
        quantize_weight(None, "int8", 32, RawGGUFWeight("Q9_9", raw.data, raw.shape))


def test_bundled_file_q4_1_is_exact():
    """The real file: every Q4_1 tensor of the first and last blocks, through the same fields the loader fills."""
    from gguf import GGUFReader

    from inferlab.common.bundled import bundled_model_path

    reader = GGUFReader(str(bundled_model_path()))
    tensors = [t for t in reader.tensors if t.name.startswith(("blk.0.", "blk.29.")) and t.tensor_type.name == "Q4_1"]
    assert len(tensors) == 14
    for t in tensors:
        shape = (int(t.shape[1]), int(t.shape[0]))
        raw = RawGGUFWeight("Q4_1", np.asarray(t.data).view(np.uint8).reshape(shape[0], -1), shape)
        layer, _ = quantize_weight(None, "int4", 32, raw)
        ref = torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(shape)
        assert torch.equal(layer.dequantize(), ref), t.name
        rows = torch.tensor([0, shape[0] - 1, shape[0] // 2])
        assert torch.equal(layer.dequantize_rows(rows), ref[rows]), t.name
