"""One `inferlab bench` invocation: target, workload, one or more load points, and the results file.

results.json is the single source of truth: provenance plus one summary per load point (see summary.py);
the terminal table, CSV, HTML and `inferlab compare` are views of it. Per-request records go to records.jsonl
as they complete, so an interrupted run keeps what it measured and still writes its summary.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import os
import platform
import shlex
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from inferlab.bench import arrivals, slo_search, summary as summary_mod
from inferlab.bench.conversation import ThinkTime, file_sessions, synthetic_sessions
from inferlab.bench.cost import capacity_cost, run_cost
from inferlab.bench.client import BenchError, Target, make_session, preflight
from inferlab.bench.launcher import LaunchError, RunningServer, free_port, inferlab_argv, launch
from inferlab.bench.machine import MachineSampler, local_server_pid, machine_warnings
from inferlab.bench.http import Pool
from inferlab.bench.records import RequestRecord, read_records
from inferlab.bench.runner import Load, WorkerPlan, install_stop, run_processes, run_worker
from inferlab.bench.scrape import Scraper
from inferlab.bench.tokenizer import TokenizerError, load_tokenizer
from inferlab.bench.workload import LengthDist, Workload, jsonl, sharegpt, synthetic, trace

SCHEMA = "inferlab.bench.results/1"
DEFAULT_NUM_REQUESTS = 100
DURATION_POOL = 1000  # synthetic prompts drawn for a --duration run with no --num-requests


@dataclass(slots=True)
class WorkloadConfig:
    input_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 64))
    output_len_given: bool = False
    prefix_groups: int = 0
    prefix_len: int = 0
    dataset: str | None = None
    dataset_format: str = "jsonl"  # jsonl | sharegpt | trace
    trace_time_unit: str = "s"
    tokenizer: str | None = None  # None = bundled model's; "none" = no tokenizer
    conversations: bool = False  # sessions of turns (--dataset-format conversations)
    turns: LengthDist = field(default_factory=lambda: LengthDist("fixed", 4))  # synthetic sessions
    first_turn_len: LengthDist | None = None  # synthetic sessions' first user turn (default: input_len)
    think_time: ThinkTime = field(default_factory=ThinkTime)
    text_seed: int | None = None  # synthetic prompts' words from their own seed (same lengths, fresh text)


@dataclass(slots=True)
class BenchConfig:
    target: Target
    loads: list[Load]  # one per load point
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    base_url: str | None = None  # None: start inferlab's server
    serve_args: list[str] = field(default_factory=list)
    server_timeout: float = 600.0
    auto_sweep: bool = False  # double the concurrency of loads[0] until throughput stops rising
    sweep_max: int = 1024
    num_requests: int | None = None
    duration: float | None = None
    warmup: int = 0
    seed: int = 0
    workers: int = 1
    slos: dict[str, float] = field(default_factory=dict)
    slo_percentile: str = "p99"
    scrape_metrics: bool = False
    scrape_interval: float = 1.0
    output_dir: Path = Path("bench-results")
    quiet: bool = False
    argv: list[str] = field(default_factory=list)
    slo_search: slo_search.SearchConfig | None = None  # --sweep slo
    price_per_hour: float | None = None
    output_cost_ratio: float = 4.0


@dataclass(slots=True)
class BenchOutcome:
    results: dict
    path: Path
    interrupted: bool


def machine() -> dict:
    info = {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine()}
    try:
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return info


class Benchmark:
    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        self.tag = uuid.uuid4().hex[:8]
        self.out = cfg.output_dir
        self.records_path = self.out / "records.jsonl"
        self.tokenizer = None
        self.server: RunningServer | None = None
        self.results: dict = {}

    # --- workload -------------------------------------------------------------------------------------------

    def point_total(self, load: Load, file_len: int | None) -> int | None:
        """Requests sent at a load point, warmup included; None = until --duration ends."""
        cfg = self.cfg
        if cfg.num_requests is None and cfg.duration is not None:
            return None
        n = cfg.num_requests if cfg.num_requests is not None else (file_len or DEFAULT_NUM_REQUESTS)
        if cfg.auto_sweep and load.kind == "concurrency":
            n = max(n, 4 * int(load.value))  # a point shorter than a few rounds per user is mostly ramp
        return n + cfg.warmup

    def pool_size(self, load: Load) -> int:
        total = self.point_total(load, None)
        if total is not None:
            return total
        if load.kind == "rate" and not math.isinf(load.value):
            return int(load.value * self.cfg.duration * 1.3) + 16 + self.cfg.warmup
        return DURATION_POOL + self.cfg.warmup

    def workload(self, load: Load, part: int) -> Workload:
        w, tok = self.cfg.workload, self.tokenizer
        default_out = int(w.output_len.a) if w.output_len.kind == "fixed" else None
        if w.conversations:
            if w.dataset is not None:
                sessions = file_sessions(w.dataset, tok, default_out if w.output_len_given else None)
                spec = {"kind": "conversations", "path": w.dataset, "sessions": len(sessions)}
            else:
                users = int(load.value) if load.kind == "concurrency" else 1
                mean_turns = max(w.turns.a if w.turns.kind != "uniform" else (w.turns.a + w.turns.b) / 2, 1)
                n = int(math.ceil(self.pool_size(load) / mean_turns)) + users
                sessions = synthetic_sessions(n, w.turns, w.first_turn_len or w.input_len, w.input_len,
                                              w.output_len, tok, self.cfg.seed, part)
                spec = {"kind": "conversations", "sessions": n, "turns": w.turns.describe(),
                        "first_turn_len": (w.first_turn_len or w.input_len).describe(),
                        "input_len": w.input_len.describe(), "output_len": w.output_len.describe()}
            spec["think_time"] = w.think_time.describe()
            return Workload([], spec, sessions=sessions)
        if w.dataset is None:
            return synthetic(self.pool_size(load), w.input_len, w.output_len, tok, self.cfg.seed,
                             w.prefix_groups, w.prefix_len, part=part, text_seed=w.text_seed)
        if w.dataset_format == "sharegpt":
            return sharegpt(w.dataset, tok, default_out if w.output_len_given else None)
        if w.dataset_format == "trace":
            return trace(w.dataset, tok, self.cfg.seed, w.trace_time_unit)
        return jsonl(w.dataset, tok, default_out)

    # --- one load point -------------------------------------------------------------------------------------

    def plans(self, load: Load, wl: Workload, run: int, records_path: Path) -> list[WorkerPlan]:
        cfg = self.cfg
        n_workers = max(1, cfg.workers)
        total = self.point_total(load, len(wl.requests) if cfg.workload.dataset else None)
        base = dict(target=cfg.target, load=load, pool=wl.requests, warmup=cfg.warmup, duration=cfg.duration,
                    run=run, tag=self.tag, tokenizer=cfg.workload.tokenizer)
        plans = []
        if wl.sessions is not None:
            if load.kind != "concurrency":
                raise BenchError("conversations run closed loop: give --concurrency N (users), not --rate")
            plans.append(WorkerPlan(**base, indices=None, schedule=None, users=int(load.value), num_requests=total,
                                    sessions=wl.sessions, think_time=cfg.workload.think_time, seed=cfg.seed))
        elif load.kind == "concurrency":
            users = int(load.value)
            if users < n_workers:
                n_workers = users
            for k in range(n_workers):
                plans.append(WorkerPlan(**base, indices=None, schedule=None, users=len(range(k, users, n_workers)),
                                        num_requests=total, worker=k))
        elif load.kind == "trace":
            sched = wl.schedule
            if sched is None:
                raise BenchError("trace replay needs a workload with timestamps (--dataset-format trace)")
            n = len(sched) if total is None else min(total, len(sched))
            for k in range(n_workers):
                idx = list(range(k, n, n_workers))
                plans.append(WorkerPlan(**base, indices=idx, schedule=[sched[i] / load.value for i in idx], worker=k))
        else:
            scheds = arrivals.worker_schedules(load.value, load.arrival, load.burstiness, workers=n_workers,
                                               seed=cfg.seed, run=run, n=total, duration=cfg.duration)
            for k, s in enumerate(scheds):
                plans.append(WorkerPlan(**base, indices=[k + j * n_workers for j in range(len(s))],
                                        schedule=s.tolist(), worker=k))
        for p in plans:
            p.records_path = str(records_path if len(plans) == 1 else
                                 self.out / f"records.run{run}.w{p.worker}.jsonl")
        return plans

    async def run_point(self, load: Load, run: int, stop: asyncio.Event, session) -> dict:
        cfg = self.cfg
        wl = self.workload(load, run)
        plans = self.plans(load, wl, run, self.records_path)
        scraper = Scraper(session, cfg.target.base_url, cfg.scrape_interval) if cfg.scrape_metrics else None
        if scraper:
            await scraper.start()
        total = None if plans[0].num_requests is None and plans[0].schedule is None else (
            plans[0].num_requests if plans[0].schedule is None else sum(len(p.schedule) for p in plans))
        progress = _Progress(f"[{run + 1}] {load.label}", total, cfg.quiet)
        t_wall = time.time()
        sampler = MachineSampler(self.server_pid())
        sampler.start()
        with progress:
            if len(plans) == 1:
                records, interrupted = await run_worker(plans[0], stop, progress.on_record)
            else:
                interrupted = await run_processes(plans, stop, progress.set)
                records = self._merge_parts(plans)
        machine_use = sampler.stop(workers=len(plans))
        server_metrics = await scraper.stop(plans[0].t0) if scraper else None
        warnings = list(wl.warnings) + machine_warnings(machine_use)
        used = max((r.index for r in records), default=-1) + 1
        if wl.cache_free and used > len(wl.requests):
            warnings.append(f"the workload's {len(wl.requests)} prompts were reused ({used} requests sent): the "
                            f"server's prefix cache may have served repeats; raise --num-requests")
        s = summary_mod.summarize(sorted(records, key=lambda r: r.index), load=load.to_dict(), slos=cfg.slos,
                                  slo_percentile=cfg.slo_percentile, cache_free=wl.cache_free,
                                  interrupted=interrupted, warnings=warnings)
        s["run"] = run
        s["clock_origin"] = plans[0].t0
        s["started_at"] = dt.datetime.fromtimestamp(t_wall, dt.timezone.utc).isoformat()
        s["workload"] = wl.spec
        s["workers"] = len(plans)
        s["server_metrics"] = server_metrics
        s["machine"] = machine_use
        if cfg.price_per_hour is not None:
            s["cost"] = run_cost(s, cfg.price_per_hour, cfg.output_cost_ratio)
        if server_metrics and wl.cache_free and (server_metrics.get("prefix_cache_hit_rate") or 0) > 0.1:
            s["warnings"].append(
                f"the server reports a {server_metrics['prefix_cache_hit_rate']:.0%} prefix-cache hit rate during "
                f"a workload meant to be cache-free: results may be faster than cold prompts")
        return s

    def server_pid(self) -> int | None:
        """The server's pid when it runs on this machine (its CPU is not a neighbour's), found once."""
        if not hasattr(self, "_server_pid"):
            proc = self.server.process if self.server else None
            pid = proc.pid if proc else local_server_pid(self.cfg.target.base_url)
            self._server_pid = None if pid == os.getpid() else pid  # a server in bench's own process (tests)
        return self._server_pid

    def _merge_parts(self, plans: list[WorkerPlan]) -> list[RequestRecord]:
        records = []
        with open(self.records_path, "a", encoding="utf-8") as out:
            for p in plans:
                path = Path(p.records_path)
                if not path.exists():
                    continue
                part = list(read_records(path))
                records.extend(part)
                for r in part:
                    out.write(r.to_json() + "\n")
                path.unlink()
        return records

    # --- the whole invocation -------------------------------------------------------------------------------

    def provenance(self, models: dict) -> dict:
        from inferlab import __version__

        cfg = self.cfg
        import aiohttp

        return {
            "inferlab_version": __version__,
            "command_line": shlex.join(["inferlab", "bench", *cfg.argv]),
            "argv": cfg.argv,
            "start_time": dt.datetime.now(dt.timezone.utc).isoformat(),
            "target": {"base_url": cfg.target.base_url, "endpoint": cfg.target.endpoint, "model": cfg.target.model,
                       "embedded_server": {"command": self.server.argv, "log": str(self.server.log_path)}
                       if self.server else None,
                       "stream": cfg.target.stream, "ignore_eos": cfg.target.ignore_eos,
                       "usage_stats_requested": cfg.target.usage_stats},
            "models": models,
            "machine": machine(),
            "client": {"python": platform.python_version(), "aiohttp": aiohttp.__version__,
                       "event_loop": _loop_name(), "workers": cfg.workers, "clock": "time.perf_counter",
                       "receive_clock": Pool(cfg.target.base_url).receive_clock},
            "seed": cfg.seed,
            "text_seed": cfg.workload.text_seed,
            "tokenizer": self.tokenizer.name if self.tokenizer else None,
            "workload": {"input_len": cfg.workload.input_len.describe(),
                         "output_len": cfg.workload.output_len.describe(),
                         "prefix_groups": cfg.workload.prefix_groups, "prefix_len": cfg.workload.prefix_len,
                         "dataset": cfg.workload.dataset, "dataset_format": cfg.workload.dataset_format,
                         **({"turns": cfg.workload.turns.describe(),
                             "think_time": cfg.workload.think_time.describe()} if cfg.workload.conversations else {})},
            "load": {"points": [ld.to_dict() for ld in cfg.loads], "auto_sweep": cfg.auto_sweep,
                     "num_requests": cfg.num_requests, "duration": cfg.duration, "warmup": cfg.warmup},
            "slos": cfg.slos or None,
            "slo_percentile": cfg.slo_percentile,
            "price_per_hour": cfg.price_per_hour,
            "output_cost_ratio": cfg.output_cost_ratio if cfg.price_per_hour is not None else None,
        }

    def write(self) -> Path:
        path = self.out / "results.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_finite(self.results), indent=1, allow_nan=False, default=_json_default),
                       encoding="utf-8")
        os.replace(tmp, path)
        return path

    async def search(self, stop: asyncio.Event, session) -> None:
        """--sweep slo: measure the rates slo_search proposes until it is done (or interrupted)."""
        cfg = self.cfg
        template = cfg.loads[0]
        points: list[slo_search.Point] = []
        while not stop.is_set() and (rate := slo_search.next_rate(points, cfg.slo_search)) is not None:
            load = Load("rate", rate, template.arrival, template.burstiness, template.max_concurrency)
            i = len(self.results["runs"])
            s = await self.run_point(load, i, stop, session)
            self.results["runs"].append(s)
            if not s["interrupted"]:
                points.append(slo_search.point_from_run(s, i))
            self.results["slo_search"] = self.search_summary(points)
            self.results["slo_passed"] = _slo_passed(self.results)
            self.write()

    def search_summary(self, points: list) -> dict:
        cfg = self.cfg
        out = slo_search.estimate(points, cfg.slo_percentile)
        out.update(slos=cfg.slos, tolerance=cfg.slo_search.tolerance, repeats=cfg.slo_search.repeats)
        lo = out["bracket"][0]
        if cfg.price_per_hour is not None and out["capacity"] is not None and lo is not None:
            best = [self.results["runs"][p.run] for p in points if p.rate == lo and p.passed]
            out["cost"] = capacity_cost(out["capacity"], best[-1], cfg.price_per_hour,
                                        cfg.output_cost_ratio) if best else None
        return out

    def start_server(self) -> RunningServer:
        """With no --base-url: inferlab's own server, on a free loopback port, in a child process."""
        port = free_port()
        argv = inferlab_argv(port) + self.cfg.serve_args
        if not self.cfg.quiet:
            print(f"starting inferlab's server: {shlex.join(argv)}", file=sys.stderr)
        try:
            return launch(argv, port, ready_timeout=self.cfg.server_timeout, log_path=self.out / "server.log")
        except LaunchError as e:
            raise LaunchError(f"{e}\n  (raise --server-timeout, or start a server yourself and pass --base-url)",
                              e.server) from None

    async def run(self) -> BenchOutcome:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self.tokenizer = load_tokenizer(cfg.workload.tokenizer)
        except TokenizerError as e:
            if cfg.workload.tokenizer is not None or cfg.workload.dataset is None:
                raise
            # A prompt file needs no tokenizer when the server reports usage: go on without the default one.
            print(f"warning: {e}; counting tokens from the server's usage (or one per chunk)", file=sys.stderr)
            cfg.workload.tokenizer = "none"
            self.tokenizer = None
        stop = asyncio.Event()
        install_stop(asyncio.get_running_loop(), stop)
        if cfg.base_url is None:
            self.server = await asyncio.get_running_loop().run_in_executor(None, self.start_server)
            cfg.target.base_url = self.server.base_url
        try:
            async with make_session() as session:
                models = await preflight(session, cfg.target)
                self.results = {"schema": SCHEMA, "provenance": self.provenance(models), "runs": [], "sweep": None,
                                "slo_passed": None, "records": self.records_path.name, "slo_search": None}
                self.write()
                if cfg.slo_search is not None:
                    await self.search(stop, session)
                loads = [] if cfg.slo_search is not None else list(cfg.loads)
                i = 0
                while i < len(loads) and not stop.is_set():
                    s = await self.run_point(loads[i], i, stop, session)
                    self.results["runs"].append(s)
                    self.results["sweep"] = sweep_summary(self.results["runs"], cfg.auto_sweep)
                    self.results["slo_passed"] = _slo_passed(self.results)
                    self.write()
                    if cfg.auto_sweep and _keep_sweeping(self.results["runs"]) and loads[i].value * 2 <= cfg.sweep_max:
                        loads.append(Load("concurrency", loads[i].value * 2))
                    i += 1
        finally:
            if self.server:
                self.server.stop()
        interrupted = stop.is_set()
        self.results["interrupted"] = interrupted
        return BenchOutcome(self.results, self.write(), interrupted)


