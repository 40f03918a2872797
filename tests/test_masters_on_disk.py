"""The masters in files (``state_placement=roundpipe.MastersOnDisk(DIR)``): bitwise the in-RAM
run through training (async and sync step, fp16 GradScaler with skipped steps, with Adam's
state spilled too or in RAM, on CPU workers and the emulated accelerator), checkpoints both
ways, the bytes each step moves, the host terms, and failures named with the directory."""

import errno
import os
import socket

import pytest
import torch
from spill_common import batches as _batches
from spill_common import dead_pid
from spill_common import model as _model
from spill_common import train as _train
from torch import nn

import roundpipe
import roundpipe.checkpoint as ckpt
import roundpipe.optim as rp_optim
from roundpipe import GradScaler, MastersOnDisk, RoundPipe
from roundpipe.memory.host import host_terms
from roundpipe.optim import SpillError, master_file, spill, spill_file

# 12 KiB slots: 1024 elements of two moments and a master, so the 64x64 weight takes 4 chunks.
SMALL_BUFFER = 4 * 3 * 4096


def _run(tmp_path, batches, masters, state, is_async=True, devices="cpu", make_opt=None):
    """Train ``batches``: masters in files under ``tmp_path`` with ``masters``, Adam's state
    too with ``state``."""
    model = _model(MastersOnDisk(tmp_path / "m", SMALL_BUFFER) if masters else None, devices)
    if make_opt is not None:
        opt = make_opt(model.optim_parameters())
    elif state:
        opt = rp_optim.AdamW(
            model.optim_parameters(),
            lr=1e-2,
            state_dir=tmp_path / "s",
            state_buffer_bytes=SMALL_BUFFER,
        )
    elif masters:
        with pytest.warns(UserWarning, match="Pass state_dir=DIR to stream them") as record:
            opt = rp_optim.AdamW(model.optim_parameters(), lr=1e-2)
        assert record[0].filename == __file__  # names the user's line
    else:
        opt = rp_optim.AdamW(model.optim_parameters(), lr=1e-2)
    # 2**24 overflows fp16 gradients: the first steps are skipped while the scale backs off.
    scaler = GradScaler("cpu", init_scale=2.0**24, growth_interval=4)
    _train(model, opt, scaler, batches, is_async)
    return model, opt, scaler


