#!/bin/bash
# A second GPU call after benchmarks/gpu_session.sh (about 4 minutes): the optimizer thread's core
# count, the 8-microbatch profile, bench_gpu.py with the two device-memory options. Carry .peer.
# Everything under $OUT: sweep.jsonl, log.txt, p8/trace.json.gz, p8/timeline.json.
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/gpu_out}; mkdir -p "$out/p8"
export PYTHONUNBUFFERED=1 ROUNDPIPE_DEVICES=cuda:0 PYTHONPATH="$PWD"
log="$out/log.txt"
started=$(date +%s)
run() { local s=$1; shift; local t0=$(date +%s); echo "== $*" >> "$log"; timeout "$s" "$@" >> "$log" 2>&1; echo "rc=$? $(( $(date +%s) - t0 )) s :: $*" | tee -a "$log"; }
for t in 14 8 11 16 14; do
  t0=$(date +%s)
  ROUNDPIPE_OPTIMIZER_THREADS=$t timeout 45 python3 .peer/peer_bench.py --model gpt --impl ours --warmup 2 --iters 8 --layers 12 2>>"$log" | tail -1 | sed "s/^{/{\"opt_threads\": $t, /" | tee -a "$out/sweep.jsonl"
  echo "threads $t: $(( $(date +%s) - t0 )) s" | tee -a "$log"
done
run 50 python3 benchmarks/profile_gpu.py --layers 12 --microbatches 8 --out "$out/p8"
grep -m3 "measured\|priced" "$log"
run 90 python3 benchmarks/bench_gpu.py --layers 12 --microbatches 4 8 --warmup 2 --iters 4 --device-grad-dtype fp16 --offload-activations
echo "done in $(( $(date +%s) - started )) s"
