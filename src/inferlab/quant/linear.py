"""The shared shape of a weight-quantized linear layer: a fast kernel for small steps, dequantize + dense matmul
for large ones.

The kernels are inferlab's own (kernels/gemv.cpp): they stream the quantized weight once per step and
dequantize in registers, so a decode token reads 2-3x fewer bytes than bf16 and runs 2-3x faster. Their work grows
with the tokens in the step, while a bf16 GEMM barely slows down until it turns compute-bound, so from a few
tokens on the dense matmul wins (`python benchmarks/quantization.py kernels`, in docs/benchmarks.md). The dense
path has two forms:
  - packed (the CPU default with bf16 activations, like PackedLinear for float layers): a packed bf16 copy of the
    dequantized weight (inferlab's layout, or oneDNN's where inferlab's kernel is not built or the CPU has AMX:
    layers/packed_linear.py), made once by `pack_dense`. The fastest for large steps; it costs a bf16 copy of the
    weights in memory, which the engine reports beside the quantized bytes. Kernel up to PACKED_MAX_KERNEL_TOKENS.
  - dequantize per step (`--no-pack-weights`, fp32 models, other devices): no second copy, so the memory saving
    stays whole; the dequantization is a fixed cost that only a larger step amortises, hence the larger
    per-scheme `max_kernel_tokens`, and larger still with fp32 activations (`max_kernel_tokens_fp32`: the
    dense path then dequantizes into fp32 and runs MKL's sgemm, as on a CPU without AVX-512 BF16).
Both forms multiply by the dequantized values, so every path computes with the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferlab.kernels import gemv_kernels, int_gemv_kernels
from inferlab.layers.packed_linear import KernelLinear, pack_weight, packed_bytes, packed_mm, packing_available

# With a packed bf16 copy the kernel wins up to 4 tokens on every SmolLM2-135M shape, the LM head included, and
# loses on most from 8 (measured against oneDNN's packed GEMM, docs/benchmarks.md; inferlab's own is faster still).
PACKED_MAX_KERNEL_TOKENS = 4
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_UNSET = object()


class QuantLinear(KernelLinear):
    """Stands in for `nn.Linear(in_features, out_features, bias=False)`: forward(x [..., in]) -> [..., out] in x's
    dtype.

    Subclasses store the quantized weight as buffers (so `.to(device)` moves it and `state_dict()` saves it) and
    implement `dequantize_rows`, `_kernel_mm` and `_plan_fields`.
    """

    scheme = ""
    # Without a packed copy, steps with more tokens than this dequantize and run the dense matmul; with fp32
    # activations (which never use the bf16 copy) past max_kernel_tokens_fp32.
    max_kernel_tokens = 0
    max_kernel_tokens_fp32 = 0
    # Whether the kernel computes each row of a step on its own (kernels/gemv.cpp's do: a row's sums never meet
    # another row's, whatever the tile).
    kernel_rows_alone = False

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # The packed bf16 copy (see pack_dense): a plain attribute, so .to() and state_dict() skip it.
        self.packed: torch.Tensor | None = None
        self._kernels = _UNSET  # find_kernels(), looked up on first use and again after every device move

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._kernels = _UNSET
        if self.packed is not None and self.device.type != "cpu":
            self.packed = None  # a CPU copy is no use elsewhere
        return self

    def kernel_token_limit(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """The most tokens a step of activations in `dtype` runs on the kernel."""
        if dtype == torch.float32:
            return self.max_kernel_tokens_fp32
        return PACKED_MAX_KERNEL_TOKENS if self.packed is not None else self.max_kernel_tokens

    def pack_dense(self) -> int:
        """Keep a packed bf16 copy of the dequantized weight for large steps (layers/packed_linear.py); returns its
        bytes (0 where packing does not apply)."""
        if not packing_available(self.device, torch.bfloat16):
            return 0
        with torch.no_grad():
            self.packed = pack_weight(self.dequantize(torch.bfloat16), min_rows=PACKED_MAX_KERNEL_TOKENS + 1)
        return packed_bytes(self.packed)

    def streamed_tensors(self) -> list[str]:
        names = [name for name, _ in self.named_buffers(recurse=False)]
        return names + (["packed"] if self.packed is not None and not self.packed.is_mkldnn else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called ~120 times per decode step: the checks are kept to attribute reads (measured: a generator over
        # buffers() here cost ~5% of a batch-1 step).
        x2 = x.reshape(-1, self.in_features)
        kernels = self._kernels if self._kernels is not _UNSET else self._lookup_kernels()
        if (kernels is not None and x2.shape[0] <= self.kernel_token_limit(x.dtype) and x.dtype in KERNEL_DTYPES
                and not x.requires_grad):
            y = self._kernel_mm(kernels, x2)
        else:
            y = self.dense_mm(x2)
        return y.reshape(*x.shape[:-1], self.out_features)

    def find_kernels(self):
        """The module with this layer's CPU kernel, or None (other devices, or where the kernels cannot be built):
        then the layer dequantizes (correct, not fast)."""
        return gemv_kernels() if self.device.type == "cpu" else None

    def _lookup_kernels(self):
        self._kernels = self.find_kernels()
        return self._kernels

    def kernel_available(self) -> bool:
        return (self._kernels if self._kernels is not _UNSET else self._lookup_kernels()) is not None

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    def rounds_rows_alone(self) -> bool:
        # MKL's sgemm differs by row count up to 11 rows: inferlab's kernel takes every fp32 step of that size.
        kernels = self._kernels if self._kernels is not _UNSET else self._lookup_kernels()
        return (self.kernel_rows_alone and kernels is not None and kernels is int_gemv_kernels()
                and self.kernel_token_limit(torch.float32) >= 11)

    def plan_linear(self, dtype: torch.dtype = torch.bfloat16):
        """ProjKind.INT8 or INT4, run as forward() runs them: inferlab's kernel up to kernel_token_limit(dtype)
        tokens, the packed copy (where there is one, for bf16) beyond. None without inferlab's kernel."""
        kernels = self._kernels if self._kernels is not _UNSET else self._lookup_kernels()
        if kernels is None or kernels is not int_gemv_kernels() or dtype not in KERNEL_DTYPES:
            return None
        p = kernels.PlanLinear()
        self._plan_fields(p, kernels.ProjKind)
        p.kernel_max_tokens = self.kernel_token_limit(dtype)
        if self.packed is not None and dtype == torch.bfloat16:
            p.out_features = self.out_features
            if self.packed.is_mkldnn:
                p.onednn = self.packed  # every step past the kernel
            else:
                p.packed = self.packed
        return p

    def _plan_fields(self, p, kinds) -> None:
        """Set p.kind (one of `kinds`, the bound ProjKind) and the operands decode_layers.h reads for that kind."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full weight [out, in] as the quantized values represent it."""
        return self.dequantize_rows(None, dtype)

    def dense_mm(self, x: torch.Tensor) -> torch.Tensor:
        """The large-step path: x [T, in] -> [T, out]."""
        if self.packed is not None and x.dtype == torch.bfloat16:
            return packed_mm(x, self.packed, self.out_features)
        return F.linear(x, self.dequantize(x.dtype))

    def dequantize_rows(self, rows: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `rows` (all when None) of the dequantized weight: [len(rows), in]. Embedding lookups use this."""
        raise NotImplementedError

    def _kernel_mm(self, kernels, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (fp32 or bf16, on the CPU) -> [T, out] in x's dtype, with `kernels` from find_kernels."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"
