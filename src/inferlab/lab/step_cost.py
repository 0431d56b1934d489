"""The step-cost model: how long one engine step takes, as a linear function of what the step carries.

Why this form. An engine step (schedule -> forward -> sample) on inferlab's engine, vLLM or SGLang costs
  - a constant: every weight is read once per step whatever the batch (the bandwidth-bound floor of decode), plus
    the step's fixed Python and launch overhead             -> `intercept`
  - per prefill token: each prompt token goes through every GEMM (compute); so does a decode's token in a step
    that carries a prefill chunk, one more row of the same GEMMs             -> `per_prefill_token`
  - per decoding sequence of a decode-only step: its one token through the GEMMs on the engine's decode path (on
    the CPU a GEMV-like C++ path; on a GPU the same GEMMs at a small M, in a captured graph)
                                                                            -> `per_decode_seq`
  - per key a decode attends: it reads that key's K and V from the cache, once per layer (memory: 23 KB a key for
    SmolLM2 in bf16, ~1 µs at 20 GB/s)                                      -> `per_attended`
  - per (query, key) pair of a prefill chunk's attention: n tokens after c computed ones do n·(c + (n+1)/2) pairs
    (causal); the chunk reads each key once for all its queries, so the cost is compute (QK and PV: 4 x heads x
    head_dim FLOPs a layer, 69 kFLOP for SmolLM2; 0.58 µs served on the 2-core machine, where a decode pays ~1.5 µs
    a key to read it): one coefficient for both fits neither. A 1,000-token prompt's attention is a quarter of its
    GEMMs' time                                                             -> `per_prefill_pair`
  - per sampled row: the LM head's logits for each sequence that reached its last token, and the sampler on them
                                                                            -> `per_sampled_row`
  - per step that carries any prefill: the general path's own fixed cost. Engines run decode-only steps on a
    cheaper path (inferlab's CPU engine a fused C++ decode plan, GPU engines a captured CUDA graph) and steps with
    a multi-token query eagerly; served on the 2-core machine a prefill step costs ~20 ms before its first token
    against ~11 ms for a batch-1 decode                                      -> `per_prefill_step`
The sum is exact for a roofline-bound step only piecewise (max of compute and memory), but over the batch sizes one
engine serves the linear sum fits within the residuals that `fit` reports, and it extrapolates sanely.

`request_overhead` is per request, not per step: HTTP, tokenization and the stream's first write, which delay a
request's entry into the scheduler. Only black-box calibration (measured at the client) can see it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from inferlab.engine.scheduler import ScheduledBatch
from inferlab.engine.step_trace import BatchShape

COEFFICIENTS = ("intercept", "per_prefill_token", "per_decode_seq", "per_attended", "per_sampled_row",
                "request_overhead", "per_prefill_step", "per_prefill_pair")
FEATURES = ("steps", "prefill_tokens", "decode_seqs", "attended", "sampled_rows", "requests", "prefill_steps",
            "prefill_pairs")
# Which roofline term each coefficient follows when the profile is moved to other hardware (`scaled`).
# Weights read once a step (the general path reads its own copy of them); K/V read per attended key.
MEMORY_TERMS = ("intercept", "per_attended", "per_prefill_step")
COMPUTE_TERMS = ("per_prefill_token", "per_decode_seq", "per_sampled_row", "per_prefill_pair")  # GEMM FLOPs per token / row


@dataclass(slots=True, frozen=True)
class StepFeatures:
    """What a step carries, in the cost model's terms. Sums of features are features (a TTFT spanning three steps
    is the sum of their rows), which is what makes the black-box fit a linear least-squares problem."""

    steps: float = 0.0
    prefill_tokens: float = 0.0
    decode_seqs: float = 0.0
    attended: float = 0.0
    sampled_rows: float = 0.0
    requests: float = 0.0  # request overheads included (black-box rows only)
    prefill_steps: float = 0.0  # steps carrying a multi-token query
    prefill_pairs: float = 0.0  # (query, key) pairs of multi-token queries

    def vector(self) -> np.ndarray:
        return np.array([self.steps, self.prefill_tokens, self.decode_seqs, self.attended, self.sampled_rows,
                         self.requests, self.prefill_steps, self.prefill_pairs], dtype=np.float64)

    def __add__(self, other: "StepFeatures") -> "StepFeatures":
        return StepFeatures(*(a + b for a, b in zip(self.vector(), other.vector())))

    def scale(self, k: float) -> "StepFeatures":
        return StepFeatures(*(k * a for a in self.vector()))


def chunk_features(num_computed: int, n: int, samples: bool) -> StepFeatures:
    """One sequence's share of a step: n new tokens after num_computed cached ones."""
    if n == 1:
        return StepFeatures(0, 0, 1, num_computed + 1, 1 if samples else 0)
    return StepFeatures(0, n, 0, 0, 1 if samples else 0, prefill_pairs=n * (num_computed + (n + 1) / 2))