def _keep_sweeping(runs: list[dict]) -> bool:
    last = runs[-1]
    if last["interrupted"] or last["counts"]["error_rate"] > 0.5:
        return False
    sat = sweep_summary(runs, True)["saturation"]
    return sat is None


def sweep_summary(runs: list[dict], auto: bool) -> dict | None:
    """Saturation: the first load point whose request throughput rose less than 5% over the best before it
    (throughput stopped rising); the point reported is the best one so far. With SLOs, also the highest load
    whose SLO gate passed."""
    if len(runs) < 2 and not auto:
        return None
    tput = [r["throughput"]["requests_per_s"] for r in runs]
    saturation = None
    for i in range(1, len(runs)):
        best = max(range(i), key=lambda j: tput[j])
        if tput[i] < 1.05 * tput[best]:
            saturation = {"index": best, "label": runs[best]["load"]["label"], "value": runs[best]["load"]["value"],
                          "requests_per_s": tput[best],
                          "output_tokens_per_s": runs[best]["throughput"]["output_tokens_per_s"]}
            break
    good = [r for r in runs if r["slo_gate"] and r["slo_gate"]["passed"]]
    top = max(good, key=lambda r: r["load"]["value"] or math.inf) if good else None
    return {"kind": runs[0]["load"]["kind"], "auto": auto, "points": [r["load"]["label"] for r in runs],
            "saturation": saturation,
            "max_load_meeting_slos": None if top is None else {"index": top["run"], "label": top["load"]["label"],
                                                                "value": top["load"]["value"]}}


