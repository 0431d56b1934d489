"""Memory fit and roofline lower bounds for a model on a machine: arithmetic, no model loaded.

The roofline: a step can be no faster than the bytes it must read divided by the memory bandwidth, nor than the
FLOPs it must do divided by the peak FLOP/s. Decode at small batch reads every weight once per step to produce one
token per sequence, so it is bandwidth-bound; its arithmetic intensity grows with the batch until it reaches the
machine's FLOP/byte ratio, where it turns compute-bound. KV reads grow with batch × context as fast as attention's
FLOPs, at an intensity of about heads/kv_heads FLOP/byte, so at long contexts decode may never turn compute-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from inferlab.lab.hardware import Hardware
from inferlab.lab.model_presets import ModelSpec

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "int8": 1, "fp8": 1}
QUANTIZATIONS = ("none", "int8", "int4", "w8a8", "bf16")
FLOAT_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(slots=True, frozen=True)
class QuantScheme:
    """Weight-only quantization of the linear layers as inferlab's engine does it (src/inferlab/quant): int8
    symmetric with one bf16 scale per output channel; int4 with a bf16 scale and zero point per group of input
    weights (the layout of torch's CPU int4 kernel). A tied embedding/LM head is kept at int8 under both (it costs
    more quality at int4 than all the other layers together), and the lookups read the quantized table."""

    name: str
    bits: int  # of a quantized weight; for "none", the float dtype's bits
    group_size: int = 0  # 0 = one scale per output channel
    scale_bytes: int = 2  # bf16
    zero_point: bool = False

    def describe(self) -> str:
        if self.name == "none":
            return f"{self.bits}-bit floats"
        if self.name == "bf16":
            return "bf16 weights under fp32 activations"
        per = "output channel" if self.group_size == 0 else f"group of {self.group_size} weights"
        extra = "scale and zero point" if self.zero_point else "scale"
        return f"{self.bits}-bit weights + a {8 * self.scale_bytes}-bit {extra} per {per}"


def quant_scheme(name: str, dtype: str = "bf16", group_size: int = 32) -> QuantScheme:
    if name == "none":
        return QuantScheme("none", 8 * DTYPE_BYTES[dtype])
    if name in ("int8", "w8a8"):  # the same weights; w8a8 also rounds the activations (to compute in int8)
        return QuantScheme(name, 8, 0)
    if name == "bf16":
        return QuantScheme("bf16", 16, scale_bytes=0)
    if name == "int4":
        if group_size < 1:
            raise ValueError(f"int4 group size must be a positive number of weights, got {group_size}")
        return QuantScheme("int4", 4, group_size, zero_point=True)
    raise ValueError(f"unknown quantization {name!r}; choose one of: {', '.join(QUANTIZATIONS)}")


@dataclass(slots=True, frozen=True)
class WeightMemory:
    scheme: str
    description: str
    quantized_bytes: int  # the linear layers' weights at the scheme's bits (and a tied table at int8)
    scale_bytes: int  # the scheme's overhead: scales and zero points
    unquantized_bytes: int  # untied embedding table, norms, biases and router, always at the float dtype
    linear_bytes: int  # the quantizable linears alone, with their scales (no tied table): MoE expert reads

    @property
    def total(self) -> int:
        return self.quantized_bytes + self.scale_bytes + self.unquantized_bytes


def weight_memory(spec: ModelSpec, scheme: QuantScheme, dtype: str = "bf16") -> WeightMemory:
    q = spec.quantizable_params
    float_bytes = DTYPE_BYTES[dtype]
    if scheme.name == "none":
        return WeightMemory("none", scheme.describe(), q * float_bytes, 0, (spec.num_params - q) * float_bytes,
                            q * float_bytes)
    if scheme.name == "bf16":  # no scales; a tied table is rounded to bf16 with the rest (quant/bf16.py)
        table = spec.embedding_params if spec.tie_word_embeddings else 0
        return WeightMemory("bf16", scheme.describe(), (q + table) * 2, 0,
                            (spec.num_params - q - table) * float_bytes, q * 2)
    qbytes = math.ceil(q * scheme.bits / 8)
    per_group = scheme.scale_bytes * (2 if scheme.zero_point else 1)
    sbytes = (spec.quantizable_out_features * per_group if scheme.group_size == 0
              else math.ceil(q / scheme.group_size) * per_group)
    rest = spec.num_params - q
    linear = qbytes + sbytes
    description = scheme.describe()
    if spec.tie_word_embeddings:
        table = spec.embedding_params
        qbytes += table  # int8, one scale per row (vocabulary entry)
        sbytes += spec.vocab_size * scheme.scale_bytes
        rest -= table
        description += "; tied embedding/LM head at int8 per row"
    return WeightMemory(scheme.name, description, qbytes, sbytes, rest * float_bytes, linear)


@dataclass(slots=True)
class FitRequest:
    context: int = 4096  # tokens per sequence (prompt + output) the KV cache must hold
    concurrency: int = 1  # sequences resident at once
    prompt_len: int | None = None  # for the prefill estimate; None = context
    quantization: str = "none"
    quant_group_size: int = 32
    dtype: str = "bf16"  # float dtype of unquantized weights, activations and compute
    kv_dtype: str | None = None  # None = dtype
    block_size: int = 16  # the KV cache is allocated in blocks of this many tokens
    max_num_batched_tokens: int = 512  # the widest step, which sets the activation peak
    reserve_frac: float = 0.10  # of device memory for the runtime and allocator fragmentation
    memory_budget: int | None = None  # bytes; caps what the model may use (a card's constraint)

    def validate(self) -> None:
        for name in ("context", "concurrency", "block_size", "max_num_batched_tokens", "quant_group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prompt_len is not None and not 1 <= self.prompt_len <= self.context:
            raise ValueError(f"prompt_len must be between 1 and the context ({self.context}), got {self.prompt_len}")
        if not 0 <= self.reserve_frac < 1:
            raise ValueError(f"reserve_frac must be in [0, 1), got {self.reserve_frac}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of: {', '.join(QUANTIZATIONS)}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(FLOAT_DTYPES)}")
        if self.quantization == "bf16" and self.dtype != "fp32":
            raise ValueError(f"quantization bf16 keeps bf16 weights under fp32 activations; with dtype {self.dtype} "
                             f"use quantization none")
        if self.kv_dtype is not None and self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown kv_dtype {self.kv_dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")


@dataclass(slots=True)
class DecodeRoofline:
    batch: int
    context: int
    weight_bytes_read: float  # per step; fewer than all weights for MoE at small batch, no embedding table
    kv_bytes_read: float  # per step: every cached token of every sequence
    flops: float  # per step
    memory_ms: float  # bytes / bandwidth
    compute_ms: float  # flops / peak
    step_ms: float  # the larger: the lower bound on one decode step, i.e. on each user's inter-token latency
    bound: str  # memory | compute
    tokens_per_s_per_user: float
    tokens_per_s: float  # all sequences together
    intensity: float  # FLOP/byte


@dataclass(slots=True)
class PrefillRoofline:
    tokens: int
    bytes_read: float  # weights once (all experts a prompt touches) and the prompt's KV written
    flops: float
    compute_ms: float
    memory_ms: float
    time_ms: float  # lower bound on the prefill of one prompt: a floor under TTFT
    bound: str


@dataclass(slots=True)
class FitReport:
    model: str
    model_source: str
    hardware: str
    hardware_source: str
    hardware_measured: bool
    request: FitRequest
    num_params: int
    active_params: int
    weights: dict[str, WeightMemory]  # every scheme, for comparison
    selected: str
    kv_bytes_per_token: float
    kv_tokens_per_seq: int  # context rounded up to whole blocks
    kv_bytes: float  # for context x concurrency
    activation_bytes: float
    reserve_bytes: float
    memory_bytes: int
    budget_bytes: float
    needed_bytes: float
    fits: bool
    max_concurrency: int  # at this context
    max_context: int  # at this concurrency
    bandwidth: float
    peak_flops: float
    machine_balance: float  # FLOP/byte where compute and bandwidth limits meet
    decode: list[DecodeRoofline]
    prefill: PrefillRoofline
    compute_bound_batch: int | None  # at the requested context; None = never (KV reads keep it memory-bound)
    compute_bound_batch_short: int | None  # at context 1: the weights-only figure usually quoted
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        d = asdict(self)
        for k, w in self.weights.items():
            d["weights"][k]["total"] = w.total
        return d


def _experts_touched(spec: ModelSpec, tokens: int) -> float:
    """Expected distinct experts per layer that `tokens` tokens route to, if routing is uniform and independent."""
    if not spec.is_moe:
        return 1.0
    e, k = spec.num_experts, spec.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def _matmul_params_per_token(spec: ModelSpec) -> int:
    """Weights one decode token multiplies with: its experts' and attention's linears, the router, the LM head.
    The embedding lookup reads one row and does no FLOPs, so it is left out (also when tied: then the table is
    counted once, as the LM head)."""
    router = spec.hidden_size * spec.num_experts if spec.is_moe else 0
    per_layer = spec.attn_linear_params + spec.num_experts_per_tok * spec.expert_params + router
    return spec.num_layers * per_layer + spec.vocab_size * spec.hidden_size


class _Model:
    """The byte and FLOP counts of one config, shared by the fit and the roofline."""

    def __init__(self, spec: ModelSpec, w: WeightMemory, kv_dtype_bytes: float, float_bytes: int):
        self.spec, self.w, self.kv_dtype_bytes = spec, w, kv_dtype_bytes
        # Bytes of one expert's linears at the selected scheme (scales included, pro rata).
        self.expert_bytes = w.linear_bytes * spec.expert_params / max(1, spec.quantizable_params)
        # An untied embedding table is not read by decode: each step looks up one row per sequence.
        self.embed_bytes = 0 if spec.tie_word_embeddings else spec.embedding_params * float_bytes

    def weight_bytes_read(self, tokens: int) -> float:
        s = self.spec
        unused = s.num_layers * (s.num_experts - _experts_touched(s, tokens)) * self.expert_bytes
        return self.w.total - self.embed_bytes - unused

    def decode_flops(self, batch: int, context: int) -> float:
        s = self.spec
        # Attention of one new token over `context` cached ones: q·K and p·V, 2 FLOPs per multiply-add each.
        attn = 4 * s.num_heads * s.head_dim * s.kv_layer_tokens(context)
        return batch * (2 * _matmul_params_per_token(s) + attn)

    def decode_bytes(self, batch: int, context: int) -> float:
        return self.weight_bytes_read(batch) + batch * self.kv_bytes(context)

    def kv_bytes(self, context: int) -> float:
        """KV bytes one sequence's decode step reads."""
        return self.spec.kv_bytes_per_seq(context, self.kv_dtype_bytes)

    def prefill_flops(self, tokens: int) -> float:
        s = self.spec
        lm_head = s.vocab_size * s.hidden_size
        body = _matmul_params_per_token(s) - lm_head
        # Causal attention: about tokens²/2 (query, key) pairs, each q·k and p·v at 2·head_dim FLOPs per head.
        attn = 2 * s.num_layers * s.num_heads * s.head_dim * tokens * tokens
        return 2 * tokens * body + attn + 2 * lm_head  # logits only for the last position


