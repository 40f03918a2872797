"""Adam/AdamW with the state in files (``state_dir=``): bitwise the in-RAM optimizer, through
training with an async step and an fp16 GradScaler, state_dict and checkpoint resume; the
streaming pipeline's order and byte counts; I/O failures reported with the directory."""

import copy
import errno
import os
import socket

import pytest
import torch
import torch.nn.functional as F
from spill_common import batches as _batches
from spill_common import dead_pid
from spill_common import model as _seq_model
from spill_common import train as _train
from torch import nn

import roundpipe
import roundpipe.checkpoint as ckpt
import roundpipe.optim as rp_optim
from roundpipe import GradScaler
from roundpipe.optim import SpillError, placement, spill, spill_file

# Fits a few chunks of the shapes below, so every parameter kind is cut somewhere.
SMALL_BUFFER = 4 * 3 * 4096

SHAPES = [
    ((100, 37), torch.float32),
    ((5,), torch.float32),
    ((3001,), torch.float32),
    ((0,), torch.float32),
    ((), torch.float32),
    ((40,), torch.complex64),
    ((77, 3), torch.float64),
]


def _params(seed=1, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen, dtype=dt)) for s, dt in shapes]


def _set_grads(param_lists, gen, skip=()):
    for i, ps in enumerate(zip(*param_lists)):
        g = None if i in skip else torch.randn(ps[0].shape, generator=gen, dtype=ps[0].dtype)
        for p in ps:
            p.grad = None if g is None else g.clone()


