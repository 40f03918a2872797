#!/bin/bash
# Models and sequences that do not fit the GPU, in one device call (about 9 minutes): every
# contender's process capped to a 24 GiB GPU (BENCH_GPU_CAP_GIB; benchmarks/gpu_rows.py), random
# weights built from the published configs in benchmarks/configs, the same data, batch and loop
# for every contender, each row with its model FLOPs utilisation. In this order:
#
#   1. full fine-tuning, Qwen3-4B's shape (36 layers), sequence 2048, batch 8 in 4 microbatches:
#      roundpipe.hf.wrap at its defaults (exact Adam, then with 8-bit moments: the optimizer
#      step is the longest part of this row's iteration), the public RoundPipe 0.1.1 at its HF
#      setup, PyTorch FSDP2 with CPUOffloadPolicy(pin_memory=True), bf16 MixedPrecisionPolicy
#      and checkpointing;
#   2. LoRA r=16 (attention and MLP projections), Llama-3.1-8B's shape, sequence 4096, batch 4 in
#      4 microbatches: roundpipe against the public RoundPipe;
#   3. Qwen3-1.7B's and Llama-3.1-8B's shapes with 4 decoder layers at the longest sequence
#      `python -m roundpipe plan CFG --max-seq-len --device-memory 24GiB` gives (asked at run time
#      up to the length precomputed on the CPU, which stands in when the plan does not answer in
#      time), one sequence: a warm-up and a timed iteration, the allocator's peaks beside the plan's;
#   4. continuity: Qwen3-1.7B's shape with 8 layers (fp16, as before), roundpipe at 4 and 8
#      microbatches, the public RoundPipe, plain transformers with checkpointing; then
#      profile_hf.py's price beside its measured iteration (not capped).
#
# Prepare .peer/ where pip works (python benchmarks/peer_setup.py), carry .peer, and run from the
# project's root:
#
#     bash benchmarks/gpu_offload.sh            # GPU_ROWS="3 4" runs those rows only
#     GPU_DRY_RUN=1 bash benchmarks/gpu_offload.sh   # lists the parts in order, runs nothing
#
# Everything lands under $OUT (or /tmp/gpu_out): summary.txt, peer.jsonl (one JSON line per
# contender: tokens/s, s/iteration, MFU, peaks, host RSS, losses), bench_err.log, plan_*.log,
# profile_hf.log. Each part has its own timeout, and a part that could run past
# GPU_SESSION_SECONDS (default 540) from the start is skipped, so the call ends inside its limit.
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 ROUNDPIPE_DEVICES=cuda:0 TOKENIZERS_PARALLELISM=false
export BENCH_GPU_CAP_GIB=${BENCH_GPU_CAP_GIB:-24}
sum="$out/summary.txt"; : > "$sum"
started=$(date +%s); budget=${GPU_SESSION_SECONDS:-540}
rows=" ${GPU_ROWS:-1 2 3 4} "
cfg=benchmarks/configs
# Row 3's lengths, precomputed on the CPU with the same command and config (4 decoder layers,
# --device-memory 24GiB, --seq-step 256): used when the plan does not answer in time.
QWEN3_LONGEST=325120
LLAMA_LONGEST=284672
source benchmarks/gpu_common.sh
if [ -n "$GPU_DRY_RUN" ]; then budget=0  # every part is listed as skipped
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$sum"
  grep -m1 'model name' /proc/cpuinfo | tee -a "$sum"; nproc | tee -a "$sum"
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])" | tee -a "$sum"
  python3 -c "import transformers, peft; print('machine transformers', transformers.__version__, 'peft', peft.__version__)" 2>&1 | tail -1 | tee -a "$sum"
  # roundpipe and FSDP2 run on the machine's transformers where roundpipe supports it, else on the
  # wheel in .peer/whl-extra; the public RoundPipe in its own folder, with the transformers 4.57 and
  # peft 0.17 it runs on (benchmarks/peer_setup.py downloads them).
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
fi
note "cap: BENCH_GPU_CAP_GIB=$BENCH_GPU_CAP_GIB; budget ${budget} s; rows:$rows"

