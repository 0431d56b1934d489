"""Reading GGUF's own quantized blocks straight into our layers, without a dequantize -> requantize round trip.

Block layouts (ggml-common.h; gguf.quants is the reference dequantizer the tests compare against):
  Q4_1: 32 weights in 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; byte i holds weight i (low nibble) and
        weight i + 16 (high nibble); value = d * q + m.
  Q8_0: 32 weights in 34 bytes: fp16 d, 32 int8; value = d * q.

K-quants (Q4_K, Q5_K, Q6_K: llama.cpp's Q4_K_M files) are dequantized at load by gguf's reference (then, with
--quantization, quantized again from those exact floats), except Q4_K under int4:
  Q4_K: a weight is d * sc * q - dmin * mn, with 6-bit sc and mn per 32 weights under fp16 d and dmin per 256:
        q4_k_groups hands int4 each group's q as it is, with d * sc and -dmin * mn rounded to fp16 (11-bit d x 6-bit
        sc needs up to 17 bits: within 2^-11 of each, not bit-exact). Requantizing from the floats instead refits
        each group's min and max, and a group whose q never reaches 0 or 15 lands on another grid: on Gemma 3 270M
        that cost +2.2% corpus perplexity against bf16, the direct groups +0.37% in all (inferlab eval, measured).
  Q5_K: 5-bit q (no 5-bit kernel). Q6_K: 6-bit q with an int8 scale per 16 weights (the int8 layers scale per
        output channel). Both are requantized from their floats (int4 keeps them at int8: quant/__init__.py).
Cost, measured ad hoc on the shared 2-core machine (contended): gguf dequantizes 95-130 M weights/s, about 2-3 s
for a 270M model and a minute for a 7B, and bf16 keeps 2 bytes a weight where Q4_K held 0.56.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # weights per block in Q4_0/Q4_1/Q8_0
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34, "Q4_K": 144}
QK_K = 256  # weights per K-quant super-block


@dataclass(slots=True)
class RawGGUFWeight:
    """One linear weight as the GGUF file stores it (models/loader.py reads these for quantize_model)."""

    ggml_type: str  # "Q4_1", "Q8_0", "F32", ...
    data: np.ndarray  # uint8 [out_rows, bytes_per_row]: rows already permuted/fused like the float weight
    shape: tuple[int, int]  # (out, in)


def _blocks(raw: RawGGUFWeight, ggml_type: str) -> np.ndarray:
    """The raw rows viewed as [out, in / 32, block bytes], with a clear error when they do not fit."""
    out, k = raw.shape
    nbytes, per = BLOCK_BYTES[ggml_type], QK_K if ggml_type.endswith("_K") else QK
    if raw.ggml_type != ggml_type:
        raise ValueError(f"expected a {ggml_type} weight, got {raw.ggml_type}")
    if k % per or raw.data.dtype != np.uint8 or raw.data.shape != (out, k // per * nbytes):
        raise ValueError(f"{ggml_type} data for shape {raw.shape} must be uint8 [{out}, {k // per * nbytes}], "
                         f"got {raw.data.dtype} {list(raw.data.shape)}")
    return np.ascontiguousarray(raw.data).reshape(out, k // per, nbytes)


def q4_1_blocks(raw: RawGGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows -> (nibble bytes uint8 [out, in/2] as the file stores them, d fp16 [out, in/32], m fp16 [out, in/32]).

    Byte i of a block holds weight i in its low nibble and weight i + 16 in its high nibble: Int4Linear's layout for
    group size 32, so the bytes are used as they are."""
    b = _blocks(raw, "Q4_1")
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0])
    m = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0])
    qs = torch.from_numpy(b[..., 4:].copy())  # [out, blocks, 16]
    return qs.reshape(raw.shape[0], raw.shape[1] // 2), d, m


def q8_0_blocks(raw: RawGGUFWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> (q int8 [out, in], d fp16 [out, in/32])."""
    b = _blocks(raw, "Q8_0")
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0])
    q = torch.from_numpy(b[..., 2:].copy().view(np.int8))
    return q.reshape(raw.shape), d


def q4_k_groups(raw: RawGGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Q4_K rows -> (q uint8 [out, in] in 0..15, d fp16 [out, in/32], m fp16 [out, in/32]) with each weight
    ~ d * q + m (ggml's block_q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles);
    None where a group's scale or min overflows fp16."""
    b = _blocks(raw, "Q4_K")  # [out, supers, 144]
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # [out, supers, 1]
    dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc_bytes, qs = b[..., 4:16].astype(np.uint8), b[..., 16:]
    # ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-7, 4-7 split over bytes 8-11 and the
    # top 2 bits of bytes 0-7.
    sc = np.concatenate([sc_bytes[..., 0:4] & 63, (sc_bytes[..., 8:12] & 0xF) | ((sc_bytes[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([sc_bytes[..., 4:8] & 63, (sc_bytes[..., 8:12] >> 4) | ((sc_bytes[..., 4:8] >> 6) << 4)], -1)
    # 4 chunks of 32 bytes: the low nibbles are sub-block 2j, the high ones sub-block 2j + 1.
    q4 = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    q = (q4 & 0xF).reshape(raw.shape)
    with np.errstate(over="ignore"):
        gd = (d * sc).astype(np.float16).reshape(raw.shape[0], -1)
        gm = (-dmin * mn).astype(np.float16).reshape(raw.shape[0], -1)
    if not (np.isfinite(gd).all() and np.isfinite(gm).all()):
        return None
    return torch.from_numpy(q.copy()), torch.from_numpy(gd), torch.from_numpy(gm)


def dequantize_raw(raw: RawGGUFWeight) -> torch.Tensor:
    """Any GGUF weight -> float32 [out, in], through gguf's own reference dequantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType[raw.ggml_type]
    except KeyError:
        raise ValueError(f"unknown GGML type {raw.ggml_type!r}") from None
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw.data, qtype), dtype=np.float32)).reshape(raw.shape)
