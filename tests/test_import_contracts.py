"""The import direction is a contract, checked by import-linter against pyproject.toml's [tool.importlinter]: a
wrong arrow (the engine importing the server, bench importing the engine, a proposer reaching into the scheduler)
fails this test instead of waiting for a review."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_imports_follow_the_contracts():
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout
