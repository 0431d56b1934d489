"""The workload card: one YAML file stating the product contract, the traffic, the objectives, the constraints and
the baseline server. `inferlab bench --card`, `inferlab experiment` and `inferlab diagnose` all read it.

Validation happens in two passes: the JSON schema (card_schema.json) catches unknown fields, wrong types and
missing sections; the semantic pass catches what a schema cannot say well: missing units, percentiles outside
0..100, objectives that contradict one another or the traffic. Every problem is collected, so a user fixes a card
in one round, and each message names the field's path.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from statistics import NormalDist

from inferlab.bench.launcher import (RunningServer, config_flags, connect, fill_template, free_port, inferlab_argv,
                                     launch)
from inferlab.common.units import UnitError, parse_bytes, parse_duration, parse_rate

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
REQUEST_METRICS = ("ttft", "tpot", "e2e")  # a single request meets or misses these: goodput counts them
OPEN_LOOP = ("poisson", "gamma", "constant")


class CardError(ValueError):
    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        n = len(problems)
        super().__init__(f"{source}: {n} problem{'s' if n > 1 else ''}:\n  - " + "\n  - ".join(problems))


@dataclass(slots=True)
class Length:
    """A token-length distribution, in bench's terms (bench.workload.LengthDist): fixed N, uniform LO..HI
    (inclusive), normal MEAN,STD or lognormal MEDIAN,SIGMA (sigma of the log length)."""

    dist: str = "fixed"
    value: int | None = None
    min: int | None = None
    max: int | None = None
    mean: float | None = None
    std: float | None = None
    median: float | None = None
    sigma: float | None = None

    def quantile(self, q: float) -> float:
        if self.dist == "fixed":
            return float(self.value)
        if self.dist == "uniform":
            return self.min + q * (self.max - self.min)
        z = NormalDist().inv_cdf(q)
        return self.mean + z * self.std if self.dist == "normal" else self.median * math.exp(z * self.sigma)

    @property
    def expected(self) -> float:
        if self.dist == "lognormal":
            return self.median * math.exp(self.sigma**2 / 2)
        return self.quantile(0.5)

    @property
    def upper(self) -> float:
        """The largest length drawn in practice: the maximum where bounded, else the 99.9th percentile."""
        return self.quantile(1.0 if self.dist in ("fixed", "uniform") else 0.999)

    @property
    def lower(self) -> float:
        """The smallest length to plan for: the minimum where bounded, else the one-in-a-million draw."""
        return max(1.0, self.quantile(0.0 if self.dist in ("fixed", "uniform") else 1e-6))

    def bench_arg(self) -> str:
        a, b = {"fixed": (self.value, None), "uniform": (self.min, self.max), "normal": (self.mean, self.std),
                "lognormal": (self.median, self.sigma)}[self.dist]
        return str(a) if b is None else f"{self.dist}:{a:g},{b:g}"


_LENGTH_FIELDS = {"fixed": {"value"}, "uniform": {"min", "max"}, "normal": {"mean", "std"},
                  "lognormal": {"median", "sigma"}}


@dataclass(slots=True)
class Traffic:
    arrival: str = "poisson"
    rate: float | None = None  # requests/s (open loop)
    burstiness: float = 1.0
    concurrency: int | None = None
    requests: int | None = None
    duration: float | None = None  # seconds
    warmup: int = 0
    seed: int = 0
    input_len: Length = field(default_factory=lambda: Length("fixed", 256))
    output_len: Length = field(default_factory=lambda: Length("fixed", 128))
    prefix_share: float = 0.0
    prefix_groups: int = 1
    dataset: str | None = None

    @property
    def closed_loop(self) -> bool:
        return self.arrival == "closed"

    @property
    def open_loop_arrival(self) -> str:
        """The arrival process when the load runs at a rate: the card's, or Poisson for a closed-loop card."""
        return "poisson" if self.closed_loop else self.arrival

    @property
    def prefix_len(self) -> int:
        """Tokens of the shared prefix: the share of the expected prompt length."""
        return round(self.prefix_share * self.input_len.expected)


