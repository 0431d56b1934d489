"""One-variable-at-a-time experiments from a workload card.

The plan: the card's baseline server config, then each --vary value changed alone from it (so every difference
from the baseline has one cause), then optionally the best value of each variable together. Each config gets
its own server start (nothing warm carries over), the card's workload `repeats` times through bench (warm-up
requests left out of each run's statistics, as the card says), the server's memory figures, and a quality
evaluation against the baseline. A config below the card's quality floor is rejected whatever its speed.

State is written after every config, so an interrupted experiment resumes from the configs already measured.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from inferlab.common.units import format_ms
from inferlab.bench.launcher import LaunchError, RunningServer, config_flags
from inferlab.lab.card import Card, Check, engine_options, evaluate, start_server, to_bench_config

STATE_VERSION = 1
BUSY_RETRIES = 2  # default times a repeat measured on a busy machine (bench's `machine.contaminated`) is remeasured
LATENCY_KEYS = ("mean", "p50", "p90", "p99")


class ExperimentError(ValueError):
    pass


@dataclass(slots=True)
class Variation:
    key: str
    values: list


def _typed(text: str):
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def parse_vary(items: list[str], card: Card) -> list[Variation]:
    """['quantization=none,int8,int4', 'max_num_seqs=8,32'] -> variations, checked against the server."""
    out: list[Variation] = []
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        vals = [_typed(v) for v in values.split(",") if v.strip()]
        if not sep or not key or not vals:
            raise ExperimentError(f"--vary {item!r}: write KEY=V1,V2,..., e.g. quantization=none,int8,int4")
        if any(v.key == key for v in out):
            raise ExperimentError(f"--vary {key} is given twice; list all its values in one --vary")
        out.append(Variation(key, vals))
    if card.server.kind == "endpoint" and out:
        raise ExperimentError("the card's server is a running endpoint: the lab cannot change its config; use "
                              "server kind inferlab or a command template")
    if card.server.kind == "inferlab":
        known = engine_options()
        for v in out:
            if v.key not in known:
                raise ExperimentError(f"--vary {v.key}: not an `inferlab serve` option")
    return out


@dataclass(slots=True)
class ConfigPoint:
    id: str  # "baseline", "quantization=int8", "combined"
    changes: dict  # what differs from the baseline
    config: dict  # the server config to start


def plan_configs(baseline: dict, variations: list[Variation]) -> list[ConfigPoint]:
    points = [ConfigPoint("baseline", {}, dict(baseline))]
    for v in variations:
        for value in v.values:
            if baseline.get(v.key) == value:
                continue  # the baseline measures it already
            points.append(ConfigPoint(f"{v.key}={_show(value)}", {v.key: value}, {**baseline, v.key: value}))
    return points


def _show(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


@dataclass(slots=True)
class PointResult:
    id: str
    changes: dict
    config: dict
    status: str = "pending"  # measured | failed
    error: str | None = None
    repeats: list[dict] = field(default_factory=list)  # compact metrics of each bench run
    results_paths: list[str] = field(default_factory=list)
    memory: dict = field(default_factory=dict)  # bytes, from the server's /metrics where it reports them
    quality: dict | None = None
    quality_note: str = ""
    startup_s: float | None = None
    server_log: str | None = None
    busy_repeats: int = 0  # repeats kept although still contaminated after the re-measurements

    def metric(self, key: str) -> dict | None:
        """Mean, min and max over repeats of a compact metric ('ttft.p99', 'requests_per_s', ...)."""
        vals = [_get(r, key) for r in self.repeats]
        vals = [v for v in vals if v is not None]
        if not vals:
            return None
        return {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "n": len(vals)}

    def aggregate_run(self) -> dict:
        """A bench-run-shaped dict of the repeat means, for checking the card's objectives."""
        lat = {}
        for m in ("ttft", "tpot", "itl", "e2e"):
            lat[m] = {k: (self.metric(f"{m}.{k}") or {}).get("mean") for k in LATENCY_KEYS}
        mean = lambda k: (self.metric(k) or {}).get("mean")  # noqa: E731
        return {"latency": lat,
                "throughput": {"requests_per_s": mean("requests_per_s"),
                               "output_tokens_per_s": mean("output_tokens_per_s")},
                "goodput": {"share": mean("goodput_share"), "requests_per_s": mean("goodput_rps")}
                if self.repeats and self.repeats[0].get("goodput_share") is not None else None,
                "counts": {"error_rate": mean("error_rate")}}


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def compact(run: dict) -> dict:
    """The figures the report needs from one bench run summary."""
    lat = run.get("latency") or {}
    gp = run.get("goodput") or {}
    out = {m: {k: (lat.get(m) or {}).get(k) for k in LATENCY_KEYS} for m in ("ttft", "tpot", "itl", "e2e")}
    out.update(
        requests_per_s=run["throughput"]["requests_per_s"], output_tokens_per_s=run["throughput"]["output_tokens_per_s"],
        goodput_rps=gp.get("requests_per_s"), goodput_share=gp.get("share"),
        error_rate=run["counts"]["error_rate"], completed=run["counts"]["completed"],
        errors={k: v.get("count") for k, v in (run.get("errors") or {}).items()},
        server_metrics={k: v for k, v in (run.get("server_metrics") or {}).items()
                        if k in ("preemptions", "queue_time_mean_s", "prefill_time_mean_s", "kv_cache_usage", "prefix_cache_hit_rate",
                                 "requests_running", "requests_waiting")},
        warnings=run.get("warnings") or [],
        machine={k: (run.get("machine") or {}).get(k) for k in ("foreign_cpu_share", "contaminated", "client_bound")},
    )
    return out


