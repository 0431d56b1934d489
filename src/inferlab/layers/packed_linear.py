"""bf16 linear layers for the CPU, with the weight kept in a layout made for the kernel that multiplies it.

Where inferlab's kernels are built with AVX-512 BF16 the layout is inferlab's own (`pack_bf16`, multiplied by
kernels/packed_gemm.cpp at every step size): measured with SmolLM2-135M's four layer shapes x 30 layers on the
project's 2-core EPYC (`python benchmarks/linear_kernels.py`), it beats oneDNN's own pre-packed bf16 GEMM from 1
to 512 rows (1 row 7.5 vs 11.8 ms, 16 rows 13.8 vs 14.9, 64 rows 36.4 vs 39.3, 512 rows 261 vs 286).
Where the CPU has AMX (Intel Xeon from Sapphire Rapids on), oneDNN multiplies bf16 tiles in it and wins from four
rows: on a 2-core Xeon with AMX, 16 rows 11.6 vs 20.4 ms, 64 rows 15.6 vs 67.5, 256 rows 30.5 vs 268 (same command),
while inferlab's kernel streams a few rows' weights faster (1 row 8.0-8.2 vs 11.9-12.5 ms, 2 rows 9.7-10.1 vs
11.8-12.2, 3 rows 11.0-11.1 vs 11.7-12.0, 4 rows level: two runs). There a layer keeps both copies and picks by
the step's rows (`onednn_min_rows`).
Elsewhere it is oneDNN's pre-packed layout (`torch.ops.mkldnn._reorder_linear_weight`), 1.25-1.6x faster than
`F.linear` from 4 to 64 rows, with torch's own gemv (oneDNN bypassed) for 1-2 rows, which reads the plain weight.
Where oneDNN cannot multiply bf16 either (no AVX-512: an AVX2-only EPYC, where the engine's default dtype is fp32),
bf16 layers stay torch's, and fp32 layers take oneDNN's fp32 layout (onednn_fp32_packing); the default there keeps
bf16 weights in inferlab's layout instead, under fp32 activations (quant/bf16.py).
inferlab's layout only reorders the weight, so a model's layers drop their plain weight once packed into it and
unpack it on the rare read off the hot path (`release_plain_weight`); a weight another module reads (a tied
embedding) stays. So packing costs the model the copies beside the first: for SmolLM2-135M the tied head's 54 MiB
with inferlab's kernel, 258 MiB more with AMX (oneDNN's copy), 258 MiB with oneDNN's layout alone;
`--no-pack-weights` undoes it.
The kernels can round a bf16 result differently in the last bit from torch's, so bf16 outputs are not
bit-identical to the unpacked layer's (fp32, which the batch-invariance tests use, never takes this path: see
models/llama.py, batch_invariant_rows).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from inferlab.common.host_memory import huge_page_copies
from inferlab.kernels import gemv_kernels

# Without inferlab's kernel, steps of at most this many rows use torch's gemv instead of oneDNN.
GEMV_MAX_ROWS = 2
# With AMX, steps of at least this many rows use oneDNN's GEMM instead of inferlab's kernel (measured: see above).
AMX_MIN_ROWS = 4
# oneDNN's GEMM takes steps of more than ONEDNN_EXACT_ROWS rows padded with zeros to a multiple of
# ONEDNN_ROW_QUANTUM. It builds (JITs) a GEMM for each row count it meets and caches 1,024 (its default): on the
# 2-core Xeon with AMX a new row count cost SmolLM2's four layer shapes 7.4 ms (a 64-256-token prefill step x1.19) and
# 0.6 MB of memory each, so a server whose prompts vary in length rebuilt GEMMs on most prefills and grew (1.2 GB
# after every row count from 16 to 528; padded, 0.17 GB). Padded, a 512-token step budget brings at most 28 row
# counts past 64. `python benchmarks/onednn_rows.py`: prefills of 96 new lengths 57.5 -> 50.2 ms a step; of 288
# lengths drawn from 64-512 93.6 -> 80.7 ms, the process 2,098 -> 1,637 MB; the padding's own cost, the same lengths
# again, 48.3 -> 50.4 ms. Up to 64 rows (decode steps: max_num_seqs counts, which stay cached) rows are exact:
# padded, 4-15 decodes ran 3-10% slower.
ONEDNN_ROW_QUANTUM = 16
ONEDNN_EXACT_ROWS = 64


@functools.cache
def onednn_min_rows() -> int | None:
    """The smallest step (rows) that oneDNN's pre-packed bf16 GEMM multiplies beside inferlab's kernel: AMX_MIN_ROWS
    where oneDNN runs on AMX, None (never) elsewhere. INFERLAB_ONEDNN_MIN_ROWS sets it (0: never), to tune a machine
    or to take the path on one without AMX."""
    env = os.environ.get("INFERLAB_ONEDNN_MIN_ROWS")
    if env is not None:
        try:
            rows = int(env)
        except ValueError:
            raise ValueError(f"INFERLAB_ONEDNN_MIN_ROWS must be a whole number of rows, got {env!r}") from None
        return rows if rows > 0 else None
    amx = torch.backends.mkldnn.is_available() and getattr(torch._C._cpu, "_init_amx", lambda: False)()
    return AMX_MIN_ROWS if amx else None


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu":
        return False
    if dtype == torch.float32:
        return onednn_fp32_packing()
    return dtype == torch.bfloat16 and (gemv_kernels() is not None or onednn_bf16_available())


@functools.cache
def onednn_fp32_packing() -> bool:
    """Whether fp32 layers take oneDNN's pre-packed GEMM: where inferlab's kernels are not built vectorised (a CPU
    without AVX-512 BF16, such as an AVX2-only EPYC, where the engine's default dtype is fp32). There, on a 2-core
    AVX2 EPYC (Zen 3), SmolLM2-135M's layer shapes ran 1.8x torch's F.linear (MKL's sgemm) at one row, 3.1x at
    four, 2.1x and 1.5x at 16 and 64, 1.1x at 256, and oneDNN's result for a row is the same bits whatever else
    shares the step (1-79, 100, 128, 200 and 256 rows checked), which MKL's is only at 4, 8 and 12 rows or more
    (models/llama.py: batch_invariant_rows).
    Elsewhere fp32 stays torch's F.linear, which the batch-invariance tests were measured on."""
    return gemv_kernels() is None and _onednn_linear_ops()


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and refuses to
    pack a bf16 weight elsewhere (an AVX2-only EPYC, say), where a bf16 layer stays torch's plain one."""
    return _onednn_linear_ops() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _onednn_linear_ops() -> bool:
    """Whether this torch build has oneDNN and the linear ops pack_onednn and packed_mm call."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K even) -> inferlab's layout [ceil(N / 32), K / 2, 32, 2] in bf16: for each tile of 32 outputs, the
    weights of input pairs (k, k + 1) side by side (kernels/packed_gemm.cpp explains why). Rows past N are zeros."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"inferlab's packed layout needs an even number of inputs, got {k}")
    padded = F.pad(weight.detach().to(torch.bfloat16), (0, 0, 0, -n % 32))
    return padded.view(-1, 32, k // 2, 2).transpose(1, 2).contiguous()


def unpack_bf16(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """pack_bf16's inverse: inferlab's layout -> the weight [out_features, K], a new tensor."""
    tiles, half_k = packed.shape[:2]
    return packed.transpose(1, 2).reshape(tiles * 32, half_k * 2)[:out_features]


def pack_onednn(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [N, K] -> oneDNN's pre-packed weight in `dtype` (an mkldnn tensor), laid out for steps of ~64 rows."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), 64)


def pack_weight(weight: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    """The packed copy a CPU bf16 layer multiplies by in steps of `min_rows` rows or more: inferlab's layout where
    its kernel runs, unless oneDNN's GEMM takes all such steps (onednn_min_rows); else oneDNN's. An fp32 weight
    stays fp32 (oneDNN's: onednn_fp32_packing)."""
    if weight.dtype == torch.float32:
        return pack_onednn(weight, torch.float32)
    amx_rows = onednn_min_rows()
    if gemv_kernels() is not None and weight.shape[1] % 2 == 0 and not (amx_rows and min_rows >= amx_rows):
        with torch.no_grad():
            return pack_bf16(weight)
    return pack_onednn(weight)


def packed_mm(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [T, in] @ the weight `pack_weight` (or `pack_onednn`) packed, in its dtype -> [T, out]."""
    if packed.is_mkldnn:
        pad = -x.shape[0] % ONEDNN_ROW_QUANTUM if x.shape[0] > ONEDNN_EXACT_ROWS else 0
        y = torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, pad)) if pad else x, packed, None, "none", [], "")
        return y[:x.shape[0]] if pad else y
    return gemv_kernels().packed_linear(x, packed, out_features)


def packed_bytes(packed: torch.Tensor) -> int:
    return packed.numel() * packed.element_size()


class KernelLinear(nn.Module):
    """A bias-free linear layer that inferlab's kernels multiply by: packed bf16 (PackedLinear below) or quantized
    (quant/linear.py, QuantLinear). The one-call decode path (kernels/decode_layers.cpp) runs only these."""

    def plan_linear(self, dtype: torch.dtype = torch.bfloat16):
        """This projection as a kernels.PlanLinear, which decode_layers.cpp multiplies by exactly as forward()
        would at that step size for activations in `dtype`; None where inferlab's kernels do not multiply it."""
        raise NotImplementedError

    def rounds_rows_alone(self) -> bool:
        """Whether an fp32 row's result is the same bits whatever other rows share the step, at every step size
        where MKL's sgemm's is not (models/llama.py: batch_invariant_rows), so a model of such layers needs no row
        padding."""
        return False

    def pack_dense(self) -> int:
        """Keep a packed bf16 copy of the weight for large steps; returns the bytes added."""
        return 0

    def streamed_tensors(self) -> list[str]:
        """The attributes holding the weights a step reads from this layer (see place_streamed_weights)."""
        return []


class PackedLinear(KernelLinear):
    """Stands in for a bias-free `nn.Linear` in bf16 (or fp32 where onednn_fp32_packing) on the CPU. `weight` is the
    plain [out, in] parameter (shared with a tied embedding where there is one) until release_plain_weight(); then a
    read unpacks it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.repack()

    def __getattr__(self, name: str):
        # nn.Module looks parameters up here; a released weight is no parameter any more.
        if name == "weight" and "weight" not in self._parameters and "packed" in self.__dict__:
            return self.packed.to_dense() if self.packed.is_mkldnn else unpack_bf16(self.packed, self.out_features)
        return super().__getattr__(name)

    def release_plain_weight(self) -> int:
        """Drop the plain weight where the packed copy is all a step reads (weight then unpacks it on each read);
        returns the bytes freed. Only for a weight no other module reads: the caller knows the model (pack_linears)."""
        if self.reads_plain_weight() or "weight" not in self._parameters:
            return 0
        w = self._parameters.pop("weight")
        return w.numel() * w.element_size()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if "weight" not in self._parameters:
            destination[prefix + "weight"] = self.weight

    def repack(self) -> None:
        """Pack (again, after the plain weight was changed in place)."""
        # Plain attributes, not buffers, so module-wide .to() and state_dict() skip them. `onednn`: oneDNN's copy
        # for steps of `onednn_rows` rows or more, beside inferlab's (see the module's docstring).
        self.packed = pack_weight(self.weight)
        self.onednn_rows = onednn_min_rows() if not self.packed.is_mkldnn else None
        self.onednn = pack_onednn(self.weight) if self.onednn_rows else None

    def reads_plain_weight(self) -> bool:
        """oneDNN's bf16 layout leaves one or two rows to torch's gemv, which reads the plain weight."""
        return self.packed.is_mkldnn and self.packed.dtype == torch.bfloat16

    def rounds_rows_alone(self) -> bool:
        return self.packed.is_mkldnn and self.packed.dtype == torch.float32  # oneDNN's (see onednn_fp32_packing)

    def _packed_for(self, rows: int) -> torch.Tensor:
        return self.onednn if self.onednn is not None and rows >= self.onednn_rows else self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.requires_grad or x2.dtype != self.packed.dtype:
            y = F.linear(x2, self.weight)
        elif self.reads_plain_weight() and x2.shape[0] <= GEMV_MAX_ROWS:
            with _without_onednn():
                y = F.linear(x2, self.weight)
        else:
            y = packed_mm(x2, self._packed_for(x2.shape[0]), self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """forward() in fp32 (logits): inferlab's kernel hands over its fp32 sums without rounding them to bf16."""
        x2 = x.reshape(-1, self.in_features)
        if self._packed_for(x2.shape[0]).is_mkldnn or x.requires_grad or x.dtype != torch.bfloat16:
            return self(x).float()
        y = gemv_kernels().packed_linear(x2, self.packed, self.out_features, fp32_out=True)
        return y.reshape(*x.shape[:-1], self.out_features)

    def streamed_tensors(self) -> list[str]:
        return [] if self.packed.is_mkldnn else ["packed"]

    def plan_linear(self, dtype: torch.dtype = torch.bfloat16):
        """ProjKind.PACKED: the packed weight at every step size, as forward() multiplies by it."""
        if self.packed.is_mkldnn or dtype != torch.bfloat16:
            return None
        kernels = gemv_kernels()
        p = kernels.PlanLinear()
        p.kind, p.packed, p.out_features = kernels.ProjKind.PACKED, self.packed, self.out_features
        if self.onednn is not None:
            p.onednn, p.onednn_min_tokens = self.onednn, self.onednn_rows
        return p

    def extra_repr(self) -> str:
        kind = "oneDNN" if self.packed.is_mkldnn else "inferlab" if self.onednn is None else "inferlab and oneDNN"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for {kind}"


def pack_linears(model: nn.Module) -> int:
    """Replace every bias-free bf16 `nn.Linear` of a CPU model by a PackedLinear, dropping each plain weight that its
    packed copy holds and no other module reads, and give every quantized layer its packed bf16 copy for large steps
    (quant/linear.py). Returns the bytes added, net of those dropped."""
    added = sum(m.pack_dense() for m in model.modules() if isinstance(m, KernelLinear))
    readers = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None and packing_available(child.weight.device,
                                                                                     child.weight.dtype):
                packed = PackedLinear(child)
                setattr(parent, name, packed)
                added += packed_bytes(packed.packed) + (packed_bytes(packed.onednn) if packed.onednn is not None else 0)
                if readers[id(child.weight)] == 1:
                    added -= packed.release_plain_weight()
    return added


def weight_bytes(modules) -> int:
    """Bytes of the modules' weights as loaded, each tensor once: parameters and buffers, and the plain weights that
    packing released (counted as the parameters they were; the packed copies are not counted)."""
    tensors = {id(t): t for m in modules for t in (*m.parameters(), *m.buffers())}
    released = {id(p): p.in_features * p.out_features * p.packed.element_size() for m in modules for p in m.modules()
                if isinstance(p, PackedLinear) and "weight" not in p._parameters}
    return sum(t.numel() * t.element_size() for t in tensors.values()) + sum(released.values())


def place_streamed_weights(model: nn.Module) -> int:
    """Move the weights every kernel layer of a CPU model streams each step onto one mapping backed by huge pages,
    in the modules' order, which is the order a step reads them (common/host_memory.py: huge_page_copies). Call it
    before the decode plan takes references to them. Returns the bytes moved.

    SmolLM2-135M's 30 layers in bf16 ran 1.05-1.11x faster placed so at one token, 1.06-1.13x at 4-16 and 1.02-1.04x at
    64, int4 and w8a8 1.05-1.09x at one token (two runs of `python benchmarks/linear_kernels.py --placement`)."""
    slots = [(m, name) for m in model.modules() if isinstance(m, KernelLinear) for name in m.streamed_tensors()]
    tensors = [getattr(m, name) for m, name in slots]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return 0
    for (m, name), copy in zip(slots, huge_page_copies(tensors)):
        setattr(m, name, copy)
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def _without_onednn():
    # torch.backends.mkldnn.flags would also reset the TF32 settings (and warn about them on CPU builds).
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)
