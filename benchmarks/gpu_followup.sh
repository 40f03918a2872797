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
note() { echo "$*" | tee -a "$sum"; }
fits() {
  if (( $(date +%s) - started + $1 > budget )); then note "skipped (budget): ${*:2}"; return 1; fi
}
part() {  # seconds log command...
  local s=$1 log=$2; shift 2
  fits "$s" "$*" || return 0
  local t0=$(date +%s)
  echo "== $*" >> "$out/$log"
  timeout "$s" "$@" >> "$out/$log" 2>&1; local rc=$?
  note "$log: rc=$rc in $(( $(date +%s) - t0 )) s (limit $s) :: $*"
}
bench() {  # model impl pythonpath seconds [flags]
  local model=$1 impl=$2 path=$3 s=$4; shift 4
  fits "$s" "bench $model $impl $*" || return 0
  local t0=$(date +%s)
  echo "== $model $impl $*" >> "$out/bench_err.log"
  PYTHONPATH=$path timeout "$s" python3 .peer/peer_bench.py --model "$model" --impl "$impl" \
    --warmup 2 --iters 8 "$@" 2>>"$out/bench_err.log" | tail -1 | tee -a "$out/peer.jsonl"
  note "bench $model $impl $*: $(( $(date +%s) - t0 )) s"
}
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
