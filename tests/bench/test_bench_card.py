"""`inferlab bench --card`: the card's workload, load and SLOs, against the server the card names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from inferlab.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_card_with_command_server_runs_its_workload(tmp_path):
    text = (ROOT / "examples" / "card-cpu.yaml").read_text()
    text = text[: text.index("\nserver:")] + (
        "\nserver:\n  kind: command\n"
        f"  command: \"{sys.executable} -m inferlab fake-server --port {{port}} --ttft 20ms --itl 5ms\"\n"
        "  model: fake-model\n  ready_timeout: 120s\n")
    card = tmp_path / "card.yaml"
    card.write_text(text)
    out = tmp_path / "out"
    argv = ["bench", "--card", str(card), "--num-requests", "6", "--output-dir", str(out), "--quiet", "--no-html"]
    # The fake server's 20 ms TTFT and 5 ms per token meet the card's objectives (TTFT p99 2 s, TPOT p99 120 ms).
    assert main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["slo_passed"] is True
    from inferlab.lab.card import load_card

    c = load_card(card)
    assert res["runs"][0]["counts"]["completed"] == 6  # the user's --num-requests overrides the card's
    assert res["runs"][0]["load"]["kind"] == ("concurrency" if c.traffic.closed_loop else "rate")
    assert res["provenance"]["slos"]  # the card's objectives became bench SLOs


def test_bad_card_fails_with_the_problem_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("traffic:\n  concurency: 4\n")
    assert main(["bench", "--card", str(bad)]) == 2
    assert "concurency" in capsys.readouterr().err
