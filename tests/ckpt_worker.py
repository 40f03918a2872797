"""One training run with roundpipe.checkpoint (tests/test_checkpoint_resume.py and
tests/test_checkpoint_faults.py run it as a new process, as a user's run would be).

    python tests/ckpt_worker.py CONFIG_JSON    # under torchrun's variables for data parallel

or ``main()`` in a rank process of the test session (tests/rank_pool_worker.py), for the runs
that patch nothing (``kill_in_broadcast``, ``kill_in_write`` and ``announce_write_at`` patch
this process for good: those run in new processes).

Config: ``model`` ("seq": a Sequential of fp16 stages with dropout, Adam masters, a StepLR
scheduler and a GradScaler; "lora": a tiny Llama with peft LoRA adapters through
roundpipe.hf.wrap, same optimizer, scheduler and scaler), ``devices``, ``steps`` (train until
this iteration), ``root`` (checkpoints), ``save_every`` (save after every N iterations),
``save_at`` (also: iteration -> where: "end" after scaler.update, "after_fb" between
forward_backward and step), ``resume`` (load the newest checkpoint of ``root`` first),
``hf`` (write the HF directory too), ``dp`` (data parallel), ``shard`` (with ShardedState),
``timeout`` (the process group's, seconds), ``kill_in_broadcast`` ({"rank": r, "at": c}: rank
r kills itself with SIGKILL in the weight broadcast, before the c-th layer's),
``kill_in_write`` ({"rank": r, "save": c}: rank r kills itself on its checkpoint writer thread
as it starts writing its share of its c-th save, counted from 1), ``keep_last``,
``wait`` (wait for every save), ``out`` (the record,
JSON: per iteration the loss as float.hex, the final masters' and parameters' sha256, the
scaler's state, what load returned, this rank's masters and optimizer state by parameter
name, as sha256, right after the load and at the end, and the warnings made while building the
model and the optimizer), ``state_dir`` and ``state_buffer_bytes`` (Adam's state in files),
``masters_dir`` (the masters in files: roundpipe.MastersOnDisk, or ShardedState's share with
``shard``; "seq" only),
``announce_write_at`` (print "writing" once, when Adam's writer thread starts a write while the
main thread is at that iteration).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
import roundpipe.checkpoint as ckpt
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe import distributed as rpd
from roundpipe.checkpoint import named

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_pool_worker import wait_for_go  # noqa: E402

DEFAULTS = {
    "model": "seq",
    "devices": "cpu",
    "steps": 6,
    "root": None,
    "save_every": None,
    "save_at": {},
    "resume": False,
    "hf": False,
    "dp": False,
    "keep_last": None,
    "wait": False,
    "out": None,
    "width": 16,
    "announce_saves": False,
    "state_dir": None,
    "state_buffer_bytes": None,
    "masters_dir": None,
    "announce_write_at": None,
    "shard": False,
    "timeout": 60,
    "kill_in_broadcast": None,
    "kill_in_write": None,
}
BATCH, NUM_MB = 8, 2


def build_seq(cfg):
    torch.manual_seed(0)
    w = cfg["width"]
    seq = nn.Sequential(
        nn.Linear(8, w), nn.Dropout(0.2), nn.Tanh(), nn.Linear(w, w), nn.GELU(), nn.Linear(w, 4)
    ).half()
    placement = None
    if cfg["shard"]:
        placement = rpd.ShardedState(masters_dir=cfg["masters_dir"])
    elif cfg["masters_dir"]:
        placement = roundpipe.MastersOnDisk(cfg["masters_dir"])
    return RoundPipe(
        seq,
        optim_dtype=torch.float32,
        devices=cfg["devices"],
        model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB),
        state_placement=placement,
    )


def by_name(model, opt):
    """This rank's masters and optimizer state, by parameter name, as sha256 digests."""
    masters = dict(model.optim_named_parameters())
    state = named.by_name(opt.state_dict(), named.param_names(opt, masters))["state"]
    out = {f"master/{n}": digest([("", m)]) for n, m in masters.items()}
    for name, values in state.items():
        for key, value in values.items():
            out[f"optimizer/{name}/{key}"] = digest([("", torch.as_tensor(value))])
    return out


