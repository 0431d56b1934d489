"""How finely W8A8 must scale its int8 activations: corpus perplexity with the layers' inputs rounded to int8 at
several group sizes, on the int8-weight model, in fp32 arithmetic (no kernel: the rounding alone).

    python benchmarks/activation_rounding.py [--groups 0 32 64 192]    # 0: one scale per token

Each of the 120 layer matmuls (not the LM head) rounds its input per token and group of G inputs, a = round(x /
s), s = max|x| / 127, and multiplies the dequantized values by the dequantized int8 weight. The first row is the
int8 weights with unrounded activations; `inferlab eval --quantization none` gives bf16's own. The choice it
informed is in kernels/w8a8_gemm.cpp.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    t, k = x.shape
    g = x.float().view(t, k // (group or k), group or k)
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (torch.round(g / s) * s).view(t, k).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, nargs="+", default=[0, 32, 64, 192])
    args = ap.parse_args()

    from inferlab import LLM
    from inferlab.lab.eval import load_corpus, perplexity
    from inferlab.quant.int8 import Int8Linear

    llm = LLM(quantization="int8", pack_weights=False)
    layers = [m for m in llm.engine.runner.model.modules()
              if isinstance(m, Int8Linear) and m is not llm.engine.runner.model.lm_head]
    docs = load_corpus()
    for group in [None, *args.groups]:
        for m in layers:
            def forward(x, m=m, group=group):
                x2 = x.reshape(-1, m.in_features)
                x2 = x2 if group is None else rounded(x2, group)
                return F.linear(x2, m.dequantize(x2.dtype)).reshape(*x.shape[:-1], m.out_features)
            m.forward = forward
        ppl = perplexity(llm, docs).perplexity
        name = "unrounded" if group is None else "per token" if group == 0 else f"per {group} inputs"
        print(f"activations {name:>15}: corpus perplexity {ppl:.3f}", flush=True)


if __name__ == "__main__":
    main()
