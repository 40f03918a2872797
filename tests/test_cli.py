"""`python -m roundpipe`: versions, device pool and the self-check, run as a user runs it (a new
interpreter); `python -m roundpipe plan`, the memory plan of a transformers config, through the
same entry point in this process."""

import gc
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import roundpipe
from roundpipe.memory.host import format_bytes


def run_cli(*args, env_extra=None, timeout=100):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ROUNDPIPE_DEVICES", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "roundpipe", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def plan_cli(capsys, *args):
    """`python -m roundpipe plan ARGS` in this process (the plan it prints is the point; the
    tests of the self-check and of --help start the interpreter as a user does): the exit code,
    stdout and stderr."""
    import roundpipe.__main__ as cli

    try:
        code = cli.main(["plan", *map(str, args)])
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_quick_self_check_passes_and_reports_the_environment():
    proc = run_cli("--quick")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"roundpipe {roundpipe.__version__}" in out
    assert f"torch {torch.__version__}" in out
    assert "device pool (default): " in out
    assert out.rstrip().splitlines()[-1].startswith("PASSED")
    assert "[FAIL]" not in out
    for what in (
        "the loss went down",
        "ran on the optimizer thread",
        "hold the newest masters",
        "re-raised on the main thread",
        "usable after that error",
    ):
        assert what in out