# --- quality -------------------------------------------------------------------------------------------------

QualityFn = Callable[[ConfigPoint, ConfigPoint, Path], tuple[dict | None, str]]


# Engine options that change no output, only speed and memory: a config differing from the baseline in these
# alone has the baseline's quality, and eval (which runs the engine offline) is not told about them.
NUMERICS_NEUTRAL = {"max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory",
                    "enable_prefix_caching", "num_threads", "device", "max_model_len"}


def quality_config(config: dict) -> dict:
    """The part of a server config that can change the model's outputs, as `inferlab eval` options."""
    engine = engine_options()
    return {k: v for k, v in config.items() if k in engine and k not in NUMERICS_NEUTRAL and k != "seed"}


def eval_quality(point: ConfigPoint, baseline: ConfigPoint, out_dir: Path, model: str | None = None,
                 extra_args: list[str] | None = None) -> tuple[dict | None, str]:
    """Quality through `inferlab eval` in a child process (the engine loads there, not in the lab). A config
    is compared with the baseline's saved eval (`--baseline-result`), so the baseline is evaluated once; one
    that differs from the baseline only in speed-only options shares its quality. Returns
    ({perplexity, task_accuracy, greedy_agreement}, note) or (None, why not)."""
    import subprocess

    base_json = out_dir.parent / _slug(baseline.id) / "eval.json"
    mine = quality_config(point.config)
    if point.id != baseline.id and mine == quality_config(baseline.config) and base_json.exists():
        # Offline, the same numerics give the same greedy tokens: agreement with the baseline is 1 by construction.
        q = {**quality_from_eval(json.loads(base_json.read_text())), "greedy_agreement": 1.0}
        return q, "same numerics as the baseline: its eval"
    out = out_dir / "eval.json"
    argv = [sys.executable, "-m", "inferlab", "eval", *(["--model", model] if model else []), *config_flags(mine),
            "--json-out", str(out), *(extra_args or [])]
    if point.id != baseline.id:
        argv += (["--baseline-result", str(base_json)] if base_json.exists()
                 else ["--baseline", " ".join(config_flags(quality_config(baseline.config)))])
    log = out_dir / "eval.log"
    with open(log, "wb") as f:
        code = subprocess.call(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if code not in (0, 1) or not out.exists():  # 1: eval's own gate failed, which it is not given here
        tail = log.read_text(errors="replace").splitlines()[-5:]
        return None, f"not measured: `inferlab eval` exited with code {code}: " + " | ".join(tail)
    return quality_from_eval(json.loads(out.read_text())), f"inferlab eval ({out})"


def quality_from_eval(d: dict) -> dict:
    """Adapter from `inferlab eval`'s JSON to the three figures the quality floor uses."""

    def find(*keys):
        for k in keys:
            v = _get(d, k)
            if isinstance(v, (int, float)):
                return float(v)
        return None

    return {"perplexity": find("perplexity.perplexity", "perplexity.value", "perplexity"),
            "task_accuracy": find("tasks.accuracy", "task_accuracy", "accuracy"),
            "greedy_agreement": find("agreement.agreement", "greedy_agreement.share", "greedy_agreement")}


def quality_checks(card: Card, q: dict | None, base: dict | None, is_baseline: bool = False) -> list[Check]:
    """The card's quality floor against a config's quality, relative to the baseline's where the floor is. The
    baseline meets the relative floors by definition (it agrees with itself)."""
    floor = card.quality
    out: list[Check] = []
    if not floor:
        return out
    q, base = dict(q or {}), base or {}
    if is_baseline and q and q.get("greedy_agreement") is None:
        q["greedy_agreement"] = 1.0
    if "perplexity_max_increase_pct" in floor:
        lim = floor["perplexity_max_increase_pct"]
        v = None
        if q.get("perplexity") is not None and base.get("perplexity"):
            v = (q["perplexity"] / base["perplexity"] - 1) * 100
        out.append(Check(f"perplexity +{lim:g}% at most", "quality", lim, v, None if v is None else v <= lim + 1e-9))
    if "task_accuracy_min" in floor:
        lim = floor["task_accuracy_min"]
        v = q.get("task_accuracy")
        out.append(Check(f"task accuracy >= {lim:g}", "quality", lim, v, None if v is None else v >= lim))
    if "task_accuracy_max_drop" in floor:
        lim = floor["task_accuracy_max_drop"]
        v = None
        if q.get("task_accuracy") is not None and base.get("task_accuracy") is not None:
            v = base["task_accuracy"] - q["task_accuracy"]
        out.append(Check(f"task accuracy drop <= {lim:g}", "quality", lim, v, None if v is None else v <= lim + 1e-9))
    if "greedy_agreement_min" in floor:
        lim = floor["greedy_agreement_min"]
        v = q.get("greedy_agreement")
        out.append(Check(f"greedy agreement >= {lim:g}", "quality", lim, v, None if v is None else v >= lim))
    return out


# --- judging -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Verdict:
    accepted: bool
    status: str
    quality_ok: bool | None
    latency_ok: bool | None
    reliability_ok: bool | None
    checks: list[Check]


def _all(checks: list[Check], kinds: tuple[str, ...]) -> bool | None:
    sel = [c for c in checks if c.kind in kinds]
    if not sel:
        return None
    if any(c.passed is False for c in sel):
        return False
    return None if any(c.passed is None for c in sel) else True


def verdict(card: Card, res: PointResult, base: PointResult | None) -> Verdict:
    if res.status != "measured":
        return Verdict(False, "failed to run", None, None, None, [])
    checks = run_checks(card, res, base)
    q = _all(checks, ("quality",))
    lat = _all(checks, ("latency", "throughput", "goodput"))
    rel = _all(checks, ("reliability",))
    if q is False:
        status = "rejected: below the quality floor"
    elif rel is False:
        status = "rejected: too many errors"
    elif lat is False:
        status = "misses objectives"
    elif q is None and card.quality:
        status = "unverified: quality not measured"
    else:
        status = "accepted"
    return Verdict(status == "accepted", status, q, lat, rel, checks)


def score(r: PointResult) -> tuple[float, float]:
    """Goodput first, then throughput (which breaks ties, e.g. when no config meets the objectives)."""
    g, t = r.metric("goodput_rps"), r.metric("requests_per_s")
    return (g["mean"] if g else -1.0, t["mean"] if t else -1.0)


def rank(card: Card, results: list[PointResult]) -> list[tuple[PointResult, Verdict]]:
    """Accepted configs first, then those missing objectives, then the rejected; by goodput within each."""
    base = next((r for r in results if r.id == "baseline"), None)
    order = {"accepted": 0, "misses objectives": 1, "unverified: quality not measured": 2}
    rows = [(r, verdict(card, r, base)) for r in results]
    return sorted(rows, key=lambda rv: (order.get(rv[1].status, 3), *(-x for x in score(rv[0]))))


# --- running -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Experiment:
    card: Card
    variations: list[Variation]
    out_dir: Path
    repeats: int = 3
    combine: bool = False
    requests: int | None = None  # overrides the card's traffic.requests (a quicker, noisier experiment)
    quality: QualityFn | None = None
    busy_retries: int = BUSY_RETRIES
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))
    state: dict = field(default_factory=dict)

    @property
    def state_path(self) -> Path:
        return self.out_dir / "state.json"

    def fingerprint(self) -> str:
        key = {"card": self.card.raw, "vary": [asdict(v) for v in self.variations], "repeats": self.repeats,
               "requests": self.requests}
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def load_state(self, restart: bool = False) -> None:
        fp = self.fingerprint()
        if self.state_path.exists() and not restart:
            old = json.loads(self.state_path.read_text())
            if old.get("fingerprint") != fp:
                raise ExperimentError(
                    f"{self.state_path} belongs to a different experiment (another card, --vary, --repeats or "
                    f"--requests); pass --restart to discard it, or choose another --output-dir")
            self.state = old
            done = [k for k, p in old["points"].items() if p["status"] == "measured"]
            if done:
                self.log(f"resuming: {len(done)} config(s) already measured ({', '.join(done)})")
        else:
            self.state = {"version": STATE_VERSION, "fingerprint": fp, "card": self.card.path, "points": {}}

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, default=str))
        os.replace(tmp, self.state_path)

    def result(self, pid: str) -> PointResult | None:
        d = self.state["points"].get(pid)
        return PointResult(**d) if d else None

    def run(self, restart: bool = False) -> list[PointResult]:
        self.load_state(restart)
        points = plan_configs(self.card.server.config, self.variations)
        baseline = points[0]
        for i, p in enumerate(points, 1):
            self._measure(p, baseline, f"[{i}/{len(points) + (1 if self.combine else 0)}]")
        if self.combine:
            best = self.best_combination(points)
            if best is not None:
                self._measure(best, baseline, f"[{len(points) + 1}/{len(points) + 1}]")
            else:
                self.log("no combination to try: fewer than two variables improved on the baseline")
        return [self.result(p) for p in self.state["points"]]

    def best_combination(self, points: list[ConfigPoint]) -> ConfigPoint | None:
        base = self.result("baseline")
        changes = {}
        for v in self.variations:
            cands = [self.result(p.id) for p in points if v.key in p.changes]
            cands = [c for c in cands if c and verdict(self.card, c, base).accepted]
            if cands and base and score(max(cands, key=score)) > score(base):
                changes.update(max(cands, key=score).changes)
        if len(changes) < 2:
            return None
        return ConfigPoint("combined", changes, {**self.card.server.config, **changes})

    def _measure(self, p: ConfigPoint, baseline: ConfigPoint, tag: str) -> None:
        done = self.result(p.id)
        if done and done.status == "measured":
            self.log(f"{tag} {p.id}: measured before, kept")
            return
        res = PointResult(p.id, p.changes, p.config)
        pdir = self.out_dir / _slug(p.id)
        pdir.mkdir(parents=True, exist_ok=True)
        res.server_log = str(pdir / "server.log")
        self.log(f"{tag} {p.id}: starting the server ({self.card.server.kind})")
        try:
            srv = start_server(self.card.server, p.config, log_path=pdir / "server.log")
        except LaunchError as e:
            res.status, res.error = "failed", str(e)
            self.log(f"{tag} {p.id}: FAILED to start: {str(e).splitlines()[0]}")
            self._store(res)
            return
        res.startup_s = srv.ready_after
        self.log(f"{tag} {p.id}: ready after {srv.ready_after:.1f} s")
        try:
            for k in range(self.repeats):
                run = self._bench(srv, pdir / f"bench-{k + 1}", k)
                for retry in range(1, self.busy_retries + 1):
                    if not (run.get("machine") or {}).get("contaminated"):
                        break
                    self.log(f"{tag} {p.id}: repeat {k + 1}/{self.repeats} ran on a busy machine (other processes "
                             f"used {run['machine']['foreign_cpu_share']:.0%} of the CPU): measuring it again "
                             f"({retry}/{self.busy_retries})")
                    run = self._bench(srv, pdir / f"bench-{k + 1}", k)
                if (run.get("machine") or {}).get("contaminated"):
                    res.busy_repeats += 1
                    self.log(f"{tag} {p.id}: repeat {k + 1}/{self.repeats} kept, flagged: still a busy machine")
                res.repeats.append(compact(run))
                res.results_paths.append(str(pdir / f"bench-{k + 1}" / "results.json"))
                r = res.repeats[-1]
                self.log(f"{tag} {p.id}: repeat {k + 1}/{self.repeats}: {r['completed']} requests, "
                         f"{r['requests_per_s']:.2f} req/s, ttft p99 {format_ms(r['ttft']['p99'])}, "
                         f"itl p50 {format_ms(r['itl']['p50'])}, errors {r['error_rate']:.0%}")
            res.memory = server_memory(srv)
        except KeyboardInterrupt:
            self.log(f"{tag} {p.id}: interrupted; rerun the same command to resume from the measured configs")
            raise
        finally:
            srv.stop()
        if self.quality is not None:
            self.log(f"{tag} {p.id}: quality")
            res.quality, res.quality_note = self.quality(p, baseline, pdir)
        else:
            res.quality_note = "not measured (--no-quality)"
        res.status = "measured"
        self._store(res)

    def _store(self, res: PointResult) -> None:
        self.state["points"][res.id] = asdict(res)
        self.save()

    def _bench(self, srv: RunningServer, out: Path, repeat: int) -> dict:
        from inferlab.bench.benchmark import Benchmark

        cfg = to_bench_config(self.card, base_url=srv.base_url, output_dir=out)
        cfg.seed = self.card.traffic.seed + repeat  # new prompts per repeat: a warm prefix cache cannot flatter
        if self.requests is not None:
            cfg.num_requests, cfg.duration = self.requests, None
        outcome = asyncio.run(Benchmark(cfg).run())
        if outcome.interrupted:
            raise KeyboardInterrupt
        return outcome.results["runs"][0]


def server_memory(srv: RunningServer) -> dict:
    """Weight, KV-pool and peak-RSS bytes from the server's /metrics (inferlab's own series; others lack them)."""
    import urllib.request

    from inferlab.bench.scrape import parse

    try:
        with urllib.request.urlopen(srv.base_url + "/metrics", timeout=10) as r:
            m = parse(r.read().decode())
    except (OSError, ValueError):
        return {}
    names = {"weight_bytes": "weight_bytes", "kv_cache_bytes": "kv_cache_bytes", "peak_rss_bytes": "peak_rss_bytes"}
    return {k: int(m[v]) for k, v in names.items() if v in m}


def _slug(pid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in pid.replace("=", "-"))


def run_checks(card: Card, res: PointResult, base: PointResult | None) -> list[Check]:
    return evaluate(card.objectives, res.aggregate_run()) + quality_checks(
        card, res.quality, base.quality if base else None, is_baseline=res.id == "baseline")
