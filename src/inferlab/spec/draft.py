"""Draft-model proposals: a smaller model with the target's tokenizer proposes k tokens autoregressively.

Two drafts:
- `--draft-layers L` alone: the target's first L layers + its final norm and head. No extra weights, and no extra
  KV either: those layers' K/V for a token are exactly the target's, so the draft reads the target's pool (all
  computed positions are already there) and writes only positions the target's verification pass rewrites
  before anyone attends to them.
- `--draft-model PATH [--draft-layers L]`: another model (optionally truncated). It keeps its own paged KV pool of
  the target pool's shape, indexed by the target's block tables (a token has the same position in both), and a
  per-sequence count of tokens whose draft K/V are valid; it catches up on tokens it has not seen (the prompt,
  the target's tokens after a rejection, everything after a preemption) in the first of its k batched passes.
"""

from __future__ import annotations

import logging
import numpy as np
import torch

from inferlab.common.errors import ModelLoadError
from inferlab.engine.config import EngineConfig
from inferlab.engine.model_runner import ModelRunner
from inferlab.engine.sampler import exponential_noise, sampling_probs
from inferlab.engine.sequence import Sequence
from inferlab.layers.attention import allocate_kv_cache
from inferlab.layers.packed_linear import weight_bytes
from inferlab.spec.proposer import Proposer, SpecPolicy, SpeculativeConfigError, StepContext