@pytest.mark.slow
def test_quick_self_check_on_two_workers_in_bf16_from_the_environment():
    proc = run_cli("--quick", "--dtype", "bf16", env_extra={"ROUNDPIPE_DEVICES": "cpu:2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "device pool ($ROUNDPIPE_DEVICES): cpu#0, cpu#1" in proc.stdout
    assert "bf16 shards" in proc.stdout and "PASSED" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("spec,pool", [("emu", "emu:0"), ("emu:2", "emu:0, emu:1")])
def test_quick_self_check_on_the_emulated_accelerator(spec, pool):
    proc = run_cli("--quick", env_extra={"ROUNDPIPE_DEVICES": spec})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"device pool ($ROUNDPIPE_DEVICES): {pool}" in proc.stdout
    assert "PASSED" in proc.stdout and "[FAIL]" not in proc.stdout


@pytest.mark.slow
def test_a_bad_device_pool_fails_with_the_reason():
    proc = run_cli("--quick", env_extra={"ROUNDPIPE_DEVICES": "gpu9"})
    assert proc.returncode == 1
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith("FAILED") and "gpu9" in last and "cpu:N" in last


def test_self_check_fails_when_the_optimizer_does_nothing(monkeypatch, capsys):
    import roundpipe.__main__ as cli

    class IdleAdam(roundpipe.optim.Adam):
        def step(self, closure=None):
            return None

    monkeypatch.setattr(roundpipe.optim, "Adam", IdleAdam)
    assert cli.main(["--quick"]) == 1
    out = capsys.readouterr().out
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("FAILED") and "the loss went down" in last and "changed 0/6" in last
    assert "PASSED" not in out


@pytest.mark.slow
def test_help_is_plain_text():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "``" not in proc.stdout  # reST markup of the module docstring showed through before
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    assert "self-check training loop" in text and "PASSED (exit code 0)" in text


@pytest.mark.parametrize("lora", [0, 4])
def test_plan_of_a_transformers_config_reports_host_and_device(tmp_path, capsys, lora):
    pytest.importorskip("transformers")
    if lora:
        pytest.importorskip("peft")
    config = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = plan_cli(capsys, path, "--seq-len", 128, "--lora", lora, "--devices", "emu")
    assert code == 0, out + err
    assert "Host RAM" in out and "Device emu:0: peak" in out and "Largest term" in out
    # The host terms count all six layers (the plan is of the whole model, on the meta device).
    layer = 4 * 64 * 64 // 2 + 2 * 64 * 16 * 2 + 3 * 64 * 128 + 2 * 64  # q,o + k,v + mlp + norms
    total = 2 * 512 * 64 + 64 + 6 * layer
    # LoRA: A (4 x in) and B (out x 4) on q, o (64 -> 64) and k, v (64 -> 32) of six layers.
    trained = 6 * (2 * (4 * 64 + 64 * 4) + 2 * (4 * 64 + 32 * 4)) if lora else total
    assert f"({trained / 1e3:.2f}K trainable params" in out, out


def _tiny_config(tmp_path):
    config = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_a_plan_process_that_does_not_quantize_never_imports_bitsandbytes(tmp_path):
    # peft imports bitsandbytes wherever it is installed: 2 s of an 8B length search's 20 s.
    # A bitsandbytes of the test's own, first on the path, says whether anything imported it,
    # whether or not the real one is installed.
    pytest.importorskip("peft")
    fake = tmp_path / "site" / "bitsandbytes"
    fake.mkdir(parents=True)
    marker = tmp_path / "imported"
    (fake / "__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
    )
    args = ["plan", _tiny_config(tmp_path), "--seq-len", "64", "--lora", "4", "--devices", "emu"]
    env = {k: v for k, v in os.environ.items() if k != "ROUNDPIPE_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "roundpipe", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Host RAM" in proc.stdout
    assert not marker.exists()
    # The same package is imported where peft is asked for it outright.
    subprocess.run([sys.executable, "-c", "import bitsandbytes"], env=env, check=True, timeout=60)
    assert marker.exists()


def test_the_plan_command_keeps_bitsandbytes_where_it_may_quantize(capsys):
    from roundpipe.hf.memory_cli import quantizes

    assert not quantizes(["cfg.json", "--seq-len", "64", "--lora", "4"])
    assert quantizes(["cfg.json", "--seq-len", "64", "--lora", "4", "--quantize", "nf4"])
    assert quantizes(["cfg.json", "--seq-len", "64", "--lora", "4", "--quant=fp4"])  # argparse's
    assert quantizes(["cfg.json", "--seq-len", "sixty-four"])  # main() reports the error
    assert quantizes(["--help"])  # main() prints the help, once
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    "text, expected",
    [("24GiB", 24 << 30), ("24GB", 24 * 10**9), ("512 MiB", 512 << 20), ("1e9", 10**9)],
)
def test_sizes_are_read_as_people_write_them(text, expected):
    from roundpipe.hf.memory_cli import parse_size

    assert parse_size(text) == expected


def test_a_size_without_a_known_unit_is_refused_with_examples():
    from roundpipe.hf.memory_cli import parse_size

    with pytest.raises(ValueError, match="24GiB"):
        parse_size("24 gigs")


def test_a_plan_from_a_config_counts_the_weights_against_the_host(tmp_path):
    pytest.importorskip("transformers")
    from roundpipe.hf.memory_cli import plan_config

    path = _tiny_config(tmp_path)
    plan = plan_config(str(path), seq_len=32, devices="emu", host_memory=10**9)
    host = plan.host
    assert not host.weights_allocated and host.available == 10**9
    assert host.new_bytes == host.total  # nothing of it exists yet
    assert "model weights and buffers (to allocate)" in str(plan)
    # The weights alone push it over: a host that holds everything but them does not fit.
    squeezed = plan_config(
        str(path), seq_len=32, devices="emu", host_memory=host.total - host.weights // 2
    )
    assert not squeezed.fits


def test_a_plan_from_a_config_counts_a_tied_embeddings_gradients_as_the_runtime_holds_them(
    tmp_path,
):
    # A tied embedding is in the first and the last stage: on an accelerator each stage's
    # gradients are downloaded into a pinned pool of their own, so its gradient is held twice
    # until the second is added. The plan from the config counts what wrapping the same model
    # with real weights and training it takes from the pinned pools (the emulated device
    # counts them exactly).
    transformers = pytest.importorskip("transformers")
    from roundpipe.hf.memory_cli import plan_config
    from roundpipe.testing import emu

    path = _tiny_config(tmp_path)
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "tie_word_embeddings": True}))
    planned = plan_config(str(path), seq_len=32, devices="emu", host_memory=10**12).host
    embedding = 512 * 64 * 4
    assert planned.grads >= planned.masters + embedding

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(str(path))
    ).to(torch.bfloat16)
    model = roundpipe.hf.wrap(hf, devices="emu")
    with roundpipe.OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.optim_parameters(), lr=1e-3)
    gc.collect()  # pinned pools earlier tests left to the collector: freed now, not mid-run
    before = emu.pinned_memory_stats(reset_peak=True).allocated_bytes  # the model's weights
    ids = torch.randint(0, 512, (1, 32))
    for _ in range(2):
        model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    measured = emu.pinned_memory_stats().peak_allocated_bytes - before
    # The gradients and the next weights the one-pass async step writes (pinned like the
    # model's weights). Within the downloads' 4-byte inf/NaN flags (not planned) and the pool's
    # block rounding, which depends on what blocks earlier tests left cached: far below the
    # embedding's gradient (131,072 bytes), which the plan counted once before.
    expected = planned.grads + planned.next_weights
    assert abs(measured - expected) <= 1024, (measured, planned.grads, planned.next_weights)