@dataclass(slots=True)
class Objectives:
    latency: dict[str, dict[str, float]] = field(default_factory=dict)  # metric -> {"p99": seconds, ...}
    min_requests_per_s: float | None = None
    min_output_tokens_per_s: float | None = None
    goodput_min_share: float | None = None
    goodput_min_requests_per_s: float | None = None
    max_error_rate: float | None = None

    def request_slos(self) -> dict[str, float]:
        """Per-request limits for goodput: each metric's limit at its highest listed percentile (the tail
        objective), for the metrics a single request can meet or miss."""
        out = {}
        for metric in REQUEST_METRICS:
            targets = self.latency.get(metric)
            if targets:
                out[metric] = targets[max(targets, key=_percentile_rank)]
        return out


@dataclass(slots=True)
class Check:
    """One objective against one bench run."""

    objective: str  # e.g. "ttft p99 <= 1.5 s"
    kind: str  # latency | throughput | goodput | reliability
    limit: float
    measured: float | None
    passed: bool | None  # None: the run did not measure it
    note: str = ""


def stat_at(stats: dict, key: str) -> tuple[float | None, str]:
    """A percentile from bench's stats dict: its own figure when it has one, else interpolated from its CDF
    (the 0..100% quantiles in 1% steps), which the note says."""
    if stats.get(key) is not None:
        return stats[key], ""
    cdf = stats.get("cdf") or []
    if key.startswith("p") and len(cdf) >= 2:
        x = float(key[1:]) / 100 * (len(cdf) - 1)
        i = min(int(x), len(cdf) - 2)
        return cdf[i] + (x - i) * (cdf[i + 1] - cdf[i]), "interpolated from the CDF"
    return None, ""


def evaluate(objectives: Objectives, run: dict) -> list[Check]:
    """Check one bench run summary (results.json's runs[i]) against the card's objectives."""
    out: list[Check] = []
    for metric, targets in objectives.latency.items():
        stats = run.get("latency", {}).get(metric, {})
        for key, limit in sorted(targets.items(), key=lambda kv: _percentile_rank(kv[0])):
            v, note = stat_at(stats, key)
            out.append(Check(f"{metric} {key} <= {limit * 1e3:g} ms", "latency", limit, v,
                             None if v is None else v <= limit, note))
    thr = run.get("throughput", {})
    for attr, key, label in (("min_requests_per_s", "requests_per_s", "requests/s"),
                             ("min_output_tokens_per_s", "output_tokens_per_s", "output tokens/s")):
        limit = getattr(objectives, attr)
        if limit is not None:
            v = thr.get(key)
            out.append(Check(f"throughput >= {limit:g} {label}", "throughput", limit, v,
                             None if v is None else v >= limit))
    gp = run.get("goodput") or {}
    for attr, key, label in (("goodput_min_share", "share", "of requests"),
                             ("goodput_min_requests_per_s", "requests_per_s", "good requests/s")):
        limit = getattr(objectives, attr)
        if limit is not None:
            v = gp.get(key)
            out.append(Check(f"goodput >= {limit:g} {label}", "goodput", limit, v, None if v is None else v >= limit,
                             "" if gp else "the run had no per-request SLOs (bench --slo)"))
    if objectives.max_error_rate is not None:
        v = run.get("counts", {}).get("error_rate")
        out.append(Check(f"error rate <= {objectives.max_error_rate:.2%}", "reliability", objectives.max_error_rate,
                         v, None if v is None else v <= objectives.max_error_rate))
    return out


@dataclass(slots=True)
class ServerSpec:
    kind: str = "inferlab"  # inferlab | command | endpoint
    model: str | None = None
    command: str | None = None
    url: str | None = None
    config: dict = field(default_factory=dict)
    ready_timeout: float = 300.0
    api_key_env: str | None = None


def start_server(spec: ServerSpec, config: dict | None = None, log_path: str | Path | None = None,
                 host: str = "127.0.0.1") -> RunningServer:
    """The card's server with `config` (the card's baseline config when None) applied."""
    cfg = spec.config if config is None else config
    api_key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
    if spec.kind == "endpoint":
        return connect(spec.url, spec.ready_timeout, api_key)
    port = free_port(host)
    if spec.kind == "command":
        argv = fill_template(spec.command, port, host) + config_flags(cfg)
    else:
        argv = inferlab_argv(port, spec.model, cfg, host)
    return launch(argv, port, host, spec.ready_timeout, log_path, api_key=api_key)


