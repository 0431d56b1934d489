"""The kernel build survives a build that was killed: torch's `lock` file, which would block every later process."""

from __future__ import annotations

import torch.utils.cpp_extension

from inferlab.kernels import build_kernels

_TINY_MODULE = """#include <pybind11/pybind11.h>
static int add(int a, int b) { return a + b; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""


def test_a_lock_left_by_a_killed_build_is_removed_before_torch_sees_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    stale = tmp_path / "ext" / "tiny" / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    seen = {}

    def fake_load(**kwargs):
        seen["build_directory"] = kwargs["build_directory"]
        seen["lock_present"] = stale.exists()
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    assert build_kernels(tmp_path, "tiny") == "module"
    assert seen == {"build_directory": str(stale.parent), "lock_present": False}


def test_a_real_build_completes_where_a_killed_build_left_its_lock(tmp_path, monkeypatch):
    # Without the removal torch's FileBaton waits on this file forever: the lock path is torch's, not ours.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tiny.cpp").write_text(_TINY_MODULE)
    stale = tmp_path / "ext" / "inferlab_lock_test" / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    module = build_kernels(tmp_path / "src", "inferlab_lock_test")
    assert module.add(2, 3) == 5
    assert not stale.exists()
