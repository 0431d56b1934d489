"""The engine: add requests, then `step()` = schedule -> run the model -> sample -> postprocess, repeatedly."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from inferlab.engine.block_manager import BlockManager
from inferlab.engine.config import EngineConfig
from inferlab.engine.cpu_threads import ThreadAdapter, make_adapter
from inferlab.engine.detokenizer import Detokenizer
from inferlab.engine.kv_pool import size_kv_pool
from inferlab.common.errors import InvalidRequestError
from inferlab.engine.kv_transfer import HandOff, KVTransport
from inferlab.engine.logprobs import TokenLogprob, token_logprobs
from inferlab.engine.model_runner import ModelRunner, StepInputs
from inferlab.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from inferlab.engine.prompt import Prompt, PromptTokenizer, check_prompt_fits
from inferlab.common.host_memory import available_memory, keep_step_buffers, release_free_heap
from inferlab.engine.sampler import Sampler
from inferlab.engine.sampling_params import SamplingParams
from inferlab.engine.scheduler import ScheduledBatch, Scheduler
from inferlab.engine.sequence import Sequence
from inferlab.engine.step_budget import PrefillBudget
from inferlab.engine.step_trace import BatchShape, StepTrace
from inferlab.engine.structured_output import StructuredOutput
from inferlab.kernels import int_gemv_kernels
from inferlab.layers import kv_int8
from inferlab.layers.packed_linear import onednn_min_rows
from inferlab.models.loader import load_model, load_tokenizer
from inferlab.spec import StepContext, make_proposer

log = logging.getLogger("inferlab.engine")



def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16
    # Measured on an AVX-512 BF16 EPYC: bf16 matmul ~2.2x fp32 at batch 32+ and slightly faster at batch 1.
    return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32


def resolve_quantization(name: str, dtype_name: str, dtype: torch.dtype, device: torch.device) -> str:
    """--quantization auto: bf16 weights under the fp32 activations that --dtype auto falls back to on a CPU without
    AVX-512 BF16, where inferlab's kernel for them is vectorised (AVX2): the same weights the bf16 default serves
    elsewhere, half the bytes a decode step streams in fp32 (quant/bf16.py). Else none; an explicit --dtype float32
    keeps float32 weights."""
    if name != "auto":
        return name
    if device.type == "cpu" and dtype_name == "auto" and dtype == torch.float32 and int_gemv_kernels() is not None:
        return "bf16"
    return "none"


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        torch.manual_seed(config.seed)  # unseeded requests draw from torch's global stream
        self.device = resolve_device(config.device)
        self.cpu_threads: ThreadAdapter | None = None
        if self.device.type == "cpu":
            keep_step_buffers()
            self.cpu_threads = make_adapter(config.num_threads)
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, self.device)
        quantization = resolve_quantization(config.quantization, config.dtype, self.dtype, self.device)
        if quantization != config.quantization:  # the scheme served, for the log, /metrics and a draft model
            self.config = config = replace(config, quantization=quantization)
        loaded = load_model(config.model, self.dtype, self.device, config.quantization, config.quant_group_size)
        self.model_config = cfg = loaded.config
        self.model_path = loaded.path
        self.quant_path = loaded.quant_path
        self.tokenizer = load_tokenizer(config.model)
        self.model_name = "SmolLM2-135M-Instruct" if config.model is None else loaded.path.stem
        self.weight_bytes = sum(t.numel() * t.element_size() for t in
                                {id(t): t for t in list(loaded.model.parameters()) + list(loaded.model.buffers())}.values())

        bs = config.block_size
        self.kv_dtype = {"int8": torch.int8, "bfloat16": torch.bfloat16}.get(config.kv_cache_dtype, self.dtype)
        self.kv_bytes_per_token = (
            2 * cfg.num_layers * cfg.num_kv_heads * kv_int8.row_bytes(cfg.head_dim) if self.kv_dtype == torch.int8
            else cfg.kv_bytes_per_token(torch.tensor([], dtype=self.kv_dtype).element_size()))
        per_block = self.kv_bytes_per_token * bs
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_len_reason = "the model's maximum context length"
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else available_memory()
        pool = size_kv_pool(per_block, bs, config.max_num_seqs, self.max_model_len, config.kv_cache_memory, free)
        num_blocks = pool.num_blocks
        if num_blocks * bs < self.max_model_len:
            # A request must always fit the pool alone, or it could preempt itself forever.
            self.max_model_len = num_blocks * bs
            self.max_len_reason = f"the KV cache pool ({num_blocks} blocks of {bs} tokens)"
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        budget = None if config.decode_stall_ratio is None else PrefillBudget(config.decode_stall_ratio)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_tokens_with_decodes, budget)
        self.runner = ModelRunner(loaded.model, num_blocks, bs, self.kv_dtype, self.device, config.pack_weights)
        self.sampler = Sampler()
        self.detokenizer = Detokenizer(self.tokenizer)
        self.vocab_size: int = cfg.vocab_size
        # Vocabulary strings spell each byte as one character (byte-level BPE) or keep the text (SentencePiece), so
        # no token decodes to more characters than its string has: a prompt longer than max_model_len times this
        # cannot fit, whatever it says (the server refuses it before tokenizing).
        self.max_token_chars: int = max(map(len, self.tokenizer.get_vocab()), default=1)
        self.prompts = PromptTokenizer(self.tokenizer, self.vocab_size)
        self.eos_token_ids = {t for t in (cfg.eos_token_id, self.tokenizer.eos_token_id) if t is not None}
        self.requests: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._forks: dict[str, Sequence] = {}  # n > 1 requests whose choice 0 is still computing the prompt
        self._structured_output: StructuredOutput | None = None  # built on the first request with a guide
        self.proposer = make_proposer(config, self.runner, self.tokenizer)  # None unless --speculative
        self.stats_counters = EngineStats()
        self.last_step_time = 0.0
        self.step_trace = None if config.step_trace is None else StepTrace(config.step_trace, {
            "model": self.model_name, "dtype": str(self.dtype).removeprefix("torch."),
            "kv_bytes_per_token": self.kv_bytes_per_token, "kv_cache_dtype": config.kv_cache_dtype,
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_prefill_tokens_with_decodes": config.max_prefill_tokens_with_decodes,
            "decode_stall_ratio": config.decode_stall_ratio, "block_size": bs,
            "num_blocks": num_blocks, "enable_prefix_caching": config.enable_prefix_caching})
        if self.device.type == "cpu":
            # Loading freed hundreds of MiB (dequantized float32 weights, conversions) that glibc would keep.
            release_free_heap()
        # Disaggregated serving (server/disagg_worker.py): a prefill engine stops each request once it has sampled
        # its first token and holds its blocks in `handing_off` until send_kv copies them out.
        self.hand_off_after_prefill = False
        self.handing_off: list[Sequence] = []
        # Which GEMM multiplies the packed copies shapes every figure (layers/packed_linear.py), so it is said.
        amx_rows = onednn_min_rows() if self.runner.packed_weight_bytes else None
        log.info("loaded %s (%s, %s) in %.1fs; weights %.1f MiB (+%.1f MiB packed%s), "
                 "KV pool %d blocks x %d tokens = %.1f MiB in %s (%s); quantization: %s", self.model_path.name,
                 self.device, self.dtype, loaded.load_seconds, self.weight_bytes / 2**20,
                 self.runner.packed_weight_bytes / 2**20,
                 f"; oneDNN's GEMM from {amx_rows} rows (INFERLAB_ONEDNN_MIN_ROWS)" if amx_rows else "", num_blocks, bs,
                 self.runner.kv_cache_bytes / 2**20, str(self.kv_dtype).removeprefix("torch."), pool.reason,
                 self.quant_path)

    # -- requests ---------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Safe to call from any thread (engine/prompt.py)."""
        return self.prompts.tokenize(prompt)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> int:
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        token_ids, text = self.tokenize_prompt(prompt)
        n = len(token_ids)
        check_prompt_fits(n, params.max_tokens, self.max_model_len, self.max_len_reason)
        now = time.perf_counter()
        seq = Sequence(request_id, token_ids, params, RequestMetrics(arrival_time or now, queued_time=now),
                       cache_salt=cache_salt, prompt_text=text)
        self._register(seq)
        self.scheduler.add(seq)
        if params.n > 1:
            self._forks[request_id] = seq
        return n

    def _register(self, seq: Sequence) -> None:
        """Make a new sequence known: its grammar matcher, its own random stream when seeded."""
        if seq.params.guide is not None:
            seq.grammar = self.structured_output.matcher(seq.params.guide)
        if seq.params.seed is not None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seq.params.seed)
            self._generators[seq.request_id] = g
        self.requests[seq.request_id] = seq

    @property
    def structured_output(self) -> StructuredOutput:
        if self._structured_output is None:
            self._structured_output = StructuredOutput(self.tokenizer, self.model_config.vocab_size,
                                                       sorted(self.eos_token_ids))
        return self._structured_output

    def _fork(self, parent: Sequence) -> None:
        """Choices 1..n-1 of an n > 1 request, queued once choice 0 has computed the prompt, so that they share its
        KV blocks: the full blocks through the prefix cache (ref-counted, never written again), and the last,
        partial block recomputed by each choice (under block_size tokens, against copying a block of every layer's
        K/V, which the pool has no kernel for; it also gives each choice the logits of the prompt's last token to
        draw its own first token from). Choice i is seeded with seed + i, so n = 4 with seed s samples exactly what
        four requests with seeds s..s+3 would. Without prefix caching each choice computes the whole prompt."""
        p = parent.params
        children = []
        for i in range(1, p.n):
            rid = f"{parent.request_id}#{i}"
            # Seeds live modulo 2^64 (manual_seed reads a negative one as its uint64 twin): seed + i never overflows.
            params = replace(p, seed=None if p.seed is None else (p.seed + i) % 2**64, n=1)
            seq = Sequence(rid, list(parent.prompt_token_ids), params, RequestMetrics(parent.metrics.arrival_time),
                           cache_salt=parent.cache_salt, prompt_text=parent.prompt_text,
                           group_id=parent.request_id, index=i)
            self._register(seq)
            children.append(seq)
        self.scheduler.add_first(children)

    def abort(self, request_id: str) -> bool:
        if self._forks.pop(request_id, None) is None:  # else its other choices were never forked
            for rid in [r for r in self.requests if r.startswith(request_id + "#")]:
                self.abort(rid)  # the other choices of an n > 1 request
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        if seq in self.handing_off:
            self.handing_off.remove(seq)
        self.scheduler.finish(seq)
        self._generators.pop(request_id, None)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_outputs)

    # -- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs, self._pending_outputs = self._pending_outputs, []
        batch = self.scheduler.schedule()
        shape = BatchShape.of(batch) if batch and self.step_trace is not None else None
        if batch:
            outputs += self._run(batch)
        dt = time.perf_counter() - t0
        if batch:
            self.scheduler.observe(batch, dt)
        if batch and self.cpu_threads is not None:
            self.cpu_threads.observe(batch.num_tokens, dt)
        if shape is not None:
            self.step_trace.record(t0, dt, shape, self.has_work(), batch.prefill_cap, batch.drain)
        self.last_step_time = dt
        self.stats_counters.num_steps_total += 1
        self.stats_counters.step_time_seconds_total += dt
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        inputs = self.runner.prepare(batch, [self.block_manager.table(s.request_id) for s in batch.seqs])
        logits = self.runner.execute(inputs)
        seqs = inputs.sample_seqs
        if inputs.prompt_spans:
            self._collect_prompt_logprobs(logits[inputs.num_sample_rows:], inputs.prompt_spans)
            logits = logits[:inputs.num_sample_rows] if seqs else None
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        if want_logprobs:  # normalised before sampling: a verifier may work on the logits in place
            row_logits = self._logprob_rows(logits, inputs.logits_per_seq, seqs)
        if logits is not None and self._structured_output is not None:
            self._apply_grammars(logits, inputs.logits_per_seq, seqs)
        failed: dict[Sequence, tuple[str, BaseException]] = {}
        sampled = [] if logits is None else self._sample(logits, inputs, failed)
        if failed:  # they leave now, so their blocks are neither cached nor trimmed
            batch = ScheduledBatch([s for s in batch.seqs if s not in failed],
                                   [n for s, n in zip(batch.seqs, batch.num_new_tokens) if s not in failed])
            sampled = [t for s, t in zip(seqs, sampled) if s not in failed]
            seqs = [s for s in seqs if s not in failed]
        self.scheduler.update_from_output(batch, dict(zip(seqs, sampled)))
        now = time.perf_counter()
        outputs = [self._fail(seq, stage, error, now) for seq, (stage, error) in failed.items()]
        lps = {}
        if want_logprobs:
            lps = self._sampled_logprobs({s: r for s, r in row_logits.items() if s not in failed}, sampled, seqs)
        for seq, new_tokens in zip(seqs, sampled):
            try:  # free when nothing raises (3.11+): the isolation costs the hot loop nothing
                outputs.append(self._append_tokens(seq, new_tokens, now, lps.get(seq)))
            except Exception as e:  # noqa: BLE001 - detokenizing or a stop check failed for this request alone
                outputs.append(self._fail(seq, "detokenize", e, now))
        if self.proposer is not None:
            proposals = self.proposer.propose(self.scheduler.running, self._step_context())
            self.scheduler.set_proposals({s: t for s, t in proposals.items() if s.grammar is None})
        return outputs

    def _sample(self, logits: torch.Tensor, inputs: StepInputs,
                failed: dict[Sequence, tuple[str, BaseException]]) -> list[list[int]]:
        """The tokens each sampling sequence gains. A batched call that raises is retried one request at a time to
        find the culprit(s), which go to `failed` with an empty list; the others get what they would have got
        (the sampler draws a seeded request's random number only after the steps that can raise on bad input)."""
        seqs, per_seq = inputs.sample_seqs, inputs.logits_per_seq
        try:
            sampled = self._sample_batch(logits, seqs, per_seq)
        except Exception:  # noqa: BLE001 - isolate the request(s) that made the batch fail
            log.warning("batched sampling failed; retrying request by request", exc_info=True)
            sampled, start = [], 0
            for seq, k in zip(seqs, per_seq):
                try:
                    sampled += self._sample_batch(logits[start:start + k], [seq], [k])
                except Exception as e:  # noqa: BLE001
                    failed[seq] = ("sample", e)
                    sampled.append([])
                start += k
        if sampled and min(t[0] if t else 0 for t in sampled) < 0:  # the sampler found no token to draw
            for seq, t in zip(seqs, sampled):
                if t and t[0] < 0:
                    failed[seq] = ("sample", FloatingPointError(
                        "no token has a finite probability: the model's logits for this request are NaN or -inf"))
        return sampled

    def _sample_batch(self, logits: torch.Tensor, seqs: list[Sequence], per_seq: list[int]) -> list[list[int]]:
        if self.proposer is not None and any(s.spec_token_ids for s in seqs):
            return self.proposer.verify(logits, per_seq, seqs, self._generators)
        gens = [self._generators.get(s.request_id) for s in seqs]
        return [[t] for t in self.sampler(logits, [s.params for s in seqs], gens).tolist()]

    def _fail(self, seq: Sequence, stage: str, error: BaseException, now: float) -> RequestOutput:
        """Finish one request with finish_reason "error"; the engine goes on with the others."""
        log.error("request %s failed in %s: %r", seq.request_id, stage, error, exc_info=error)
        seq.finish_reason, seq.stop_reason = "error", None
        seq.metrics.finished_time = now
        if not seq.is_finished:
            self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        self._generators.pop(seq.request_id, None)
        return RequestOutput(request_id=seq.request_id, new_token_ids=[], new_text="", finished=True,
                             finish_reason="error", num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                             error=f"{type(error).__name__}: {error}", error_stage=stage, metrics=seq.metrics)

    def _apply_grammars(self, logits: torch.Tensor, per_seq: list[int], seqs: list[Sequence]) -> None:
        rows, matchers, row = [], [], 0
        for s, n in zip(seqs, per_seq):
            if s.grammar is not None:  # one row: guided requests get no proposals
                rows.append(row)
                matchers.append(s.grammar)
            row += n
        if rows:
            self.structured_output.apply(logits, rows, matchers)

    # -- logprobs (engine/logprobs.py) -------------------------------------------------------------------------
    @staticmethod
    def _logprob_rows(logits: torch.Tensor, per_seq: list[int], seqs: list[Sequence]) -> dict[Sequence, torch.Tensor]:
        """The logits rows of each sequence that wants logprobs (a copy: indexing gathers)."""
        offsets = [0]
        for n in per_seq:
            offsets.append(offsets[-1] + n)
        return {s: logits[offsets[i]:offsets[i + 1]].clone() for i, s in enumerate(seqs) if s.params.logprobs is not None}

    def _sampled_logprobs(self, rows: dict[Sequence, torch.Tensor], sampled: list[list[int]],
                          seqs: list[Sequence]) -> dict[Sequence, list[TokenLogprob]]:
        """Row j of a sequence's rows predicted its j-th new token (accepted proposals, then the sampled one); all
        sequences' rows go through one batched log_softmax."""
        new = dict(zip(seqs, sampled))
        order = [s for s in rows if new[s]]
        if not order:
            return {}
        logits = torch.cat([rows[s][:len(new[s])] for s in order])
        toks = [t for s in order for t in new[s]]
        ks = [s.params.logprobs for s in order for _ in new[s]]
        entries = token_logprobs(logits, toks, ks, self.tokenizer)
        out, i = {}, 0
        for s in order:
            out[s] = entries[i:i + len(new[s])]
            i += len(new[s])
        return out

    def _collect_prompt_logprobs(self, logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]) -> None:
        toks = [t for s, lo, n in spans for t in s.token_ids[lo + 1:lo + 1 + n]]
        ks = [s.params.prompt_logprobs for s, _, n in spans for _ in range(n)]
        entries = token_logprobs(logits, toks, ks, self.tokenizer)
        i = 0
        for s, lo, n in spans:
            assert len(s.prompt_logprobs) == lo, "prompt logprobs must be collected in position order"
            s.prompt_logprobs.extend(entries[i:i + n])
            i += n

    def _step_context(self) -> StepContext:
        sched = self.scheduler
        return StepContext(waiting_tokens=sum(s.num_tokens for s in sched.waiting),
                           max_num_batched_tokens=sched.max_num_batched_tokens, max_model_len=self.max_model_len,
                           generators=self._generators, block_table=self.block_manager.table,
                           allocate=self.block_manager.allocate)

    def _append_tokens(self, seq: Sequence, new_tokens: list[int], now: float,
                       logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        p = seq.params
        appended: list[int] = []
        old_len = len(seq.output_text)
        if p.max_tokens == 0:  # scoring the prompt only: its logprobs are in, the sampled token is dropped
            new_tokens = []
            seq.finish_reason = "length"
        for tok in new_tokens:
            if seq.grammar is not None and not seq.grammar.accept_token(tok):
                log.warning("request %s: token %d was sampled outside its grammar", seq.request_id, tok)
            seq.token_ids.append(tok)
            appended.append(tok)
            seq.metrics.token_times.append(now)
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            if tok in self.eos_token_ids and not p.ignore_eos:
                seq.finish_reason, seq.stop_reason = "stop", None
            elif tok in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
            else:
                self.detokenizer.update(seq)
                if self.detokenizer.check_stop_strings(seq, old_len):
                    pass
                elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                    seq.finish_reason = "length"
            if seq.finish_reason is not None:
                break
        finished = seq.finish_reason is not None
        if finished:
            seq.metrics.finished_time = now
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
            if self.step_trace is not None:
                self.step_trace.record_request(seq)
            self._generators.pop(seq.request_id, None)
        self.stats_counters.generation_tokens_total += len(appended)
        first = seq.num_output_tokens == len(appended)
        if first:
            self.stats_counters.prompt_tokens_total += seq.num_prompt_tokens
            if self._forks.pop(seq.request_id, None) is not None:
                self._fork(seq)
            if self.hand_off_after_prefill and not finished:
                self.scheduler.hand_off(seq)
                self.handing_off.append(seq)
        out = RequestOutput(
            request_id=seq.group_id or seq.request_id,
            index=seq.index,
            new_token_ids=appended,
            new_text=self.detokenizer.take_new_text(seq, finished),
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=seq.metrics if finished else None,
        )
        if p.logprobs is not None:
            out.logprobs = (logprobs or [])[:len(appended)]
        if first and p.prompt_logprobs is not None:
            t0 = seq.prompt_token_ids[0]
            out.prompt_logprobs = [TokenLogprob(t0, self.tokenizer.decode([t0]), None), *seq.prompt_logprobs]
        if first and p.echo:
            out.prompt_text = (seq.prompt_text if seq.prompt_text is not None
                               else self.tokenizer.decode(seq.prompt_token_ids))
        return out

    # -- disaggregated serving (engine/kv_transfer.py) ---------------------------------------------------------
    def send_kv(self, seq: Sequence, transport: KVTransport) -> HandOff | None:
        """Prefill role: copy a handed-off request's prompt KV into the transport. On success the request leaves
        this engine (its blocks return to the pool, the full ones staying in the prefix cache) and the HandOff
        says what the decode engine needs; None when the transport has no room yet (the blocks stay held)."""
        bm = self.block_manager
        blocks = bm.table(seq.request_id)[:bm.blocks_needed(seq.num_prompt_tokens)]
        handle = transport.send(seq.request_id, self.runner.kv_cache, blocks, seq.num_prompt_tokens)
        if handle is None:
            return None
        gen = self._generators.pop(seq.request_id, None)
        self.handing_off.remove(seq)
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        return HandOff.of(seq, handle, None if gen is None else gen.get_state())

    def inject(self, hand_off: HandOff, transport: KVTransport) -> bool:
        """Decode role: admit a request whose prompt KV another engine computed, its first token already sampled.
        Blocks the prefix cache holds are taken from it and the rest copied in from the transport. False,
        changing nothing, when the scheduler has no room for it now (see Scheduler.admit_injected)."""
        if hand_off.request_id in self.requests:
            raise InvalidRequestError(f"request id {hand_off.request_id!r} is already in use", "request_id")
        seq = hand_off.to_sequence()
        cached = self.block_manager.find_cached_prefix(seq)
        if not self.scheduler.admit_injected(seq, cached):
            return False
        table = self.block_manager.table(seq.request_id)
        transport.recv(hand_off.handle, self.runner.kv_cache, table[:len(hand_off.handle.blocks)], skip=len(cached))
        self.block_manager.cache_computed_blocks(seq)
        self._register(seq)
        if hand_off.generator_state is not None:
            self._generators[seq.request_id].set_state(hand_off.generator_state)
        return True

    # -- observability ----------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        c = self.stats_counters
        bm = self.block_manager
        c.num_running = len(self.scheduler.running)
        c.num_waiting = len(self.scheduler.waiting)
        c.kv_cache_usage = bm.usage
        c.num_kv_blocks = bm.num_blocks
        c.num_free_kv_blocks = bm.num_free_blocks
        c.kv_cache_bytes = self.runner.kv_cache_bytes
        c.weight_bytes = self.weight_bytes
        c.packed_weight_bytes = self.runner.packed_weight_bytes
        c.num_preemptions_total = self.scheduler.num_preemptions
        c.prefix_cache_queries_total = bm.prefix_queries
        c.prefix_cache_hits_total = bm.prefix_hits
        if self.proposer is not None:
            spec = self.proposer.counters
            c.spec_num_drafts_total = spec.num_drafts
            c.spec_num_draft_tokens_total = spec.num_draft_tokens
            c.spec_num_accepted_tokens_total = spec.num_accepted_tokens
            c.spec_accepted_per_pos_total = list(spec.accepted_per_pos)
        if self.cpu_threads is not None:
            ct = self.cpu_threads
            c.cpu_threads, c.cpu_threads_max = ct.threads, ct.levels[0]
            c.cpu_fallbacks_total, c.cpu_recoveries_total = dict(ct.fallbacks), ct.recoveries
        return EngineStats(**{f: getattr(c, f) for f in EngineStats.__slots__})
