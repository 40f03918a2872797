"""Data parallelism across processes: the digits classifier of digits_classifier.py on several
ranks, each on its shard of every global batch, launched by torchrun.

    torchrun --standalone --nproc-per-node 2 examples/data_parallel.py [--steps 300]

Started without torchrun (``python examples/data_parallel.py``) it trains as a single rank.

Every rank builds the same model and runs the same loop. ``DataParallel`` gives every rank rank
0's parameters, and each step averages the masters' gradients over the ranks on the optimizer
thread (overlapping the next iteration's compute), so the masters stay identical everywhere.
Each rank takes its share of the global batch (``shard``) and computes the mean loss of that
share: the averaged gradient is then the gradient of the mean loss over the global batch. Rank
0 prints; at the end every rank checks that the replicas are bitwise identical.
On machines with GPUs, give each rank its own: ``--devices cuda:$LOCAL_RANK`` (torchrun sets
``LOCAL_RANK``). See docs/distributed.md.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import roundpipe
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe import distributed as rpd


def load_data(seed):
    digits = load_digits()  # bundled with sklearn: nothing is downloaded
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        torch.arange(len(y)).numpy(), test_size=0.2, random_state=seed, stratify=digits.target
    )
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training iterations (default 300)")
    parser.add_argument(
        "--global-batch-size",
        type=int,
        default=64,
        help="samples per step over all ranks (a multiple of the world size)",
    )
    parser.add_argument(
        "--num-microbatch",
        type=int,
        default=2,
        help="microbatches each rank splits its share into (default 2)",
    )
    parser.add_argument(
        "--lr", type=float, default=2e-3, help="Adam's learning rate (default 2e-3)"
    )
    parser.add_argument("--devices", default="cpu", help="this rank's device pool, e.g. cuda:0")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds a collective may wait for the other ranks",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the data split and the batch order (the same on every rank)",
    )
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the timeout turns a failed
    # rank into a DataParallelError on the others instead of a hang.
    if "RANK" in os.environ:
        rpd.init_process_group(timeout=args.timeout)
    else:  # started as a plain script: one rank, in this process
        print(
            "not started by torchrun: training as one rank (world size 1); for two ranks run\n"
            "    torchrun --standalone --nproc-per-node 2 examples/data_parallel.py",
            flush=True,
        )
        rpd.init_process_group(
            timeout=args.timeout, store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(args.seed + rank)  # ranks may differ: DataParallel broadcasts rank 0's state
    x_train, y_train, x_test, y_test = load_data(args.seed)

    seq_model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    num_mb = args.num_microbatch
    model = RoundPipe(
        seq_model.half(),
        optim_dtype=torch.float32,
        devices=args.devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_mb),
    )
    dp = rpd.DataParallel(model)  # every rank now holds rank 0's parameters
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=args.lr)
    scaler = GradScaler(growth_interval=50)
    if rank == 0:
        print(
            f"roundpipe {roundpipe.__version__}: {world} rank{'s' if world > 1 else ''}, global batch "
            f"{args.global_batch_size} ({args.global_batch_size // world} per rank), "
            f"{num_mb} microbatches per rank, timeout {args.timeout:g} s",
            flush=True,
        )

    def loss_fn(out, label):  # the mean over this rank's share, as in one process
        return scaler.scale(F.cross_entropy(out.float(), label)) / num_mb

    # The same shuffled order on every rank (same seed); each takes its share of each batch.
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.steps), desc="training", unit="step", disable=rank != 0)
    perm, pos = torch.randperm(len(x_train), generator=gen), 0
    for it in bar:
        if pos + args.global_batch_size > len(perm):
            perm, pos = torch.randperm(len(x_train), generator=gen), 0
        idx = perm[pos : pos + args.global_batch_size]
        pos += args.global_batch_size
        x, y = rpd.shard((x_train[idx].half(), y_train[idx]))
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        if it % 25 == 0 or it == args.steps - 1:
            bar.set_postfix(
                loss=f"{loss.item() / scaler.get_scale():.3f}", scale=f"{scaler.get_scale():g}"
            )
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))  # averages, then steps
        scaler.update()
    model.synchronize()

    identical = dp.replicas_identical()  # every rank takes part
    if rank == 0:
        with torch.no_grad():
            logits = model(x_test.half())
        accuracy = (logits.argmax(dim=1) == y_test).float().mean().item()
        snap = scaler.snapshot()
        print(f"masters identical on every rank: {identical}")
        print(f"loss scale: {snap.newest_scale:g}, skipped steps: {snap.skipped_steps}")
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    dp.close()
    torch.distributed.destroy_process_group()
    if not identical:
        raise SystemExit(f"rank {rank}: the replicas differ")


if __name__ == "__main__":
    main()
