"""roundpipe.checkpoint in one process: the files (standard safetensors, a manifest with sizes
and checksums, a directory that has its name only when complete, keep-last-N), what a save
takes and when (the next step waits for the write, the next forward_backward does not), what
it refuses, how a failed write is reported, extra's types, and the HuggingFace directory."""

from __future__ import annotations

import json
import threading

import ckpt_worker
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
import roundpipe.checkpoint as ckpt
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, optim_thread
from roundpipe.checkpoint import files as ckpt_files


def build(width=16, seed=0, devices="cpu", dtype=torch.float16):
    torch.manual_seed(seed)
    seq = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4)).to(dtype)
    model = RoundPipe(
        seq,
        optim_dtype=torch.float32,
        devices=devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    return model, opt, scaler


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def iteration(model, opt, scaler, i, step_fn=None):
    x, y = batch(i)
    model.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=lambda out, lbl: scaler.scale(F.cross_entropy(out.float(), lbl)) / 2,
    )
    model.step(step_fn or (lambda: (scaler.step(opt), opt.zero_grad())))
    scaler.update()


def snapshot(model, opt):
    optim_thread.wait_all()
    return (
        {k: v.clone() for k, v in model.state_access().module.state_dict().items()},
        model.master_state_dict(),
        {
            k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
            for k, s in opt.state_dict()["state"].items()
        },
    )


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], dict):
                for n in x[k]:
                    assert torch.equal(torch.as_tensor(x[k][n]), torch.as_tensor(y[k][n])), (k, n)
            else:
                assert torch.equal(x[k], y[k]), k


