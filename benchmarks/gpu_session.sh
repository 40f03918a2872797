#!/bin/bash
# A whole GPU session in one device call (about 9 minutes): smoke and the CUDA tests, the
# side-by-side benchmark against the public RoundPipe and plain PyTorch (Qwen3's shape through
# roundpipe.hf.wrap, then the GPT, eager and with compiled blocks, at 4 and 8 microbatches), the
# overlapped recompute against the defaults, and the plan's price beside a profiled GPT iteration.
# Prepare .peer/ first where pip works (python benchmarks/peer_setup.py; a transformers wheel the
# GPU machine lacks goes in .peer/whl-extra), carry .peer, and run from the project's root:
#
#     bash benchmarks/gpu_session.sh
#
# Everything lands under $OUT (or /tmp/gpu_out): summary.txt, smoke.log, tests.log, peer.jsonl,
# bench_err.log, profile_hf.log, profile.log, trace.json.gz, timeline.json. Each part has
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
part 200 tests.log python3 -m pytest -q -p no:cacheprovider --noconftest --timeout 120 tests/test_cuda.py
# 2. Side by side on Qwen3-1.7B's shape (8 layers): roundpipe.hf.wrap at its defaults (compiled
#    decoder layers on CUDA), the public RoundPipe, plain transformers with checkpointing.
bench qwen3 ours     "$ours"       80 --layers 8
bench qwen3 upstream /tmp/upstream 70 --layers 8
bench qwen3 torch    "$ours"       45 --ckpt --layers 8
# 3. The GPT (12 blocks): roundpipe at its defaults (eager), with compile=True, the public
#    RoundPipe, plain PyTorch with recompute; then 8 microbatches, eager and compiled.
bench gpt ours       "$ours"       50 --layers 12
note "next gpt ours row: ROUNDPIPE_BENCH_COMPILE=1 (RoundPipe(compile=True))"
ROUNDPIPE_BENCH_COMPILE=1 bench gpt ours "$ours" 80 --layers 12
bench gpt upstream   /tmp/upstream 70 --layers 12
bench gpt torch      "$ours"       40 --ckpt --layers 12
bench gpt ours       "$ours"       50 --layers 12 --mb 8
note "next gpt ours row: ROUNDPIPE_BENCH_COMPILE=1 (RoundPipe(compile=True))"
ROUNDPIPE_BENCH_COMPILE=1 bench gpt ours "$ours" 50 --layers 12 --mb 8
# 4. The overlapped recompute against the defaults, in one call; the plan's price.
part 60 profile_hf.log python3 benchmarks/profile_hf.py --layers 8 --no-profile
part 60 profile_hf.log python3 benchmarks/profile_hf.py --layers 8 --no-profile --overlap-recompute
part 60 profile.log python3 benchmarks/profile_gpu.py --layers 12 --out "$out"
note "done in $(( $(date +%s) - started )) s; files under $out"
