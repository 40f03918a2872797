#!/bin/bash
# A whole GPU session in one device call (about 9 minutes): smoke and the CUDA tests, wrap's
# compiled layers timed and profiled, the side-by-side benchmark on Qwen3's shape against the
# public RoundPipe and plain transformers, the plan's price beside a profiled GPT iteration, and
# two more host-path settings. The GPT rows are in benchmarks/gpu_followup.sh.
# Prepare .peer/ first where pip works (python benchmarks/peer_setup.py; a transformers wheel the
# GPU machine lacks goes in .peer/whl-extra), carry .peer, and run from the project's root:
#
#     bash benchmarks/gpu_session.sh
#
# Everything lands under $OUT (or /tmp/gpu_out): summary.txt, smoke.log, tests.log, peer.jsonl,
# bench_err.log, profile_hf.log with hfc/trace.json.gz, profile.log, trace.json.gz, timeline.json. Each part has
# its own timeout, the order puts what matters most first, and a part that could run past
# GPU_SESSION_SECONDS (default 540) from the start is skipped, so the call ends inside its limit.
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 ROUNDPIPE_DEVICES=cuda:0 TOKENIZERS_PARALLELISM=false
sum="$out/summary.txt"; : > "$sum"
started=$(date +%s); budget=${GPU_SESSION_SECONDS:-540}
source benchmarks/gpu_common.sh

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$sum"
grep -m1 'model name' /proc/cpuinfo | tee -a "$sum"; nproc | tee -a "$sum"
python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])" | tee -a "$sum"
python3 -c "import transformers, peft; print('machine transformers', transformers.__version__, 'peft', peft.__version__)" 2>&1 | tail -1 | tee -a "$sum"
# roundpipe's own path: the checkout, with the machine's transformers where it is inside the
# supported range, else the wheel in .peer/whl-extra; the public RoundPipe gets its own folder,
# with the transformers 4.57 it runs on (benchmarks/peer_setup.py downloads both).
ours="$PWD"
if ! python3 -c "import sys, transformers; from packaging.version import Version; sys.exit(Version(transformers.__version__) < Version('4.56.2'))" 2>/dev/null \
  && ls .peer/whl-extra/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/extra .peer/whl-extra/*.whl \
    && ours="$PWD:/tmp/extra"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream .peer/whl/*.whl \
  || note "peer wheels missing: run python benchmarks/peer_setup.py"
export PYTHONPATH="$ours"
python3 -c "import transformers; print('roundpipe runs with transformers', transformers.__version__)" | tee -a "$sum"


# 1. Smoke and the CUDA tests (in a process that never installs the emulated device).
part 50 smoke.log python3 -m roundpipe
part 170 tests.log python3 -m pytest -q -p no:cacheprovider --noconftest --timeout 120 tests/test_cuda.py
# 2. Compiled decoder layers (roundpipe.hf.wrap(compile=True)) on Qwen3-1.7B's shape, 8 layers:
#    timed and profiled (its inductor kernels stay in the machine's cache for the bench row).
part 170 profile_hf.log python3 benchmarks/profile_hf.py --layers 8 --compile --out "$out/hfc"
# 3. Side by side on that shape: compiled, the public RoundPipe, the defaults, plain
#    transformers with gradient checkpointing.
note "next qwen3 ours row: ROUNDPIPE_BENCH_COMPILE=1 (wrap(compile=True))"
ROUNDPIPE_BENCH_COMPILE=1 bench qwen3 ours "$ours" 120 --layers 8
bench qwen3 upstream /tmp/upstream 70 --layers 8
bench qwen3 ours     "$ours"       60 --layers 8
bench qwen3 torch    "$ours"       60 --ckpt --layers 8
# 4. The plan's price beside a profiled GPT iteration; the other host-path settings.
part 60 profile.log python3 benchmarks/profile_gpu.py --layers 12 --out "$out"
part 60 profile_hf.log python3 benchmarks/profile_hf.py --layers 8 --no-profile --overlap-recompute
part 60 profile_hf.log python3 benchmarks/profile_hf.py --layers 8 --no-profile --switch-interval 0.0005
note "done in $(( $(date +%s) - started )) s; files under $out"
