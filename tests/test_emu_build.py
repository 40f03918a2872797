"""The emulated device's C++ libraries: a build killed while it held torch's build lock does not
make every later install wait forever (see [Note: the build lock] in roundpipe.native_build), and
checkouts at different paths build from one source path, so they share the cached build (see
[Note: the build's source path] there)."""

import os
import shutil
import subprocess
import sys

import pytest
from torch.utils import cpp_extension

from roundpipe.testing import emu

INSTALL = "from roundpipe.testing import emu; emu.install(); print('installed')"


def test_two_checkouts_compile_one_source_path_so_they_share_the_build(tmp_path, monkeypatch):
    here = emu._build_source("emu_guard")
    assert os.path.dirname(here) == cpp_extension._get_build_directory(
        emu._extension_name("emu_guard"), False
    )
    # Another checkout of the same sources, at another path (a worktree, CI's copy).
    other = tmp_path / "checkout" / "testing"
    shutil.copytree(emu._HERE, other, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(emu, "_HERE", str(other))
    for name in ("emu_guard", "emu_autocast"):
        path = emu._build_source(name)
        assert not path.startswith(str(tmp_path)), path
        with open(path, "rb") as built, open(other / f"_{name}.cpp", "rb") as source:
            assert built.read() == source.read()
    assert emu._build_source("emu_guard") == here


@pytest.mark.slow  # a subprocess
def test_a_killed_builds_lock_is_cleared_by_the_next_install():
    # torch's baton, as a process killed during its build leaves it, beside each library.
    batons = []
    for name in ("emu_guard", "emu_autocast"):
        build_dir = cpp_extension._get_build_directory(emu._extension_name(name), False)
        baton = os.path.join(build_dir, "lock")
        with open(baton, "w"):
            pass
        batons.append(baton)
    # Without the fix this process waits in torch's FileBaton.wait forever.
    result = subprocess.run(
        [sys.executable, "-c", INSTALL], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "installed" in result.stdout
    assert not any(os.path.exists(b) for b in batons)
