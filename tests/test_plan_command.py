"""The plan command's answers (``python -m roundpipe plan CONFIG``, roundpipe.hf.memory_cli): the
longest sequence that fits, the limit that binds it, the activation offload chosen where it
makes the plan fit, what to change with what each change saves, and a report people read.
Tiny configs on the emulated device, planned against a stated GPU and host; what a full-size
search costs is measured by benchmarks/bench_plan.py, not here."""

import json
import re
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from roundpipe.hf import memory_cli  # noqa: E402
from roundpipe.hf.defaults import kept_input_bytes, offload_needed  # noqa: E402
from roundpipe.hf.memory_cli import ConfigPlanner, main, what_to_change  # noqa: E402
from roundpipe.memory import trace  # noqa: E402

MIB = 1 << 20
# 48 decoder layers of hidden 256 (two heads of 128, whose attention takes memory linear in
# the tokens): the stage inputs kept for the backward, 49 x 512 bytes a token, are most of
# what a long sequence needs on the device, as in a full-size model.
DEEP = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 48,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
SMALL = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
GPU = 1 << 30  # the GPU planned against: 512 MiB for tensors after the CUDA context
STEP = 512


def _config(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _planner(path, **kwargs):
    kwargs.setdefault("device_memory", GPU)
    return ConfigPlanner(path, devices="emu", **kwargs)


def _state_bytes(path):
    """The host RAM the model's state takes (weights, masters, gradients, Adam): what the
    host needs before any activation."""
    return _planner(path, host_memory=1 << 40).fixed_host.new_bytes


@pytest.fixture
def traced(monkeypatch):
    """The stages traced on fake tensors, in order, by index."""
    seen = []
    real = trace._trace_one
    monkeypatch.setattr(
        trace, "_trace_one", lambda stage, *a: seen.append(stage.index) or real(stage, *a)
    )
    return seen


def test_a_host_short_at_every_length_is_said_at_once(tmp_path, traced, capsys):
    """Full fine-tuning on a host that cannot hold the model's state: no length fits and the
    host binds, found from the host terms before any length is searched (one plan, at the
    step, traced for the report)."""
    path = _config(tmp_path, SMALL)
    planner = _planner(path, host_memory=2 * MIB)
    found = planner.search(32768, 256)
    assert found.seq_len == 0 and found.host_everywhere and found.beyond is None
    assert found.traced <= 1 and len(traced) <= 3, traced
    assert found.at.seq_len == 256 and not found.at.fits
    assert all(d.fits for d in found.at.plan.devices)  # the device is not the limit
    code = main(
        [path, "--max-seq-len", "32768", "--devices", "emu", "--gpu", "rtx4090"]
        + ["--host-memory", "2MiB"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "No sequence fits" in out
    short = found.at.plan.host.new_bytes - 2 * MIB
    assert "Bound by the host RAM at every length" in out
    assert f"{memory_cli.format_bytes(short)} short before any activation" in out


def test_the_offload_is_chosen_where_it_makes_the_longest_sequence_fit(tmp_path, capsys):
    """A host with 64 MiB beside the model's state cannot hold the offloaded stage inputs of
    a long sequence, which the device holds: the longest sequence keeps them on the device,
    where wrap's old default (offload past a quarter of the device, host or not) moved them to
    the host, which then did not fit. Checked as the command is asked: the answer fits, and one
    step more fits under no offload setting."""
    path = _config(tmp_path, DEEP)
    host = _state_bytes(path) + 64 * MIB
    planner = _planner(path, host_memory=host)
    found = planner.search(65536, STEP)
    n = found.seq_len
    assert n > 0 and found.at.fits and found.at.offload is False, found.at.reason
    assert not found.at.by_offload[True].fits  # offloaded, the host is short
    kept = kept_input_bytes(48, n, 256, 2)
    assert offload_needed(kept, planner.device_free())  # the old rule offloaded here
    assert not offload_needed(kept, planner.device_free(), host - _state_bytes(path))
    assert not planner.wrap_offloads(n)  # wrap's default now agrees with the plan
    assert found.beyond is not None and found.beyond.seq_len == n + STEP
    for setting in (True, False):  # --offload-activations / --no-offload-activations
        beyond = _planner(path, host_memory=host, offload_activations=setting).plans(n + STEP)
        assert not beyond.fits and not found.beyond.by_offload[setting].fits, setting
    args = [path, "--devices", "emu", "--device-memory", "1GiB", "--host-memory", str(host)]
    assert main([*args, "--seq-len", str(n)]) == 0
    out = capsys.readouterr().out
    assert "Activation offload: off: the device holds the stage inputs" in out
    bound = "\n".join(memory_cli.describe_bound(found))  # what --max-seq-len prints
    assert f"Bound at {n + STEP} tokens by:" in bound
    assert "activation offload off: short of the device (GPU of 1.00 GiB)" in bound
    assert "activation offload on: short of the host RAM" in bound


def test_the_longest_sequence_fits_and_one_step_more_fits_under_no_setting(tmp_path, traced):
    """A host with room and a small GPU (the device binds): the offload is on where only that
    fits, the plan at the answer fits and one step more does not, on or off; each length is
    traced once for both settings (the embedding, one decoder layer and the head)."""
    path = _config(tmp_path, DEEP)
    planner = ConfigPlanner(path, devices="emu", device_memory=768 * MIB, host_memory=1 << 40)
    found = planner.search(65536, STEP)
    n = found.seq_len
    assert 0 < n < 65536 and found.at.fits and found.at.offload is True, found.at.reason
    assert not found.at.by_offload[False].fits  # kept on the device, it would not fit
    assert found.beyond is not None and found.beyond.seq_len == n + STEP
    assert not any(p.fits for p in found.beyond.by_offload.values())
    assert len(traced) == 3 * found.traced
    assert found.traced <= 6, found.traced  # a bisection of 1..128 steps traces 8 or more


def _advice(lines):
    """(options, saves in bytes or None, about, alone) of each change the advice names."""
    changes = []
    alone = None
    for line in lines:
        if line.strip() == "any one of these makes it fit:":
            alone = True
        elif line.strip() in ("not enough alone:", "none is enough alone:"):
            alone = False
        else:
            m = re.match(r"\s+(--[^:]+): saves (about )?([0-9.]+) (B|KiB|MiB|GiB);", line)
            if m:
                unit = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(4)]
                changes.append((m.group(1), float(m.group(3)) * unit, bool(m.group(2)), alone))
    return changes


def _applied(path, options, kwargs, seq_len, tmp_path):
    """The plans after one change the advice names, as the command's options."""
    kwargs = dict(kwargs)
    words = options.split()
    while words:
        option, value = words.pop(0), None
        if words and not words[0].startswith("--"):
            value = words.pop(0)
        if option == "--no-offload-activations":
            kwargs["offload_activations"] = False
        elif option == "--offload-activations":
            kwargs["offload_activations"] = True
        elif option == "--seq-len":
            seq_len = int(value)
        elif option == "--lora":
            pytest.importorskip("peft")
            kwargs["lora"] = int(value)
        elif option == "--quantize":
            pytest.importorskip("bitsandbytes")
            kwargs["quantize"] = value
        elif option == "--optim-states":
            kwargs["optim_states"] = value
        elif option == "--optim-dtype":
            kwargs["optim_dtype"] = torch.bfloat16
        elif option == "--ranks":
            kwargs["ranks"] = int(value)
        elif option == "--num-microbatch":
            kwargs["num_microbatch"] = int(value)
        elif option == "--spill-dir":
            kwargs["spill_dir"] = kwargs.get("spill_dir") or str(tmp_path)
        elif option == "--spill-masters":
            kwargs["spill_masters"] = True
        elif option == "--sync-step":
            kwargs["sync_step"] = True
        elif option == "--grad-dtype":
            kwargs["grad_dtype"] = torch.bfloat16
        else:
            raise AssertionError(f"the advice names an option the test does not know: {options}")
    return _planner(path, **kwargs).plans(seq_len)


def _need(plan, where):
    if where == "host":
        return plan.host.new_bytes
    dev = plan.devices[0]
    return dev.peak + dev.reserve


@pytest.mark.parametrize(
    "case, gpu, seq_len, where",
    [
        ("host short, the offload given", GPU, 4096, "host"),
        ("device short", GPU, 16384, "device"),
    ],
)
def test_each_change_the_advice_names_saves_what_it_says(tmp_path, case, gpu, seq_len, where):
    """Each change comes with what it saves (exact, or marked "about"), checked by planning
    with that change alone; "any one of these makes it fit" lists exactly those that alone
    make the plan fit. The host short: the offload given on, which --no-offload-activations
    undoes. The device short: offloading would move the shortfall to the host."""
    path = _config(tmp_path, DEEP)
    kwargs = {"host_memory": _state_bytes(path) + 64 * MIB, "device_memory": gpu}
    if where == "host":
        kwargs["offload_activations"] = True
    planner = _planner(path, **kwargs)
    lp = planner.plans(seq_len)
    assert not lp.fits
    lines = what_to_change(planner, lp, longer_search=True)
    changes = _advice(lines)
    assert changes and any(alone for *_, alone in changes), lines
    names = [c[0] for c in changes]
    if where == "host":
        assert "--no-offload-activations" in names
    else:
        assert "--offload-activations" in names and any(n.startswith("--seq-len") for n in names)
    _assert_each_saves_what_it_says(path, kwargs, seq_len, where, lp, changes, lines, tmp_path)


def _assert_each_saves_what_it_says(path, kwargs, seq_len, where, lp, changes, lines, tmp_path):
    for options, saves, about, alone in changes:
        after = _applied(path, options, kwargs, seq_len, tmp_path)
        assert after.fits == alone, (options, alone, after.reason, lines)
        if options.startswith("--ranks"):
            continue  # per machine; the check above is what matters
        saved = _need(lp.plan, where) - _need(after.plan, where)
        tolerance = 0.1 if about else 0.01  # "about": an estimate; else printed to 3 digits
        assert abs(saved - saves) <= tolerance * abs(saved) + MIB / 100, (options, saves, saved)


# Two decoder layers of hidden 2048 (67M parameters each) and a short sequence: the layers'
# weights and gradients, not the activations, are what the device holds at its peak.
WIDE = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


def test_a_device_short_by_its_gradients_is_told_of_bf16_gradients(tmp_path):
    """Full fine-tuning with one microbatch, the device short by less than what bf16
    gradients save there (the sums in half the bytes, the first gradient taken as the sum
    instead of copied into an fp32 one): the advice names --grad-dtype bf16 and --lora 16
    (planned with the adapters: the peak's terms show no gradient sums here, the first
    gradient counting under the running action) among the changes that alone make it fit,
    each with its saving, checked by planning with it."""
    path = _config(tmp_path, WIDE)
    roomy = _planner(path, host_memory=1 << 40, device_memory=64 << 30)
    with_bf16 = roomy.plan_with_gradients_in(roomy.plans(64), torch.bfloat16)
    need, low = _need(roomy.plans(64).plan, "device"), _need(with_bf16, "device")
    assert need - low > 64 * MIB  # a layer's 67M gradients in 2 bytes fewer, about
    short = (need - low) // 2
    kwargs = {
        "host_memory": 1 << 40,
        "device_memory": memory_cli.CUDA_CONTEXT + need - short,
    }
    planner = _planner(path, **kwargs)
    lp = planner.plans(64)
    assert not lp.fits
    lines = what_to_change(planner, lp, longer_search=False)
    changes = _advice(lines)
    named = [(c[0], c[3]) for c in changes]
    assert ("--grad-dtype bf16", True) in named and ("--lora 16", True) in named, lines
    _assert_each_saves_what_it_says(path, kwargs, 64, "device", lp, changes, lines, tmp_path)


def test_the_report_names_the_gpu_the_stages_and_the_hosts_figure(tmp_path, capsys):
    path = _config(tmp_path, SMALL)
    code = main(
        [path, "--seq-len", "64", "--devices", "emu", "--gpu", "rtx4090"]
        + ["--host-memory", "64GiB"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Device rtx4090: peak" in out and "emu:0" not in out
    for name in (
        "layer 0 (model.embed_tokens",
        "layer 1 (model.layers.0)",
        "layer 4 (model.layers.3)",
    ):
        assert name in out, name
    assert "layer 5 (model.norm + lm_head + loss)" in out
    assert re.search(r"peak [0-9.]+ [KMG]iB of [0-9.]+ GiB free, during the .+ of layer", out)
    assert not re.search(r"\b[FLBUPRDOIHW][0-9]+\.[0-9]+\b", out), out  # no compact labels
    assert "host RAM given (--host-memory)" in out
    assert "Activation offload: off: the device holds the stage inputs" in out
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "q_proj, k_proj, v_proj, o_proj" in text  # what --lora puts adapters on


def test_a_tied_embedding_is_named_where_the_stage_holds_it(tmp_path):
    path = _config(tmp_path, {**SMALL, "tie_word_embeddings": True})
    plan = _planner(path, host_memory=1 << 40).plan(64)
    assert plan.stage_names[0].startswith("layer 0 (model.embed_tokens")
    assert plan.stage_names[-1] == "layer 5 (model.norm + lm_head + loss)"


def test_a_lora_plan_shows_no_deprecation_warning_of_the_libraries(tmp_path):
    # peft reads transformers' old checkpointing name when it wraps the model on the meta
    # device, which warns from transformers 5.24: the plan says nothing of it.
    pytest.importorskip("peft")
    path = _config(tmp_path, SMALL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _planner(path, lora=16).plans(64)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_two_short_devices_are_advised_from_one_plan_of_each_change(tmp_path, monkeypatch):
    """A pool of two devices, both short: each gets its changes, and each change is planned
    once for both (a plan with bf16 gradients, a planner with the adapters)."""
    path = _config(tmp_path, WIDE)
    planner = ConfigPlanner(
        path,
        devices="emu:2",
        host_memory=1 << 40,
        device_memory=memory_cli.CUDA_CONTEXT + 300 * MIB,
    )
    lp = planner.plans(64)
    assert not any(d.fits for d in lp.plan.devices)
    made = []
    for name in ("plan_with_gradients_in", "variant"):
        real = getattr(ConfigPlanner, name)
        monkeypatch.setattr(
            ConfigPlanner,
            name,
            lambda self, *a, _real=real, _name=name, **k: (
                made.append(_name) or _real(self, *a, **k)
            ),
        )
    lines = what_to_change(planner, lp)
    assert sorted(made) == ["plan_with_gradients_in", "variant"], made
    for device in ("#0", "#1"):
        section = "\n".join(lines).split(f"{device}:", 1)[1]
        assert "--grad-dtype bf16: saves" in section and "--lora 16: saves" in section, lines