def shape_features(shape: BatchShape) -> StepFeatures:
    """The features of one step, from its batch's shape (engine/step_trace.py). A query of one token counts as a
    decode, as the engine's runner treats it (batch.num_decodes). Beside a prefill chunk a decode's token is one
    more row of the step's GEMMs at the chunk's size (inferlab's CPU engine runs the whole step as rows of its
    decode plan: engine/model_runner.py, ROW_ATTENTION_MAX_KEYS), so it counts as a prefill token there, its
    attention and its sampled row as a decode's. Charged at the decode-only step's per-sequence cost instead, the
    error grew with the decodes: on the 2-core machine a step with one decode beside a chunk was predicted 2-10%
    fast, one with four 6-11% slow (docs/benchmarks.md, "Decodes beside a prefill chunk")."""
    d = shape.num_decodes
    if not shape.chunks:
        return StepFeatures(1, 0, d, shape.decode_context, d)
    f = StepFeatures(1, d, 0, shape.decode_context, d, prefill_steps=1)
    for c, n, samples in shape.chunks:
        f = f + chunk_features(c, n, samples)
    return f


def batch_features(batch: ScheduledBatch) -> StepFeatures:
    """The features of a batch the scheduler just returned (before update_from_output moves num_computed_tokens)."""
    return shape_features(BatchShape.of(batch))


@dataclass(slots=True)
class FitQuality:
    """How well the fitted model explains the measurements it was fitted on (relative residuals:
    (predicted - measured) / measured)."""

    n: int = 0
    r2: float | None = None
    rel_mean: float | None = None  # signed: > 0 = the model predicts slower than measured on average
    rel_abs_p50: float | None = None
    rel_abs_p90: float | None = None
    rel_abs_max: float | None = None
    outliers: int = 0  # measurements left out of the fit as outliers (robust fits), still in the figures above
    rows: list[dict] = field(default_factory=list)  # per measurement: label, measured, predicted (black-box fits)


