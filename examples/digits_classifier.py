"""A mixed-precision classifier with RoundPipe: fp16 shards, fp32 Adam masters, GradScaler and the
asynchronous optimizer step, on scikit-learn's bundled 8x8 digits (no download).

    python examples/digits_classifier.py [--steps 600] [--dtype fp16|bf16] [--plot out.png]
                                         [--clip 1.0] [--lr-schedule cosine]

The loop is the one in README.md: the model's stages hold fp16 parameters, the optimizer updates
fp32 master copies on the optimizer thread while the next iteration computes (one step stale),
and the loss is scaled so that small fp16 gradients do not flush to zero. ``growth_interval`` is
set low so that a short run shows the scaler at work: the scale grows until fp16 gradients
overflow, the step is skipped and the scale backs off. ``--plot`` saves the loss, the scale in
use and the skipped steps (needs matplotlib, which the ``examples`` extra installs).
``--clip`` and ``--lr-schedule`` show where gradient clipping and a learning-rate scheduler go:
inside the step function, on the masters (README.md, "Clipping and schedulers").
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import roundpipe
from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig, TrainingMonitor
from roundpipe.devices import resolve_devices

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def load_data(seed):
    digits = load_digits()  # 1797 images of 8x8 pixels with values 0..16, bundled with sklearn
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        torch.arange(len(y)).numpy(), test_size=0.2, random_state=seed, stratify=digits.target
    )
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def batches(n, batch_size, generator):
    """Indices of shuffled batches, epoch after epoch, forever."""
    while True:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n - batch_size + 1, batch_size):
            yield perm[start : start + batch_size]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="training iterations (default 600)")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="samples per iteration (default 64)"
    )
    parser.add_argument(
        "--num-microbatch",
        type=int,
        default=4,
        help="microbatches each batch is split into (default 4)",
    )
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="Adam's learning rate (default 1e-3)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp16",
        help="the stages' low-precision dtype (default fp16)",
    )
    parser.add_argument(
        "--devices",
        default=None,
        help="device pool, e.g. cpu:2 (default: ROUNDPIPE_DEVICES, else all CUDA devices, else one CPU worker)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the model, the split and the batch order"
    )
    parser.add_argument(
        "--plot", default=None, metavar="PNG", help="save loss/scale/skipped steps to this file"
    )
    parser.add_argument(
        "--clip",
        type=float,
        default=None,
        metavar="MAX_NORM",
        help="clip the gradient norm of the masters to MAX_NORM, in the step function",
    )
    parser.add_argument(
        "--lr-schedule",
        choices=["constant", "cosine"],
        default="constant",
        help="learning-rate schedule, stepped in the step function (default constant)",
    )
    args = parser.parse_args()
    if args.plot:
        try:  # now, not after training: save_plot at the end needs it
            import matplotlib.figure  # noqa: F401
        except ImportError:
            parser.error(
                "--plot needs matplotlib: `python -m pip install matplotlib`, or the "
                "examples extra from the checkout: "
                '`python -m pip install -e ".[examples]"`'
            )

    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    x_train, y_train, x_test, y_test = load_data(args.seed)

    seq_model = nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )
    num_mb = args.num_microbatch
    model = RoundPipe(
        seq_model.to(dtype),
        optim_dtype=torch.float32,
        devices=args.devices,
        model_run_config=RoundPipeRunConfig(num_microbatch=num_mb),
    )
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(model.parameters(), lr=args.lr)  # built on the fp32 masters
    scaler = GradScaler(growth_interval=50)
    monitor = TrainingMonitor(scaler)
    sched = None
    if args.lr_schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    grad_norms = []  # appended on the optimizer thread, read after model.synchronize()

    def step_fn():  # runs on the optimizer thread, where model.parameters() gives the masters
        if args.clip is not None:
            scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
        scaler.step(opt)
        if sched is not None:
            sched.step()  # here, not on the main thread: a running step would read the lr
        opt.zero_grad()

    print(
        f"roundpipe {roundpipe.__version__}: {len(x_train)} train / {len(x_test)} test digits, "
        f"{args.dtype} shards + fp32 masters, {num_mb} microbatches, devices "
        f"{', '.join(map(str, resolve_devices(args.devices)))}"
    )

    def loss_fn(out, label):  # runs once per microbatch, on a device worker
        return scaler.scale(F.cross_entropy(out.float(), label)) / num_mb

    gen = torch.Generator().manual_seed(args.seed)
    order = batches(len(x_train), args.batch_size, gen)
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for it in bar:
        idx = next(order)
        x, y = x_train[idx].to(dtype), y_train[idx]
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        monitor.record(loss, scaled=True)  # never blocks; converts lazily
        if it % 25 == 0 or it == args.steps - 1:
            # The loss comes back on the CPU (output_device), so item() costs nothing; it was
            # multiplied by the scale in use, which get_scale() returns until update().
            bar.set_postfix(
                loss=f"{loss.item() / scaler.get_scale():.3f}", scale=f"{scaler.get_scale():g}"
            )
        model.step(step_fn)  # on the optimizer thread
        scaler.update()  # never waits for that step
    model.synchronize()  # the model's fp16 params now hold the newest masters

    with torch.no_grad():
        logits = model(x_test.to(dtype))
    accuracy = (logits.argmax(dim=1) == y_test).float().mean().item()
    hist = monitor.history()
    last = hist.loss[-20:]
    print(f"final train loss: {sum(last) / len(last):.4f} (mean of the last {len(last)} steps)")
    print(
        f"loss scale: {scaler.get_scale(up_to_date=True):g}, skipped steps: {hist.skipped_steps} "
        f"at iterations {hist.skipped_iterations}"
    )
    if grad_norms:
        finite = [n.item() for n in grad_norms if torch.isfinite(n)]
        clipped = sum(n > args.clip for n in finite)
        print(
            f"gradient norm before clipping: median {sorted(finite)[len(finite) // 2]:.3f}, "
            f"clipped to {args.clip:g} in {clipped} of {len(finite)} steps"
        )
    if sched is not None:
        print(f"final learning rate: {sched.get_last_lr()[0]:.3g}")
    print(f"test accuracy: {accuracy:.4f}")
    if args.plot:
        monitor.save_plot(args.plot, title=f"digits classifier ({args.dtype} shards, fp32 masters)")
        print(f"plot saved to {args.plot}")


if __name__ == "__main__":
    main()
