#!/bin/bash
# A whole GPU session in one device call (about 9 minutes), what is least measured first: smoke
# and a subset of the CUDA tests; Qwen3's shape through roundpipe.hf.wrap at its defaults against
# the public RoundPipe and plain transformers with checkpointing, eager and with compiled decoder
# layers (PLAIN_BENCH_COMPILE=1); the plan's price beside a profiled GPT iteration (with the
# host contention measured); wrap at 8 microbatches; the overlapped recompute against the
# defaults; the optimizer thread on 8 cores; the GPT compiled and eager against plain PyTorch
# and the public RoundPipe; the rest of the CUDA tests. Prepare .peer/ first where pip works
# (python benchmarks/peer_setup.py; a transformers wheel the GPU machine lacks goes in
# .peer/whl-extra), carry .peer, and run from the project's root:
#
#     bash benchmarks/gpu_session.sh
#
# Everything lands under $OUT (or /tmp/gpu_out): summary.txt, smoke.log, tests.log, peer.jsonl,
# bench_err.log, profile_hf.log and hf/ (its trace), profile.log, trace.json.gz, timeline.json.
# Each part has its own timeout, the order puts what matters most first, and a part that could
# run past GPU_SESSION_SECONDS (default 540) from the start is skipped, so the call ends inside
# its limit.
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


# 1. Smoke and the CUDA tests but the HF equality's compiled variants past the first family's
#    (in a process that never installs the emulated device; the rest run last).
part 50 smoke.log python3 -m roundpipe
part 130 tests.log python3 -m pytest -q -p no:cacheprovider --noconftest --timeout 100 tests/test_cuda.py \
  -k "not hf_wrap or llama-1 or qwen3-4-left-False or qwen3_moe-4"
# 2. Side by side on Qwen3-1.7B's shape (8 layers): roundpipe.hf.wrap at its defaults (compiled
#    decoder layers on CUDA), the public RoundPipe, plain transformers with checkpointing, eager
#    and with its decoder layers compiled (nn.Module.compile, as a user would).
bench qwen3 ours     "$ours"       80 --layers 8
bench qwen3 upstream /tmp/upstream 75 --layers 8
bench qwen3 torch    "$ours"       45 --ckpt --layers 8
note "next qwen3 torch row: PLAIN_BENCH_COMPILE=1 (each decoder layer compiled)"
PLAIN_BENCH_COMPILE=1 bench qwen3 torch "$ours" 80 --ckpt --layers 8
# 3. The plan's price (with the host contention) beside a profiled GPT iteration; wrap at 8
#    microbatches; the overlapped recompute against the defaults, both in this call.
part 60 profile.log python3 benchmarks/profile_gpu.py --layers 12 --out "$out"
bench qwen3 ours     "$ours"       70 --layers 8 --mb 8
#    The first also times the optimizer thread on 8 and 14 cores (does the contention fall?)
#    and profiles two iterations: where the iteration's edges (the embedding's upload and its
#    gradient's download, the master->model copy before the first stage) leave the GPU idle.
part 90 profile_hf.log python3 benchmarks/profile_hf.py --layers 8 --threads 8 14 --out "$out/hf"
part 60 profile_hf.log python3 benchmarks/profile_hf.py --layers 8 --no-profile --overlap-recompute
# 4. The GPT (12 blocks): roundpipe with compile=True and at its defaults (eager) against plain
#    PyTorch with recompute, compiled and eager, and the public RoundPipe.
note "next gpt ours row: ROUNDPIPE_BENCH_COMPILE=1 (RoundPipe(compile=True))"
ROUNDPIPE_BENCH_COMPILE=1 bench gpt ours "$ours" 80 --layers 12
note "next gpt torch row: PLAIN_BENCH_COMPILE=1 (each block compiled)"
PLAIN_BENCH_COMPILE=1 bench gpt torch "$ours" 60 --ckpt --layers 12
bench gpt torch      "$ours"       40 --ckpt --layers 12
bench gpt ours       "$ours"       50 --layers 12
bench gpt upstream   /tmp/upstream 70 --layers 12
# 5. The HF equality's other compiled variants.
part 120 tests.log python3 -m pytest -q -p no:cacheprovider --noconftest --timeout 100 tests/test_cuda.py \
  -k "hf_wrap and not (llama-1 or qwen3-4-left-False or qwen3_moe-4)"
note "done in $(( $(date +%s) - started )) s; files under $out"
