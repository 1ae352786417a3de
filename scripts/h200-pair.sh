#!/usr/bin/env bash
# Work for two GPUs side by side on a two-GPU machine, so one device call does the work
# of two:
#
#   run(command="bash scripts/h200-pair.sh correctness peers", carry=[".device-stage/cute"],
#       kind="nvidia-h200-x2")
#
# Each argument is what one GPU runs: stages of scripts/h200.sh joined by '+', run in
# turn. A stage `tests:FILE,FILE[@KEXPR]` runs pytest on those files (with `-k KEXPR`).
# Both GPUs use the cute bundle (tilelang has its own call). Stage i of GPU g writes under
# $OUT/gpu<g>-<i>-<name>/; logs are printed at the end.
set -uo pipefail
a=${1:?work of GPU 0}; b=${2:?work of GPU 1}
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JCM_BUNDLE_READY=1
# Unpack the bundle once, before the two GPUs' stages race to do it.
python3 .device-stage/cute/install.py >/dev/null || { echo "install of cute failed"; exit 2; }
nvidia-smi -L

run_chain() {  # gpu, chain
  local g=$1 i=0 st name dir files kexpr
  IFS='+' read -ra stages <<<"$2"
  for st in "${stages[@]}"; do
    name=${st%%:*}; dir="$OUT/gpu$g-$i-$name"; mkdir -p "$dir"
    if [[ $name == tests ]]; then
      files=${st#*:}; kexpr=
      [[ $files == *@* ]] && { kexpr=${files#*@}; files=${files%%@*}; }
      ( export CUDA_VISIBLE_DEVICES=$g XLA_PYTHON_CLIENT_PREALLOCATE=false
        timeout 560 python3 -m pytest -q -rs -p no:cacheprovider ${files//,/ } ${kexpr:+-k "$kexpr"} \
          --junitxml="$dir/junit.xml" --durations=10 >"$dir/stage.log" 2>&1 )
    else
      ( export CUDA_VISIBLE_DEVICES=$g; OUT=$dir bash scripts/h200.sh "$name" >"$dir/stage.log" 2>&1 )
    fi
    i=$((i + 1))
  done
}
run_chain 0 "$a" &
p0=$!
run_chain 1 "$b" &
p1=$!
wait $p0 $p1
for d in "$OUT"/gpu*; do
  echo "=== $(basename "$d")"; grep -v -E 'Warning|warn\(|create_block_mask\(' "$d/stage.log" | tail -40
done
