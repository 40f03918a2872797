"""The emulated device's rules (roundpipe.testing.emu.Rules): all on by default, switched by
name for a block or from the environment, unknown names refused with the list of rules."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roundpipe.testing import emu

ROOT = Path(__file__).resolve().parents[1]


def test_every_rule_is_on_by_default_in_the_suite():
    assert all(dataclasses.asdict(emu.rules()).values())


def test_a_rule_switched_for_a_block_comes_back():
    with emu.rules_set(allocator_reuse=False, event_queries=False) as inside:
        assert not inside.allocator_reuse and not inside.event_queries
        assert emu.rules() == inside
    assert emu.rules().allocator_reuse and emu.rules().event_queries


def test_an_unknown_rule_is_refused_with_the_list():
    with pytest.raises(ValueError, match=r"unknown emulated-device rule\(s\) \['allocator'\]"):
        emu.set_rules(allocator=False)
    assert emu.rules() == emu.Rules()


@pytest.mark.slow
@pytest.mark.parametrize(
    "lenient, expected",
    [
        ("allocator_reuse, event_queries", "False False True"),
        ("no_such_rule", "ROUNDPIPE_EMU_LENIENT='no_such_rule' names an unknown rule"),
    ],
)
def test_rules_are_switched_off_from_the_environment(lenient, expected):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from roundpipe.testing import emu; emu.install(); r = emu.rules(); "
            "print(r.allocator_reuse, r.event_queries, r.cuda_autocast)",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, ROUNDPIPE_EMU_LENIENT=lenient),
        timeout=100,
    )
    assert expected in proc.stdout + proc.stderr, proc.stdout + proc.stderr
