# Sourced by benchmarks/gpu_session.sh and gpu_followup.sh (run from the project's root, with
# $out, $sum, $started and $budget set): a budget-bounded part, a bench row of the side-by-side
# harness, a line of the summary.
note() { echo "$*" | tee -a "$sum"; }
fits() {  # seconds: whether a part of that limit ends inside the budget
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
