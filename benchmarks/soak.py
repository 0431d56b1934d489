"""Soak: `inferlab serve` under a steady mixed load for many minutes, to show that nothing leaks and every request is
accounted for (issue 15). Not a test: it takes at least ten minutes and its figures depend on the machine.

    python benchmarks/soak.py                      # starts `inferlab serve` (bundled model), 10 minutes at 80%
    python benchmarks/soak.py --minutes 1          # a smoke run
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --rate 2.5   # a running server

1. Saturation: a closed loop of --concurrency streams of normal requests for --calibrate-seconds; their completed
   requests per second is the saturated rate (skipped with --rate).
2. Load: Poisson arrivals at --load x saturation for --minutes, each request drawn from the mix: normal streams
   (checked to end with [DONE] and a finish_reason), client disconnects after a few chunks, and malformed requests
   (a rotating list of hostile bodies, each of which must get a 4xx).
3. After the load: wait until the server has nothing in flight, then read KV blocks in use, running and waiting
   requests and the server's error counters from /metrics.
Throughout, the server's RSS (from /proc/PID/status) is sampled every --rss-interval seconds. Every request sent
ends in exactly one outcome: completed, disconnected (by us, on purpose), rejected (a 4xx/429, with its code) or
error (a 5xx, an error event, or a transport failure, with its message); `unaccounted` must be 0.

Writes one JSON (--out) and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven tired engineers watch the logs scroll by".split()

MALFORMED: list[tuple[str, str | bytes]] = [  # (what, raw body); each must get a 4xx
    ("top_k 2^63", json.dumps({"prompt": "hi", "top_k": 2**63, "max_tokens": 4})),
    ("lone surrogate", '{"prompt": "x\\ud800", "max_tokens": 4}'),
    ("truncated json", '{"prompt": "abc", "max_tok'),
    ("negative max_tokens", json.dumps({"prompt": "hi", "max_tokens": -1})),
    ("seed 2^64", json.dumps({"prompt": "hi", "seed": 2**64, "max_tokens": 4})),
    ("deep nesting", '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"),
    ("temperature NaN", '{"prompt": "hi", "temperature": NaN}'),
    ("token id beyond vocab", json.dumps({"prompt": [10**9], "max_tokens": 4})),
    ("unknown model", json.dumps({"prompt": "hi", "model": "gpt-17", "max_tokens": 4})),
]


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _metric(text: str, name: str, **labels: str) -> float | None:
    total = None
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name or not all(f'{k}="{v}"' in head for k, v in labels.items()):
            continue
        total = (total or 0.0) + float(value)
    return total


async def normal(h: httpx.AsyncClient, body: dict) -> tuple[str, str]:
    async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return ("rejected" if r.status_code < 500 else "error"), f"{r.status_code} {text[:200]}"
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "error", "stream ended without [DONE]"
    last = json.loads(events[-2]) if len(events) >= 2 else {}
    if "error" in last:
        return "error", f"error event: {last['error'].get('code')}: {last['error'].get('message', '')[:200]}"
    finish = next((c["choices"][0]["finish_reason"] for c in map(json.loads, reversed(events[:-1]))
                   if c.get("choices") and c["choices"][0].get("finish_reason")), None)
    return ("completed", f"finish_reason={finish}") if finish in ("stop", "length") else ("error", f"finish={finish}")


async def disconnect(h: httpx.AsyncClient, body: dict, after_chunks: int) -> tuple[str, str]:
    async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return ("rejected" if r.status_code < 500 else "error"), str(r.status_code)
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            if n >= after_chunks:
                return "disconnected", f"after {n} chunks"
    return "completed", "finished before the planned disconnect"


async def malformed(h: httpx.AsyncClient, what: str, raw: str | bytes) -> tuple[str, str]:
    r = await h.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    if 400 <= r.status_code < 500:
        try:
            code = r.json()["error"].get("code") or r.json()["error"].get("type")
        except (ValueError, KeyError):
            return "error", f"{what}: {r.status_code} without an OpenAI error body"
        return "rejected", f"{what}: {r.status_code} {code}"
    return "error", f"{what}: expected a 4xx, got {r.status_code} {r.text[:200]}"


async def one(h: httpx.AsyncClient, kind: str, rng: random.Random, args, record: dict) -> None:
    t0 = time.perf_counter()
    body = {"prompt": _prompt(rng, args.input_words), "max_tokens": args.output_tokens, "temperature": 0.7,
            "ignore_eos": True}
    try:
        if kind == "normal":
            outcome, reason = await normal(h, body)
        elif kind == "disconnect":
            outcome, reason = await disconnect(h, body, rng.randint(2, max(2, args.output_tokens // 2)))
        else:
            what, raw = MALFORMED[record["i"] % len(MALFORMED)]
            outcome, reason = await malformed(h, what, raw)
    except (httpx.HTTPError, ValueError) as e:
        outcome, reason = "error", f"{type(e).__name__}: {e}"
    record.update(outcome=outcome, reason=reason, seconds=round(time.perf_counter() - t0, 4))


async def calibrate(h: httpx.AsyncClient, args, rng: random.Random) -> float:
    end = time.perf_counter() + args.calibrate_seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < end:
            rec: dict = {"i": 0}
            await one(h, "normal", rng, args, rec)
            done += rec["outcome"] == "completed"

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(args.concurrency)])
    return done / (time.perf_counter() - t0)


async def soak(args, base: str, pid: int | None) -> dict:
    rng = random.Random(args.seed)
    # A client must drop an idle connection before the server does: at equal idle timeouts (httpx's and the
    # server's --keep-alive-timeout are both 5 s) a request sent as the server closes the connection fails with a
    # ReadError, a client-side race that says nothing about the server (seen once in 9,556 requests).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)
    rss: list[tuple[float, int]] = []
    start = time.perf_counter()
    stop_rss = asyncio.Event()

    async def sample_rss() -> None:
        while not stop_rss.is_set():
            if (v := _rss_bytes(pid)) is not None:
                rss.append((round(time.perf_counter() - start, 1), v))
            try:
                await asyncio.wait_for(stop_rss.wait(), args.rss_interval)
            except asyncio.TimeoutError:
                pass

    async with httpx.AsyncClient(base_url=base, timeout=args.request_timeout, limits=limits) as h:
        sampler = asyncio.create_task(sample_rss())
        saturated = None
        if args.rate is None:
            print(f"calibrating: {args.concurrency} closed-loop streams for {args.calibrate_seconds:g} s", flush=True)
            saturated = await calibrate(h, args, rng)
            rate = args.load * saturated
            print(f"saturated at {saturated:.2f} req/s; soaking at {rate:.2f} req/s", flush=True)
        else:
            rate = args.rate
        load_start = time.perf_counter() - start
        records: list[dict] = []
        tasks: list[asyncio.Task] = []
        end = time.perf_counter() + args.minutes * 60
        next_t = time.perf_counter()
        kinds, weights = ["normal", "disconnect", "malformed"], [args.normal, args.disconnects, args.malformed]
        while (now := time.perf_counter()) < end:
            if now < next_t:
                await asyncio.sleep(next_t - now)
                continue
            kind = rng.choices(kinds, weights)[0]
            rec = {"i": len(records), "kind": kind, "sent_at": round(now - start, 3), "outcome": None}
            records.append(rec)
            tasks.append(asyncio.create_task(one(h, kind, rng, args, rec)))
            next_t += rng.expovariate(rate)
        print(f"load done: {len(records)} requests sent; waiting for the last ones", flush=True)
        await asyncio.wait(tasks, timeout=args.request_timeout + 30) if tasks else None
        # Let the server notice the last disconnects, then read what it holds.
        settled = None
        for _ in range(int(args.settle_seconds * 10)):
            m = (await h.get("/metrics")).text
            if _metric(m, "inferlab:num_requests_in_flight") == 0 and _metric(m, "vllm:num_requests_running") == 0:
                settled = m
                break
            await asyncio.sleep(0.1)
        m = settled or (await h.get("/metrics")).text
        stop_rss.set()
        await sampler
    blocks, free = _metric(m, "inferlab:num_kv_blocks"), _metric(m, "inferlab:num_free_kv_blocks")
    outcomes = Counter(r["outcome"] or "unaccounted" for r in records)
    by_kind = {k: dict(Counter(r["outcome"] or "unaccounted" for r in records if r["kind"] == k)) for k in kinds}
    reasons = Counter(f"{r['kind']}: {r['outcome']}: {r['reason']}" for r in records
                      if r["outcome"] in ("rejected", "error"))
    after_warmup = [v for t, v in rss if t >= load_start + args.warmup_seconds]
    rss_summary = None
    if after_warmup:
        t_w = [t for t, _ in rss if t >= load_start + args.warmup_seconds]
        minutes = max((t_w[-1] - t_w[0]) / 60, 1e-9)
        rss_summary = {"first_after_warmup_mib": after_warmup[0] / 2**20, "last_mib": after_warmup[-1] / 2**20,
                       "max_mib": max(after_warmup) / 2**20,
                       "growth_mib": (after_warmup[-1] - after_warmup[0]) / 2**20,
                       "growth_mib_per_minute": (after_warmup[-1] - after_warmup[0]) / 2**20 / minutes}
    return {
        "config": {k: v for k, v in vars(args).items()}, "base_url": base,
        "saturated_requests_per_s": saturated, "rate_requests_per_s": rate,
        "sent": len(records), "outcomes": dict(outcomes), "by_kind": by_kind,
        "unaccounted": outcomes.get("unaccounted", 0),
        "normal_not_completed": sum(1 for r in records if r["kind"] == "normal" and r["outcome"] != "completed"),
        "malformed_not_4xx": sum(1 for r in records if r["kind"] == "malformed" and r["outcome"] != "rejected"),
        "reasons": dict(reasons.most_common()),
        "after_load": {"settled": settled is not None,
                       "kv_blocks_in_use": None if blocks is None or free is None else blocks - free,
                       "num_requests_running": _metric(m, "vllm:num_requests_running"),
                       "num_requests_waiting": _metric(m, "vllm:num_requests_waiting"),
                       "request_errors_total": _metric(m, "inferlab:request_errors_total"),
                       "requests_rejected_total": _metric(m, "inferlab:requests_rejected_total"),
                       "aborted_total": _metric(m, "vllm:request_success_total", finished_reason="abort")},
        "rss": {"samples": rss, "summary": rss_summary},
        "records": records,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start `inferlab serve` on the bundled model)")
    p.add_argument("--pid", type=int, help="the running server's pid, for RSS (with --url)")
    p.add_argument("--serve-args", default="", help="extra flags for the started `inferlab serve`")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, help="requests per second (default: --load x the measured saturation)")
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop streams when measuring saturation")
    p.add_argument("--calibrate-seconds", type=float, default=30.0)
    p.add_argument("--input-words", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--normal", type=float, default=0.8, help="share of normal requests")
    p.add_argument("--disconnects", type=float, default=0.1, help="share of streams the client drops midway")
    p.add_argument("--malformed", type=float, default=0.1, help="share of malformed requests")
    p.add_argument("--warmup-seconds", type=float, default=60.0, help="RSS growth is measured after this")
    p.add_argument("--rss-interval", type=float, default=5.0)
    p.add_argument("--settle-seconds", type=float, default=60.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("soak.json"))
    args = p.parse_args()
    args.warmup_seconds = min(args.warmup_seconds, args.minutes * 60 / 4)

    proc = None
    if args.url:
        base, pid = args.url.rstrip("/"), args.pid
    else:
        port = _free_port()
        cmd = [sys.executable, "-m", "inferlab", "serve", "--port", str(port), "--log-level", "warning",
               "--max-queue", "100000", *args.serve_args.split()]
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        base, pid = f"http://127.0.0.1:{port}", proc.pid
        for _ in range(3000):
            if proc.poll() is not None:
                print(f"soak: the server exited with {proc.returncode}", file=sys.stderr)
                return 1
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    try:
        result = asyncio.run(soak(args, base, pid))
    finally:
        if proc is not None:
            proc.terminate()
            result_code = proc.wait(timeout=120)
            print(f"server exited with {result_code}")
    result["config"]["out"] = str(args.out)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    r, a, rs = result, result["after_load"], result["rss"]["summary"]
    print(f"\nsoak {args.minutes:g} min at {r['rate_requests_per_s']:.2f} req/s"
          + (f" (saturation {r['saturated_requests_per_s']:.2f})" if r["saturated_requests_per_s"] else ""))
    print(f"  sent {r['sent']}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items())))
    for k, v in r["by_kind"].items():
        print(f"    {k}: {v}")
    print(f"  unaccounted {r['unaccounted']}, normal not completed {r['normal_not_completed']}, "
          f"malformed not 4xx {r['malformed_not_4xx']}")
    print(f"  after the load: KV blocks in use {a['kv_blocks_in_use']}, running {a['num_requests_running']}, "
          f"waiting {a['num_requests_waiting']} (settled: {a['settled']})")
    if rs:
        print(f"  RSS after warm-up {rs['first_after_warmup_mib']:.1f} -> {rs['last_mib']:.1f} MiB "
              f"(max {rs['max_mib']:.1f}; growth {rs['growth_mib']:+.1f} MiB, {rs['growth_mib_per_minute']:+.2f} "
              f"MiB/min)")
    for reason, n in list(r["reasons"].items())[:12]:
        print(f"    {n:5d}  {reason}")
    print(f"  -> {args.out}")
    ok = r["unaccounted"] == 0 and r["normal_not_completed"] == 0 and r["malformed_not_4xx"] == 0 \
        and a["kv_blocks_in_use"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
