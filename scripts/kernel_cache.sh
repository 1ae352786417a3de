#!/usr/bin/env bash
# Compile here, before a device call, the CuTe kernels that h200.sh stages would compile on
# the device, and pack them for the call: each stage runs with JCM_COMPILE_ONLY=1 (its own
# command lines: benchmarks with --compile-only, pytest with -p compile_only; see
# benchmarks/compile_only.py) in the device's Python twin (scripts/device_env.sh), and the
# kernels of the current sources go to .device-stage/kernels/kernels.tar.xz. h200.sh
# unpacks that into the disk cache before its stage and says, on exit, how many kernels the
# call still compiled. A kernel's key holds a hash of the sources a kernel's trace runs
# (api._package_fingerprint: the kernel modules, the residual programs, api.py without its
# host-only policy functions), so pack after the last edit to those: a later one makes the
# device compile afresh (never load a stale kernel); edits elsewhere keep the pack.
#
#   bash scripts/kernel_cache.sh STAGE ['VAR=VALUE ... STAGE' ...]
#   e.g. bash scripts/kernel_cache.sh frse 'JCM_BENCH_NS=8192 fwdtable' i15 bpers
#   then run(command="bash scripts/h200.sh frse", carry=[".device-stage/cute", ".device-stage/kernels"])
#
# An entry is split on whitespace and its quote characters are kept: write a value with ';'
# unquoted (JCM_LB_VARIANTS=a=X=1;b=Y=1 lb), never '...' (the stage then sees the quotes).
# Each entry adds to the cache (~5-10 s of CPU a kernel here); the tar holds every kernel
# of the current sources compiled so far (JCM_KERNEL_CACHE_RESET=1 starts empty; `--pack`
# alone packs them again; JCM_KERNEL_PACK_ALSO="FP ..." also packs the cached kernels of those
# source fingerprints, e.g. the main line's beside a branch's, for a call that runs both
# trees: it copies the main line's kernel sources over the branch's between its stages). A call
# carries at most 64 MiB with the cute bundle (~56 MiB) and the tree: the size is checked.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
(( $# )) || { sed -n 2,20p "$0"; exit 2; }
[[ $1 == --pack ]] && shift      # no stage: only pack what the cache holds
source scripts/device_env.sh
export CUTE_DSL_ARCH=sm_90a
cache=${JCM_KERNEL_CACHE:-$HOME/.cache/jcm-kernel-stage}
[[ -n ${JCM_KERNEL_CACHE_RESET:-} ]] && rm -rf "$cache"
mkdir -p "$cache"
export JCOMPILEMASK_CACHE_DIR=$cache
[[ -z $(git status --porcelain -- 'jcompilemask/*.py') ]] \
  || echo "kernel_cache.sh: jcompilemask/ has uncommitted changes; the device must get this same tree" >&2
for entry in "$@"; do
  read -r -a words <<< "$entry"
  stage=${words[-1]}
  echo "== $entry"
  out=${JCM_KERNEL_CACHE_OUT:-/tmp/kernel-cache-out}/$stage
  rm -rf "$out"; mkdir -p "$out"
  env "${words[@]:0:${#words[@]}-1}" JCM_COMPILE_ONLY=1 OUT="$out" bash scripts/h200.sh "$stage" \
    > "$out/stage.log" 2>&1 || echo "   the stage exited with $?"
  # Every test fails here (no kernel ran: AssertionError and the like). Any other error was
  # raised while tracing, i.e. before a kernel was built: it would fail on the device too.
  # (a stage that compiled nothing prints no such line: not an error under set -e)
  { cat "$out"/*.log | grep -hE "^compile-only: [0-9]+ " || true; } | sort | uniq -c | sed 's/^/   /'
  "$JCM_DEVICE_PY" - "$out" <<'PY'
import collections, glob, json, re, sys
seen = collections.Counter()
for path in glob.glob(f"{sys.argv[1]}/*.log"):
    if path.endswith("/stage.log"):
        continue
    for line in open(path, errors="replace"):
        if line.startswith('{"') and '"error"' in line:
            try:
                rec = json.loads(line)
                seen[f"{rec.get('impl')} {rec.get('mask')} {rec.get('n')}: {rec['error']}"] += 1
            except (ValueError, KeyError):
                pass
        elif re.match(r"E +[A-Za-z_.]*(Error|Exception)\b", line) and "AssertionError" not in line:
            seen[line.strip()] += 1
for text, n in sorted(seen.items()):
    print(f"   TRACE ERROR x{n}: {text[:300]}")
PY
done
# The kernels of the current sources only (a kernel of older sources would never load).
# (and the backward preprocess kernels of glue.py, under their own fingerprint)
read -r fp fp_glue < <("$JCM_DEVICE_PY" -c 'from jcompilemask.kernels.cute import api; print(api._package_fingerprint(), api._glue_fingerprint())')
mkdir -p .device-stage/kernels
list=$(mktemp)
for key in "$cache"/cute-*/*/key.json; do
  [[ -f $key ]] || continue
  dir=$(dirname "$key")
  for want in $fp $fp_glue ${JCM_KERNEL_PACK_ALSO:-}; do
    grep -q "\"source_fingerprint\": \"$want\"" "$key" && [[ -f $dir/kernel.o ]] \
      && { echo "${dir#"$cache"/}" >> "$list"; break; }
  done
done
n=$(wc -l < "$list")
tar -cf - -C "$cache" -T "$list" | xz -T2 -9 > .device-stage/kernels/kernels.tar.xz
echo "$(git rev-parse --short HEAD)$([[ -n $(git status --porcelain -- 'jcompilemask/*.py') ]] && echo +dirty) $fp $n kernels (glue $fp_glue)${JCM_KERNEL_PACK_ALSO:+ (also of $JCM_KERNEL_PACK_ALSO)}" \
  > .device-stage/kernels/REVISION
# The host launchers use this CPU's instruction sets (LLVM's native target; the DSL takes no
# other host CPU with --enable-tvm-ffi): HOST_FLAGS lists the flags a loading CPU needs, i.e.
# this CPU's base vector flags plus each optional extension an instruction of the packed
# launchers actually uses (scripts/host_flags.py), and h200.sh unpacks only where all are.
flags=$(mktemp)
grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 > "$flags"
objs=$(mktemp)
sed 's|$|/kernel.o|; s|^|'"$cache"'/|' "$list" > "$objs"
"$JCM_DEVICE_PY" scripts/host_flags.py "$flags" - < "$objs" > .device-stage/kernels/HOST_FLAGS
rm -f "$list" "$flags" "$objs"
echo "kernel cache: a loading CPU needs $(cat .device-stage/kernels/HOST_FLAGS)"
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
carry=$(du -cb .device-stage/cute .device-stage/kernels | tail -1 | cut -f1)
echo "kernel cache: $n kernels, $(du -h .device-stage/kernels/kernels.tar.xz | cut -f1) packed;" \
  "tree + cute bundle + kernels = $(( (tree + carry) / 1048576 )) MiB of 64"
(( tree + carry < 64 * 1048576 )) || { echo "kernel_cache.sh: over the 64 MiB a call carries" >&2; exit 1; }