def _slo_passed(results: dict) -> bool | None:
    gates = [r["slo_gate"] for r in results["runs"] if r["slo_gate"]]
    if not gates:
        return None
    if results["sweep"] or results.get("slo_search"):  # a sweep passes when at least one load meets them
        return any(g["passed"] for g in gates)
    return all(g["passed"] for g in gates)


def _loop_name() -> str:
    loop = asyncio.get_running_loop()
    return type(loop).__module__.split(".")[0]


def _finite(o):
    """NaN and infinities are not JSON: they become null rather than cost the run its summary."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot serialise {type(o).__name__}")


class _Progress:
    """A live bar on stderr: requests done, errors, and elapsed time."""

    def __init__(self, label: str, total: int | None, quiet: bool):
        self.quiet = quiet or not sys.stderr.isatty()
        self.done = self.failed = 0
        self.label, self.total = label, total
        self._p = None

    def __enter__(self):
        if not self.quiet:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[err]}"), TimeElapsedColumn(),
                               console=Console(stderr=True), refresh_per_second=4)
            self._p.start()
            self._task = self._p.add_task(self.label, total=self.total, err="")
        return self

    def __exit__(self, *exc):
        if self._p:
            self._p.stop()

    def on_record(self, rec: RequestRecord) -> None:
        self.set(self.done + 1, self.failed + (1 if rec.error_kind and rec.error_kind != "cancelled" else 0))

    def set(self, done: int, failed: int) -> None:
        self.done, self.failed = done, failed
        if self._p:
            self._p.update(self._task, completed=done, err=f"{failed} errors" if failed else "")