def test_a_checkpoint_is_standard_safetensors_with_a_manifest_of_sizes_and_checksums(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model, opt, scaler = build()
    for i in range(3):
        iteration(model, opt, scaler, i)
    path = ckpt.save(tmp_path, model, opt, scaler=scaler, extra={"iteration": 3}).wait()
    assert path == tmp_path / "ckpt-000001" and ckpt.latest(tmp_path) == path
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["roundpipe_version"] == roundpipe.__version__
    assert manifest["format_version"] == 1
    listed = set(manifest["files"])
    assert listed == {p.name for p in path.iterdir()} - {"manifest.json"}
    masters = model.master_state_dict()
    for name, info in manifest["files"].items():
        assert (path / name).stat().st_size == info["bytes"]
        assert ckpt_files.file_crc32(path / name) == info["crc32"]
    loaded = safetensors.load_file(str(path / "masters-00001-of-00001.safetensors"))
    assert loaded.keys() == {f"masters/{n}" for n in masters}
    for n, v in masters.items():
        assert torch.equal(loaded[f"masters/{n}"], v)
    model_file = safetensors.load_file(str(path / "model-00001-of-00001.safetensors"))
    assert model_file["model/0.weight"].dtype == torch.float16
    assert [t[0] for t in manifest["model"]["tensors"]] == list(model.state_dict())


def test_shards_are_closed_at_max_shard_bytes_and_load_reads_across_them(tmp_path):
    model, opt, scaler = build(width=64)
    iteration(model, opt, scaler, 0)
    expected = snapshot(model, opt)
    path = ckpt.save(tmp_path, model, opt, scaler=scaler, max_shard_bytes=1024).wait()
    shards = sorted(p.name for p in path.glob("masters-*"))
    assert len(shards) == 4 and shards[0] == "masters-00001-of-00004.safetensors"
    other, opt2, scaler2 = build(width=64, seed=5)
    ckpt.load(path, other, opt2, scaler=scaler2, progress=False)
    assert_same(expected, snapshot(other, opt2))


def test_keep_last_removes_the_oldest_and_load_takes_the_newest(tmp_path):
    model, opt, scaler = build()
    paths = []
    for i in range(4):
        iteration(model, opt, scaler, i)
        paths.append(ckpt.save(tmp_path, model, opt, scaler=scaler, extra={"i": i}, keep_last=2))
    ckpt.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003", "ckpt-000004"]
    other, opt2, scaler2 = build(seed=3)
    assert ckpt.load(tmp_path, other, opt2, scaler=scaler2, progress=False) == {"i": 3}
    assert paths[-1].path == ckpt.latest(tmp_path)


def test_a_name_is_never_reused_and_the_temporary_directory_is_not_a_checkpoint(tmp_path):
    model, opt, scaler = build()
    ckpt.save(tmp_path, model, opt, scaler=scaler, name="best").wait()
    with pytest.raises(FileExistsError, match="best"):
        ckpt.save(tmp_path, model, opt, scaler=scaler, name="best")
    (tmp_path / ".later.tmp-1").mkdir()  # what a killed write leaves
    (tmp_path / "half").mkdir()  # shards without a manifest: not complete
    (tmp_path / "half" / "model-00001-of-00001.safetensors").write_bytes(b"")
    assert ckpt.latest(tmp_path) == tmp_path / "best"
    with pytest.raises(ckpt.CheckpointFormatError, match="no manifest.json"):
        ckpt.load(tmp_path / "half", model, opt, scaler=scaler)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete roundpipe checkpoint"):
        ckpt.load(tmp_path / "empty", model)


def test_the_next_step_waits_for_the_write_and_the_next_forward_backward_does_not(
    tmp_path, monkeypatch
):
    # The writer is held inside its last group (the optimizer state): the next
    # forward_backward's gradient moves pass the hold (else this test would hang), the next
    # step waits for it, so the checkpoint holds the masters of before that step.
    model, opt, scaler = build()
    for i in range(2):
        iteration(model, opt, scaler, i)
    expected = snapshot(model, opt)
    entered, release = threading.Event(), threading.Event()
    write = ckpt_files.ShardWriter.write

    def held_write(self, on_bytes=None):
        if self.path.name.startswith("optimizer"):
            entered.set()
            release.wait()
        write(self, on_bytes)

    monkeypatch.setattr(ckpt_files.ShardWriter, "write", held_write)
    handle = ckpt.save(tmp_path, model, opt, scaler=scaler)
    entered.wait()
    ran = []
    iteration(model, opt, scaler, 2, lambda: (ran.append(1), scaler.step(opt), opt.zero_grad()))
    assert not handle.done()
    release.set()
    handle.wait()
    optim_thread.wait_all()
    assert ran == [1]  # the step ran, after the write
    other, opt2, scaler2 = build(seed=9)
    ckpt.load(handle.path, other, opt2, scaler=scaler2, progress=False)
    assert_same(expected, snapshot(other, opt2))


def test_a_save_is_refused_between_the_step_and_the_scaler_update():
    model, opt, scaler = build()
    x, y = batch(0)
    model.forward_backward(
        input_args=(x,), label=y, loss_fn=lambda o, l: scaler.scale(F.cross_entropy(o.float(), l))
    )
    model.step(lambda: (scaler.step(opt), opt.zero_grad()))
    with pytest.raises(RuntimeError, match="between model.step"):
        ckpt.save("unused", model, opt, scaler=scaler)
    scaler.update()


def test_extra_round_trips_its_types_and_names_what_it_cannot_hold(tmp_path):
    model, opt, scaler = build()
    extra = {
        "iteration": 7,
        "lr": 3e-4,
        "inf": float("inf"),
        "order": torch.randperm(10),
        "pair": (1, "a"),
        "by_epoch": {0: [1.5, None], 1: {"nested": True}},
        "__tensor__": "a key that looks like a tag",
    }
    ckpt.save(tmp_path, model, opt, scaler=scaler, extra=extra).wait()
    back = ckpt.load(tmp_path, model, opt, scaler=scaler, progress=False)
    assert back.keys() == extra.keys()
    assert torch.equal(back.pop("order"), extra["order"])
    assert back == {k: v for k, v in extra.items() if k != "order"}
    with pytest.raises(TypeError, match=r"extra\['gen'\].*get_state"):
        ckpt.save(tmp_path, model, opt, scaler=scaler, extra={"gen": torch.Generator()})
    with pytest.raises(TypeError, match=r"extra\['opt'\].*state_dict\(\)"):
        ckpt.save(tmp_path, model, opt, scaler=scaler, extra={"opt": opt})


def test_a_failed_write_is_raised_by_wait_once_and_leaves_earlier_checkpoints(
    tmp_path, monkeypatch
):
    model, opt, scaler = build()
    iteration(model, opt, scaler, 0)
    first = ckpt.save(tmp_path, model, opt, scaler=scaler).wait()

    write = ckpt_files.ShardWriter.write

    def full_disk(self, on_bytes=None):
        if ".after." in self.path.parent.name:
            return write(self, on_bytes)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_files.ShardWriter, "write", full_disk)
    iteration(model, opt, scaler, 1)
    with pytest.raises(OSError, match="No space left") as info:
        ckpt.save(tmp_path, model, opt, scaler=scaler).wait()
    assert any("checkpoint writer" in n for n in info.value.__notes__)
    iteration(model, opt, scaler, 2)  # reported once: the model's next call does not raise it
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # nothing half written
    # Nobody waits: the model's next call reports it (the write was the model's state).
    ckpt.save(tmp_path, model, opt, scaler=scaler)
    # One writer, in order: once this one is written, the one before has failed.
    ckpt.save(tmp_path, model, opt, scaler=scaler, name="after").wait()
    with pytest.raises(OSError, match="No space left"):
        iteration(model, opt, scaler, 3)
    monkeypatch.undo()
    iteration(model, opt, scaler, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after", first.name]
    ckpt.load(first, build(seed=4)[0], progress=False, strict=False)


def test_a_checkpoint_of_an_untrained_model_and_of_a_model_after_synchronize_resume(tmp_path):
    # "Any point of the loop": before the first step, and after model.synchronize() (which
    # puts the newest masters into the model: the checkpoint then holds those).
    for when in ("untrained", "synchronized"):
        model, opt, scaler = build()
        if when == "synchronized":
            for i in range(2):
                iteration(model, opt, scaler, i)
            model.synchronize()
        path = ckpt.save(tmp_path / when, model, opt, scaler=scaler).wait()
        other, opt2, scaler2 = build(seed=7)
        ckpt.load(path, other, opt2, scaler=scaler2, progress=False)
        for i in range(2, 4):
            iteration(model, opt, scaler, i)
            iteration(other, opt2, scaler2, i)
        assert_same(snapshot(model, opt), snapshot(other, opt2))


def test_the_hf_directory_of_a_full_model_loads_in_transformers_with_the_masters(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = ckpt_worker.tiny_llama_config(tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model = roundpipe.hf.wrap(hf, optim_dtype=torch.float32, check=False, devices="cpu")
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model.forward_backward(
            input_kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda loss, _: loss
        )
        model.step(lambda: (opt.step(), opt.zero_grad()))
    for dtype in (torch.float32, torch.float16):
        path = ckpt.save(tmp_path / str(dtype), model, opt, hf=True, hf_dtype=dtype).wait()
        optim_thread.wait_all()
        masters = dict(model.optim_named_parameters())
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path / "hf"))
        assert loaded.dtype == dtype
        state = loaded.state_dict()
        for name, master in masters.items():
            # The masters of the checkpoint (the model itself is one step older).
            assert torch.equal(state[name], master.to(dtype)), name
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    with pytest.raises(TypeError, match="roundpipe.hf.wrap"):
        ckpt.save(tmp_path / "plain", build()[0], hf=True)


def test_a_save_between_forward_backward_and_step_is_refused_over_several_ranks(
    tmp_path, monkeypatch
):
    # Each rank's accumulated gradients are its own until the step averages them: rank 0's copy
    # restored on every rank would be wrong, so the save is refused before anything is launched.
    from roundpipe.distributed import group

    model, opt, scaler = build()
    x, y = batch(0)
    model.forward_backward(
        input_args=(x,), label=y, loss_fn=lambda out, lbl: F.cross_entropy(out.float(), lbl)
    )
    monkeypatch.setattr(group, "data_parallel_rank", lambda: (0, 2))
    with pytest.raises(RuntimeError, match=r"over 2 ranks.*between forward_backward and step"):
        ckpt.save(tmp_path, model, opt, scaler=scaler)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    # In one process the same save is allowed: the gradients are the whole batch's.
    ckpt.save(tmp_path, model, opt, scaler=scaler).wait()
    model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
