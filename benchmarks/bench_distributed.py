"""Data parallelism: what the gradient average costs per step and how much of it the async step
hides, on processes of this machine (gloo over 127.0.0.1); and the state sharded over the ranks
(``ShardedState``): its iteration time against the replicated run's, and each rank's host RSS
against the plan.

Each configuration runs as its own set of processes, one after the other:

* ``1 process``: the loop without DataParallel (the per-rank work of the others, alone);
* ``N ranks, sync``: ``model.step(fn, is_async=False)``, the all-reduce on the critical path;
* ``N ranks, async``: ``model.step(fn)``, the all-reduce overlapping the next iteration;
* ``N ranks, sharded, sync|async``: the same with ``state_placement=ShardedState()``: the
  gradients reduced onto their owners, the weights broadcast in the master->model copy;
* ``N ranks, FSDP2``, the baseline for the sharded state: torch's own
  ``torch.distributed.fsdp.fully_shard`` on the same ranks, model, data and loop (each block,
  then the root, over a CPU mesh on gloo; ``MixedPrecisionPolicy`` gathering in the dtype
  roundpipe computes in, reducing in fp32 onto fp32 shards; the same per-layer non-reentrant
  recompute as roundpipe's default; the microbatches' gradients summed locally and
  reduce-scattered once; the fastest optimizer implementation that takes its DTensor
  parameters on the CPU), in its fastest standard setting for gradient accumulation: a
  block's parameters gathered once per iteration (``reshard_after_forward=False``,
  ``set_reshard_after_backward`` on the last microbatch only);
* ``N ranks, FSDP2, resharded``: the same with fully_shard's default resharding (gathered for
  every microbatch's forward and again for its backward), the setting of ``--memory``.

Every rank runs the same per-rank batch, so a perfect data-parallel run takes the time of
``1 process`` per iteration. Printed: the median iteration time on rank 0 (main thread), its
ratios to ``1 process`` and to ``N ranks, FSDP2``, and the median time of the gradient
reduction on roundpipe's optimizer thread. The configurations alternate, ``--rounds`` times;
each cell is the median over the rounds of the per-round medians.

``--memory``: a transformers Llama of ``--memory-layers`` decoder layers (fp16 compute, fp32
masters, Adam), trained a few steps by replicated roundpipe ranks, sharded roundpipe ranks and
FSDP2 ranks, alternating ``--rounds`` times; printed per rank (medians over the rounds): host
RSS added by the model and its training (VmRSS after training, less VmRSS before the model was
built, free heap trimmed) per parameter, the peak (VmHWM, restarted after the model's
initialisation; for FSDP2, after ``fully_shard``) likewise, both also as ratios to the FSDP2
rank's, against the ideal (2 + 16/N bytes per parameter roundpipe sharded, 18 replicated, 16/N
FSDP2) and the plan's prediction (``python -m roundpipe plan CONFIG --ranks N``, whose host
total this calls ``plan_config`` for); then rank 0's loss at every step, a check that FSDP2
trains the same model.

    python benchmarks/bench_distributed.py [--ranks 2] [--layers 8] [--width 1024] [--iters 30]
    python benchmarks/bench_distributed.py --memory [--ranks 2] [--memory-devices cpu:2]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM_MICROBATCH = 2  # the iteration benchmark's microbatches per iteration, every configuration


def _linear_stack(cfg):
    """The iteration benchmark's model, the same for every configuration: Linear + Tanh pairs in
    fp32, seeded."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(cfg["layers"]):
        layers += [nn.Linear(cfg["width"], cfg["width"]), nn.Tanh()]
    return nn.Sequential(*layers)


def worker(cfg):
    import torch
    import torch.nn.functional as F

    from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
    from roundpipe import distributed as rpd

    seq_model = _linear_stack(cfg)
    if cfg["dp"]:
        rpd.init_process_group("gloo", timeout=120)
    model = RoundPipe(
        seq_model,
        optim_dtype=torch.float32,
        devices="cpu",
        model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH),
        state_placement=rpd.ShardedState() if cfg.get("shard") else None,
    )
    reduce_times = []
    if cfg["dp"]:
        # Step pre-hooks run in registration order: DataParallel's gradient average between
        # these two.
        started = []
        model.register_step_pre_hook(lambda: started.append(time.perf_counter()))
        dp = rpd.DataParallel(model)
        model.register_step_pre_hook(
            lambda: reduce_times.append(time.perf_counter() - started.pop())
        )
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(cfg["batch"], cfg["width"])
    target = torch.randn(cfg["batch"], cfg["width"])
    times = []
    for it in range(cfg["warmup"] + cfg["iters"]):
        t0 = time.perf_counter()
        model.forward_backward(
            input_args=(x,),
            label=target,
            loss_fn=lambda out, y: F.mse_loss(out, y) / NUM_MICROBATCH,
        )
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=cfg["async"])
        if it >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    model.synchronize()
    if cfg["dp"]:
        dp.close()
        torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        skip = cfg["warmup"]
        print(
            json.dumps(
                {
                    "iteration_ms": 1e3 * statistics.median(times),
                    "reduce_ms": 1e3 * statistics.median(reduce_times[skip:])
                    if reduce_times
                    else None,
                }
            )
        )


