"""The emulated device's C++ libraries: a build killed while it held torch's build lock does not
make every later install wait forever (see [Note: the build lock] in roundpipe.testing.emu)."""

import os
import subprocess
import sys

import pytest
from torch.utils import cpp_extension

from roundpipe.testing import emu

# Every test here runs a subprocess (see the slow marker in pyproject.toml).
pytestmark = pytest.mark.slow

INSTALL = "from roundpipe.testing import emu; emu.install(); print('installed')"


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
