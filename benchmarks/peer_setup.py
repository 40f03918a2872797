"""Prepare the side-by-side GPU harness (../shared/gpu) in .peer/ for a GPU run, in one command:

    python benchmarks/peer_setup.py            # where pip can reach the package index
    # then, on the GPU machine, from the project's root (carry .peer), one call of ~9 minutes:
    bash benchmarks/gpu_offload.sh     # or benchmarks/gpu_session.sh

It copies the harness into .peer/ (in .gitignore) and patches it:

- its ``ours_wrap_hf`` runs ``roundpipe.hf.wrap`` with the documented HuggingFace loop (fp16
  model, fp32 masters, roundpipe's GradScaler and Adam); ``ROUNDPIPE_BENCH_COMPILE``: 1 for
  ``compile=True``, 0 for ``compile=False``, unset for wrap's default. The GPT's ``RoundPipe``
  takes ``compile=True`` from it too, else its default;
- the plain PyTorch baselines compile their decoder layers or blocks under
  ``PLAIN_BENCH_COMPILE=1`` (``nn.Module.compile`` in place, as a user would);
- it loads benchmarks/gpu_rows.py from the checkout (so that file travels with the checkout,
  not with .peer/): every contender's process applies the cap of ``$BENCH_GPU_CAP_GIB`` first
  (a GPU of that many GiB: the allocator's fraction and ``mem_get_info``), every row prints its
  model FLOPs per token and MFU, the allocator's reserved peak and what the process held on the
  device, and ``--model hf --config CONFIG.json`` runs a config-driven model (random weights,
  built fast; ``--lora R``, ``--dtype``, ``--memory-plan``) through ``--impl ours``,
  ``upstream`` or ``fsdp2`` (PyTorch FSDP2 with CPU offload, a contender of its own).

It downloads, for the GPU machine's Python, the public RoundPipe's wheels with a transformers
it runs on (4.57: it is written for the 4.5x API, and the GPU machine's 5.x fails inside its
Qwen3 model) and a peft of that era for its LoRA row, all installed into the peer's own folder
there; and, with
``--carry-transformers VERSION``, a transformers wheel for roundpipe's side (.peer/whl-extra),
for a machine whose own transformers roundpipe does not support.
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The public RoundPipe and what it runs on that the GPU machine lacks: a 4.5x transformers and
# the tokenizers and huggingface_hub that version takes (installed with --no-deps beside it).
PEER_WHEELS = (
    "roundpipe==0.1.1",
    "beartype==0.23.1",
    "transformers==4.57.6",
    "tokenizers==0.22.2",
    "huggingface_hub==0.36.2",
    "peft==0.17.1",  # the LoRA row: peft for transformers 4.5x (the machine's is for its 5.x)
)

OURS_WRAP_HF = '''def ours_wrap_hf(model, mb):
    """roundpipe.hf.wrap with the documented HuggingFace loop (set by benchmarks/peer_setup.py)."""
    import roundpipe
    from roundpipe import GradScaler, OptimizerCtx, RoundPipeRunConfig

    import os
    rp = roundpipe.hf.wrap(model, optim_dtype=torch.float32,
                           compile={"1": True, "0": False}.get(
                               os.environ.get("ROUNDPIPE_BENCH_COMPILE", "")),
                           model_run_config=RoundPipeRunConfig(num_microbatch=mb))
    with OptimizerCtx():
        opt = roundpipe.optim.Adam(rp.parameters(), lr=1e-5)
    scaler = GradScaler()

    def run(ids, labels, mb):
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        scale = scaler.get_scale()
        loss = rp.forward_backward(input_kwargs=batch, loss_fn=lambda l, _: scaler.scale(l))
        rp.step(lambda: (scaler.step(opt), opt.zero_grad()))
        scaler.update()
        return loss.item() / scale

    return rp, run
'''


GPT_ROUNDPIPE = (
    "rp = RoundPipe(model, optim_dtype=torch.float32, model_run_config=cfg, "
    "compile={'1': True, '0': False}.get(__import__('os').environ.get("
    "'ROUNDPIPE_BENCH_COMPILE', ''), False))"
)


# The plain baselines with compiled layers under $PLAIN_BENCH_COMPILE=1, as a user of plain
# PyTorch would compile them (nn.Module.compile in place, torch's defaults): each decoder layer
# of the HF model, each block of the GPT; gradient checkpointing recomputes the compiled call.
PLAIN_COMPILE_QWEN3 = (
    "model.train()\n"
    "        if os.environ.get('PLAIN_BENCH_COMPILE') == '1':\n"
    "            for layer in model.model.layers:\n"
    "                layer.compile()"
)
PLAIN_COMPILE_GPT = (
    "model = model.to(dev)\n"
    "        if os.environ.get('PLAIN_BENCH_COMPILE') == '1':\n"
    "            for block in list(model)[1:-1]:\n"
    "                block.compile()"
)


# benchmarks/gpu_rows.py, from the checkout beside .peer/ (never the public RoundPipe's path).
IMPORT_ROWS = (
    "import torch.nn.functional as F\n"
    "sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "
    "'benchmarks'))\n"
    "import gpu_rows  # the cap, MFU, --model hf and FSDP2 (benchmarks/gpu_rows.py)\n"
)
# Each contender's own FLOPs per token, computed on the model as built.
FLOPS = (
    "nparams = sum(t.numel() for t in model.parameters())\n"
    "    fpt = gpu_rows.flops_per_token(model, a.seq, gpu_rows.harness_dims(model, a))"
)


def patch(text: str, pattern: str, replacement: str, what: str, path: Path, count: int = 1) -> str:
    """``text`` with the ``count`` matches of ``pattern`` replaced; exits naming ``what``
    otherwise."""
    text, found = re.subn(pattern, lambda _: replacement, text)
    if found != count:
        sys.exit(f"{path}: {what} not found {count} times (matched {found}); patch it by hand")
    return text


def patched_harness(text: str, bench: Path) -> str:
    """The shared harness's ``peer_bench.py`` (``text``, read from ``bench``) with this
    project's patches (see the module's docstring); exits naming a patch that does not
    apply."""
    text = patch(
        text,
        r"def ours_wrap_hf\(model, mb\):\n(?:    .*\n|\n)*?(?=\n\ndef )",
        OURS_WRAP_HF,
        "ours_wrap_hf",
        bench,
    )
    # The GPT's RoundPipe at its defaults, or with compiled blocks under $ROUNDPIPE_BENCH_COMPILE.
    text = patch(
        text,
        r"rp = RoundPipe\(model, optim_dtype=torch.float32, model_run_config=cfg\)",
        GPT_ROUNDPIPE,
        "the GPT's RoundPipe(...) line",
        bench,
    )
    text = patch(text, r"model\.train\(\)", PLAIN_COMPILE_QWEN3, "qwen3's model.train()", bench)
    text = patch(text, r"model = model\.to\(dev\)", PLAIN_COMPILE_GPT, "the GPT's .to(dev)", bench)
    # benchmarks/gpu_rows.py: the cap first, FLOPs and MFU in every row, --model hf, fsdp2.
    text = patch(text, r"import torch\.nn\.functional as F\n", IMPORT_ROWS, "the F import", bench)
    text = patch(
        text,
        r'choices=\["ours", "upstream", "torch"\]',
        'choices=["ours", "upstream", "torch", "fsdp2"]',
        "--impl's choices",
        bench,
    )
    text = patch(
        text, r'choices=\["gpt", "qwen3"\]', 'choices=["gpt", "qwen3", "hf"]', "--model's", bench
    )
    text = patch(
        text,
        r"    a = p\.parse_args\(\)\n",
        "    gpu_rows.add_arguments(p)\n    a = p.parse_args()\n    gpu_rows.apply_cap()\n",
        "parse_args()",
        bench,
    )
    text = patch(
        text,
        r'    if a\.model == "qwen3":\n',
        '    if a.model == "hf":\n        return gpu_rows.run_hf(a)\n    if a.model == "qwen3":\n',
        "the qwen3 dispatch",
        bench,
    )
    text = patch(
        text,
        r"nparams = sum\(t\.numel\(\) for t in model\.parameters\(\)\)",
        FLOPS,
        "the two parameter counts",
        bench,
        count=2,
    )
    text = patch(
        text,
        r"print\(json\.dumps\(res\), flush=True\)",
        "print(json.dumps(gpu_rows.finish(res, fpt)), flush=True)",
        "the two result lines",
        bench,
        count=2,
    )
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shared", default=str(ROOT.parent / "shared" / "gpu"), help="the harness's folder"
    )
    parser.add_argument(
        "--python-version", default="3.12", help="the GPU machine's Python (default 3.12)"
    )
    parser.add_argument("--no-download", action="store_true", help="copy and patch only")
    parser.add_argument(
        "--carry-transformers",
        metavar="VERSION",
        help="also download this transformers for roundpipe's side (.peer/whl-extra)",
    )
    args = parser.parse_args()

    src, peer = Path(args.shared), ROOT / ".peer"
    peer.mkdir(exist_ok=True)
    for name in ("peer_bench.py", "run.sh", "README.md"):
        (peer / name).write_bytes((src / name).read_bytes())
    bench = peer / "peer_bench.py"
    bench.write_text(patched_harness(bench.read_text(), bench))
    if not args.no_download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--python-version", args.python_version, "--implementation", "cp",
             "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
             "--platform", "manylinux2014_x86_64",
             "-d", str(peer / "whl"), *PEER_WHEELS],
            check=True,
        )  # fmt: skip
        if args.carry_transformers:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 "-d", str(peer / "whl-extra"), f"transformers=={args.carry_transformers}"],
                check=True,
            )  # fmt: skip
    print(
        f"ready: {peer} (carry .peer; on the GPU machine: bash benchmarks/gpu_offload.sh, "
        "or bash benchmarks/gpu_session.sh)"
    )


if __name__ == "__main__":
    main()
