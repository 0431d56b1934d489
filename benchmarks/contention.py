"""Served speed on a busy machine: inferlab (and llama.cpp's llama-server where it is built) at 1 and 16 streams
beside each kind of neighbour, as a share of the quiet figure from the same run.

    python benchmarks/contention.py                               # everything; table to stdout, JSON to --out
    python benchmarks/contention.py --quick --neighbours none,other-session --streams 1   # a smoke run

Neighbours (each a CPU-bound Python busy loop, started 2 s before the load point and killed after it):
  none           the quiet reference
  same-session   one loop in the server's login session (Linux autogroup shares CPU between sessions)
  other-session  one loop started with setsid, as from another terminal: its session gets half the machine
  nice19         two loops at nice 19 in the server's session
  quota          no loop; the server runs in a cgroup limited to one CPU (v2 cpu.max or v1 cpu.cfs_quota_us),
                 created here (root needed; skipped with a message otherwise)
The server and the bench client run in this script's session. The peer is llama.cpp's server through
/work/shared/peers/llamacpp.sh, used only when $PEER_DIR/build/bin/llama-server exists (this never builds it).
Each row also records what bench saw of the machine (foreign CPU share) and, for inferlab, its CPU thread count
and fallbacks from /metrics at the end of the point.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER_SCRIPT = Path("/work/shared/peers/llamacpp.sh")
NEIGHBOURS = ("none", "same-session", "other-session", "nice19", "quota")
BUSY = [sys.executable, "-c", "while True: pass"]
CGROUP_NAME = f"inferlab-contention-{os.getpid()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the one-CPU cgroup ----------------------------------------------------------------------------------------

def make_cgroup() -> tuple[Path | None, str]:
    """A cgroup limited to one CPU: (the file a pid is written to, how), or (None, why not)."""
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
            d = v2 / CGROUP_NAME
            d.mkdir(exist_ok=True)
            (d / "cpu.max").write_text("100000 100000\n")
            return d / "cgroup.procs", f"cgroup v2 {d}/cpu.max = 100000 100000"
        v1 = v2 / "cpu"
        if not (v1 / "cpu.cfs_quota_us").exists():
            v1 = v2 / "cpu,cpuacct"
        if (v1 / "cpu.cfs_quota_us").exists():
            d = v1 / CGROUP_NAME
            d.mkdir(exist_ok=True)
            (d / "cpu.cfs_period_us").write_text("100000\n")
            (d / "cpu.cfs_quota_us").write_text("100000\n")
            return d / "cgroup.procs", f"cgroup v1 {d}/cpu.cfs_quota_us = 100000 per 100000"
    except OSError as e:
        return None, f"cannot create a cgroup here ({e}); run as root on a machine with the cpu controller"
    return None, "no cgroup cpu controller found (neither v2 cpu.max nor v1 cpu.cfs_quota_us)"


def remove_cgroup(procs: Path | None) -> None:
    if procs is not None:
        try:
            procs.parent.rmdir()
        except OSError:
            pass


# --- servers and neighbours ------------------------------------------------------------------------------------

def server_argv(target: str, port: int) -> list[str]:
    if target == "inferlab":
        return [sys.executable, "-m", "inferlab", "serve", "--port", str(port)]
    return ["bash", str(PEER_SCRIPT), str(port), "-t", str(os.cpu_count() or 1)]


def peer_available() -> bool:
    peer_dir = Path(os.environ.get("PEER_DIR", "/tmp/peer-llamacpp"))
    return PEER_SCRIPT.exists() and (peer_dir / "build/bin/llama-server").exists()


def start_server(target: str, cgroup_procs: Path | None, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = server_argv(target, port)
    if cgroup_procs is not None:  # join the cgroup before exec, so the engine reads its quota at start
        argv = ["sh", "-c", f"echo $$ > {shlex.quote(str(cgroup_procs))} && exec {shlex.join(argv)}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("OMP_WAIT_POLICY", None)  # measure the defaults a user gets
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # this session
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{target} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{target} did not become ready; see {log}")


def stop(proc: subprocess.Popen, group: bool = False) -> None:
    try:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.terminate()
            proc.wait(15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        proc.kill()
    proc.wait()


def start_neighbours(kind: str) -> list[tuple[subprocess.Popen, bool]]:
    if kind == "same-session":
        return [(subprocess.Popen(BUSY), False)]
    if kind == "other-session":
        return [(subprocess.Popen(BUSY, start_new_session=True), True)]
    if kind == "nice19":
        return [(subprocess.Popen(BUSY, preexec_fn=lambda: os.nice(19)), False) for _ in range(2)]
    return []


def engine_metrics(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict = {"cpu_fallbacks": 0.0}
    for line in text.splitlines():
        if line.startswith("inferlab:cpu_threads{"):
            out["cpu_threads"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("inferlab:cpu_fallbacks_total{"):
            out["cpu_fallbacks"] += float(line.rsplit(" ", 1)[1])
    return out


def bench(url: str, streams: int, rounds: int, out: Path) -> dict:
    n = streams * rounds
    argv = [sys.executable, "-m", "inferlab", "bench", "--base-url", url, "--concurrency", str(streams),
            "--num-requests", str(n), "--warmup", str(streams), "--input-len", "128", "--output-len", "64",
            "--output-dir", str(out), "--quiet", "--no-html"]
    subprocess.run(argv, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                   stdout=subprocess.DEVNULL)
    run = json.loads((out / "results.json").read_text())["runs"][0]
    m = run.get("machine") or {}
    return {"output_tokens_per_s": run["throughput"]["output_tokens_per_s"],
            "itl_p50_ms": (run["latency"]["itl"]["p50"] or 0) * 1e3,
            "itl_p99_ms": (run["latency"]["itl"]["p99"] or 0) * 1e3,
            "foreign_cpu_share": m.get("foreign_cpu_share"), "server_cpu_share": m.get("server_cpu_share"),
            "duration_s": run["window"]["duration"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="inferlab,llamacpp")
    ap.add_argument("--neighbours", default=",".join(NEIGHBOURS))
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--rounds", type=int, default=4, help="measured requests per stream (default 4)")
    ap.add_argument("--quick", action="store_true", help="one measured request per stream: a smoke run")
    ap.add_argument("--out", default="contention.json")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    neighbours = [n for n in args.neighbours.split(",") if n]
    bad = [n for n in neighbours if n not in NEIGHBOURS]
    if bad:
        ap.error(f"unknown neighbour(s) {bad}; choose from {', '.join(NEIGHBOURS)}")
    targets = []
    for t in args.targets.split(","):
        if t == "llamacpp" and not peer_available():
            print("llamacpp: skipped (no llama-server under $PEER_DIR; build it with "
                  f"{PEER_SCRIPT} first)", file=sys.stderr)
        elif t in ("inferlab", "llamacpp"):
            targets.append(t)
    streams = [int(s) for s in args.streams.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="contention-"))
    rows: list[dict] = []
    notes: list[str] = []
    for target in targets:
        # One server for the neighbours; a fresh one inside the cgroup, so it reads the quota at start.
        groups = [("shared", [n for n in neighbours if n != "quota"])]
        groups += [("quota", ["quota"])] if "quota" in neighbours else []
        for group, kinds in groups:
            if not kinds:
                continue
            procs = None
            if group == "quota":
                procs, how = make_cgroup()
                if procs is None:
                    notes.append(f"quota: skipped: {how}")
                    print(f"quota: skipped: {how}", file=sys.stderr)
                    continue
                notes.append(f"quota: {how}")
            server, url = start_server(target, procs, tmp / f"{target}-{group}.log")
            try:
                for kind in kinds:
                    for s in streams:
                        nb = start_neighbours(kind)
                        try:
                            time.sleep(2.0 if nb else 0.0)
                            r = bench(url, s, rounds, tmp / f"{target}-{kind}-{s}")
                        finally:
                            for p, group_kill in nb:
                                stop(p, group_kill)
                        if target == "inferlab":
                            r.update(engine_metrics(url))
                        rows.append({"target": target, "neighbour": kind, "streams": s, **r})
                        print(f"{target:9s} {kind:14s} {s:3d} streams: {r['output_tokens_per_s']:7.1f} tok/s",
                              file=sys.stderr)
            finally:
                stop(server)
                remove_cgroup(procs)
    for r in rows:
        quiet = next((q for q in rows if q["target"] == r["target"] and q["streams"] == r["streams"]
                      and q["neighbour"] == "none"), None)
        r["share_of_quiet"] = r["output_tokens_per_s"] / quiet["output_tokens_per_s"] if quiet else None
    header = ("| target | neighbour | streams | output tok/s | share of quiet | ITL p50 ms | ITL p99 ms | foreign CPU "
              "| threads at end | fallbacks |")
    print(header)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = f"{r['share_of_quiet']:.0%}" if r["share_of_quiet"] is not None else "–"
        fc = f"{r['foreign_cpu_share']:.0%}" if r.get("foreign_cpu_share") is not None else "–"
        print(f"| {r['target']} | {r['neighbour']} | {r['streams']} | {r['output_tokens_per_s']:.1f} | {share} | "
              f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {fc} | {r.get('cpu_threads', '–')} | "
              f"{r.get('cpu_fallbacks', '–')} |")
    for n in notes:
        print(f"- {n}")
    Path(args.out).write_text(json.dumps({"rows": rows, "notes": notes, "cpu_count": os.cpu_count(),
                                          "rounds": rounds}, indent=1))
    print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