def _assert_bitwise(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _assert_same_state(sd_a, sd_b):
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for key, state in sd_a["state"].items():
        assert state.keys() == sd_b["state"][key].keys()
        for name, t in state.items():
            assert torch.equal(t, sd_b["state"][key][name]), (key, name)


@pytest.mark.parametrize("cls", [rp_optim.Adam, rp_optim.AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_spilled_steps_equal_in_ram_bitwise(tmp_path, cls, amsgrad):
    ram, disk = _params(), _params()
    opts = dict(lr=0.02, weight_decay=0.05, amsgrad=amsgrad)
    opt_ram = cls(ram, **opts)
    opt_disk = cls(disk, **opts, state_dir=tmp_path, state_buffer_bytes=SMALL_BUFFER)
    assert len(os.listdir(tmp_path)) == 1  # one fresh directory of its own
    gen = torch.Generator().manual_seed(2)
    for step in range(6):
        # Step 2 leaves two parameters without a gradient: their state stays as it was.
        _set_grads([ram, disk], gen, skip=(0, 2) if step == 2 else ())
        opt_ram.step()
        opt_disk.step()
    _assert_bitwise(ram, disk)
    _assert_same_state(opt_ram.state_dict(), opt_disk.state_dict())
    # Parameters were cut across chunks, and chunks hold several parameters.
    store = opt_disk._placement
    assert any(len(record.segments) > 1 for record in store._params)
    assert any(len(chunk.segments) > 1 for chunk in store._chunks)
    opt_disk.close()
    assert os.listdir(tmp_path) == []


def test_state_dict_round_trips_both_ways(tmp_path):
    real = [(shape, dtype) for shape, dtype in SHAPES if not dtype.is_complex]
    a, b = _params(shapes=real), _params(shapes=real)  # torch's fused Adam refuses complex
    opt_a = torch.optim.AdamW(a, lr=0.01, fused=True)  # torch's own, in RAM
    opt_b = rp_optim.AdamW(b, lr=0.01, state_dir=tmp_path, state_buffer_bytes=SMALL_BUFFER)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        _set_grads([a, b], gen)
        opt_a.step()
        opt_b.step()
    # Swap the states: the spilled optimizer's into RAM (torch's format: torch loads it too),
    # torch's into a spilled one. Deep copies: a state dict holds the live step counts.
    sd_a, sd_b = copy.deepcopy(opt_a.state_dict()), copy.deepcopy(opt_b.state_dict())
    torch.optim.AdamW(_params(shapes=real), lr=0.01).load_state_dict(copy.deepcopy(sd_b))
    c = [nn.Parameter(p.detach().clone()) for p in b]
    d = [nn.Parameter(p.detach().clone()) for p in a]
    opt_c = rp_optim.AdamW(c, lr=0.01)
    opt_c.load_state_dict(sd_b)
    opt_d = rp_optim.AdamW(d, lr=0.01, state_dir=tmp_path, state_buffer_bytes=SMALL_BUFFER)
    opt_d.load_state_dict(sd_a)
    assert set(opt_d.state[d[0]]) == {"step"}  # the moments went to the file
    for _ in range(3):
        _set_grads([a, b, c, d], gen)
        for opt in (opt_a, opt_b, opt_c, opt_d):
            opt.step()
    for other in (b, c, d):
        _assert_bitwise(a, other)
    _assert_same_state(opt_b.state_dict(), opt_d.state_dict())
    _assert_same_state(opt_b.state_dict(), opt_c.state_dict())


def test_a_skipped_step_leaves_the_file_and_the_counts_unchanged(tmp_path):
    params = _params()
    opt = rp_optim.Adam(params, lr=0.01, state_dir=tmp_path, state_buffer_bytes=SMALL_BUFFER)
    gen = torch.Generator().manual_seed(4)
    _set_grads([params], gen)
    opt.step()
    path = os.path.join(opt._placement.path, spill._FILE)
    with open(path, "rb") as f:
        before = f.read()
    values = [p.detach().clone() for p in params]
    _set_grads([params], gen)
    opt.grad_scale = torch.tensor(8.0)
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    with open(path, "rb") as f:
        assert f.read() == before
    _assert_bitwise(params, values)
    assert {float(s["step"]) for s in opt.state.values()} == {1.0}


def test_each_step_streams_every_chunk_once_reads_ahead_and_writes_behind(tmp_path, monkeypatch):
    # 12 KiB slots hold 1536 elements of exp_avg and exp_avg_sq: 6 chunks.
    params = [nn.Parameter(torch.randn(6 * 1536))]
    opt = rp_optim.Adam(params, lr=0.01, state_dir=tmp_path, state_buffer_bytes=SMALL_BUFFER)
    store = opt._placement
    log = []
    reader_submit, writer_submit = store._reader.submit, store._writer.submit
    monkeypatch.setattr(store._reader, "submit", lambda *a: log.append("R") or reader_submit(*a))
    monkeypatch.setattr(store._writer, "submit", lambda *a: log.append("W") or writer_submit(*a))
    kernel = roundpipe.optim.kernel.run_fused_kernel
    monkeypatch.setattr(
        roundpipe.optim.spill, "run_fused_kernel", lambda *a: log.append("K") or kernel(*a)
    )
    params[0].grad = torch.randn(6 * 1536)
    opt.step()
    assert len(store._chunks) == 6
    # Three reads ahead of the first update; each later read is issued right after a write.
    assert "".join(log) == "RRR" + "KWR" * 3 + "KW" * 3
    assert (
        store._size
        == 6 * 2 * 1536 * 4
        == os.path.getsize(os.path.join(store.path, "adam_state.bin"))
    )
    assert store._buffer.numel() == SMALL_BUFFER  # the host memory it streams through


def _run(state_dir, batches):
    model = _seq_model()
    spill_options = dict(state_dir=state_dir, state_buffer_bytes=SMALL_BUFFER) if state_dir else {}
    opt = rp_optim.AdamW(model.optim_parameters(), lr=1e-2, **spill_options)
    # 2**24 overflows fp16 gradients: the first steps are skipped while the scale backs off.
    scaler = GradScaler("cpu", init_scale=2.0**24, growth_interval=4)
    _train(model, opt, scaler, batches)
    return model, opt, scaler


def test_training_with_a_grad_scaler_equals_the_in_ram_run_bitwise(tmp_path):
    batches = _batches(20)
    model_ram, opt_ram, scaler_ram = _run(None, batches)
    model_disk, opt_disk, scaler_disk = _run(tmp_path, batches)
    steps = {float(s["step"]) for s in opt_disk.state.values()}
    assert len(steps) == 1 and 0 < steps.pop() < 20  # some steps were skipped, most ran
    _assert_bitwise(model_ram.optim_parameters(), model_disk.optim_parameters())
    _assert_same_state(opt_ram.state_dict(), opt_disk.state_dict())
    assert scaler_ram.state_dict() == scaler_disk.state_dict()
    opt_disk.close()


def test_a_checkpoint_resumes_the_spilled_run_bitwise(tmp_path):
    batches = _batches(12)
    model_ram, _, _ = _run(None, batches)
    model, opt, scaler = _run(tmp_path / "a", batches[:6])
    ckpt.save(tmp_path / "ckpt", model, opt, scaler=scaler).wait()
    opt.close()
    model = _seq_model()
    opt = rp_optim.AdamW(
        model.optim_parameters(), lr=1e-2, state_dir=tmp_path / "b", state_buffer_bytes=SMALL_BUFFER
    )
    scaler = GradScaler("cpu")
    ckpt.load(tmp_path / "ckpt", model, opt, scaler=scaler, progress=False)
    _train(model, opt, scaler, batches[6:])
    _assert_bitwise(model_ram.optim_parameters(), model.optim_parameters())
    opt.close()


def test_a_failing_write_raises_on_the_main_thread_naming_the_directory(tmp_path, monkeypatch):
    model = _seq_model()
    opt = rp_optim.Adam(model.optim_parameters(), lr=1e-2, state_dir=tmp_path)
    ((x, y),) = _batches(1)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    def iteration():
        model.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda o, lbl: F.cross_entropy(o.float(), lbl)
        )
        model.step(lambda: (opt.step(), opt.zero_grad()))

    iteration()
    model.synchronize()
    monkeypatch.setattr(spill_file, "_pwrite", full)
    iteration()  # returns at once: the step runs on the optimizer thread
    with pytest.raises(SpillError, match=str(tmp_path)) as info:
        model.synchronize()
    assert info.value.errno == errno.ENOSPC
    assert "No space left" in str(info.value) and "last checkpoint" in str(info.value)
    monkeypatch.undo()
    iteration()  # usable again once the disk is
    model.synchronize()
    opt.close()


def test_a_directory_that_cannot_hold_the_file_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SpillError, match="a_file"):
        rp_optim.Adam(_params(), state_dir=blocker / "sub")


def test_parameters_the_fused_kernel_cannot_take_are_refused(tmp_path):
    with pytest.raises(ValueError, match="state_dir"):
        rp_optim.Adam(_params(), state_dir=tmp_path, foreach=True)
    with pytest.raises(ValueError, match="not contiguous"):
        rp_optim.Adam([nn.Parameter(torch.randn(4, 3).t())], state_dir=tmp_path)
    with pytest.raises(ValueError, match="state_buffer_bytes"):
        rp_optim.Adam(_params(), state_buffer_bytes=1 << 20)  # no state_dir


def test_state_too_large_for_ram_names_state_dir(monkeypatch):
    monkeypatch.setattr(placement, "host_memory_available", lambda: 1000)
    with pytest.raises(MemoryError, match="state_dir"):
        rp_optim.Adam(_params())


def test_a_killed_processs_state_directory_is_removed_by_the_next_optimizer(tmp_path):
    host = socket.gethostname()
    dead = dead_pid()
    orphan = tmp_path / f"roundpipe-adam-{host}-{dead}-abc_123"
    orphan.mkdir()
    (orphan / "adam_state.bin").write_bytes(b"\0" * (1 << 20))
    # Another host's directory (a shared filesystem) and a live process's stay.
    other_host = tmp_path / f"roundpipe-adam-{host}x-{dead}-def456"
    live = tmp_path / f"roundpipe-adam-{host}-{os.getpid()}-ghi789"
    unrelated = tmp_path / "roundpipe-adam-notes"
    for d in (other_host, live, unrelated):
        d.mkdir()
    with pytest.warns(
        UserWarning, match=r"removed 1 state directory left by killed processes"
    ) as rec:
        opt = rp_optim.Adam(_params(), lr=1e-2, state_dir=tmp_path)
    assert orphan.name in str(rec[0].message) and "1.00 MiB freed" in str(rec[0].message)
    assert rec[0].filename == __file__  # the warning points at the user's line
    assert not orphan.exists()
    assert other_host.exists() and live.exists() and unrelated.exists()
    # The optimizer's own directory names this host and process, so it is found the same way.
    (mine,) = [
        p
        for p in tmp_path.iterdir()
        if p.name.startswith(f"roundpipe-adam-{host}-{os.getpid()}-") and p != live
    ]
    opt.close()
    assert not mine.exists()