def test_a_plan_for_a_named_gpu_uses_its_memory_and_reserve(tmp_path):
    pytest.importorskip("transformers")
    from roundpipe.devices.accelerator import cublas_workspace_bytes, device_reserve
    from roundpipe.hf.memory_cli import CUDA_CONTEXT, GPUS, plan_config

    total, major = GPUS["rtx4090"]
    plan = plan_config(
        str(_tiny_config(tmp_path)),
        seq_len=32,
        devices="emu",
        device_memory=total,
        compute_capability=major,
    )
    (dev,) = plan.devices
    assert dev.available == total - CUDA_CONTEXT
    assert (dev.reserve, dev.reserve_note) == device_reserve(dev.peak, cublas_workspace_bytes(8))
    assert dev.fits and plan.fits


def test_the_plan_command_says_what_to_change_when_it_does_not_fit(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = _tiny_config(tmp_path)
    code, out, err = plan_cli(
        capsys, path, "--seq-len", 32, "--devices", "emu",
        "--device-memory", "520MiB", "--host-memory", "1MiB",
    )  # fmt: skip
    assert code == 1, out + err
    for expected in (
        "DOES NOT FIT. What would make it fit:",
        "host RAM:",
        "--lora 16: saves about",
        "device GPU of 520.0 MiB:",
        "short at the peak, during the ",
    ):
        assert expected in out, (expected, out)
    code, out, err = plan_cli(capsys, path, "--seq-len", 32, "--gpu", "rtx4090", "--devices", "emu")
    assert code == 0, out + err
    assert "of 23.49 GiB free" in out or "GiB free" in out
    code, _, err = plan_cli(capsys, path, "--seq-len", 32, "--device-memory", "24 gigs")
    assert code == 2 and "24GiB" in err


def _big_config(tmp_path):
    """A model whose Adam state (728 MB) and masters (364 MB) outgrow the spill buffers; two
    layers, so a plan traces little."""
    config = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
    }
    path = tmp_path / "big.json"
    path.write_text(json.dumps(config))
    return str(path)


def _hints(path, **kwargs):
    from roundpipe.hf.memory_cli import ConfigPlanner, what_to_change

    planner = ConfigPlanner(path, devices="emu", host_memory=1 << 20, **kwargs)
    return what_to_change(planner, planner.plans(32))


def test_a_plan_with_a_spill_dir_counts_only_the_streaming_buffer(tmp_path, capsys):
    pytest.importorskip("transformers")
    from roundpipe.hf.memory_cli import main, plan_config
    from roundpipe.optim.spill import DEFAULT_BUFFER_BYTES

    path = str(_tiny_config(tmp_path))
    plain = plan_config(path, seq_len=32, devices="emu", host_memory=10**12)
    spilled = plan_config(
        path, seq_len=32, devices="emu", host_memory=10**12, spill_dir=str(tmp_path)
    )
    assert plain.host.optimizer == 2 * plain.host.masters
    assert spilled.host.optimizer == DEFAULT_BUFFER_BYTES
    assert spilled.host.total == plain.host.total - plain.host.optimizer + DEFAULT_BUFFER_BYTES
    assert f"optimizer state: in files under {tmp_path}" in str(spilled)
    # A host short of RAM is told about --spill-dir and what it saves, unless it is spilled
    # already (or the state is smaller than the buffer it would stream through).
    big = _big_config(tmp_path)
    hints = _hints(big)
    state = plan_config(big, seq_len=32, devices="emu").host.optimizer
    saves = format_bytes(state - DEFAULT_BUFFER_BYTES)
    assert any(f"--spill-dir DIR: saves {saves};" in line for line in hints), hints
    assert not any("--spill-dir" in line for line in _hints(big, spill_dir="/x"))
    assert not any("--spill-dir DIR:" in line for line in _hints(path))
    assert main([path, "--seq-len", "32", "--devices", "emu", "--spill-dir", str(tmp_path)]) == 0
    assert "streaming buffer" in capsys.readouterr().out