def _fully_shard(model, blocks, param_dtype, reshard_after_forward=True):
    """torch's FSDP2 as its users set it up: ``fully_shard`` on each block, then on the root,
    over a CPU mesh of every rank (gloo). Each rank keeps a shard of the parameters in their own
    dtype (fp32: the masters), gathers a block's in ``param_dtype`` for its forward and backward
    (once for both with ``reshard_after_forward=False``), and reduce-scatters its gradients in
    fp32 onto fp32 gradient shards."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp_worker(cfg):
    """``N ranks, FSDP2``: the iteration benchmark's model, data and loop under torch's FSDP2."""
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=120))
    seq_model = _linear_stack(cfg)
    # roundpipe recomputes each stage (one layer: a Linear or a Tanh) under non-reentrant
    # checkpoint (RoundPipeRunConfig's default recompute=True): the same here, per layer.
    model = nn.Sequential(
        *(
            checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            for layer in seq_model
        )
    )
    # The stack computes in fp32 under roundpipe too: no lower param_dtype to gather in.
    # cfg["reshard"] False: the blocks' parameters, gathered by the first microbatch's forward,
    # stay unsharded until the last microbatch's backward (one all-gather per block and
    # iteration instead of two per microbatch; more memory, less communication).
    blocks = [m for m in model if list(m.parameters())]
    _fully_shard(model, blocks, torch.float32, reshard_after_forward=cfg["reshard"])
    # fused SGD has no DTensor sharding rule in torch 2.13 (NotImplementedError: "Operator
    # aten._fused_sgd_.default does not have a sharding strategy registered"): foreach, the
    # next fastest.
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, foreach=True)
    x = torch.randn(cfg["batch"], cfg["width"])
    target = torch.randn(cfg["batch"], cfg["width"])
    chunks = list(zip(x.chunk(NUM_MICROBATCH), target.chunk(NUM_MICROBATCH)))
    times = []
    for it in range(cfg["warmup"] + cfg["iters"]):
        t0 = time.perf_counter()
        for mb_index, (x_mb, y_mb) in enumerate(chunks):
            # Gradient accumulation as FSDP2 does it: the unsharded gradients of the microbatches
            # are summed locally and reduce-scattered once, after the last.
            last = mb_index == len(chunks) - 1
            model.set_requires_gradient_sync(last)
            if not cfg["reshard"]:
                model.set_reshard_after_backward(last)
            (F.mse_loss(model(x_mb), y_mb) / NUM_MICROBATCH).backward()
        opt.step()
        opt.zero_grad()
        if it >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"iteration_ms": 1e3 * statistics.median(times), "reduce_ms": None}))


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _trim():
    """Return the heap's free memory to the OS (glibc's malloc_trim), so RSS counts live data."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _llama(cfg):
    """The memory benchmark's model and batch, the same for every configuration: the fp16 Llama
    of ``cfg["config"]`` (seeded), its parameter count, and one sequence of ``seq_len`` tokens
    (from a generator of its own, so that what a configuration draws before does not change it).
    Also returns VmRSS before the model was built."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    before = _status_bytes("VmRSS")
    torch.manual_seed(0)
    config = LlamaConfig(**json.loads(Path(cfg["config"]).read_text()))
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    numel = sum(p.numel() for p in hf.parameters())
    ids = torch.randint(
        0, config.vocab_size, (1, cfg["seq_len"]), generator=torch.Generator().manual_seed(1)
    )
    return hf, numel, ids, before


def _restart_peak(before):
    """The model's initialisation (in fp32, then cast) leaves freed heap behind: hand it back to
    the OS and restart the peak (Linux: clear_refs 5 resets VmHWM), so that what follows counts
    the weights, the wrap and the training only. Returns the RSS the model added."""
    _trim()
    weights = _status_bytes("VmRSS") - before
    Path("/proc/self/clear_refs").write_text("5")
    return weights


def _train(steps, train_step):
    """Run ``train_step() -> loss`` ``steps`` times; returns the times (s) and the losses."""
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(float(train_step()))
        times.append(time.perf_counter() - t0)
    return times, losses


def _report(numel, weights, before, times, losses):
    """Print this rank's memory (peak since _restart_peak; RSS now, free heap trimmed), median
    iteration time (the first step left out) and losses as one JSON line."""
    peak = _status_bytes("VmHWM") - before
    _trim()
    rss = _status_bytes("VmRSS") - before
    print(
        json.dumps(
            {
                "rank": int(os.environ["RANK"]),
                "numel": numel,
                "weights": weights,
                "rss": rss,
                "peak": peak,
                "iteration_s": statistics.median(times[1:] or times),
                "losses": losses,
            }
        )
    )


def memory_worker(cfg):
    import torch

    import roundpipe
    from roundpipe import OptimizerCtx, RoundPipeRunConfig
    from roundpipe import distributed as rpd

    rpd.init_process_group("gloo", timeout=600)
    hf, numel, ids, before = _llama(cfg)
    weights = _restart_peak(before)
    model = roundpipe.hf.wrap(
        hf,
        optim_dtype=torch.float32,
        devices=cfg["devices"],
        check=False,
        memory_check=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=1),
        state_placement=rpd.ShardedState() if cfg["shard"] else None,
    )
    dp = rpd.DataParallel(model)
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=1e-5)
    batch = {"input_ids": ids, "labels": ids}

    def train_step():
        loss = model.forward_backward(input_kwargs=batch)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        return loss

    times, losses = _train(cfg["steps"], train_step)
    model.synchronize()
    _report(numel, weights, before, times, losses)
    dp.close()
    torch.distributed.destroy_process_group()


def fsdp_memory_worker(cfg):
    """``FSDP2``: the memory benchmark's model, batch and loop under torch's FSDP2."""
    from datetime import timedelta

    import torch

    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=600))
    hf, numel, ids, before = _llama(cfg)
    # FSDP2 shards the parameters in their own dtype: the fp32 masters, here the fp16
    # initialisation cast up, as roundpipe's masters are. The whole fp32 model exists on every
    # rank until fully_shard has sharded it; _restart_peak leaves that out, as a user who
    # initialises on the meta device and loads a checkpoint into the shards never holds it.
    hf.float()
    hf.train()
    # roundpipe recomputes every stage (RoundPipeRunConfig's default recompute=True), each decoder
    # layer under non-reentrant checkpoint: transformers' activation checkpointing does that
    # (older transformers name it gradient_checkpointing_enable, now its deprecated alias).
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _fully_shard(hf, hf.model.layers, torch.float16)
    weights = _restart_peak(before)
    opt = torch.optim.Adam(hf.parameters(), lr=1e-5, fused=True)

    def train_step():
        loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    _report(numel, weights, before, *_train(cfg["steps"], train_step))
    torch.distributed.destroy_process_group()


def memory(args):
    import torch

    from roundpipe.hf.memory_cli import plan_config

    spec = {
        "vocab_size": 16000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": args.memory_layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    out = Path(os.environ.get("TMPDIR", "/tmp")) / "roundpipe_bench_distributed"
    out.mkdir(exist_ok=True)
    config = out / "config.json"
    config.write_text(json.dumps({**spec, "model_type": "llama"}))
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores; Llama config {json.dumps(spec)}; "
        f"fp16 compute, fp32 masters, Adam; seq len {args.seq_len}, {args.memory_steps} steps, "
        f"{args.rounds} round(s); roundpipe devices {args.memory_devices!r}"
    )
    n = args.ranks
    base = {
        "memory": True,
        "config": str(config),
        "seq_len": args.seq_len,
        "steps": args.memory_steps,
        "threads": args.threads,
        "devices": args.memory_devices,
    }
    contenders = {
        "replicated": {**base, "shard": False},
        "sharded": {**base, "shard": True},
        "FSDP2": {**base, "fsdp": True},
    }
    runs: dict[str, list] = {name: [] for name in contenders}
    for _ in range(args.rounds):  # the contenders alternate
        for name, cfg in contenders.items():
            runs[name].append(launch(n, cfg, all_ranks=True))
    plans = {
        name: plan_config(
            str(config), seq_len=args.seq_len, dtype=torch.float16, ranks=n if shard else 1
        ).host.total
        for name, shard in (("replicated", False), ("sharded", True))
    }
    ideals = {"replicated": 18, "sharded": 2 + 16 / n, "FSDP2": 16 / n}

    def median(name, rank, key):
        return statistics.median(r[rank][key] for r in runs[name])

    print(
        "| ranks | state | rank | params | weights (B/param) | RSS after training (B/param) "
        "| RSS / FSDP2 | peak RSS (B/param) | peak / FSDP2 | plan (B/param) | ideal "
        "| iteration (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in contenders:
        for rank in range(n):
            numel = runs[name][0][rank]["numel"]
            rss, peak = median(name, rank, "rss"), median(name, rank, "peak")
            plan = f"{plans[name] / numel:.2f}" if name in plans else "-"
            print(
                f"| {n} | {name} | {rank} | {numel / 1e6:.1f}M | "
                f"{median(name, rank, 'weights') / numel:.2f} | {rss / numel:.2f} | "
                f"{rss / median('FSDP2', rank, 'rss'):.2f} | {peak / numel:.2f} | "
                f"{peak / median('FSDP2', rank, 'peak'):.2f} | {plan} | {ideals[name]:.2f} | "
                f"{median(name, rank, 'iteration_s'):.2f} |",
                flush=True,
            )
    # A sanity check that FSDP2 trains the same model: the losses of rank 0, first round. The
    # roundpipe runs step one step stale (model.step's default): step k computes with the
    # parameters of step k - 2, so their losses k = 0, 1 are FSDP2's loss 0, and their loss k
    # (k >= 2) FSDP2's loss k - 1.
    for name in contenders:
        losses = ", ".join(f"{x:.6f}" for x in runs[name][0][0]["losses"])
        print(f"losses, {name}: {losses}")
    print(
        f"plan command: python -m roundpipe plan {config} --seq-len {args.seq_len} "
        f"--dtype fp16 --ranks {n}"
    )


def launch(world, cfg, all_ranks=False):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
                PYTHONPATH=str(ROOT),
                OMP_NUM_THREADS=str(cfg["threads"]),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", json.dumps(cfg)],
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    if all_ranks:
        return [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return json.loads(outs[0].strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the contenders")
    parser.add_argument("--memory", action="store_true", help="host RSS per rank (see above)")
    parser.add_argument("--memory-layers", type=int, default=4)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument(
        "--memory-devices",
        default="cpu",
        help="roundpipe's pool in --memory: 'cpu' (one fused call, every gradient sum at its "
        "end) or e.g. 'cpu:2' (sums handed over stage by stage, as on an accelerator)",
    )
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    if args.worker:
        cfg = json.loads(args.worker)
        if cfg.get("memory"):
            fsdp_memory_worker(cfg) if cfg.get("fsdp") else memory_worker(cfg)
        else:
            fsdp_worker(cfg) if cfg.get("fsdp") else worker(cfg)
        return
    if args.memory:
        memory(args)
        return
    import torch

    base = {
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "iters": args.iters,
        "warmup": args.warmup,
        "threads": args.threads,
    }
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, {args.threads} thread(s) per "
        f"process, {params / 1e6:.1f}M fp32 params ({params * 4 / 2**20:.0f} MiB of gradients), "
        f"per-rank batch {args.batch}, {args.iters} iterations"
    )
    n = args.ranks
    rows = [
        ("1 process", 1, {**base, "dp": False, "async": True}),
        (f"{n} ranks, sync", n, {**base, "dp": True, "async": False}),
        (f"{n} ranks, sharded, sync", n, {**base, "dp": True, "async": False, "shard": True}),
        (f"{n} ranks, async", n, {**base, "dp": True, "async": True}),
        (f"{n} ranks, sharded, async", n, {**base, "dp": True, "async": True, "shard": True}),
        (f"{n} ranks, FSDP2", n, {**base, "fsdp": True, "reshard": False}),
        (f"{n} ranks, FSDP2, resharded", n, {**base, "fsdp": True, "reshard": True}),
    ]
    results: dict[str, list] = {name: [] for name, _, _ in rows}
    for _ in range(args.rounds):  # the contenders alternate
        for name, world, cfg in rows:
            results[name].append(launch(world, cfg))
    print(
        "| configuration | iteration (ms) | ratio to 1 process | ratio to FSDP2 "
        "| reduction per step (ms) |"
    )
    print("|---|---|---|---|---|")
    one = statistics.median(r["iteration_ms"] for r in results["1 process"])
    fsdp = statistics.median(r["iteration_ms"] for r in results[f"{n} ranks, FSDP2"])
    for name, _, _ in rows:
        it = statistics.median(r["iteration_ms"] for r in results[name])
        reduces = [r["reduce_ms"] for r in results[name] if r["reduce_ms"] is not None]
        reduce = f"{statistics.median(reduces):.1f}" if reduces else "-"
        print(f"| {name} | {it:.1f} | {it / one:.2f} | {it / fsdp:.2f} | {reduce} |", flush=True)


if __name__ == "__main__":
    main()