@dataclass(slots=True)
class Card:
    name: str
    description: str = ""
    endpoint: str = "chat"
    streaming: bool = True
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_model_len: int | None = None
    quality: dict[str, float] = field(default_factory=dict)
    traffic: Traffic = field(default_factory=Traffic)
    objectives: Objectives = field(default_factory=Objectives)
    hardware: str | None = None
    memory_budget: int | None = None  # bytes
    server: ServerSpec = field(default_factory=ServerSpec)
    path: str | None = None
    raw: dict = field(default_factory=dict)


# --- loading and validation ----------------------------------------------------------------------------------


@cache
def card_schema() -> dict:
    return json.loads(resources.files("inferlab.lab").joinpath("card_schema.json").read_text(encoding="utf-8"))


def load_card(path: str | Path) -> Card:
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise CardError(str(p), [f"cannot read the card: {e.strerror or e}"]) from None
    except yaml.YAMLError as e:
        raise CardError(str(p), [f"not valid YAML: {e}"]) from None
    card = card_from_dict(data, source=str(p))
    card.path = str(p)
    return card


def card_from_dict(data, source: str = "card") -> Card:
    if not isinstance(data, dict):
        raise CardError(source, [f"a card is a YAML mapping of sections, got {type(data).__name__}"])
    problems = _schema_problems(data)
    if problems:
        raise CardError(source, problems)
    problems = []
    card = _build(data, problems)
    if problems:
        raise CardError(source, problems)
    return card


def _where(path) -> str:
    parts = [str(p) if not isinstance(p, int) else f"[{p}]" for p in path]
    return ".".join(parts).replace(".[", "[") or "(top level)"


def _schema_at(schema: dict, path) -> dict:
    """The sub-schema for an instance path, following $ref and additionalProperties."""
    root = card_schema()
    node = schema
    for key in path:
        while "$ref" in node:
            node = root["$defs"][node["$ref"].rsplit("/", 1)[1]]
        props = node.get("properties", {})
        node = props.get(key) if key in props else node.get("additionalProperties") or {}
    while "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _schema_problems(data: dict) -> list[str]:
    from jsonschema import Draft202012Validator

    schema = card_schema()
    out = []
    for e in sorted(Draft202012Validator(schema).iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        where = _where(e.absolute_path)
        if e.validator == "additionalProperties" and isinstance(e.instance, dict):
            allowed = list(_schema_at(schema, e.absolute_path).get("properties", {}))
            for name in sorted(set(e.instance) - set(allowed)):
                hint = difflib.get_close_matches(name, allowed, n=1)
                fix = f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(allowed)})"
                prefix = f"{where}." if e.absolute_path else ""
                out.append(f"{prefix}{name}: unknown field{fix}")
        elif e.validator == "required":
            missing = e.message.split("'")[1]
            out.append(f"{where}: missing required field {missing!r}")
        elif e.validator == "enum":
            out.append(f"{where}: {e.instance!r} is not one of {', '.join(map(str, e.validator_value))}")
        elif e.validator == "type":
            want = e.validator_value if isinstance(e.validator_value, str) else " or ".join(e.validator_value)
            out.append(f"{where}: expected {want}, got {e.instance!r}")
        elif "propertyNames" in e.absolute_schema_path:
            out.append(f"{where}: {e.instance!r} is not a percentile; write p50, p90, p99, p99.9, mean or max")
        elif e.validator == "oneOf" and e.absolute_path and str(e.absolute_path[-1]).endswith("_len"):
            out.append(f"{where}: write a token count (e.g. 512) or a distribution: {{dist: fixed, value: N}}, "
                       f"{{dist: uniform, min: A, max: B}}, {{dist: normal, mean: M, std: S}} or "
                       f"{{dist: lognormal, mean: M, sigma: S}}" + _oneof_detail(e))
        else:
            out.append(f"{where}: {e.message}")
    return out