def test_a_plan_with_lean_optimizer_states_counts_their_bytes(tmp_path, capsys):
    pytest.importorskip("transformers")
    from roundpipe.hf.memory_cli import main, plan_config

    path = str(_tiny_config(tmp_path))
    plans = {
        kind: plan_config(path, seq_len=32, devices="emu", host_memory=10**12, optim_states=kind)
        for kind in ("exact", "bf16", "8bit")
    }
    exact, bf16, eight = (plans[k].host for k in ("exact", "bf16", "8bit"))
    assert exact.optimizer == 2 * exact.masters  # fp32 moments
    assert bf16.optimizer == exact.optimizer // 2  # every parameter in bf16
    # 8-bit: 1 byte per moment plus an fp32 absmax per 256 elements; under 4096 elements exact
    assert exact.optimizer // 4 < eight.optimizer < bf16.optimizer
    for kind, host in (("exact", exact), ("bf16", bf16), ("8bit", eight)):
        assert host.total == exact.total - exact.optimizer + host.optimizer
        assert host.optim_states == kind
    assert "8-bit moments" in str(plans["8bit"]) and "bf16 moments" in str(plans["bf16"])
    hints = _hints(_big_config(tmp_path))
    assert any("--optim-states 8bit: saves" in line for line in hints), hints
    assert main([path, "--seq-len", "32", "--devices", "emu", "--optim-states", "8bit"]) == 0
    assert "8-bit moments" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([path, "--seq-len", "32", "--optim-states", "bf16", "--spill-dir", str(tmp_path)])
    assert "give one of them" in capsys.readouterr().err


def test_a_plan_with_spilled_masters_counts_only_the_two_buffers(tmp_path, capsys):
    pytest.importorskip("transformers")
    from roundpipe.hf.memory_cli import main, plan_config
    from roundpipe.optim.master_file import DEFAULT_COPY_BUFFER_BYTES

    path = str(_tiny_config(tmp_path))
    state = plan_config(path, seq_len=32, devices="emu", host_memory=10**12, spill_dir="/x")
    both = plan_config(
        path, seq_len=32, devices="emu", host_memory=10**12, spill_dir="/x", spill_masters=True
    )
    assert both.host.masters == DEFAULT_COPY_BUFFER_BYTES
    assert both.host.total == state.host.total - state.host.masters + DEFAULT_COPY_BUFFER_BYTES
    assert "master copies" in str(both) and "in files under /x (copy buffer)" in str(both)
    # Short of RAM with the state spilled, the plan names the masters next; spilled, not.
    big = _big_config(tmp_path)
    assert any("--spill-masters: saves" in line for line in _hints(big, spill_dir="/x"))
    hints = _hints(big, spill_dir="/x", spill_masters=True)
    assert not any("--spill-masters" in line for line in hints)
    with pytest.raises(SystemExit):
        main([path, "--seq-len", "32", "--devices", "emu", "--spill-masters"])
    assert "--spill-masters keeps the masters in files under --spill-dir" in capsys.readouterr().err


