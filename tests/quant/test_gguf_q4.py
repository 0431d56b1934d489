"""GGUF blocks loaded without requantization reproduce gguf's own reference dequantizer exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from inferlab.quant import Int4Linear, quantize_weight
from inferlab.quant.gguf_q4 import RawGGUFWeight, q4_1_blocks, q8_0_blocks


def _raw(kind: str, n: int = 128, k: int = 256, seed: int = 0) -> RawGGUFWeight:
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)
    return RawGGUFWeight(kind, quantize(w, GGMLQuantizationType[kind]), (n, k))


def _reference(raw: RawGGUFWeight) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw.data, GGMLQuantizationType[raw.ggml_type]))


def _kernel_values_fp32(layer: Int4Linear, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Read the kernel's own dequantized values: multiply the identity, with fp32 scale d and zero m + 8d (the
    fp32 kernel path is slow but takes fp32 scales, so no rounding is added)."""
    sz = torch.stack([d.float(), m.float() + 8 * d.float()], dim=-1).transpose(0, 1).contiguous()
    k = layer.in_features
    return torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k), layer.qweight, 32, sz).T


@pytest.mark.parametrize("seed", range(3))
def test_q4_1_direct_is_exact(seed):
    raw = _raw("Q4_1", seed=seed)
    layer, how = quantize_weight(None, "int4", 32, raw)
    assert "directly" in how
    ref = _reference(raw)
    assert torch.equal(layer.dequantize(), ref)
    q, d, m = q4_1_blocks(raw)
    assert torch.equal(_kernel_values_fp32(layer, d, m), ref)  # the packed nibbles are the file's nibbles


def test_q4_1_bf16_kernel_rounding_is_bounded():
    raw = _raw("Q4_1")
    layer, _ = quantize_weight(None, "int4", 32, raw)
    ref = _reference(raw)
    _, d, m = q4_1_blocks(raw)
    # The kernel's bf16 scale and zero (m + 8d) round by at most 2^-9 relative each (see Int4Linear.from_q4_1).
    dense = layer.dense_weight(torch.float32)
    bound = (d.float().abs() * 8 + (m.float() + 8 * d.float()).abs()).repeat_interleave(32, dim=1) * 2**-8
    assert ((dense - ref).abs() <= bound).all()
    assert not torch.equal(dense, ref)  # bf16 does round: the exact copy is what makes dequantize() exact


def test_q4_1_with_another_group_size_requantizes():
    raw = _raw("Q4_1")
    layer, how = quantize_weight(None, "int4", 64, raw)
    assert "requantized from GGUF Q4_1" in how and layer.group_size == 64 and layer.q4_1_dm is None
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

    from inferlab.models.bundled import bundled_model_path

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
