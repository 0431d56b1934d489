"""The model side's imports point one way: kernels <- layers (quant beside them, importing layers) <- models <-
engine. A module importing back up the chain (layers importing quant, quant importing models) fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "inferlab"
# Each package and the inferlab packages it must not import.
FORBIDDEN = {
    "kernels": {"common", "layers", "quant", "models", "engine", "spec", "server", "bench", "lab"},
    "layers": {"quant", "models", "engine", "spec", "server", "bench", "lab"},
    "quant": {"models", "engine", "spec", "server", "bench", "lab"},
    "models": {"engine", "spec", "server", "bench", "lab"},
}


def _imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        found |= {n.split(".")[1] for n in names if n.startswith("inferlab.")}
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_back_up(package):
    wrong = {f"{p.name} imports inferlab.{bad}" for p in (SRC / package).glob("*.py")
             for bad in _imported_packages(p) & FORBIDDEN[package]}
    assert not wrong
