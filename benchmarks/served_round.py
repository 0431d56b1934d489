"""Where a closed loop's measured round goes, step by step, from a served step trace.

    inferlab serve --quantization w8a8 --kv-cache-dtype int8 --step-trace round.trace
    inferlab bench --concurrency 64 --num-requests 64 --warmup 64 --input-len 128 --output-len 128 --ignore-eos ...
    python benchmarks/served_round.py round.trace

With equal lengths a closed loop runs in rounds (benchmarks/peers.py's c64 is one warmup round, then one measured
round). The measured round starts at the first step after the batch first filled whose decodes are fewer (a warmup
stream finished and its successor's prompt is waiting), and runs to the trace's end. Its steps fall in three parts:
those carrying prefill (the round's prompts, beside whatever decodes), those decoding the full batch alone, and the
finish tail of decode-only steps with fewer sequences.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from inferlab.engine.step_trace import read_step_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a file written by `inferlab serve --step-trace`")
    args = ap.parse_args()
    _, rows = read_step_trace(args.trace)
    full = max(r["d"] for r in rows)
    first_full = next(i for i, r in enumerate(rows) if r["d"] == full)
    start = next(i for i in range(first_full, len(rows)) if rows[i]["d"] < full)
    round_ = rows[start:]
    span = round_[-1]["t"] + round_[-1]["dt"] - round_[0]["t"]
    parts = {
        "prefill beside decodes": [r for r in round_ if r.get("p")],
        f"{full} decodes alone": [r for r in round_ if not r.get("p") and r["d"] == full],
        "finish tail (fewer decodes)": [r for r in round_ if not r.get("p") and r["d"] < full],
    }
    prompt_tokens = sum(c[1] for r in parts["prefill beside decodes"] for c in r["p"])
    print(f"measured round: {len(round_)} steps, {span:.2f} s; {prompt_tokens} prompt tokens")
    print("| part | steps | seconds | median step ms |\n|---|---|---|---|")
    for name, steps in parts.items():
        dts = [r["dt"] for r in steps]
        med = f"{1000 * statistics.median(dts):.1f}" if dts else "-"
        print(f"| {name} | {len(steps)} | {sum(dts):.2f} | {med} |")


if __name__ == "__main__":
    main()