def kill_in_broadcast(rank, at):
    """Rank ``rank`` kills itself (SIGKILL) in the weight broadcast of the master->model copy:
    before the ``at``-th layer's broadcast (counted from 1 over the run, layers with
    parameters only), the earlier layers' done."""
    if torch.distributed.get_rank() != rank:
        return
    calls = [0]
    copy_layer = rpd.ShardedState.copy_layer

    def killing_copy_layer(self, pairs, *args):
        if pairs:
            calls[0] += 1
            if calls[0] == at:
                print(f"rank {rank}: killed in weight broadcast {at}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return copy_layer(self, pairs, *args)

    rpd.ShardedState.copy_layer = killing_copy_layer  # type: ignore[method-assign]


def kill_in_write(rank, save):
    """Rank ``rank`` kills itself (SIGKILL) on its checkpoint writer thread as it starts
    writing its share of its ``save``-th checkpoint."""
    if torch.distributed.get_rank() != rank:
        return
    from roundpipe.checkpoint import writer

    calls = [0]
    write_share = writer._Job._write_share

    def killing_write_share(self, *args):
        calls[0] += 1
        if calls[0] == save:
            print(f"rank {rank}: killed writing its share of save {save}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return write_share(self, *args)

    writer._Job._write_share = killing_write_share  # type: ignore[method-assign]


def tiny_llama_config(*, tie_word_embeddings):
    """The two-layer Llama the checkpoint tests train, as a transformers config."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie_word_embeddings,
    )


def build_lora(cfg):
    import peft
    import transformers

    torch.manual_seed(0)
    config = tiny_llama_config(tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lora = peft.get_peft_model(
        hf,
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]),
    )
    return roundpipe.hf.wrap(
        lora,
        devices=cfg["devices"],
        check=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MB),
    )


def batch(cfg, gen):
    if cfg["model"] == "seq":
        x = torch.randn(BATCH, 8, generator=gen)
        y = torch.randint(0, 4, (BATCH,), generator=gen)
        return {"x": x, "y": y}
    ids = torch.randint(0, 64, (BATCH, 12), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def digest(tensors):
    h = hashlib.sha256()
    for name, t in sorted(tensors):
        h.update(name.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def announce_writes(at):
    """Print "writing" once, from Adam's writer thread, as it starts a write while the main
    thread is at iteration ``at``; returns the cell the main loop keeps its iteration in."""
    current = [-1]
    if at is None:
        return current
    write, said = os.pwritev, []

    def pwritev(fd, buffers, offset):
        if (
            not said
            and current[0] == at
            and threading.current_thread().name.startswith("roundpipe-adam-write")
        ):
            said.append(True)
            print("writing", flush=True)
        return write(fd, buffers, offset)

    os.pwritev = pwritev
    return current


def main():
    cfg = {**DEFAULTS, **json.loads(sys.argv[1])}
    rank = 0
    if cfg["dp"]:
        wait_for_go()
        rpd.init_process_group("gloo", timeout=cfg["timeout"])
        rank = torch.distributed.get_rank()
        if cfg["kill_in_broadcast"]:
            kill_in_broadcast(**cfg["kill_in_broadcast"])
        if cfg["kill_in_write"]:
            kill_in_write(**cfg["kill_in_write"])
    with warnings.catch_warnings(record=True) as made:
        warnings.simplefilter("always")
        model = build_seq(cfg) if cfg["model"] == "seq" else build_lora(cfg)
    dp = rpd.DataParallel(model) if cfg["dp"] else None
    with OptimizerCtx(), warnings.catch_warnings(record=True) as made_opt:
        warnings.simplefilter("always")
        opt = roundpipe.optim.Adam(
            model.parameters(),
            lr=1e-2,
            state_dir=cfg["state_dir"],
            state_buffer_bytes=cfg["state_buffer_bytes"],
        )
    made += made_opt
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    scaler = GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    record = {"losses": {}, "loaded": None, "saved": [], "warnings": [str(w.message) for w in made]}
    current = announce_writes(cfg["announce_write_at"])
    start = 0
    if cfg["resume"]:
        extra = ckpt.load(cfg["root"], model, opt, scaler=scaler, scheduler=sched, progress=False)
        record["loaded"] = {k: v for k, v in extra.items() if k != "data"}
        gen.set_state(extra["data"])
        record["at_load"] = by_name(model, opt)
        start = extra["iteration"]
        pending = extra.get("pending_step", False)
    else:
        pending = False

    def loss_fn(out, label):
        if cfg["model"] == "seq":
            return scaler.scale(F.cross_entropy(out.float(), label)) / NUM_MB
        return scaler.scale(out)

    def step_fn():
        scaler.step(opt)
        sched.step()
        opt.zero_grad()

    def save(it, where):
        handle = ckpt.save(
            cfg["root"],
            model,
            opt,
            scaler=scaler,
            scheduler=sched,
            extra={
                "iteration": it,
                "data": gen.get_state(),
                "pending_step": where == "after_fb",
                "note": f"saved {where} of iteration {it}",
            },
            keep_last=cfg["keep_last"],
            hf=cfg["hf"],
        )
        record["saved"].append(str(handle.path))
        if cfg["announce_saves"]:
            print(f"saving {handle.path.name}", flush=True)
        if cfg["wait"]:
            handle.wait()

    for it in range(start, cfg["steps"]):
        current[0] = it
        if not pending:
            b = batch(cfg, gen)
            if dp is not None:
                b = rpd.shard(b)
            if cfg["model"] == "seq":
                loss = model.forward_backward(input_args=(b["x"],), label=b["y"], loss_fn=loss_fn)
            else:
                loss = model.forward_backward(input_kwargs=b, loss_fn=loss_fn)
            record["losses"][it] = loss.item().hex()
            if cfg["save_at"].get(str(it)) == "after_fb":
                save(it, "after_fb")
        pending = False
        model.step(step_fn)
        scaler.update()
        if cfg["save_at"].get(str(it)) == "end" or (
            cfg["save_every"] and (it + 1) % cfg["save_every"] == 0
        ):
            save(it + 1, "end")
    ckpt.wait()
    model.synchronize()
    record["masters"] = digest(model.optim_named_parameters())
    record["params"] = digest((n, p) for n, p in model.state_access().module.named_parameters())
    record["scaler"] = scaler.state_dict()
    record["lr"] = sched.get_last_lr()
    record["at_end"] = by_name(model, opt)
    if dp is not None:
        record["replicas_identical"] = dp.replicas_identical()
        dp.close()
    out = cfg["out"] if not cfg["dp"] else f"{cfg['out']}.rank{rank}"
    if out:
        with open(out, "w") as f:
            json.dump(record, f)
    if cfg["dp"]:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