def test_the_longest_sequence_is_the_edge_of_the_plan(tmp_path):
    """ConfigPlanner.longest_seq_len (the plan command's --max-seq-len): the plan at the
    answer fits and one step more does not; found by bisection over plans, not runs."""
    pytest.importorskip("transformers")
    from roundpipe.hf.memory_cli import ConfigPlanner

    planner = ConfigPlanner(
        str(_tiny_config(tmp_path)), devices="emu", device_memory=700 << 20, host_memory=1 << 40
    )
    longest = planner.longest_seq_len(32768, step=128)
    assert 0 < longest < 32768 and longest % 128 == 0
    assert planner.plan(longest).fits and not planner.plan(longest + 128).fits
    # Nor with the stage inputs offloaded or kept: the automatic choice is the best one.
    assert not any(p.fits for p in planner.plans(longest + 128).by_offload.values())


def test_identical_decoder_layers_are_traced_once(tmp_path, monkeypatch):
    """A plan of the whole model (built on the meta device) traces the embedding, one decoder
    layer and the head, and gives every decoder layer that layer's bytes."""
    pytest.importorskip("transformers")
    from roundpipe.hf.memory_cli import ConfigPlanner
    from roundpipe.memory import trace

    traced = []
    real = trace._trace_one
    monkeypatch.setattr(
        trace, "_trace_one", lambda stage, *a: traced.append(stage.index) or real(stage, *a)
    )
    plan = ConfigPlanner(str(_tiny_config(tmp_path)), devices="emu").plan(32)
    assert traced == [0, 1, 5]  # embedding, the first of 4 decoder layers, head
    rows = plan.stages[1:5]
    assert len({(r.input, r.forward, r.backward) for r in rows}) == 1


