"""bf16 linear layers for the CPU, with the weight kept in the layout oneDNN's GEMM reads fastest.

Measured on the project's 2-core AVX-512 BF16 EPYC, torch 2.13, SmolLM2-135M's four layer shapes x 30 layers with
weights out of cache (`python benchmarks/linear_kernels.py`): a weight pre-packed for oneDNN multiplies 1.25-1.6x
faster than `F.linear` from 4 to 64 rows; for one to four rows a matrix-vector kernel reads the plain weight faster
(inferlab's bf16 gemv, kernels/gemv.cpp, 1-4 rows; where it is not built, torch's own with oneDNN bypassed, 1-2
rows, ~26 GB/s, twice oneDNN's rate). The layer keeps both forms, so the speed costs a second copy of
the weights (for this model, 258 MiB more): serving trades memory for latency here, as `--no-pack-weights` undoes.
The two kernels can round a bf16 result differently in the last bit, so bf16 outputs are not bit-identical across
batch sizes (fp32, which the batch-invariance tests use, never takes this path: see models/llama.py,
batch_invariant_rows).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

# Steps with at most this many rows use a matrix-vector kernel: inferlab's (kernels/gemv.cpp) where it is built,
# else torch's own for up to 2 rows.
GEMV_MAX_ROWS = 2
KERNEL_MAX_ROWS = 4


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """Stands in for a bias-free `nn.Linear` in bf16 on the CPU; `weight` stays the plain [out, in] tensor (shared
    with a tied embedding where there is one)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        # An opaque oneDNN tensor: a plain attribute, not a buffer, so module-wide .to() and state_dict() skip it.
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 64)
        from inferlab.kernels import gemv_kernels

        self.kernels = gemv_kernels() if self.weight.is_contiguous() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.kernels is not None and x2.shape[0] <= KERNEL_MAX_ROWS and x2.dtype == torch.bfloat16 \
                and not x2.requires_grad:
            y = self.kernels.bf16_linear(x2, self.weight)
        elif x2.shape[0] <= GEMV_MAX_ROWS:
            with _without_onednn():
                y = F.linear(x2, self.weight)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, None, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def plan_linear(self):
        """This projection for kernels/decode_layers.cpp, which runs it as forward() does: the bf16 gemv up to
        KERNEL_MAX_ROWS rows, the packed weight beyond. None where inferlab's gemv is not built."""
        if self.kernels is None:
            return None
        p = self.kernels.PlanLinear()
        p.kind, p.a, p.kernel_max_tokens, p.packed = 0, self.weight.detach(), KERNEL_MAX_ROWS, self.packed
        return p

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Replace every bias-free bf16 `nn.Linear` of a CPU model by a PackedLinear, and give every quantized layer its
    packed bf16 copy for large steps (quant/linear.py). Returns the bytes added."""
    from inferlab.quant.linear import QuantLinear

    added = sum(m.pack_dense() for m in model.modules() if isinstance(m, QuantLinear))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None and packing_available(child.weight.device,
                                                                                     child.weight.dtype):
                packed = PackedLinear(child)
                setattr(parent, name, packed)
                added += packed.packed.numel() * packed.packed.element_size()
    return added


@contextlib.contextmanager
def _without_onednn():
    # torch.backends.mkldnn.flags would also reset the TF32 settings (and warn about them on CPU builds).
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)
