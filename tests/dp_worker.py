"""One rank of a data-parallel test run (tests/test_distributed.py), and the same loop without data
parallelism for the one-process reference.

    python tests/dp_worker.py CONFIG_JSON     # with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set

or ``main()`` in a rank process of the test session (tests/rank_pool_worker.py), with the same
arguments and environment: each run leaves the process as it found it (its process group
destroyed, what it patched put back).

A rank writes what it saw to ``{out}/rank{R}.pt``: the masters, the model's parameters, the
scale in use per iteration, which steps were skipped, the scaler state, and the error a call
raised (its type, message, which call, seconds since the failing iteration started).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe import distributed as rpd
from roundpipe.optim import master_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_pool_worker import wait_for_go  # noqa: E402

DEFAULTS = {
    "steps": 6,
    "global_batch": 12,
    "num_microbatch": 2,
    "mode": "async",
    "optimizer": "adam",
    "dtype": "fp32",
    "inf_step": None,
    "inf_rank": None,
    "fail": None,
    "save_after": None,
    "resume": None,
    "pg_timeout": 20.0,
    "out": None,
    "seed": 0,
    "hidden": 16,
    "shard": False,
    "clip": None,
    "devices": "cpu",
    "accumulate": 1,  # forward_backward calls per step, each on a part of the batch
    "extra_backward": False,  # also a differentiable forward() and backward() per step
    # {"rank": R, "step": K, "survive": bool}: loss_fn raises there, mid-call; surviving, the
    # rank steps with zero gradients instead of that call's
    "fail_in_backward": None,
    "hand_late": False,  # this rank hands its last stage's sums as the stage before it
    # a directory: the masters (MastersOnDisk) and Adam's state (state_dir) in files under it,
    # per rank its own subdirectory
    "spill": None,
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def global_batch(it, cfg):
    """The global batch of iteration ``it``: the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(1000 + it)
    x = torch.randn(cfg["global_batch"], 8, generator=g)
    y = torch.randint(0, 4, (cfg["global_batch"],), generator=g)
    return x, y


def build(cfg, shard=False, rank=0):
    torch.manual_seed(cfg["seed"])
    spill = None if cfg["spill"] is None else os.path.join(cfg["spill"], f"rank{rank}")
    if shard:
        placement = rpd.ShardedState(masters_dir=spill)
    else:
        placement = None if spill is None else roundpipe.MastersOnDisk(spill)
    seq = nn.Sequential(
        nn.Linear(8, cfg["hidden"]),
        nn.Tanh(),
        nn.Linear(cfg["hidden"], 16),
        nn.Tanh(),
        nn.Linear(16, 4),
    )
    model = RoundPipe(
        seq.to(DTYPES[cfg["dtype"]]),
        optim_dtype=torch.float32,
        devices=cfg["devices"],
        model_run_config=RoundPipeRunConfig(num_microbatch=cfg["num_microbatch"]),
        state_placement=placement,
    )
    with OptimizerCtx():
        if cfg["optimizer"] == "adam":  # unscales in its own kernel (grad_scale/found_inf)
            opt = roundpipe.optim.Adam(model.parameters(), lr=1e-2, state_dir=spill)
        else:  # the scaler's unscale_ path
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return model, opt, scaler


def hand_last_stage_late():
    """Make this process hand each call's last stage to the gradient reducer from another
    thread, only once the stage before it is being handed over (which then waits for it): the
    order two workers' timing could give. Returns the method it replaced."""
    from roundpipe.runtime.grad_router import CallGrads

    move = CallGrads.move

    def late_move(self, stages):
        stages = list(stages)
        if stages == [len(self.params) - 1] and self.reducer is not None:
            go = threading.Event()

            def hand_later():
                go.wait()
                move(self, stages)

            thread = threading.Thread(target=hand_later)
            thread.start()
            self.late = (go, thread)
            return
        late = getattr(self, "late", None)
        if late is not None and any(self.params[s] for s in stages):
            self.late = None
            late[0].set()
            move(self, stages)
            late[1].join()
            return
        move(self, stages)

    CallGrads.move = late_move
    return move


def train(cfg, rank=0, world=1, dp=None):
    """The loop; ``dp`` None: one process on the whole global batch."""
    cfg = {**DEFAULTS, **cfg}
    if not cfg["hand_late"]:
        return _train(cfg, rank, world, dp)
    from roundpipe.runtime.grad_router import CallGrads

    move = hand_last_stage_late()
    try:
        return _train(cfg, rank, world, dp)
    finally:  # this process may run more (tests/rank_pool_worker.py)
        CallGrads.move = move


