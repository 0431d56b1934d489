"""A token embedding that reads its rows from the quantized, tied LM head.

With tied embeddings the table is both the model's first and last weight (49152 x 576 for SmolLM2-135M, 40% of
its parameters). Quantizing the head without also serving lookups from the quantized copy would keep the float
table alive beside it, so the two share the head's buffers: a lookup dequantizes just the looked-up rows.
"""

from __future__ import annotations

import torch
from torch import nn

from inferlab.quant.linear import QuantLinear


class QuantEmbedding(nn.Module):
    """Stands in for `nn.Embedding(num_embeddings, dim)`: forward(ids [...]) -> [..., dim] in `dtype`."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype
        # Not a submodule and no buffers of its own: the head is the model's `lm_head`, which `.to()` moves and
        # weight accounting counts; registering its tensors here too would duplicate them on a device move.
        self._head = [head]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self._head[0].dequantize_rows(flat, self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows from the tied {self._head[0].scheme} lm_head"