class DraftProposer(Proposer):
    def __init__(self, runner: ModelRunner, tokenizer, config: EngineConfig, policy: SpecPolicy | None = None):
        super().__init__(config.num_speculative_tokens, policy)
        draft_model, draft_layers = config.draft_model, config.draft_layers
        self.runner = runner
        target = runner.model
        if draft_model is None:
            if draft_layers is None:
                raise SpeculativeConfigError("--speculative draft needs --draft-model PATH or --draft-layers L")
            self.model, self.shared_kv = target, True
        else:
            self.model, self.shared_kv = _load_draft(draft_model, runner, tokenizer, config), False
        n = self.model.config.num_layers
        self.num_layers = n if draft_layers is None else draft_layers
        if not 1 <= self.num_layers <= n:
            raise SpeculativeConfigError(f"--draft-layers must be between 1 and the draft's {n} layers, "
                                         f"got {draft_layers}")
        # Both passes read their layers and head once per step: their weight bytes are their relative cost.
        self._draft_cost = _weight_bytes(self.model, self.num_layers) / _weight_bytes(target, target.config.num_layers)
        self.kv_cache: torch.Tensor | None = None
        if not self.shared_kv:
            r = runner
            self.kv_cache = allocate_kv_cache(self.model.model.layers[: self.num_layers], r.num_blocks, r.block_size,
                                              r.kv_cache.dtype, r.kv_cache.device)
        logging.getLogger("inferlab.engine").info(
            "speculative draft: %s, %d layers, k=%d, %.2f of the target's weight bytes per pass, own KV %.1f MiB",
            draft_model or "the target's own", self.num_layers, self.k, self._draft_cost, self.kv_cache_bytes / 2**20)

    @property
    def draft_cost(self) -> float:
        return self._draft_cost

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size()

    def draft(self, seqs: list[Sequence], ks: list[int], ctx: StepContext) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        # The draft writes K/V up to position num_tokens + k - 2: those blocks must exist now. No room, no draft.
        drafted = [i for i, (s, k) in enumerate(zip(seqs, ks)) if ctx.allocate(s, s.num_tokens + k - 1)]
        if not drafted:
            return out
        for i in drafted:
            s, st = seqs[i], self.states[seqs[i].request_id]
            if self.shared_kv:
                st.draft_computed = s.num_tokens - 1
            elif st.num_preemptions != s.num_preemptions:  # its blocks were freed: the draft K/V went with them
                st.draft_computed, st.num_preemptions = 0, s.num_preemptions
            # Positions past what the target kept held rejected proposals: the draft must redo them too.
            st.draft_computed = min(st.draft_computed, s.num_computed_tokens)
        # First pass: everything the draft has not seen up to the last token (one token, unless it is catching up);
        # then one token per pass. Single-token chunks go first: they form the attention's decode group.
        live = sorted(drafted, key=lambda i: seqs[i].num_tokens - self.states[seqs[i].request_id].draft_computed != 1)
        starts = [self.states[seqs[i].request_id].draft_computed for i in live]
        chunks = [seqs[i].token_ids[start:] for i, start in zip(live, starts)]
        q: dict[int, list[torch.Tensor]] = {}
        while live:
            logits = self._forward([ctx.block_table(seqs[i].request_id) for i in live], starts, chunks)
            tokens = self._sample([seqs[i] for i in live], logits, live, q, ctx)
            nxt: tuple[list[int], list[int], list[list[int]]] = ([], [], [])
            for i, start, chunk, t in zip(live, starts, chunks, tokens):
                out[i].append(t)
                if len(out[i]) < ks[i]:  # feed the proposal back in the next pass
                    nxt[0].append(i)
                    nxt[1].append(start + len(chunk))
                    nxt[2].append([t])
            live, starts, chunks = nxt
        for i in drafted:
            s = seqs[i]
            self.states[s.request_id].draft_computed = s.num_tokens + ks[i] - 1  # the tokens, then k - 1 proposals
            if i in q:
                self.draft_probs[s.request_id] = torch.stack(q[i])
        return out

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, index: list[int], q: dict[int, list[torch.Tensor]],
                ctx: StepContext) -> list[int]:
        """Greedy requests get the draft's argmax; sampled ones a draw from the draft's q, kept in q[index[j]] for
        verification."""
        tokens = logits.argmax(dim=-1)
        sampled = [j for j, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            probs = sampling_probs(logits[sampled], [seqs[j].params for j in sampled])
            gens = [ctx.generators.get(seqs[j].request_id) for j in sampled]
            tokens[sampled] = (probs / exponential_noise(tuple(probs.shape), gens, probs.device)).argmax(dim=-1)
            for row, j in enumerate(sampled):
                q.setdefault(index[j], []).append(probs[row])
        return tokens.tolist()

    @torch.inference_mode()
    def _forward(self, tables: list[list[int]], starts: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """One batched draft pass; chunks of one token first. Returns float32 logits at each chunk's last token."""
        lens = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=len(chunks))
        positions, meta = self.runner.layout(tables, np.asarray(starts, dtype=np.int64), lens, int((lens == 1).sum()))
        dev = self.runner.device
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=dev)
        hidden = self.model.model(ids, positions, meta, num_layers=self.num_layers)
        return self.model.lm_head(hidden[torch.from_numpy(np.cumsum(lens) - 1).to(dev)]).float()


def _weight_bytes(model, num_layers: int) -> int:
    return weight_bytes([*model.model.layers[:num_layers], model.lm_head])


def _load_draft(path: str, runner: ModelRunner, tokenizer, config: EngineConfig):
    """Load a draft model, refusing one whose vocabulary is not the target's: its token ids would mean other
    things. The vocabulary is checked before the weights are read."""
    from inferlab.models.config import read_model_config
    from inferlab.models.loader import load_model, load_tokenizer

    n_draft, n_target = read_model_config(path).vocab_size, runner.model.config.vocab_size
    if n_draft != n_target:
        raise ModelLoadError(f"draft model {path} has a vocabulary of {n_draft} tokens but the target model has "
                             f"{n_target}: a draft must use the target's tokenizer")
    if load_tokenizer(path).get_vocab() != tokenizer.get_vocab():
        raise ModelLoadError(f"draft model {path} has as many tokens as the target model but a different "
                             f"vocabulary: a draft must use the target's tokenizer")
    # The target's activation dtype (its norms hold it; the KV pool may be int8).
    dtype = runner.model.model.norm.weight.dtype
    return load_model(path, dtype, runner.device, config.quantization, config.quant_group_size).model
