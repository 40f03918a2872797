"""roundpipe.GradScaler as a drop-in for torch.amp.GradScaler in a plain PyTorch loop.

No RoundPipe here: an ordinary fp16-autocast loop (forward, scaled backward, unscale_ and
gradient clipping, step, update) is run twice from the same seed, once with torch's scaler and
once with roundpipe's. Every step returns before update(), so roundpipe's scaler runs in its
synchronous mode, which reproduces torch's bit for bit: the same scale sequence, the same
skipped steps, the same parameters. The initial scale is set too high on purpose, so the first
steps overflow in fp16 and are skipped while the scale backs off.

    python examples/scaler_dropin.py [--steps 300]

Runs on the CPU; the data is generated (a three-armed spiral), nothing is downloaded.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import roundpipe


def make_spiral(n_per_class, seed):
    """Three interleaved spiral arms in the plane, one class each."""
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for label in range(3):
        r = torch.linspace(0.1, 1.0, n_per_class)
        theta = r * 4.0 + label * 2.0 * math.pi / 3 + torch.randn(n_per_class, generator=gen) * 0.15
        xs.append(torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1))
        ys.append(torch.full((n_per_class,), label))
    return torch.cat(xs), torch.cat(ys)


def make_model():
    return nn.Sequential(
        nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)
    )


def train(scaler, steps, batch_size=128, desc=""):
    """The loop, exactly as one writes it for torch.amp.GradScaler. Returns per-step scales,
    which steps were skipped, the model and the final loss."""
    torch.manual_seed(0)
    x_all, y_all = make_spiral(400, seed=1)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(2)
    scales, skipped = [], []
    for _ in tqdm(range(steps), desc=desc, leave=False):
        idx = torch.randint(0, len(x_all), (batch_size,), generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x_all[idx])
        loss = F.cross_entropy(logits.float(), y_all[idx])
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # gradients are now in true units ...
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # ... so clipping sees them
        scaler.step(opt)  # skipped if any gradient is inf/NaN
        before = scaler.get_scale()
        scaler.update()
        opt.zero_grad()
        scales.append(before)
        skipped.append(scaler.get_scale() < before)  # a skipped step always backs the scale off
    with torch.no_grad():
        accuracy = (model(x_all).argmax(1) == y_all).float().mean().item()
    return scales, skipped, model, accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help="training steps of each of the two runs (default 300)",
    )
    args = parser.parse_args()

    # Deliberately too high a start (2**24): fp16 gradients overflow until the scale backs off.
    kwargs = dict(init_scale=2.0**24, growth_interval=50)
    t_scales, t_skipped, t_model, t_acc = train(
        torch.amp.GradScaler("cpu", **kwargs), args.steps, desc="torch.amp"
    )
    r_scaler = roundpipe.GradScaler("cpu", **kwargs)
    r_scales, r_skipped, r_model, r_acc = train(r_scaler, args.steps, desc="roundpipe")

    same_params = all(torch.equal(a, b) for a, b in zip(t_model.parameters(), r_model.parameters()))
    snap = r_scaler.snapshot()
    print(
        f"steps: {args.steps}, skipped steps: torch {sum(t_skipped)}, roundpipe {sum(r_skipped)} "
        f"(roundpipe's own count: {snap.skipped_steps})"
    )
    print(f"final scale: torch {t_scales[-1]:g}, roundpipe {r_scales[-1]:g}")
    print(f"train accuracy: torch {t_acc:.3f}, roundpipe {r_acc:.3f}")
    print(f"same scale sequence: {t_scales == r_scales}")
    print(f"same skipped steps: {t_skipped == r_skipped}")
    print(f"bitwise identical parameters: {same_params}")
    # roundpipe's state dict carries torch's five keys, so torch's scaler can load it.
    torch_again = torch.amp.GradScaler("cpu")
    torch_again.load_state_dict(r_scaler.state_dict())
    print(f"torch scaler loaded roundpipe's state dict: scale {torch_again.get_scale():g}")
    ok = t_scales == r_scales and t_skipped == r_skipped and same_params
    print("DROP-IN OK" if ok else "DROP-IN MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