def _oneof_detail(e) -> str:
    """The mapping branch's own complaint, if the user wrote a mapping (e.g. an unknown key or a bad dist)."""
    if not isinstance(e.instance, dict):
        return ""
    for sub in e.context or []:
        if sub.validator == "additionalProperties":
            return f" ({sub.message})"
        if sub.validator in ("enum", "required", "minimum", "type") and sub.relative_schema_path[0] == 1:
            return f" ({sub.message})"
    return ""


def _percentile_rank(key: str) -> float:
    return {"mean": 50.0, "max": 100.0}.get(key, float(key[1:]) if key.startswith("p") else -1.0)


def _dur(value, where: str, problems: list[str]) -> float | None:
    try:
        v = parse_duration(value, where)
    except UnitError as e:
        problems.append(str(e))
        return None
    if v <= 0:
        problems.append(f"{where}: {value!r} must be positive")
        return None
    return v


def _share(value, where: str, problems: list[str], upper_open: bool = False) -> None:
    if value is None:
        return
    if not 0 <= value <= 1 or (upper_open and value == 1):
        problems.append(f"{where}: {value!r} is a share and must be between 0 and 1" + (" (excl. 1)" if upper_open
                                                                                          else ""))


def _length(raw, where: str, problems: list[str]) -> Length:
    if isinstance(raw, int):
        return Length("fixed", raw)
    ln = Length(**raw)
    need, given = _LENGTH_FIELDS[ln.dist], {k for k in raw if k != "dist"}
    for k in sorted(need - given):
        problems.append(f"{where}: a {ln.dist} length needs {k!r}")
    for k in sorted(given - need):
        problems.append(f"{where}: {k!r} is not used by a {ln.dist} length (it takes {', '.join(sorted(need))})")
    if need - given or given - need:
        return Length("fixed", 1)  # placeholder so later checks run; the card is rejected anyway
    if ln.dist == "uniform" and ln.min > ln.max:
        problems.append(f"{where}: min {ln.min} exceeds max {ln.max}")
    return ln


def engine_options() -> set[str]:
    """The engine's options by name: EngineConfig's fields, each of which `inferlab serve` takes as a flag
    ('--' + the name with '-' for '_'). The lab reads the engine's config, never the server's parser."""
    from dataclasses import fields

    from inferlab.engine.config import EngineConfig

    return {f.name for f in fields(EngineConfig)}


