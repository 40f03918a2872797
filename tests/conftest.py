"""Test-suite setup: the emulated accelerator, and running the runtime tests on it.

* The emulated device (:mod:`roundpipe.testing.emu`) is installed before any test runs: the
  autograd engine starts its device threads on the process's first backward, and only for the
  devices it knows then. The optimizer's compiled step (:mod:`roundpipe.optim.native`) is built
  or loaded then too.
* Every test in the modules of ``_BOTH_POOLS`` runs twice: on the CPU pool it asks for, and on
  the emulated pool of the same size (``pool_kind`` ``emu``: a pool of N CPU workers becomes
  emu:0 .. emu:N-1). So each runtime behaviour is checked with backward on autograd's device
  thread and with host tensors rejected, as on CUDA. A test about the CPU pool itself is marked
  ``cpu_pool_only``.
* Every rule of the emulated device is on (:class:`roundpipe.testing.emu.Rules`), and after
  each test the host waits for every emulated device, so device work a test leaves unordered
  (tests of races leave some on purpose) is not charged to the next test: a tensor the test
  dropped while another stream still used it would otherwise fail the next test's allocation.
* The process's environment is put back after each test. transformers' ``TrainingArguments``
  writes the run's choices into it for accelerate (``ACCELERATE_DYNAMO_BACKEND``; the floor's
  transformers ``ACCELERATE_MIXED_PRECISION`` too), and accelerate reads them back for every
  later Trainer: a plain Trainer after a test with ``bf16=True`` would
  otherwise compute under bf16 autocast.
* Fixtures for the tests that ask: ``fresh_dynamo`` (torch.compile reset, its counters zeroed),
  ``group_of_one`` (a one-rank gloo process group), ``rank_pool`` (rank processes kept for
  the session that run data-parallel runs; tests/rank_pool_worker.py).
* The suite runs on pytest-xdist's workers (``-n auto`` in pyproject.toml): each worker's
  torch takes its share of the cores, so the workers' intra-op threads do not outnumber them.
  Tests that share something across a module (a module-scoped fixture) or a session's rank
  processes are one ``xdist_group``, run by one worker.
"""

import os

import pytest
import torch

import roundpipe.devices
from roundpipe.optim import native
from roundpipe.testing import emu

emu.install()
# The optimizer's compiled step, built (or found built) before any test steps, so that every
# test runs the path users get once it is built; a failed build warns here and the tests of the
# compiled path fail, naming it (tests/test_optim_one_pass.py).
native.kernels(wait=True)

_BOTH_POOLS = {
    "test_runtime",
    "test_runtime_errors",
    "test_staleness",
    "test_autocast_rng",
    "test_concurrency",
    "test_devices",
    "test_optim_one_pass",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cpu_pool_only: a test about the CPU pool itself; not repeated on the emulated accelerator",
    )
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        config.pluginmanager.register(_GroupIds(), "roundpipe-xdist-group-ids")


class _GroupIds:
    """Gives each test in an ``xdist_group`` the id xdist's loadgroup schedules by:
    ``nodeid@group``. xdist (3.8) suffixes ``item._nodeid`` as it collects, an attribute pytest
    9 no longer reads (a node's id is ``item._id``), so without this every test is a group of
    its own: the tests of a group run on both workers, each building the group's shared fixtures
    (rank processes, two_ranks), and the groups are no longer handed out first."""

    @pytest.hookimpl(trylast=True)  # after conftest's hook below has marked the groups
    def pytest_collection_modifyitems(self, config, items):
        try:  # pytest 9's; a pytest that reads item._nodeid needs none of this
            from _pytest.nodeid import coerce_node_id
        except ImportError:
            return
        for item in items:
            if not hasattr(item, "_id"):
                return
            names = {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
            if names and "@" not in item.nodeid:
                item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(sorted(names))}")


def pytest_generate_tests(metafunc):
    module = metafunc.module.__name__.rpartition(".")[2]
    if (
        "pool_kind" in metafunc.fixturenames
        and module in _BOTH_POOLS
        and metafunc.definition.get_closest_marker("cpu_pool_only") is None
    ):
        metafunc.parametrize("pool_kind", ["cpu", "emu"], indirect=True)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    # One worker runs every test of the session's rank processes: they are started once. (A
    # module with an xdist_group of its own keeps it, joined with rank_pool's name: a group that
    # may go to another worker, which then starts rank processes of its own.)
    for item in items:
        if "rank_pool" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("rank_pool"))


@pytest.fixture(scope="session")
def ops():
    """The optimizer's compiled step kernels (torch.ops.roundpipe_optim); the test fails,
    naming why, where they did not build."""
    ops = native.kernels(wait=True)
    if ops is None:
        pytest.fail(f"the compiled step did not build here: {native.status()}")
    return ops


def _on_emu(devices):
    return tuple(
        roundpipe.devices.WorkerDevice("emu", d.index) if d.type == "cpu" else d for d in devices
    )


@pytest.fixture(autouse=True)
def _devices_settle_after_each_test():
    yield
    for index in range(emu.DEVICE_COUNT):
        torch.accelerator.synchronize(torch.device(emu.NAME, index))


@pytest.fixture(autouse=True)
def _environment_put_back_after_each_test():
    before = dict(os.environ)
    yield
    for name in os.environ.keys() - before.keys():
        del os.environ[name]
    for name, value in before.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def pool_kind(request, monkeypatch):
    """``cpu``, or ``emu``: every device pool the test builds is made of emulated devices."""
    kind = getattr(request, "param", "cpu")
    if kind == "emu":
        resolve = roundpipe.devices.pool.resolve_devices
        monkeypatch.setattr(
            roundpipe.devices.pool,
            "resolve_devices",
            lambda devices=None: _on_emu(resolve(devices)),
        )
    return kind


@pytest.fixture
def fresh_dynamo():
    """torch.compile from nothing, its counters at zero (``torch._dynamo.utils.counters``), so
    a test of compiled layers counts its own graphs; reset again afterwards."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


@pytest.fixture
def group_of_one(request, tmp_path):
    """A gloo process group of this process alone (a one-rank data-parallel run), with a
    timeout of 10 s, or of ``request.param`` seconds (parametrized with ``indirect=True``)."""
    import torch.distributed as dist

    from roundpipe.distributed import group as rpd_group

    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(str(tmp_path / "store"), 1),
        rank=0,
        world_size=1,
        timeout=rpd_group._as_timedelta(getattr(request, "param", 10)),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
        if rpd_group.active_group() is not None:  # a failed test left a DataParallel attached
            rpd_group._ACTIVE, rpd_group._ACTIVE_USERS = None, 0


@pytest.fixture(scope="session")
def rank_pool(tmp_path_factory):
    """Rank processes kept for the session that run data-parallel runs (tests/dp_worker.py's,
    tests/ckpt_worker.py's, tests/trainer_dp_worker.py's), each with its own process group: see
    tests/rank_pool_worker.py."""
    from rank_pool_worker import RankPool

    pool = RankPool(tmp_path_factory.mktemp("rank-pool"))
    try:
        yield pool
    finally:
        pool.close()
