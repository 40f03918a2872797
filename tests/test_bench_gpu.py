"""benchmarks/bench_gpu.py, run as a user runs it (a subprocess from the repository root): its tiny
mode on the CPU and on the emulated accelerator prints the table of the three variants with
ratios that agree with its own tokens/s, and without CUDA it says so and exits 0. No timing is
asserted: only that the script runs and reports what it measured.

The pieces of the GPU run of models that do not fit (benchmarks/gpu_rows.py, gpu_offload.sh):
the 24 GiB cap, the random models built without per-element initialisation, the model FLOPs
against torch's flop counter, the FSDP2 contender and roundpipe's on the CPU, the patched
side-by-side harness, and the script's rows in the issue's order."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roundpipe.plan import HOST_CONTENTION

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"
TIGHT = [
    "--layers",
    "1",
    "--dim",
    "16",
    "--heads",
    "2",
    "--seq",
    "8",
    "--vocab",
    "32",
    "--batch",
    "4",
    "--iters",
    "1",
    "--warmup",
    "1",
]
VARIANTS = ("roundpipe", "plain PyTorch", "plain PyTorch + checkpoint")
ROW = re.compile(
    r"^\| (roundpipe|plain PyTorch|plain PyTorch \+ checkpoint) \| (\d+) \| "
    r"([\d,]+) \| ([\d.]+) \| ([\d.]+) \| (\S+) \| (\S+) \|$",
    re.M,
)


def run_bench(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ROUNDPIPE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"bench_gpu.py failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow  # a subprocess (see the marker in pyproject.toml)
@pytest.mark.parametrize("devices", ["cpu", "emu"])
def test_tiny_mode_prints_the_three_variants_with_ratios(devices):
    out = run_bench("--devices", devices, "--microbatches", "1", "2", *TIGHT)
    assert f"NOT A GPU RUN: a tiny configuration on {devices}" in out
    assert (
        "| variant | microbatches | tokens/s | vs plain PyTorch | vs plain PyTorch + checkpoint "
        "| GPU peak GiB | host RSS peak GiB |"
    ) in out

    rows = {
        (name, int(m)): (float(tps.replace(",", "")), float(vs_plain), float(vs_ckpt), gpu, rss)
        for name, m, tps, vs_plain, vs_ckpt, gpu, rss in ROW.findall(out)
    }
    assert set(rows) == {(name, m) for name in VARIANTS for m in (1, 2)}, out
    for m in (1, 2):
        rp, plain, ckpt = (rows[(name, m)] for name in VARIANTS)
        assert plain[1] == 1.0 and ckpt[2] == 1.0  # each baseline against itself
        for row in (rp, plain, ckpt):
            assert row[0] > 0
            # The ratio columns are the row's tokens/s over the baseline's (tokens/s is printed
            # rounded to whole tokens, the ratio to three decimals).
            assert row[1] == pytest.approx(row[0] / plain[0], rel=0.02, abs=2e-3), out
            assert row[2] == pytest.approx(row[0] / ckpt[0], rel=0.02, abs=2e-3), out
            if devices == "cpu":
                assert row[3] == "n/a"  # no device memory of its own
            else:  # the emulated device counts its memory exactly
                assert float(row[3]) > 0
            assert float(row[4]) > 0.05  # host RSS in GiB: at least torch itself
        if devices == "emu":
            # roundpipe keeps a few stages on the device, plain PyTorch all of the model, its
            # masters and Adam's state; and the plain variants, run first, are gone by then.
            assert float(rp[3]) < float(plain[3]), out

    # The targets beside the measured values, the ratio the same as in the table.
    assert "[no GPU: not a measurement of the target]" in out
    for m in (1, 2):
        line = re.search(
            rf"roundpipe / plain PyTorch \+ checkpoint, +{m} microbatches: "
            rf"([\d.]+)  \(target >= 0.85\)  (met|NOT met)",
            out,
        )
        assert line and float(line[1]) == rows[("roundpipe", m)][2], out
    assert re.search(
        r"roundpipe tokens/s against 1 microbatches: 1: 1.000, 2: [\d.]+  "
        r"\(target: none below 0.95\)  (met|NOT met)",
        out,
    ), out
    if devices == "cpu":
        assert "GPU peak <= 2 stages + activations: n/a (no GPU memory to measure)" in out
    else:
        for m in (1, 2):
            line = re.search(
                rf"roundpipe GPU peak, +{m} microbatches: ([\d.]+) GiB  \(target "
                rf"<= 2 stages [\d.]+ \+ activations [\d.]+ = [\d.]+ GiB\)  "
                rf"(met|NOT met)",
                out,
            )
            assert line and line[1] == rows[("roundpipe", m)][3], out


@pytest.mark.slow  # a subprocess (see the marker in pyproject.toml)
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_it_says_so_and_exits_0():
    for args in ([], ["--devices", "cuda"]):
        out = run_bench(*args)
        assert out.startswith("No GPU: ") and "CUDA is not available" in out, out
        assert "--allow-cpu" in out and "| variant |" not in out

    out = run_bench("--allow-cpu", "--microbatches", "2", *TIGHT)
    assert "NOT A GPU RUN: a tiny configuration on cpu" in out
    assert {name for name, *_ in ROW.findall(out)} == set(VARIANTS)


def _profile_script(name, out):
    """benchmarks/``name`` in its tiny mode on the emulated device, one timed iteration."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ROUNDPIPE_DEVICES", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), "--devices", "emu"]
        + ["--warmup", "1", "--iters", "1", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow  # a subprocess (see the marker in pyproject.toml)
def test_profile_gpu_prices_the_plan_and_writes_a_trace_and_a_timeline(tmp_path):
    """benchmarks/profile_gpu.py in its tiny mode on the emulated device: the measured and the
    priced iteration, the profile's thread and device split, and its two files."""
    import gzip
    import json

    proc = _profile_script("profile_gpu.py", tmp_path)
    measured = float(re.search(r"^measured: ([\d.]+) s/iteration", proc.stdout, re.M)[1])
    priced = re.search(
        r"^priced: +([\d.]+) s/iteration \(devices ([\d.]+) s, optimizer thread ([\d.]+) s: "
        r"(optimizer|device)-bound, contention ([\d.]+)\).*measured/priced ([\d.]+) "
        r"\(without contention ([\d.]+)\)",
        proc.stdout,
        re.M,
    )
    assert priced is not None, proc.stdout
    total, devices, step, contention = (float(priced[i]) for i in (1, 2, 3, 5))
    assert contention == HOST_CONTENTION
    longer, shorter = max(devices, step), min(devices, step)
    assert total == pytest.approx(longer + contention * shorter, abs=2e-4)
    assert float(priced[6]) == pytest.approx(measured / total, abs=0.01)
    assert float(priced[7]) == pytest.approx(measured / longer, abs=0.01)
    assert re.search(r"^alone: +forward_backward [\d.]+ s, step [\d.]+ s; ", proc.stdout, re.M)
    assert re.search(r"^  host thread \d+: [\d.]+ s in top-level ops", proc.stdout, re.M)
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert timeline["iteration_time"] == pytest.approx(total, abs=1e-4)
    assert {s["stream"] for s in timeline["spans"]} >= {"compute"}
    trace = json.load(gzip.open(tmp_path / "trace.json.gz"))
    assert any(e.get("name", "").startswith("Optimizer.step") for e in trace["traceEvents"])


@pytest.mark.slow  # a subprocess (see the marker in pyproject.toml)
def test_profile_hf_names_roundpipes_actions_in_its_profile(tmp_path):
    """benchmarks/profile_hf.py in its tiny mode on the emulated device: the measured iteration,
    the two shares, and a table of the executor's labelled actions (every stage's forward and
    prefetch, the head's last action) with a trace that carries the same labels."""
    pytest.importorskip("transformers")
    import gzip
    import json

    proc = _profile_script("profile_hf.py", tmp_path)
    assert re.search(r"^measured: [\d.]+ s/iteration", proc.stdout, re.M), proc.stdout
    assert re.search(r"^forward_backward alone: [\d.]+ s; step alone", proc.stdout, re.M)
    assert re.search(
        rf"^overlapped: [\d.]+ s/iteration at the price's contention {HOST_CONTENTION} ",
        proc.stdout,
        re.M,
    ), proc.stdout
    # tiny mode: 2 decoder layers, so stages 0 (embedding) to 3 (head)
    actions = dict(re.findall(r"^  (roundpipe [a-z_]+ stage \d+) +(\d+) ", proc.stdout, re.M))
    for stage in (1, 2):
        # 4 microbatches in each of the 2 profiled iterations
        assert actions[f"roundpipe forward stage {stage}"] == "8", proc.stdout
        assert actions[f"roundpipe backward stage {stage}"] == "8"
    assert actions["roundpipe last stage 3"] == "8"
    assert "roundpipe prefetch stage 1" in actions and "roundpipe download stage 1" in actions
    trace = json.load(gzip.open(tmp_path / "trace.json.gz"))
    assert any(e.get("name") == "roundpipe forward stage 1" for e in trace["traceEvents"])


@pytest.mark.slow  # a subprocess (see the marker in pyproject.toml)
def test_the_gpu_session_script_is_valid_bash():
    proc = subprocess.run(
        ["bash", "-n", str(ROOT / "benchmarks" / "gpu_session.sh")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


# -- benchmarks/gpu_rows.py and gpu_offload.sh: the GPU run of models that do not fit ------------
def _load_benchmark(name):
    """benchmarks/``name``.py as a module (the benchmarks folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_rows = _load_benchmark("gpu_rows")
GiB = 1 << 30
H200_TOTAL = 143_771 << 20  # what mem_get_info reports on the H200 (benchmarks/results/gpu.md)
# Small models of the GPU rows' two families, as config.json files name them.
TINY_QWEN3 = dict(
    model_type="qwen3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=16384,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)


def _config_file(tmp_path, raw, name="tiny"):
    import json

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return path


def test_the_cap_leaves_the_allocator_the_gpu_less_the_cuda_context():
    """A process capped to C GiB holds at most C GiB: its allocator's share of the device plus
    the CUDA context, the same context the memory plan takes off a GPU."""
    from roundpipe.hf.memory_cli import CUDA_CONTEXT

    assert gpu_rows.CUDA_CONTEXT == CUDA_CONTEXT
    for cap_gib in (16, 24, 48):
        fraction = gpu_rows.cap_fraction(cap_gib * GiB, H200_TOTAL)
        assert 0 < fraction < 1
        assert fraction * H200_TOTAL + CUDA_CONTEXT == pytest.approx(cap_gib * GiB, abs=1)
    assert gpu_rows.cap_fraction(24 * GiB, 16 * GiB) == 1.0  # a device smaller than the cap
    with pytest.raises(ValueError, match=gpu_rows.CAP_ENV):
        gpu_rows.cap_fraction(CUDA_CONTEXT, H200_TOTAL)


def test_the_capped_device_reports_what_the_allocator_may_still_reserve():
    """mem_get_info under the cap: the total is the cap, and what is free plus what the
    allocator caches is what a run may still allocate under it (roundpipe's measure of free
    memory), however much it has reserved; never more than the device has free."""
    cap = 24 * GiB
    fraction = gpu_rows.cap_fraction(cap, H200_TOTAL)
    limit = int(fraction * H200_TOTAL)
    device_free = H200_TOTAL - (700 << 20)
    for reserved, allocated in ((0, 0), (5 * GiB, 3 * GiB), (limit, limit - GiB)):
        free, total = gpu_rows.capped_mem_info(device_free, H200_TOTAL, reserved, fraction, cap)
        assert total == cap
        assert free + reserved - allocated == limit - allocated
    # The real device nearly full (another process): its free memory bounds what is reported.
    assert gpu_rows.capped_mem_info(GiB, H200_TOTAL, 0, fraction, cap) == (GiB, cap)


def test_apply_cap_sets_the_fraction_and_the_process_sees_a_gpu_of_the_cap(monkeypatch):
    """With CUDA (torch.cuda's device queries stood in for by a device of the H200's size),
    ``BENCH_GPU_CAP_GIB=24`` sets the allocator's fraction once and ``torch.cuda.mem_get_info``
    (both its names) then answers as a 24 GiB GPU, as the allocator's reserve grows."""
    reserved, fractions = [0], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda d=None: (H200_TOTAL - reserved[0], H200_TOTAL)
    )
    monkeypatch.setattr(torch.cuda.memory, "mem_get_info", torch.cuda.mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: reserved[0])
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: fractions.append((f, d))
    )
    monkeypatch.setattr(gpu_rows, "_cap", {})
    monkeypatch.setenv(gpu_rows.CAP_ENV, "24")

    applied = gpu_rows.apply_cap()
    fraction = gpu_rows.cap_fraction(24 * GiB, H200_TOTAL)
    assert fractions == [(fraction, 0)]
    assert applied["allocator_limit_GiB"] == pytest.approx(
        24 - gpu_rows.CUDA_CONTEXT / GiB, abs=1e-3
    )
    assert torch.cuda.memory.mem_get_info is torch.cuda.mem_get_info
    assert torch.cuda.mem_get_info(0) == (int(fraction * H200_TOTAL), 24 * GiB)
    reserved[0] = 5 * GiB
    assert torch.cuda.mem_get_info(0) == (int(fraction * H200_TOTAL) - 5 * GiB, 24 * GiB)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_the_cap_is_not_applied_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(gpu_rows, "_cap", {})
    monkeypatch.delenv(gpu_rows.CAP_ENV, raising=False)
    assert gpu_rows.apply_cap() is None  # no cap asked for
    monkeypatch.setenv(gpu_rows.CAP_ENV, "24")
    assert gpu_rows.apply_cap() is None
    assert "no CUDA: the 24 GiB cap is not applied" in capsys.readouterr().err
    assert gpu_rows._cap == {}


class _RandomDraws(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the random numbers torch draws (the elements its random ops write)."""

    RANDOM = {"normal", "normal_", "uniform_", "randn", "rand", "randint", "random_", "bernoulli_"}

    def __init__(self):
        super().__init__()
        self.drawn = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.RANDOM and isinstance(out, torch.Tensor):
            self.drawn += out.numel()
        return out


def test_the_fast_builder_makes_transformers_model_without_a_draw_per_weight(tmp_path):
    """build_random_model gives transformers' own model for the config (the same parameter
    names, shapes, buffers and tying), in the dtype asked for, with weights of the configured
    spread and norms at one, while drawing one pool of random numbers for the whole model where
    transformers' own initialisation draws one per weight; bf16 and fp32 builds of one seed are
    one model (FSDP2's fp32 masters and the others' bf16 weights)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    for raw in (TINY_LLAMA, dict(TINY_QWEN3, vocab_size=32768, hidden_size=128)):
        config = gpu_rows.load_config(_config_file(tmp_path, raw))
        with _RandomDraws() as fast_draws:
            fast = gpu_rows.build_random_model(config, torch.bfloat16, seed=3)
        with _RandomDraws() as own_draws:
            own = AutoModelForCausalLM.from_config(config)
        numel = sum(p.numel() for p in own.parameters())
        assert numel > 4 * gpu_rows.POOL_NUMEL  # big enough to tell the two apart
        assert own_draws.drawn >= numel - 2 * config.num_hidden_layers * config.hidden_size
        assert fast_draws.drawn <= gpu_rows.POOL_NUMEL + len(list(fast.parameters()))

        shapes = {n: p.shape for n, p in own.named_parameters()}
        assert {n: p.shape for n, p in fast.named_parameters()} == shapes
        assert {p.dtype for p in fast.parameters()} == {torch.bfloat16}
        for (name, mine), (_, theirs) in zip(fast.named_buffers(), own.named_buffers()):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
        tied = fast.lm_head.weight is fast.get_input_embeddings().weight
        assert tied == bool(config.tie_word_embeddings)
        for name, p in fast.named_parameters():
            if p.dim() == 1:
                assert torch.all(p == 1), name  # the norms' scales
            else:
                assert float(p.float().std()) == pytest.approx(gpu_rows.INIT_STD, rel=0.05), name

        fp32 = gpu_rows.build_random_model(config, torch.float32, seed=3)
        for (name, a), (_, b) in zip(fp32.named_parameters(), fast.named_parameters()):
            assert torch.equal(a.to(torch.bfloat16), b), name


@pytest.mark.parametrize("lora", [0, 4])
def test_model_flops_per_token_are_what_torchs_flop_counter_counts(tmp_path, lora):
    """One training step of a tiny model under torch.utils.flop_counter.FlopCounterMode (SDPA's
    math kernel, whose matmuls the counter sees): its FLOPs are flops_per_token x tokens without
    the causal discount, and with it the counter's less half its attention matmuls. With LoRA
    the frozen weights count their forward and input gradient (every layer's input needs one
    here: the embedding's output requires grad)."""
    pytest.importorskip("transformers")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    raw = TINY_LLAMA if lora else TINY_QWEN3
    config = gpu_rows.load_config(_config_file(tmp_path, dict(raw, vocab_size=256)))
    model = gpu_rows.build_random_model(config, torch.float32)
    if lora:
        model = gpu_rows._lora(model, lora)
        model.get_base_model().enable_input_require_grads()
        assert any(not p.requires_grad for p in model.parameters())
    seq = 24
    ids = torch.randint(0, config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops()
    attention = counter.get_flop_counts()["Global"][torch.ops.aten.bmm]
    dims = gpu_rows.attention_dims(config)
    assert gpu_rows.flops_per_token(model, seq, dims, causal=False) * ids.numel() == counted
    assert gpu_rows.flops_per_token(model, seq, dims) * ids.numel() == counted - attention / 2
    tokens_per_s = 1000.0
    assert gpu_rows.mfu(tokens_per_s, counted / ids.numel()) == pytest.approx(
        tokens_per_s * counted / ids.numel() / 989e12
    )


def test_the_configs_are_the_published_shapes(tmp_path):
    """benchmarks/configs: Qwen3-4B, Qwen3-1.7B and Llama-3.1-8B as their model cards count
    them (Qwen3's non-embedding parameters and Llama's total, to the cards' precision), and the
    `layers` command the GPU script uses writes one with fewer decoder layers."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    cards = {"qwen3-4b": (3.6, False), "qwen3-1.7b": (1.4, False), "llama-3.1-8b": (8.03, True)}
    for name, (billions, total) in cards.items():
        path = ROOT / "benchmarks" / "configs" / f"{name}.json"
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(gpu_rows.load_config(path))
        count = sum(p.numel() for p in model.parameters())
        if not total:
            count -= model.get_input_embeddings().weight.numel()
        assert round(count / 1e9, 2 if total else 1) == billions, name

    out = tmp_path / "four.json"
    assert (
        gpu_rows.main(["layers", str(ROOT / "benchmarks/configs/qwen3-1.7b.json"), "4", str(out)])
        == 0
    )
    config = gpu_rows.load_config(out)
    assert config.num_hidden_layers == 4 and config.max_window_layers == 4
    assert (
        config.hidden_size
        == gpu_rows.load_config(ROOT / "benchmarks/configs/qwen3-1.7b.json").hidden_size
    )


def _run_json(cmd, env_extra=None, timeout=240):
    """Runs ``cmd`` from the repository root; returns (its last stdout line as JSON, stderr)."""
    import json

    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env.pop("ROUNDPIPE_DEVICES", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _check_row(row, impl):
    assert row["impl"] == impl and "error" not in row, row
    assert row["tok_s"] > 0 and row["s_per_iter"] > 0
    assert row["mfu"] == float(f"{row['tok_s'] * row['flops_per_token'] / 989e12:.4g}")
    assert torch.isfinite(torch.tensor([row["loss_first"], row["loss_last"]])).all()


@pytest.mark.slow  # a subprocess (see the marker in pyproject.toml)
@pytest.mark.timeout(480)
def test_fsdp2_with_cpu_offload_and_roundpipe_train_the_same_model_on_the_cpu(tmp_path):
    """The FSDP2 contender on the CPU (gloo, one rank): fully_shard of every decoder layer and
    the root with CPUOffloadPolicy (unpinned: pinning needs CUDA) and the bf16
    MixedPrecisionPolicy, checkpointed layers, fused AdamW, 2 warm-up and a timed iteration; and
    roundpipe's contender on the same config, data and microbatches. Both report the same
    model FLOPs and the same first loss (one model, one batch), under a cap that without CUDA
    is not applied and says so."""
    config = _config_file(tmp_path, TINY_QWEN3)
    args = ["--config", str(config), "--seq", "32", "--batch", "4", "--mb", "2"]
    args += ["--warmup", "2", "--iters", "1"]
    rows = {}
    for name, impl, extra in (
        ("fsdp2", "fsdp2", []),
        ("ours", "ours", []),
        ("ours 8bit", "ours", ["--optim-states", "8bit"]),  # the GPU row of issue 45
    ):
        rows[name], err = _run_json(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "gpu_rows.py"),
                "run",
                "--impl",
                impl,
                *args,
                *extra,
            ],
            {gpu_rows.CAP_ENV: "24"},
        )
        _check_row(rows[name], impl)
        if not torch.cuda.is_available():
            assert "no CUDA: the 24 GiB cap is not applied" in err
    assert rows["ours"]["optim_states"] == "exact" and rows["ours 8bit"]["optim_states"] == "8bit"
    assert rows["ours 8bit"]["loss_first"] == rows["ours"]["loss_first"]  # before any step
    assert rows["fsdp2"]["flops_per_token"] == rows["ours"]["flops_per_token"]
    assert rows["fsdp2"]["trained_M"] == rows["ours"]["trained_M"]
    assert rows["fsdp2"]["loss_first"] == pytest.approx(rows["ours"]["loss_first"], rel=1e-2)


SHARED_HARNESS = ROOT.parent / "shared" / "gpu" / "peer_bench.py"


@pytest.mark.slow  # a subprocess (see the marker in pyproject.toml)
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not SHARED_HARNESS.exists(), reason="the shared harness is not beside the checkout"
)
def test_the_patched_harness_runs_fsdp2_and_gives_every_row_its_mfu(tmp_path):
    """benchmarks/peer_setup.py's patches applied to the shared harness: placed as on the GPU
    machine (.peer/ beside benchmarks/), it runs ``--model hf --impl fsdp2`` and its own GPT
    rows, each with its model FLOPs and MFU."""
    peer_setup = _load_benchmark("peer_setup")
    (tmp_path / ".peer").mkdir()
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    bench = tmp_path / ".peer" / "peer_bench.py"
    bench.write_text(peer_setup.patched_harness(SHARED_HARNESS.read_text(), SHARED_HARNESS))
    config = _config_file(tmp_path, TINY_QWEN3)
    row, _ = _run_json(
        [sys.executable, str(bench), "--model", "hf", "--impl", "fsdp2", "--config", str(config)]
        + ["--seq", "32", "--batch", "4", "--mb", "2", "--warmup", "2", "--iters", "1"],
        {gpu_rows.CAP_ENV: "24"},
    )
    _check_row(row, "fsdp2")
    assert row["model"] == "tiny" and row["layers"] == 2
    gpt, _ = _run_json(
        [sys.executable, str(bench), "--model", "gpt", "--impl", "torch", "--layers", "1"]
        + ["--d", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--batch", "4"]
        + ["--mb", "2", "--warmup", "1", "--iters", "1"]
    )
    # The GPT's FLOPs: 6 x its linear weights (the blocks' and the head's) plus attention.
    linear = 32 * 96 + 32 * 32 + 2 * 32 * 128 + 32 * 64
    assert gpt["flops_per_token"] == 6 * linear + 3 * 4 * 16 * 32 // 2
    assert gpt["mfu"] == float(f"{gpt['tok_s'] * gpt['flops_per_token'] / 989e12:.4g}")


@pytest.mark.slow  # a subprocess (see the marker in pyproject.toml)
def test_the_offload_script_runs_the_issues_rows_in_order_within_its_budget(tmp_path):
    """benchmarks/gpu_offload.sh with GPU_DRY_RUN=1 lists its parts in order, each skipped by
    the budget: row 1 (Qwen3-4B's shape, roundpipe exact and with 8-bit moments, the public
    RoundPipe, FSDP2 on one batch),
    row 2 (LoRA 16 on Llama-3.1-8B's shape), row 3 (the planned lengths), row 4 (continuity)."""
    script = ROOT / "benchmarks" / "gpu_offload.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env = dict(os.environ, GPU_DRY_RUN="1", OUT=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = re.findall(r"^skipped \(budget\): (.*)$", proc.stdout, re.M)
    benches = [p.split()[1:3] for p in parts if p.startswith("bench ")]
    assert benches == [
        ["hf", "ours"], ["hf", "ours"], ["hf", "upstream"], ["hf", "fsdp2"],
        ["hf", "ours"], ["hf", "upstream"],
        ["qwen3", "ours"], ["qwen3", "ours"], ["qwen3", "upstream"], ["qwen3", "torch"],
    ], parts  # fmt: skip
    row1 = [p for p in parts if "qwen3-4b.json" in p]
    assert len(row1) == 4 and row1[1].endswith("--optim-states 8bit")
    for part in row1:  # the same model, data and batch for every contender
        assert "--dtype bf16 --seq 2048 --batch 8 --mb 4" in part
    row2 = [p for p in parts if "llama-3.1-8b.json" in p]
    assert len(row2) == 2 and all("--lora 16 --seq 4096" in p for p in row2)
    assert parts.index(row2[-1]) < parts.index("row 3 (its plans and the first model)")
    assert parts.index("row 3 (its plans and the first model)") < parts.index(
        "bench qwen3 ours --layers 8"
    )
    assert "--mb 8" in parts[parts.index("bench qwen3 ours --layers 8") + 1]
    assert (tmp_path / "summary.txt").read_text().count("skipped (budget)") == len(parts)