def _build(d: dict, problems: list[str]) -> Card:
    contract, tr, ob = d.get("contract", {}), d.get("traffic", {}), d.get("objectives", {})
    cons, sv = d.get("constraints", {}), d.get("server", {})
    ctx = contract.get("context", {})
    card = Card(
        name=d["name"], description=d.get("description", ""), endpoint=contract.get("endpoint", "chat"),
        streaming=contract.get("streaming", True), max_input_tokens=ctx.get("max_input_tokens"),
        max_output_tokens=ctx.get("max_output_tokens"), max_model_len=ctx.get("max_model_len"),
        quality=dict(contract.get("quality", {})), hardware=cons.get("hardware"), raw=d,
    )

    # contract.quality
    q = card.quality
    if q.get("perplexity_max_increase_pct") is not None and q["perplexity_max_increase_pct"] < 0:
        problems.append("contract.quality.perplexity_max_increase_pct: must be >= 0 (a percent increase)")
    for k in ("task_accuracy_min", "task_accuracy_max_drop", "greedy_agreement_min"):
        _share(q.get(k), f"contract.quality.{k}", problems)

    # traffic
    t = card.traffic
    t.arrival = tr.get("arrival", "poisson")
    t.concurrency, t.warmup, t.seed = tr.get("concurrency"), tr.get("warmup", 0), tr.get("seed", 0)
    t.requests, t.dataset = tr.get("requests"), tr.get("dataset")
    if "rate" in tr:
        try:
            t.rate = parse_rate(tr["rate"], "traffic.rate")
            if t.rate <= 0:
                problems.append(f"traffic.rate: {tr['rate']!r} must be positive")
        except UnitError as e:
            problems.append(str(e))
    if "duration" in tr:
        t.duration = _dur(tr["duration"], "traffic.duration", problems)
    if t.requests is None and t.duration is None:
        t.requests = 100
    if "burstiness" in tr:
        t.burstiness = tr["burstiness"]
        if t.arrival != "gamma":
            problems.append(f"traffic.burstiness: only gamma arrivals have a burstiness (arrival is {t.arrival!r})")
    if t.closed_loop:
        if t.concurrency is None:
            problems.append("traffic.concurrency: closed-loop traffic needs a number of concurrent users")
        if "rate" in tr:
            problems.append("traffic.rate: closed-loop traffic has no rate (users send when their last request "
                            "ends); use arrival: poisson for an open loop")
    elif t.rate is None and "rate" not in tr:
        problems.append(f"traffic.rate: {t.arrival} arrivals need a rate, e.g. rate: 2/s "
                        f"(or arrival: closed with a concurrency)")
    if "input_len" in tr:
        t.input_len = _length(tr["input_len"], "traffic.input_len", problems)
    if "output_len" in tr:
        t.output_len = _length(tr["output_len"], "traffic.output_len", problems)
    if "prefix" in tr:
        t.prefix_share, t.prefix_groups = tr["prefix"]["share"], tr["prefix"].get("groups", 1)
        _share(t.prefix_share, "traffic.prefix.share", problems, upper_open=True)
        if 0 < t.prefix_share < 1 and t.input_len.lower <= t.prefix_len:
            problems.append(f"traffic.prefix.share: a {t.prefix_len}-token prefix does not fit in prompts as short "
                            f"as {t.input_len.lower:.0f} tokens; each prompt needs its own suffix")
    for name, ln, cap in (("input_len", t.input_len, card.max_input_tokens),
                          ("output_len", t.output_len, card.max_output_tokens)):
        if cap is not None and ln.upper > cap:
            at = "reaches" if ln.dist in ("fixed", "uniform") else "has a 99.9th percentile of"
            problems.append(f"traffic.{name}: {at} {ln.upper:.0f} tokens, beyond the contract's {cap}")
    if card.max_model_len is not None and t.input_len.upper + t.output_len.upper > card.max_model_len:
        problems.append(f"traffic: input + output lengths can exceed contract.context.max_model_len "
                        f"({card.max_model_len})")

    # objectives
    o = card.objectives
    for metric in LATENCY_METRICS:
        targets = ob.get(metric)
        if not targets:
            continue
        parsed: dict[str, float] = {}
        for key, value in targets.items():
            where = f"objectives.{metric}.{key}"
            rank = _percentile_rank(key)
            if not 0 < rank <= 100:
                problems.append(f"{where}: percentile {key[1:]} is outside 0..100 (exclusive of 0)")
                continue
            v = _dur(value, where, problems)
            if v is not None:
                parsed[key] = v
        ranked = sorted((k for k in parsed if k != "mean"), key=_percentile_rank)
        for lo, hi in zip(ranked, ranked[1:]):
            if parsed[hi] < parsed[lo]:
                problems.append(f"objectives.{metric}: {hi} limit ({targets[hi]}) is below the {lo} limit "
                                f"({targets[lo]}); a higher percentile can never be smaller")
        if parsed:
            o.latency[metric] = parsed
    lat = o.latency
    for short, long_, why in (("tpot", "e2e", "one token's time is part of the whole request's"),
                              ("itl", "e2e", "one token's gap is part of the whole request's time"),
                              ("ttft", "e2e", "the first token arrives before the request ends")):
        for key in set(lat.get(short, {})) & set(lat.get(long_, {})):
            if lat[short][key] > lat[long_][key]:
                problems.append(f"objectives: {short} {key} ({ob[short][key]}) exceeds e2e {key} "
                                f"({ob[long_][key]}): impossible to need, {why}; units swapped?")
    if not card.streaming:
        for metric in ("ttft", "tpot", "itl"):
            if metric in lat:
                problems.append(f"objectives.{metric}: needs streaming (contract.streaming is false): without "
                                f"streaming only e2e can be measured")
    thr, gp = ob.get("throughput", {}), ob.get("goodput", {})
    o.min_requests_per_s, o.min_output_tokens_per_s = thr.get("min_requests_per_s"), thr.get("min_output_tokens_per_s")
    o.goodput_min_share, o.goodput_min_requests_per_s = gp.get("min_share"), gp.get("min_requests_per_s")
    o.max_error_rate = ob.get("max_error_rate")
    _share(o.goodput_min_share, "objectives.goodput.min_share", problems)
    _share(o.max_error_rate, "objectives.max_error_rate", problems)
    if gp and not o.request_slos():
        problems.append("objectives.goodput: needs at least one per-request objective (ttft, tpot or e2e)")
    for where, v in (("objectives.throughput.min_requests_per_s", o.min_requests_per_s),
                     ("objectives.throughput.min_output_tokens_per_s", o.min_output_tokens_per_s),
                     ("objectives.goodput.min_requests_per_s", o.goodput_min_requests_per_s)):
        if v is not None and v <= 0:
            problems.append(f"{where}: must be positive")
    if not t.closed_loop and t.rate:
        # An open loop cannot complete requests faster than it sends them.
        for where, v in (("objectives.throughput.min_requests_per_s", o.min_requests_per_s),
                         ("objectives.goodput.min_requests_per_s", o.goodput_min_requests_per_s)):
            if v is not None and v > t.rate * 1.0001:
                problems.append(f"{where}: {v}/s is more than the offered load ({t.rate:g}/s): impossible")
        if o.min_output_tokens_per_s and o.min_output_tokens_per_s > t.rate * t.output_len.upper * 1.0001:
            problems.append(f"objectives.throughput.min_output_tokens_per_s: {o.min_output_tokens_per_s} is more "
                            f"than rate × longest output ({t.rate * t.output_len.upper:g}/s): impossible")

    # constraints
    if cons.get("hardware") is not None:
        from inferlab.lab.hardware import hardware_names, resolve_hardware, THIS_MACHINE

        if cons["hardware"].strip().lower() != THIS_MACHINE:
            try:
                resolve_hardware(cons["hardware"])
            except ValueError:
                problems.append(f"constraints.hardware: unknown {cons['hardware']!r}; "
                                f"choose one of: {', '.join(hardware_names())}")
    if "memory_budget" in cons:
        try:
            card.memory_budget = parse_bytes(cons["memory_budget"], "constraints.memory_budget")
        except UnitError as e:
            problems.append(str(e))

    # server
    s = card.server
    s.kind, s.model, s.command, s.url = sv.get("kind", "inferlab"), sv.get("model"), sv.get("command"), sv.get("url")
    s.config, s.api_key_env = dict(sv.get("config") or {}), sv.get("api_key_env")
    if "ready_timeout" in sv:
        s.ready_timeout = _dur(sv["ready_timeout"], "server.ready_timeout", problems) or s.ready_timeout
    for key, kind in (("command", "command"), ("url", "endpoint")):
        if key in sv and s.kind != kind:
            problems.append(f"server.{key}: only used with kind {kind} (kind is {s.kind!r})")
    if s.kind == "command":
        if not s.command:
            problems.append("server.command: kind command needs a command template with {port}")
        else:
            try:
                shlex.split(s.command)
            except ValueError as e:
                problems.append(f"server.command: cannot split into arguments ({e})")
            if "{port}" not in s.command:
                problems.append("server.command: the template must contain {port}, where the lab puts a free port")
    elif s.kind == "endpoint":
        if not s.url or not re.match(r"^https?://[^/\s]+", s.url):
            problems.append(f"server.url: kind endpoint needs a base URL like http://host:8000, got {s.url!r}")
        if s.config:
            problems.append("server.config: a running endpoint cannot be configured by the lab; "
                            "give its settings in the description instead")
    elif s.config:
        known = engine_options()
        for k in s.config:
            if k.replace("-", "_") not in known:
                hint = difflib.get_close_matches(k.replace("-", "_"), sorted(known), n=1)
                problems.append(f"server.config.{k}: not an `inferlab serve` option"
                                + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    return card


# --- the card as a bench run -----------------------------------------------------------------------------------

_BENCH_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


def bench_slo_percentile(objectives: Objectives) -> str:
    """Bench's gate takes one percentile for every --slo; use the card's tail (the highest listed percentile),
    rounded down to one bench reports. The card's own per-metric checks (`evaluate`) stay the authority."""
    ranks = [_percentile_rank(k) for t in objectives.latency.values() for k in t if k != "mean"]
    top = max(ranks, default=99.0)
    if top >= 100:
        return "max"
    return f"p{max((p for p in _BENCH_PERCENTILES if p <= top), default=50.0):g}"


def card_bench_argv(card: Card, base_url: str | None = None, serve_config: dict | None = None,
                    requests: int | None = None) -> list[str]:
    """The card's run as `inferlab bench` flags: the one translation of a card into a bench run, read by
    `to_bench_config`, by `inferlab bench --card` (which appends the user's own flags, so theirs win) and by
    reports (how to reproduce a measurement by hand). `base_url` None lets bench start inferlab's own server
    with the card's model and `serve_config` (the card's baseline config by default)."""
    t, s = card.traffic, card.server
    argv = ["--endpoint", card.endpoint, "--stream" if card.streaming else "--no-stream"]
    if t.closed_loop:
        argv += ["--concurrency", str(t.concurrency)]
    else:
        argv += ["--rate", _num(t.rate), "--arrival", t.arrival]
        if t.arrival == "gamma":
            argv += ["--burstiness", _num(t.burstiness)]
        if t.concurrency:
            argv += ["--max-concurrency", str(t.concurrency)]
    if requests is not None:
        argv += ["--num-requests", str(requests)]
    elif t.requests is not None:
        argv += ["--num-requests", str(t.requests)]
    if t.duration is not None and requests is None:
        argv += ["--duration", f"{_num(t.duration)}s"]
    argv += ["--warmup", str(t.warmup), "--seed", str(t.seed)]
    if t.dataset:
        argv += ["--dataset", t.dataset]
    else:
        argv += ["--input-len", t.input_len.bench_arg(), "--output-len", t.output_len.bench_arg()]
        if t.prefix_share > 0:
            argv += ["--prefix-groups", str(t.prefix_groups), "--prefix-len", str(t.prefix_len)]
    for metric, limit in card.objectives.request_slos().items():
        argv += ["--slo", f"{metric}={limit * 1e3:g}ms"]  # as the card wrote it, unless it wrote seconds
    if card.objectives.latency:
        argv += ["--slo-percentile", bench_slo_percentile(card.objectives)]
    argv.append("--scrape-metrics")
    if base_url:
        argv += ["--base-url", base_url]
    elif s.kind == "endpoint":
        argv += ["--base-url", s.url]
    elif s.kind == "inferlab":
        serve = (["--model", s.model] if s.model else []) + config_flags(s.config if serve_config is None
                                                                         else serve_config)
        if serve:
            argv += ["--serve-args", shlex.join(serve)]
        argv += ["--server-timeout", f"{_num(s.ready_timeout)}s"]
    else:
        raise ValueError(f"server kind {s.kind!r}: start it (lab.card.start_server) and pass its base_url")
    if s.kind != "inferlab" and s.model:
        argv += ["--model", s.model]
    return argv


def _num(x: float) -> str:
    """Text that reads back as exactly x: '2' for 2.0, '0.11666666666666667' for 7/60 (a '7/min' rate)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


def to_bench_config(card: Card, base_url: str | None = None, output_dir: str | Path = "bench-results",
                    serve_config: dict | None = None):
    """The card's run as bench's config: `card_bench_argv` read by bench's own parser, so an experiment, a
    report's command line and `inferlab bench --card` cannot drift apart."""
    import argparse

    from inferlab.bench import cli as bench_cli

    argv = card_bench_argv(card, base_url, serve_config) + ["--output-dir", str(output_dir), "--quiet"]
    parser = argparse.ArgumentParser(prog="inferlab bench")
    bench_cli.add_arguments(parser)
    cfg = bench_cli.build_config(parser.parse_args(argv), argv)
    if card.server.api_key_env:
        cfg.target.api_key = os.environ.get(card.server.api_key_env)
    return cfg