row() { [[ $rows == *" $1 "* ]]; }

# 1. Full fine-tuning that does not fit 24 GiB (about 4.5 minutes).
if row 1; then
  q4="--config $cfg/qwen3-4b.json --dtype bf16 --seq 2048 --batch 8 --mb 4"
  bench hf ours     "$ours"       150 $q4 --iters 3
  bench hf ours     "$ours"       150 $q4 --iters 3 --optim-states 8bit
  bench hf upstream /tmp/upstream 170 $q4 --iters 3
  bench hf fsdp2    "$ours"       170 $q4 --iters 2
  note "row 1 done at $(( $(date +%s) - started )) s"
fi

# 2. LoRA that does not fit (about 2.5 minutes).
if row 2; then
  l8="--config $cfg/llama-3.1-8b.json --dtype bf16 --lora 16 --seq 4096 --batch 4 --mb 4"
  bench hf ours     "$ours"       140 $l8 --iters 3
  bench hf upstream /tmp/upstream 140 $l8 --iters 3
  note "row 2 done at $(( $(date +%s) - started )) s"
fi

# 3. The planned longest sequences, run (about 5 minutes: the plans in parallel, then each model).
if row 3 && fits $(( 150 + 130 )) "row 3 (its plans and the first model)"; then
  declare -A longest=([qwen3-1.7b]=$QWEN3_LONGEST [llama-3.1-8b]=$LLAMA_LONGEST)
  for name in qwen3-1.7b llama-3.1-8b; do
    python3 benchmarks/gpu_rows.py layers "$cfg/$name.json" 4 "$out/$name-4l.json"
    n=${longest[$name]}
    # Up to the precomputed length (one plan when it still fits), and one step past it.
    timeout 150 python3 -m roundpipe plan "$out/$name-4l.json" --max-seq-len "$n" \
      --device-memory 24GiB > "$out/plan_$name.log" 2>&1 &
    timeout 150 python3 -m roundpipe plan "$out/$name-4l.json" --seq-len $(( n + 256 )) \
      --device-memory 24GiB > "$out/plan_${name}_next.log" 2>&1 &
  done
  wait
  for name in qwen3-1.7b llama-3.1-8b; do
    n=${longest[$name]}
    found=$(sed -n 's/^Longest sequence that fits: \([0-9]*\) tokens.*/\1/p' "$out/plan_$name.log")
    if [ -n "$found" ]; then seq=$found; how="the plan's, up to $n"
    else seq=$n; how="precomputed (the plan did not answer in time)"; fi
    if grep -q 'DOES NOT FIT' "$out/plan_${name}_next.log"; then next="does not fit"
    elif grep -q '^Memory plan' "$out/plan_${name}_next.log"; then next="FITS (the plan's longest is longer now)"
    else next="not answered"; fi
    note "row 3 $name: $seq tokens ($how); $(( n + 256 )) $next"
    note "  plan: $(grep -m1 '^Device' "$out/plan_$name.log"); $(grep -m1 'reserve (' "$out/plan_$name.log" | tr -s ' ')"
    bench hf ours "$ours" $([ "$name" = qwen3-1.7b ] && echo 130 || echo 160) --config "$out/$name-4l.json" \
      --dtype bf16 --seq "$seq" --batch 1 --mb 1 --warmup 1 --iters 1 --memory-plan
  done
  note "row 3 done at $(( $(date +%s) - started )) s"
fi

# 4. Continuity (about 5 minutes): Qwen3-1.7B's shape, 8 layers, as the sessions before.
if row 4; then
  bench qwen3 ours     "$ours"       80 --layers 8
  bench qwen3 ours     "$ours"       80 --layers 8 --mb 8
  bench qwen3 upstream /tmp/upstream 75 --layers 8
  bench qwen3 torch    "$ours"       45 --ckpt --layers 8
  part 70 profile_hf.log python3 benchmarks/profile_hf.py --layers 8 --no-profile
  note "row 4 done at $(( $(date +%s) - started )) s"
fi
note "done in $(( $(date +%s) - started )) s; files under $out"