def _decode_point(m: _Model, hw: Hardware, peak: float, batch: int, context: int) -> DecodeRoofline:
    wb, kvb = m.weight_bytes_read(batch), batch * m.kv_bytes(context)
    flops = m.decode_flops(batch, context)
    mem_ms, comp_ms = (wb + kvb) / hw.bandwidth * 1e3, flops / peak * 1e3
    step = max(mem_ms, comp_ms)
    return DecodeRoofline(
        batch, context, wb, kvb, flops, mem_ms, comp_ms, step, "memory" if mem_ms >= comp_ms else "compute",
        1e3 / step, batch * 1e3 / step, flops / (wb + kvb),
    )


def compute_bound_batch(m: _Model, balance: float, context: int, limit: int = 2**20) -> int | None:
    """Smallest batch whose decode intensity reaches the machine balance (intensity is nondecreasing in batch)."""

    def reached(b: int) -> bool:
        return m.decode_flops(b, context) >= balance * m.decode_bytes(b, context)

    if not reached(limit):
        return None
    lo, hi = 0, 1
    while not reached(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reached(mid) else (mid, hi)
    return hi


def _max_context(spec: ModelSpec, kv_dtype_bytes: float, room: float, concurrency: int, block_size: int) -> int:
    """Largest multiple of block_size, at most the model's maximum context, whose KV for `concurrency` sequences
    fits in `room` bytes (KV per sequence grows monotonically with the context: a binary search)."""
    limit = spec.max_position_embeddings // block_size

    def fits(blocks: int) -> bool:
        return spec.kv_bytes_per_seq(blocks * block_size, kv_dtype_bytes) * concurrency <= room

    if not fits(0):
        return 0
    lo, hi = 0, limit  # fits(lo) holds
    if fits(hi):
        return limit * block_size
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * block_size


def activation_bytes(spec: ModelSpec, req: FitRequest) -> int:
    """An estimate of the transient peak of one step: the live tensors of one layer for the widest step (residual,
    normed input, q/k/v, gate and up projections of the experts each token uses) plus fp32 logits for every running
    sequence. Attention is assumed fused (no tokens × context score matrix)."""
    t = req.max_num_batched_tokens
    width = 2 * spec.hidden_size + (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    width += 2 * spec.num_experts_per_tok * spec.intermediate_size
    return t * width * DTYPE_BYTES[req.dtype] + req.concurrency * spec.vocab_size * 4


def fit(spec: ModelSpec, hw: Hardware, req: FitRequest | None = None) -> FitReport:
    req = req or FitRequest()
    req.validate()
    notes: list[str] = []
    weights = {q: weight_memory(spec, quant_scheme(q, req.dtype, req.quant_group_size), req.dtype)
               for q in QUANTIZATIONS if q != "bf16" or req.dtype == "fp32"}
    w = weights[req.quantization]
    kv_dtype = req.kv_dtype or req.dtype
    kv_db = DTYPE_BYTES[kv_dtype]
    kvpt = spec.kv_bytes_per_token(kv_db)
    kv_tokens = math.ceil(req.context / req.block_size) * req.block_size
    kv_seq = spec.kv_bytes_per_seq(kv_tokens, kv_db)  # sliding-window layers hold at most their window
    kv_bytes = kv_seq * req.concurrency
    act = activation_bytes(spec, req)
    reserve = req.reserve_frac * hw.memory_bytes
    budget = hw.memory_bytes - reserve
    if req.memory_budget is not None:
        budget = min(budget, req.memory_budget)
    needed = w.total + kv_bytes + act
    # Concurrency and context the budget allows: logits grow with sequences too, so solve for both terms.
    act_fixed = act - req.concurrency * spec.vocab_size * 4
    room = budget - w.total - act_fixed
    max_conc = max(0, int(room // (kv_seq + spec.vocab_size * 4)))
    # The longest context (whole blocks) whose KV for every sequence fits, never past what the model supports.
    max_ctx = _max_context(spec, kv_db, budget - w.total - act, req.concurrency, req.block_size)

    if req.context > spec.max_position_embeddings:
        notes.append(
            f"context {req.context} exceeds the model's max_position_embeddings ({spec.max_position_embeddings})"
        )
    if spec.sliding_window:
        notes.append(
            f"{spec.sliding_layers} of {spec.num_layers} layers attend within a {spec.sliding_window}-token window: "
            f"their KV is counted at most the window (an engine that frees blocks out of the window; inferlab's "
            f"engine masks them but keeps them allocated)"
        )
    if spec.is_moe:
        notes.append(
            f"mixture of experts: {spec.num_experts_per_tok} of {spec.num_experts} experts per token; decode reads "
            f"the experts a batch touches, assuming uniform independent routing"
        )
    if hw.measured:
        notes.append("hardware figures are this machine's measured rates, not datasheet peaks")

    peak = hw.peak_flops(req.dtype)
    if req.quantization == "w8a8" and "int8" in hw.flops:
        peak = hw.peak_flops("int8")
        notes.append("w8a8: the matmuls at the hardware's int8 rate")
    balance = peak / hw.bandwidth
    m = _Model(spec, w, kv_db, DTYPE_BYTES[req.dtype])
    batches = sorted({1, req.concurrency})
    decode = [_decode_point(m, hw, peak, b, req.context) for b in batches]
    p_tokens = req.prompt_len or req.context
    p_flops = m.prefill_flops(p_tokens)
    p_comp = p_flops / peak * 1e3
    p_bytes = m.weight_bytes_read(p_tokens) + spec.kv_bytes_per_seq(p_tokens, kv_db)
    p_mem = p_bytes / hw.bandwidth * 1e3
    prefill = PrefillRoofline(p_tokens, p_bytes, p_flops, p_comp, p_mem, max(p_comp, p_mem),
                              "compute" if p_comp >= p_mem else "memory")
    return FitReport(
        model=spec.name, model_source=spec.source, hardware=hw.name, hardware_source=hw.source,
        hardware_measured=hw.measured, request=req, num_params=spec.num_params, active_params=spec.active_params,
        weights=weights, selected=req.quantization, kv_bytes_per_token=kvpt, kv_tokens_per_seq=kv_tokens,
        kv_bytes=kv_bytes, activation_bytes=act, reserve_bytes=reserve, memory_bytes=hw.memory_bytes,
        budget_bytes=budget, needed_bytes=needed, fits=needed <= budget, max_concurrency=max_conc,
        max_context=max_ctx, bandwidth=hw.bandwidth, peak_flops=peak, machine_balance=balance, decode=decode,
        prefill=prefill, compute_bound_batch=compute_bound_batch(m, balance, req.context),
        compute_bound_batch_short=compute_bound_batch(m, balance, 1), notes=notes,
    )