def test_the_plan_command_finds_the_longest_sequence(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = _tiny_config(tmp_path)
    code, out, err = plan_cli(
        capsys, path, "--max-seq-len", 32768, "--seq-step", 128, "--devices", "emu",
        "--device-memory", "700MiB", "--host-memory", "1TiB",
    )  # fmt: skip
    assert code == 0, out + err
    assert "Longest sequence that fits: " in out and "Bound at " in out


def test_a_plan_of_a_synchronous_step_has_no_second_copies(tmp_path, capsys):
    # The asynchronous step's next weights and the next call's gradients (a second set of
    # each, see [Note: the next call's gradients]) are planned unless --sync-step says
    # model.step(fn, is_async=False).
    pytest.importorskip("transformers")
    path = _tiny_config(tmp_path)
    args = [path, "--seq-len", 64, "--devices", "emu"]
    code, out, err = plan_cli(capsys, *args)
    assert code == 0, out + err
    assert "next weights" in out and "gradients of the next call" in out
    code, sync, err = plan_cli(capsys, *args, "--sync-step")
    assert code == 0, sync + err
    assert "next weights" not in sync and "gradients of the next call" not in sync

    def total(text):
        return re.search(r"^  total +([0-9.]+ [KMG]?i?B)", text, re.M).group(1)

    assert total(sync) != total(out)


needs_grad_dtype = pytest.mark.skipif(
    not hasattr(torch.empty(0), "grad_dtype"), reason="torch without Tensor.grad_dtype"
)


@needs_grad_dtype
def test_a_plan_with_bf16_gradients_counts_half_their_bytes(tmp_path, capsys):
    # --grad-dtype bf16 plans AdamW(grad_dtype=torch.bfloat16) with RoundPipeRunConfig(
    # device_grad_dtype=torch.bfloat16): the masters hold the device's bf16 sums as they were
    # downloaded, both sets of them with the asynchronous step.
    pytest.importorskip("transformers")
    path = _tiny_config(tmp_path)
    args = [path, "--seq-len", 32, "--devices", "emu", "--host-memory", "1TiB"]

    def rows(*extra):
        code, out, err = plan_cli(capsys, *args, *extra)
        assert code == 0, out + err
        found = re.findall(r"^  (gradients of [^\n]*?) {2,}([0-9.]+ [KMG]?i?B)$", out, re.M)
        return dict(found)

    fp32, bf16 = rows(), rows("--grad-dtype", "bf16")
    # the rows name the dtype where it is not the masters'
    named = "gradients of the masters (in bfloat16)"
    assert named in bf16 and "gradients of the masters" in fp32
    bf16["gradients of the masters"] = bf16.pop(named)
    assert len(fp32) == 2 and fp32.keys() == bf16.keys()
    from roundpipe.hf.memory_cli import plan_config

    plain = plan_config(str(path), seq_len=32, devices="emu", host_memory=10**12).host
    low = plan_config(
        str(path), seq_len=32, devices="emu", host_memory=10**12, grad_dtype=torch.bfloat16
    ).host
    # 213,568 trainable params: 4 bytes each, then 2, to the byte (each stage's pinned pool
    # rounds alike here)
    assert plain.grads == plain.next_grads == 213_568 * 4
    assert low.grads == low.next_grads == 213_568 * 2
    assert low.total == plain.total - plain.grads
    assert plain.grads_dtype is None and low.grads_dtype == torch.bfloat16
    for label, size in fp32.items():
        assert size == format_bytes(213_568 * 4) and bf16[label] == format_bytes(213_568 * 2)
    # The masters' dtype itself plans as without the option.
    assert rows("--grad-dtype", "fp32") == fp32


@needs_grad_dtype
def test_the_plan_command_refuses_gradients_the_runtime_refuses(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from roundpipe.hf.memory_cli import ConfigPlanner
    from roundpipe.runtime import grad_router

    path = _tiny_config(tmp_path)
    args = [path, "--seq-len", 32, "--devices", "emu", "--grad-dtype", "bf16"]
    for extra, expected in (
        (["--spill-dir", tmp_path], "with --spill-dir: Adam's streamed step"),
        (["--spill-dir", tmp_path, "--spill-masters"], "masters in files read fp32 gradients"),
        (["--optim-dtype", "fp16"], "give --optim-dtype fp32 --grad-dtype bf16"),
        (["--ranks", 2], "DataParallel sums the gradients in the masters' dtype"),
        (["--devices", "cpu"], "a CPU pool sums the gradients in the masters' dtype"),
    ):
        code, out, err = plan_cli(capsys, *args, *extra)
        assert code == 2 and expected in err, (extra, err)
    code, _, err = plan_cli(
        capsys, path, "--seq-len", 32, "--optim-dtype", "bf16", "--grad-dtype", "fp32"
    )
    assert code == 2 and "takes bf16 or fp16 gradients of fp32 masters" in err
    with pytest.raises(ValueError, match="leave grad_dtype=None under DataParallel"):
        ConfigPlanner(str(path), devices="emu", ranks=2, grad_dtype=torch.bfloat16)
    monkeypatch.setattr(grad_router, "torch_has_grad_dtype", lambda: False)
    code, _, err = plan_cli(capsys, *args)
    assert code == 2 and "grad_dtype (2.10 or newer)" in err and torch.__version__ in err


@needs_grad_dtype
def test_a_host_short_of_ram_is_told_what_bf16_gradients_save(tmp_path, monkeypatch):
    # Both sets of gradients halved with the asynchronous step, one with a synchronous step;
    # not named where given already, nor where the other options or torch do not allow it.
    pytest.importorskip("transformers")
    from roundpipe.hf.memory_cli import plan_config
    from roundpipe.runtime import grad_router

    big = _big_config(tmp_path)
    plain = plan_config(big, seq_len=32, devices="emu").host
    low = plan_config(big, seq_len=32, devices="emu", grad_dtype=torch.bfloat16).host
    saves = plain.grads + plain.next_grads - low.grads - low.next_grads
    assert saves == plain.grads == 2 * low.grads  # 2 bytes a parameter of 4, twice
    hints = _hints(big)
    line = f"--grad-dtype bf16: saves {format_bytes(saves)}; "
    assert any(line in h and "both sets with the async step" in h for h in hints), hints
    synced = _hints(big, sync_step=True)
    line = f"--grad-dtype bf16: saves {format_bytes(saves // 2)}; "
    assert any(line in h and "both sets" not in h for h in synced), synced
    for kwargs in (
        {"grad_dtype": torch.bfloat16},
        {"spill_dir": str(tmp_path)},
        {"optim_dtype": torch.bfloat16},
        {"ranks": 2},
    ):
        assert not any("--grad-dtype" in h for h in _hints(big, **kwargs)), kwargs
    monkeypatch.setattr(grad_router, "torch_has_grad_dtype", lambda: False)
    assert not any("--grad-dtype" in h for h in _hints(big))