def _assert_same(model_a, model_b):
    for (n, a), (_, b) in zip(model_a.optim_named_parameters(), model_b.optim_named_parameters()):
        assert torch.equal(a, b), n
    for (n, a), (_, b) in zip(model_a.module.named_parameters(), model_b.module.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("is_async", [True, False])
@pytest.mark.parametrize("state", [True, False], ids=["state_on_disk", "state_in_ram"])
def test_training_equals_the_in_ram_run_bitwise(tmp_path, is_async, state):
    batches = _batches(12)
    model_ram, opt_ram, scaler_ram = _run(tmp_path / "a", batches, False, False, is_async)
    model, opt, scaler = _run(tmp_path / "b", batches, True, state, is_async)
    steps = {float(s["step"]) for s in opt.state.values()}
    assert len(steps) == 1 and 0 < steps.pop() < 12  # some steps were skipped, most ran
    _assert_same(model_ram, model)
    assert scaler_ram.state_dict() == scaler.state_dict()
    sd_ram, sd = opt_ram.state_dict(), opt.state_dict()
    for key, s in sd_ram["state"].items():
        for name, t in s.items():
            assert torch.equal(t, sd["state"][key][name]), (key, name)


def test_a_torch_optimizer_updates_the_masters_through_the_map(tmp_path):
    batches = _batches(6)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model_ram, *_ = _run(tmp_path / "a", batches, False, False, make_opt=sgd)
    model, *_ = _run(tmp_path / "b", batches, True, False, make_opt=sgd)
    _assert_same(model_ram, model)


def test_on_the_emulated_accelerator_equals_the_cpu_run(tmp_path):
    batches = _batches(4)
    model_cpu, *_ = _run(tmp_path / "a", batches, False, True)
    model_emu, *_ = _run(tmp_path / "b", batches, True, True, devices="emu:1")
    _assert_same(model_cpu, model_emu)


def test_each_step_reads_and_writes_the_masters_once_and_the_copy_reads_them_once(
    tmp_path, monkeypatch
):
    model = _model(MastersOnDisk(tmp_path / "m", SMALL_BUFFER))
    opt = rp_optim.AdamW(
        model.optim_parameters(), lr=1e-2, state_dir=tmp_path / "s", state_buffer_bytes=SMALL_BUFFER
    )
    nbytes = sum(m.numel() * m.element_size() for m in model.optim_parameters())
    moved = {"read": 0, "write": 0}
    read, write = spill_file.SpillFile.read, spill_file.SpillFile.write

    def counting_read(self, dest, offset):
        if self.what == "the masters":
            moved["read"] += dest.numel() * dest.element_size()
        return read(self, dest, offset)

    def counting_write(self, source, offset, drop_cache=False):
        if self.what == "the masters":
            moved["write"] += source.numel() * source.element_size()
        return write(self, source, offset, drop_cache)

    monkeypatch.setattr(spill_file.SpillFile, "read", counting_read)
    monkeypatch.setattr(spill_file.SpillFile, "write", counting_write)
    scaler = GradScaler("cpu", init_scale=1.0)  # no skipped step
    _train(model, opt, scaler, _batches(3))
    # Each step reads and writes each master once; each master->model copy (one launched with
    # each async step, one by synchronize) reads it once.
    assert moved == {"read": (3 + 4) * nbytes, "write": 3 * nbytes}
    opt.close()


def test_the_masters_live_in_a_reserved_file_not_in_ram(tmp_path):
    placement = MastersOnDisk(tmp_path, SMALL_BUFFER)
    model = _model(placement)
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith("roundpipe-masters-")]
    assert str(path) == placement.path
    file = path / "masters.bin"
    # Page-aligned runs, one per master, the whole file reserved at construction.
    expected = sum(-(-m.numel() * 4 // 4096) * 4096 for m in model.optim_parameters())
    assert file.stat().st_size == expected and file.stat().st_blocks * 512 >= expected
    first = next(model.optim_parameters())
    assert isinstance(first, roundpipe.runtime.grad_access.MasterParameter)
    assert master_file.file_of_master(first) is not None
    # The masters are views of the file's map, holding the model's values.
    with open(file, "rb") as f:
        head = torch.frombuffer(bytearray(f.read(first.numel() * 4)), dtype=torch.float32)
    assert torch.equal(head.view(first.shape), first.detach())
    assert torch.equal(first.detach(), model.module[0].weight.float())
    del model, first
    placement.close()
    assert not path.exists()


def test_the_host_terms_count_the_copy_buffer_for_the_masters(tmp_path):
    seq = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).half()
    ram = host_terms(seq, None, None)
    disk = host_terms(seq, None, None, masters_dir=str(tmp_path))
    assert ram.masters == 2 * (64 * 64 + 64) * 4
    assert disk.masters == ram.masters  # a buffer larger than the masters takes their bytes
    small = host_terms(seq, None, None, masters_dir=str(tmp_path), masters_buffer=4096)
    assert small.masters == 4096
    assert disk.grads == ram.grads
    # Such masters call for Adam's state in files too (an Adam in RAM warns): its buffer counts.
    assert disk.optimizer == min(ram.optimizer, spill.DEFAULT_BUFFER_BYTES)
    assert disk.optimizer_dir == str(tmp_path)
    assert sum(str(tmp_path) in label for label, _ in disk.rows()) == 2
    # Sharded too: a rank's share of the masters is in its file, only the buffer in RAM.
    sharded = host_terms(seq, None, None, ranks=2, masters_dir=str(tmp_path), masters_buffer=4096)
    assert sharded.masters == 4096 and sharded.optimizer < ram.optimizer


def test_a_wrap_refused_in_ram_names_masters_on_disk_and_fits_with_it(tmp_path, monkeypatch):
    seq = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).half()
    terms = host_terms(seq, None, None)
    available = terms.new_bytes - terms.masters + 4096 + 64
    monkeypatch.setattr(roundpipe.runtime.model, "host_memory_available", lambda: available)
    with pytest.raises(roundpipe.HostMemoryError) as info:
        RoundPipe(seq, devices="emu")
    message = str(info.value)
    assert "state_placement=roundpipe.MastersOnDisk(DIR)" in message, message
    assert "AdamW(..., state_dir=DIR)" in message
    RoundPipe(seq, devices="emu", state_placement=MastersOnDisk(tmp_path, 4096))


