#!/bin/bash
# A second, shorter GPU call after benchmarks/gpu_session.sh (about 5 minutes, same .peer carried):
# roundpipe.hf.wrap at its defaults (decoder layers compiled on CUDA) on Qwen3-1.7B's shape
# against the public RoundPipe and plain transformers with gradient checkpointing, the CUDA tests
# of compiled layers first, then wrap's time split and graph count, and the eager layers' row.
# Output under $OUT as there.
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 ROUNDPIPE_DEVICES=cuda:0 TOKENIZERS_PARALLELISM=false
sum="$out/summary.txt"
started=$(date +%s); budget=${GPU_SESSION_SECONDS:-320}
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$sum"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream .peer/whl/*.whl \
  || note "peer wheels missing: run python benchmarks/peer_setup.py"
ours="$PWD"; export PYTHONPATH="$ours"
part 150 tests.log python3 -m pytest -q -p no:cacheprovider --noconftest --timeout 70 tests/test_cuda.py -k "compiled or hf_wrap"
bench qwen3 ours     "$ours"       80 --layers 8
bench qwen3 upstream /tmp/upstream 70 --layers 8
bench qwen3 torch    "$ours"       45 --ckpt --layers 8
part 70 profile_hf.log python3 benchmarks/profile_hf.py --layers 8 --no-profile
note "next qwen3 ours row: ROUNDPIPE_BENCH_COMPILE=0 (wrap(compile=False))"
ROUNDPIPE_BENCH_COMPILE=0 bench qwen3 ours "$ours" 50 --layers 8
note "done in $(( $(date +%s) - started )) s; files under $out"