@dataclass(slots=True)
class StepCost:
    """A fitted step-cost model (seconds), and where it came from. `to_dict`/`from_dict` give the profile file."""

    intercept: float = 0.0
    per_prefill_token: float = 0.0
    per_decode_seq: float = 0.0
    per_attended: float = 0.0
    per_sampled_row: float = 0.0
    request_overhead: float = 0.0
    per_prefill_step: float = 0.0  # profiles from before these two terms read them as 0
    per_prefill_pair: float = 0.0
    # Quantiles of measured / predicted step time over the calibration's steps: the simulator multiplies each step's
    # cost by a draw from them (empty: every step costs exactly its prediction).
    step_noise: list[float] = field(default_factory=list)
    # Quantiles of a token's delivery, from the engine sampling it to the client reading it (s): the simulator delays
    # each token by a draw from them, in stream order (empty: a token is read when sampled, and request_overhead
    # holds the median way out too). With them, request_overhead is the way in only.
    delivery: list[float] = field(default_factory=list)
    source: str = ""  # how it was calibrated: "engine profile" | "black-box bench" | "synthetic" | "scaled ..."
    command: str = ""  # the command that made it
    # The scheduler settings the calibrated server ran with; the simulator uses them unless told otherwise.
    engine: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # name, kv_bytes_per_token
    hardware: dict = field(default_factory=dict)  # name, bandwidth (B/s), flops (FLOP/s at the dtype served)
    fit: FitQuality = field(default_factory=FitQuality)
    notes: list[str] = field(default_factory=list)

    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, c) for c in COEFFICIENTS], dtype=np.float64)

    def time(self, f: StepFeatures) -> float:
        return float(self.coefficients() @ f.vector())

    def step_time(self, batch: ScheduledBatch) -> float:
        return self.time(batch_features(batch))

    def parts(self, f: StepFeatures) -> tuple[float, float]:
        """A step's predicted time split into its MEMORY_TERMS and its COMPUTE_TERMS (request overhead in
        neither): what a host whose memory slows and whose arithmetic does not stretches differently."""
        v = f.vector()
        memory = sum(getattr(self, c) * v[COEFFICIENTS.index(c)] for c in MEMORY_TERMS)
        compute = sum(getattr(self, c) * v[COEFFICIENTS.index(c)] for c in COMPUTE_TERMS)
        return float(memory), float(compute)

    def stretched(self, k: float, k_compute: float | None = None) -> "StepCost":
        """The profile with every step's time k times as long (k < 1: shorter): the same host running slower or
        faster than when it was calibrated; with k_compute, the memory terms x k and the compute terms x
        k_compute. Request overhead (host-side, between steps) is kept."""
        kc = k if k_compute is None else k_compute
        out = StepCost(**{f.name: getattr(self, f.name) for f in fields(self)})
        for c in MEMORY_TERMS:
            setattr(out, c, getattr(self, c) * k)
        for c in COMPUTE_TERMS:
            setattr(out, c, getattr(self, c) * kc)
        out.notes = [*self.notes, f"every step term x{k:.4g}" if k_compute is None
                     else f"memory terms x{k:.4g}, compute terms x{kc:.4g}"]
        return out

    def scaled(self, to_name: str, bandwidth: float, flops: float) -> "StepCost":
        """The profile moved to other hardware by `inferlab fit`'s roofline: memory terms scale with the ratio of
        bandwidths, compute terms with the ratio of FLOP/s. Request overhead (host-side) is kept."""
        src_bw, src_flops = self.hardware.get("bandwidth"), self.hardware.get("flops")
        if not src_bw or not src_flops:
            raise ValueError("this profile does not record its hardware's bandwidth and FLOP/s; recalibrate it "
                             "(`inferlab simulate calibrate` probes this machine) to scale it to other hardware")
        out = StepCost(**{f.name: getattr(self, f.name) for f in fields(self)})
        for c in MEMORY_TERMS:
            setattr(out, c, getattr(self, c) * src_bw / bandwidth)
        for c in COMPUTE_TERMS:
            setattr(out, c, getattr(self, c) * src_flops / flops)
        out.source = f"{self.source}, scaled to {to_name} by roofline"
        out.hardware = {"name": to_name, "bandwidth": bandwidth, "flops": flops}
        out.notes = [*self.notes, f"scaled from {self.hardware.get('name')}: memory terms x{src_bw / bandwidth:.3g}, "
                                  f"compute terms x{src_flops / flops:.3g}"]
        return out

    # -- the profile file ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"schema": "inferlab.step_cost/1", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCost":
        if d.get("schema") not in (None, "inferlab.step_cost/1"):
            raise ValueError(f"not a step-cost profile (schema {d.get('schema')!r})")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names - {"schema"}
        if unknown:
            raise ValueError(f"step-cost profile: unknown field(s) {', '.join(sorted(unknown))}")
        kw = {k: v for k, v in d.items() if k in names}
        if "fit" in kw:
            kw["fit"] = FitQuality(**kw["fit"])
        for c in COEFFICIENTS:
            if c in kw and not (isinstance(kw[c], (int, float)) and kw[c] >= 0):
                raise ValueError(f"step-cost profile: {c} must be a non-negative number of seconds, got {kw[c]!r}")
        noise = kw.get("step_noise", [])
        if not (isinstance(noise, list) and all(isinstance(v, (int, float)) and v > 0 for v in noise)):
            raise ValueError("step-cost profile: step_noise must be a list of positive ratios")
        delivery = kw.get("delivery", [])
        if not (isinstance(delivery, list) and all(isinstance(v, (int, float)) and v >= 0 for v in delivery)):
            raise ValueError("step-cost profile: delivery must be a list of non-negative seconds")
        return cls(**kw)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")
        return p

    @classmethod
    def load(cls, path: str | Path) -> "StepCost":
        p = Path(path)
        try:
            return cls.from_dict(json.loads(p.read_text(encoding="utf-8")))
        except OSError as e:
            raise ValueError(f"cannot read the step-cost profile {p}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active set, small problems): a cost cannot be
    negative, and an unconstrained fit of nearly collinear terms happily trades a negative one for another."""
    m, n = a.shape
    free = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        cand = ~free & (w > 1e-12 * max(1.0, float(np.abs(w).max(initial=0))))
        if not cand.any():
            break
        free[np.argmax(np.where(cand, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            neg = free & (z <= 0)
            alpha = np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300))
            x = x + alpha * (z - x)
            free &= x > 1e-15
            x[~free] = 0.0
    return x


def fit_step_cost(features: list[StepFeatures], measured: list[float], *, relative: bool = True,
                  labels: list[str] | None = None, fixed_zero: tuple[str, ...] = (),
                  robust: bool = False, weights: list[float] | None = None) -> tuple[np.ndarray, FitQuality]:
    """Fit the coefficients to measurements (seconds), each the summed features of the steps it spans.
    relative=True minimises relative error (a 10 ms step counts as much as a 1 s prefill). Coefficients named in
    `fixed_zero` stay 0 (the data cannot tell them apart from others). robust=True refits without measurements
    whose relative residual exceeds max(25 %, 5 x the median one) — a step another process stalled — a few times.
    `weights` multiply each measurement's weight (e.g. so that a few thousand decode steps do not drown a few dozen
    prefills). Returns the coefficients in COEFFICIENTS order and the residuals over every measurement."""
    if len(features) != len(measured) or not features:
        raise ValueError("calibration needs at least one measurement, each with its features")
    x = np.stack([f.vector() for f in features])
    y = np.asarray(measured, dtype=np.float64)
    if (y <= 0).any():
        raise ValueError("every measured time must be positive")
    keep = np.array([c not in fixed_zero and x[:, i].any() for i, c in enumerate(COEFFICIENTS)])
    extra = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64)
    use = np.ones(len(y), dtype=bool)
    for _ in range(4 if robust else 1):
        w = (1.0 / y[use] if relative else np.ones(use.sum())) * extra[use]
        a = x[use][:, keep] * w[:, None]
        # Scale columns to unit norm so the active set's tolerances are not dominated by the attended column.
        norms = np.linalg.norm(a, axis=0)
        norms[norms == 0] = 1.0
        coef = np.zeros(len(COEFFICIENTS))
        coef[keep] = nonnegative_lstsq(a / norms, y[use] * w) / norms
        rel = np.abs(x @ coef - y) / y
        inlier = rel <= max(0.25, 5 * float(np.median(rel)))
        if not robust or (inlier == use).all() or inlier.sum() < keep.sum() + 2:
            break
        use = inlier
    q = quality(x @ coef, y, labels)
    q.outliers = int((~use).sum())
    return coef, q


def quality(pred: np.ndarray, y: np.ndarray, labels: list[str] | None = None) -> FitQuality:
    rel = (pred - y) / y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = None if ss_tot == 0 else 1.0 - float(((pred - y) ** 2).sum()) / ss_tot
    rows = [] if labels is None else [{"label": lb, "measured": float(m), "predicted": float(p)}
                                      for lb, m, p in zip(labels, y, pred)]
    a = np.abs(rel)
    return FitQuality(len(y), r2, float(rel.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 90)),
                      float(a.max()), rows=rows)


def with_coefficients(coef: np.ndarray, **meta) -> StepCost:
    return StepCost(**{c: float(v) for c, v in zip(COEFFICIENTS, coef)}, **meta)
