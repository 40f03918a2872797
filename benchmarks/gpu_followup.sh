#!/bin/bash
# A second, shorter GPU call after benchmarks/gpu_session.sh (about 5 minutes, same .peer carried):
# the optimizer thread's core count on roundpipe.hf.wrap's Qwen3 shape, where the devices' share
# (the host's issue path) bounds the iteration, then the side-by-side rows the first call's
# budget left out: the GPT against the public RoundPipe and plain PyTorch with recompute, and
# Qwen3 under plain transformers with gradient checkpointing. Output under $OUT as there.
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 ROUNDPIPE_DEVICES=cuda:0 TOKENIZERS_PARALLELISM=false
sum="$out/summary.txt"
started=$(date +%s); budget=${GPU_SESSION_SECONDS:-300}
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$sum"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/upstream .peer/whl/*.whl \
  || note "peer wheels missing: run python benchmarks/peer_setup.py"
ours="$PWD"; export PYTHONPATH="$ours"
part 90 threads.log python3 benchmarks/profile_hf.py --layers 8 --threads 14 8 11 5 14 --iters 6 --no-profile
bench gpt ours     "$ours"        60 --layers 12
bench gpt upstream /tmp/upstream  70 --layers 12
bench gpt torch    "$ours"        50 --ckpt --layers 12
bench qwen3 torch  "$ours"        70 --ckpt --layers 8
bench gpt ours     "$ours"        50 --layers 12 --mb 8
part 40 smoke.log python3 examples/finetune_hf.py --steps 5
note "done in $(( $(date +%s) - started )) s; files under $out"