@pytest.mark.parametrize("target", ["masters", "ram"])
def test_a_checkpoint_moves_between_masters_in_files_and_in_ram(tmp_path, target):
    batches = _batches(10)
    model_ram, *_ = _run(tmp_path / "ref", batches, False, False)
    model, opt, scaler = _run(tmp_path / "a", batches[:5], True, True)
    ckpt.save(tmp_path / "ckpt", model, opt, scaler=scaler).wait()
    opt.close()
    spilled = target == "masters"
    resumed = _model(MastersOnDisk(tmp_path / "b", SMALL_BUFFER) if spilled else None)
    spill = {"state_dir": tmp_path / "b", "state_buffer_bytes": SMALL_BUFFER} if spilled else {}
    opt = rp_optim.AdamW(resumed.optim_parameters(), lr=1e-2, **spill)
    scaler = GradScaler("cpu")
    ckpt.load(tmp_path / "ckpt", resumed, opt, scaler=scaler, progress=False)
    _train(resumed, opt, scaler, batches[5:])
    _assert_same(model_ram, resumed)


def test_loading_masters_leaves_none_of_them_mapped(tmp_path, monkeypatch):
    released = []
    release = MastersOnDisk.release
    monkeypatch.setattr(MastersOnDisk, "release", lambda self: released.append(1) or release(self))
    model = _model(MastersOnDisk(tmp_path / "m", SMALL_BUFFER))
    values = {n: m.detach() + 1 for n, m in model.optim_named_parameters()}
    model.load_state_dict({n: v.half() for n, v in values.items()}, strict=True)
    assert released  # the copy into the masters gave the map's pages back
    for n, m in model.optim_named_parameters():
        assert torch.equal(m.detach(), values[n].half().float()), n


def test_a_failing_master_write_raises_on_the_main_thread_naming_the_directory(
    tmp_path, monkeypatch
):
    model = _model(MastersOnDisk(tmp_path / "m", SMALL_BUFFER))
    opt = rp_optim.AdamW(model.optim_parameters(), lr=1e-2, state_dir=tmp_path / "s")
    scaler = GradScaler("cpu", init_scale=1.0)
    _train(model, opt, scaler, _batches(1))
    write = spill_file.SpillFile.write

    def full(self, source, offset, drop_cache=False):
        if self.what == "the masters":
            raise self.error("writing", OSError(errno.ENOSPC, "No space left on device"))
        return write(self, source, offset, drop_cache)

    monkeypatch.setattr(spill_file.SpillFile, "write", full)
    with pytest.raises(SpillError, match="MastersOnDisk") as info:
        _train(model, opt, scaler, _batches(1))
    assert info.value.errno == errno.ENOSPC and str(tmp_path / "m") in str(info.value)
    opt.close()


def test_a_disk_too_small_fails_at_construction(tmp_path, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    placement = MastersOnDisk(tmp_path)
    with pytest.raises(SpillError, match="cannot reserve .* for the masters"):
        _model(placement)
    monkeypatch.undo()
    _model(placement)  # the refused wrap left the placement unused: room now, it serves


def test_a_placement_serves_one_model(tmp_path):
    placement = MastersOnDisk(tmp_path)
    _model(placement)
    with pytest.raises(ValueError, match="new MastersOnDisk to each RoundPipe"):
        _model(placement)


def test_a_killed_processs_masters_directory_is_removed(tmp_path):
    orphan = tmp_path / f"roundpipe-masters-{socket.gethostname()}-{dead_pid()}-abc_123"
    orphan.mkdir()
    (orphan / "masters.bin").write_bytes(b"\0" * 4096)
    with pytest.warns(UserWarning, match="removed 1 state directory"):
        _model(MastersOnDisk(tmp_path))
    assert not orphan.exists()