def _train(cfg, rank, world, dp):
    model, opt, scaler = build(cfg, shard=dp is not None and cfg["shard"], rank=rank)
    if dp is not None:
        dp = rpd.DataParallel(model, bucket_cap_mb=dp.get("bucket_cap_mb", 25.0))
    start = 0
    if cfg["resume"]:
        state = torch.load(cfg["resume"], weights_only=True)
        model.load_state_dict(state["model"])
        model.load_master_state_dict(state["masters"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start = state["iteration"] + 1
    nm = cfg["num_microbatch"]
    record = {"scales": {}, "skipped": {}, "losses": {}, "norms": {}, "error": None}
    fail = cfg["fail"] if cfg["fail"] and cfg["fail"]["rank"] == rank else None

    parts = cfg["accumulate"]
    fail_in_backward = cfg["fail_in_backward"]
    if fail_in_backward is not None and fail_in_backward["rank"] != rank:
        fail_in_backward = None
    current = {"it": None}

    def loss_fn(out, label):
        if fail_in_backward is not None and current["it"] == fail_in_backward["step"]:
            raise ValueError(f"rank {rank} fails in loss_fn on purpose at {current['it']}")
        return scaler.scale(F.cross_entropy(out.float(), label)) / (nm * parts)

    it = start
    failing_since = None
    call = "forward_backward"
    try:
        for it in range(start, cfg["steps"]):
            if any(f and it == f["step"] for f in (cfg["fail"], cfg["fail_in_backward"])):
                failing_since = time.monotonic()
            if fail is not None and it == fail["step"]:
                if fail["how"] == "raise":
                    raise ValueError(f"rank {rank} fails on purpose at iteration {it}")
                if fail["how"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fail["how"] == "hang":
                    threading.Event().wait()  # the test kills this process
            x, y = global_batch(it, cfg)
            if dp is not None:
                x, y = rpd.shard((x, y))
            record["scales"][it] = scaler.get_scale()
            call = "forward_backward"
            current["it"] = it
            try:
                loss = sum(
                    model.forward_backward(input_args=(xp,), label=yp, loss_fn=loss_fn).item()
                    for xp, yp in zip(x.chunk(parts), y.chunk(parts))
                )
            except ValueError as exc:
                if fail_in_backward is None or not fail_in_backward.get("survive"):
                    raise
                # Step without the call's gradients: zero ones through a plain backward (no
                # collective), since a step needs gradients.
                record["survived"] = str(exc)
                (model(x[:2]).float().sum() * 0.0).backward()
                loss = float("nan")
            if cfg["extra_backward"]:
                # Gradients that reach the masters through autograd's hooks, not a call's sums.
                out = model(x[:2])
                (scaler.scale(out.float().square().mean()) * 0.1).backward()
            if it == start:
                record["grads_after_forward_backward"] = {
                    rec.name: (rec.held, rec.master.grad is not None)
                    for rec in model.state_access().params.records
                    if rec.master is not None
                }
            record["losses"][it] = loss

            def step_fn(it=it):
                if cfg["inf_step"] == it and cfg["inf_rank"] in (None, rank):
                    # After the gradient all-reduce, on one rank only: only the agreement on
                    # found_inf can make the other ranks skip this step too.
                    next(iter(model.optim_parameters())).grad.view(-1)[0] = float("inf")
                if cfg["clip"] is not None:
                    scaler.unscale_(opt)
                    if dp is not None:
                        record["norms"][it] = dp.clip_grad_norm_(cfg["clip"]).item()
                    else:
                        record["norms"][it] = torch.nn.utils.clip_grad_norm_(
                            list(model.optim_parameters()), cfg["clip"]
                        ).item()
                scaler.step(opt)
                record["skipped"][it] = scaler.step_was_skipped(opt)
                opt.zero_grad()

            call = "step"
            model.step(step_fn, is_async=cfg["mode"] == "async")
            call = "scaler.update"
            scaler.update()
            if cfg["save_after"] == it and rank == 0:
                torch.save(
                    {
                        "iteration": it,
                        "model": model.state_dict(),
                        "masters": model.master_state_dict(),
                        "optimizer": opt.state_dict(),
                        "scaler": scaler.state_dict(),
                    },
                    os.path.join(cfg["out"], "ckpt.pt"),
                )
        call = "synchronize"
        model.synchronize()
    except rpd.DataParallelError as exc:
        record["error"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "call": call,
            "iteration": it,
            "seconds": time.monotonic() - (failing_since or time.monotonic()),
        }
        # The library stays usable: a checkpoint can still be taken, and a later step fails at
        # once instead of waiting for another timeout.
        record["masters_after_error"] = model.master_state_dict()
        record["scaler_after_error"] = scaler.state_dict()
        t0 = time.monotonic()
        try:
            model.forward_backward(
                input_args=(rpd.shard(global_batch(it, cfg))[0],),
                label=rpd.shard(global_batch(it, cfg))[1],
                loss_fn=loss_fn,
            )
            model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
        except rpd.DataParallelError as again:
            record["error"]["again"] = str(again)
            record["error"]["again_seconds"] = time.monotonic() - t0
    record["num_trainable"] = sum(1 for p in model.module.parameters() if p.requires_grad)
    record["master_storage_bytes"] = sum(
        m.untyped_storage().nbytes() for m in model.state_access().params.grad_targets
    )
    record["masters_in_files"] = [
        master_file.file_of_master(m) is not None for m in model.optim_parameters()
    ]
    record["optimizer_state_bytes"] = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    record["masters"] = model.master_state_dict()
    try:
        record["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    except RuntimeError as exc:  # sharded: the weight broadcast failed part way
        if record["error"] is None:
            raise
        record["params"] = str(exc)
    record["scaler"] = scaler.state_dict()
    if dp is not None and record["error"] is None:
        record["replicas_identical"] = dp.replicas_identical()
        # The reduction buffers the DataParallel allocated, and what the plan counts for them.
        record["dp_buffer_bytes"] = sum(
            t.untyped_storage().nbytes() for ring in dp._rings.values() for t in ring
        ) + sum(
            t.untyped_storage().nbytes()
            for t in (dp._reducer._flats.values() if dp._reducer is not None else ())
        )
        record["planned_dp_buffer_bytes"] = model.memory_plan().host.data_parallel
    if dp is not None:
        dp.close()
    return record


def main():
    cfg = {**DEFAULTS, **json.loads(sys.argv[1])}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg.update(cfg.get("by_rank", {}).get(str(rank), {}))
    wait_for_go()
    rpd.init_process_group("gloo", timeout=cfg["pg_timeout"])
    record = train(cfg, rank, world, dp=cfg.get("dp", {}))
    torch.save(record, os.path.join(cfg["out"], f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
