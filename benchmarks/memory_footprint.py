"""Where `inferlab serve`'s resident memory goes, idle after start (issue 19, "Memory as a cost").

    python benchmarks/memory_footprint.py                     # bundled model, default flags
    python benchmarks/memory_footprint.py -- --quantization int4 --max-num-seqs 16   # engine flags after --

Two readings, both printed and written to --out:
1. In-process, stage by stage, the way `inferlab serve` starts: imports (torch, the engine, the server), the engine
   (model load, packing, KV pool), the HTTP app. After the engine, the resident bytes of the weights, the packed
   copies and the KV pool are read page by page from /proc/self/pagemap (a reserved but unwritten pool costs
   nothing), glibc's free-but-held heap from mallinfo2, and the rest is runtime and heap.
2. The real thing: `inferlab serve` started as a process with the same flags, its smaps_rollup once /v1/models
   answers and the server has sat idle for --settle seconds.
Memory is not timing-sensitive, so figures from a busy machine hold (other processes do not change our pages).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from inferlab.common.process_memory import resident_bytes, rollup  # noqa: E402

MiB = 2**20
HEAVY = ("torch", "numpy", "transformers", "tokenizers", "gguf", "xgrammar", "fastapi", "uvicorn", "pydantic",
         "jinja2", "safetensors", "sentencepiece", "scipy", "sklearn", "pandas")


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_free_bytes() -> int | None:
    """Bytes glibc's arenas hold free (freed by the program, not returned to the kernel); None off glibc."""
    try:
        f = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    f.restype = MallInfo2
    return int(f().fordblks)


def malloc_trim() -> bool:
    try:
        return bool(ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0)))
    except (OSError, AttributeError):
        return False


def tensor_resident(tensors, seen: set[int]) -> tuple[int, int]:
    """(bytes reserved, bytes resident) over the storages not in `seen` (which this adds them to): a tensor that
    views another's storage (a layer's slice of the KV pool, a tied weight) is counted once, by its first owner."""
    reserved = resident = 0
    for t in tensors:
        s = t.untyped_storage()
        if t.device.type != "cpu" or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        reserved += s.nbytes()
        resident += resident_bytes(s.data_ptr(), s.nbytes())
    return reserved, resident


def in_process(engine_args: list[str]) -> dict:
    stages: list[dict] = []

    def stage(name: str) -> None:
        r = rollup()
        stages.append({"stage": name, "rss": r.rss, "anonymous": r.anonymous, "file": r.file,
                       "heap_free": heap_free_bytes(),
                       "modules": sorted(m for m in HEAVY if m in sys.modules)})

    stage("python")
    import torch  # noqa: F401

    stage("import torch")
    import argparse as ap

    from inferlab.engine.config import EngineConfig
    from inferlab.engine.llm_engine import LLMEngine

    stage("import engine")
    import uvicorn  # noqa: F401

    from inferlab.server.api import ServerConfig, build_app
    from inferlab.server.cli import release_load_memory

    stage("import server")
    parser = ap.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    engine = LLMEngine(EngineConfig.from_cli_args(parser.parse_args(engine_args)))
    stage("engine built")
    build_app(engine, ServerConfig())
    stage("app built")
    release_load_memory()
    stage("load memory released")

    model = engine.runner.model
    others = [v for m in model.modules() for v in vars(m).values()
              if isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_mkldnn]
    seen: set[int] = set()
    parts = {"KV pool": tensor_resident([engine.runner.kv_cache], seen),
             "weights": tensor_resident(list(model.parameters()) + list(model.buffers()), seen),
             "packed copies": tensor_resident(others, seen)}  # what modules hold beside parameters and buffers
    heap_free = heap_free_bytes()
    trimmed = malloc_trim()
    stage("after malloc_trim(0)")
    return {"stages": stages, "parts": {k: {"reserved": a, "resident": b} for k, (a, b) in parts.items()},
            "heap_free_before_trim": heap_free, "malloc_trim_released": trimmed,
            "kv_blocks": engine.block_manager.num_blocks, "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.config.max_num_seqs}


def serve_idle(engine_args: list[str], settle: float) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "inferlab", "serve", "--port", str(port), "--log-level", "warning", *engine_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"inferlab serve exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"inferlab serve did not answer within 900 s: {' '.join(cmd)}")
        time.sleep(settle)
        r = rollup(proc.pid)
        return {"command": cmd, "rss": r.rss, "pss": r.pss, "anonymous": r.anonymous, "file": r.file}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds the server idles before it is read")
    ap.add_argument("--no-serve", action="store_true", help="skip starting a real `inferlab serve`")
    ap.add_argument("--out", default="bench-results/memory_footprint.json")
    ap.add_argument("engine_args", nargs="*", help="engine flags for both readings (after --)")
    args = ap.parse_args()
    if not args.no_serve:  # first, before this process's own imports and model fill the page cache's view
        served = serve_idle(args.engine_args, args.settle)
    ip = in_process(args.engine_args)

    print(f"{'stage':24s} {'RSS':>9s} {'anon':>9s} {'file':>9s} {'heap free':>10s}  heavy modules loaded")
    prev = None
    for s in ip["stages"]:
        new = sorted(set(s["modules"]) - set(prev["modules"])) if prev else s["modules"]
        hf = "—" if s["heap_free"] is None else f"{s['heap_free'] / MiB:.0f}"
        print(f"{s['stage']:24s} {s['rss'] / MiB:9.0f} {s['anonymous'] / MiB:9.0f} {s['file'] / MiB:9.0f} {hf:>10s}  "
              f"+{','.join(new) or '-'}")
        prev = s
    built = next(s for s in ip["stages"] if s["stage"] == "load memory released")
    tensors = sum(p["resident"] for p in ip["parts"].values())
    print(f"\nonce started, as `inferlab serve` is (MiB, resident / reserved), {ip['kv_blocks']} KV blocks, context {ip['max_model_len']}, "
          f"max-num-seqs {ip['max_num_seqs']}:")
    for k, p in ip["parts"].items():
        print(f"  {k:18s} {p['resident'] / MiB:8.0f} / {p['reserved'] / MiB:.0f}")
    print(f"  {'anon, the rest':18s} {(built['anonymous'] - tensors) / MiB:8.0f}   (heap free before trim "
          f"{(ip['heap_free_before_trim'] or 0) / MiB:.0f})")
    print(f"  {'file-backed':18s} {built['file'] / MiB:8.0f}   (libraries, mostly shared with other processes)")
    budget = sum(p["reserved"] for p in ip["parts"].values()) + 400 * MiB
    print(f"  issue 19 target: RSS <= weights + packed + KV pool + 400 MiB = {budget / MiB:.0f} MiB")
    if not args.no_serve:
        print(f"\n`{' '.join(served['command'][1:])}` idle after {args.settle:g}s: RSS {served['rss'] / MiB:.0f} MiB, "
              f"PSS {served['pss'] / MiB:.0f}, anon {served['anonymous'] / MiB:.0f}, file {served['file'] / MiB:.0f}"
              f" -> {'within' if served['rss'] <= budget else 'OVER'} the target")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"in_process": ip, "serve": None if args.no_serve else served, "target_bytes": budget},
                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
