#!/usr/bin/env bash
# One stage of the H200 work, run on the device machine from the repository root:
#
#   run(command="bash scripts/h200.sh STAGE", carry=[".device-stage/cute"])      # cute stages
#   run(command="bash scripts/h200.sh tilelang", carry=[".device-stage/tilelang", ".jcm-cache"])
#
# Each stage fits one device call (< 600 s), installs its bundle when needed (safe to
# repeat on a warm machine), and leaves logs, JUnit XML and result JSON under $OUT.
# Stages that budget their steps (left()) plan for 570 s; JCM_STAGE_S plans for less (a
# call given a shorter timeout_s when the session's device time runs low).
# Stages:
#   correctness  GPU tests of the CuTe backward and of mask_attention end to end (their
#                gradients through the CuTe backward, the default); test_cute_forward.py separately:
#                `bash scripts/h200.sh kernels`
#   bwdv1        backward v1: smoke run, a subset of its GPU tests, config variants timed beside FA4
#   bwdv1b       the rest of v1's backward tests, the non-finite GPU tests, 4 workloads at 32K
#   bwdv1c       the backward configs not yet run: their tests, the determinism stress, non-finite
#   bwdv1d       those configs timed at 32K beside the default and FA4 native
#   v1prof       ncu (per-instruction stalls) on one v1 backward launch + config timings at causal 32K
#   v5tests      the default backward config through every GPU backward test (+ non-finite, list chunks)
#   s6a          column_bits (Kc > 2 intervals re-read into a bit mask): its tests, then timed at 32K
#   s6b          session 6's default through the GPU backward tests + compute-sanitizer (3 tools)
#   anyk         issue 16: K > 8 / Kc > 16 intervals and residual predicates on the CuTe kernels
#   sanitize2    compute-sanitizer (3 tools) on the CuTe kernels without JAX in the process
#   s9t          session 8's SASS change (warp-uniform warpgroup index): default backward + forward GPU
#                tests; the jnp preprocess on the GPU vs the CPU at the benchmarks' sizes
#   s17          session 16's exp2_emu (part of P's exp2 on the FMA pipe) timed beside the default
#                and FA4 native at 32K, then the GPU tests under the faster
#   s10          session 9's static_stage (the tile body once per ring stage) and lse_prefetch: each
#                and both timed beside the default and FA4 native at 32K (causal, hstu), then the
#                default backward's GPU tests under the fastest
#   s11          session 10's dv_early (P converted and dV issued before the dP^T wait) timed beside
#                the default and FA4 native at 32K, then the default backward's GPU tests under it
#   s10x         issue 17 on one GPU: tests/gpu/test_sharding_gpu.py (custom calls under shard_map)
#                and tests/gpu/test_ring_gpu.py (the CuTe kernels per ring step)
#   prepro       the jnp preprocess on the GPU, kernel by kernel (ncu; shared prompt 8K by default)
#   s8t / s8b    the next backward default candidate (JCM_S8_CONFIG): its GPU tests / timed beside
#                the default and the peers at 32K + 8K
#   prof8        ncu on one causal 32K backward of ours and one of FA4's, same call
#                (JCM_PROF_PASS=fwd: the two forwards; JCM_PROF_ALL=0 skips the all-kernel listing;
#                JCM_PROF_MASK / JCM_PROF_N another workload, beside Flex+FA4)
#   parts        issue 12: the XLA pieces around the backward kernel timed alone, every kernel of
#                ours and FA4's causal steps listed with its duration (ncu; JCM_PROF_N, default 8K)
#   qb           issue 12: dq_blocked (the dQ slot in 8-column blocks): XLA pieces timed, bit-identity,
#                timed beside the default and FA4 native at 8K + 32K
#   shfl         stats_shfl, column_skip, the forward's bits path for K <= 8: tests, then timed at 32K
#   ktimes       a step's GPU time kernel by kernel, ours beside Flex+FA4 (kernel_times.py; CUPTI, not ncu)
#   masks16      issue 16's timings: block-causal spellings, dilated window, global tokens + window vs Flex+FA4
#   fwl          issue 14: the forward's work list (the default; =0 the bitmap walk): tests, then timed
#   fka          issue 14: K(t + 1) before V(t) in the forward's producer (JCOMPILEMASK_CUTE_FWD_K_AHEAD=1),
#                with / without the work list: bit-identity, tests, then timed beside FA4 native
#   fgm          issue 14: group_mask (masked tiles' rows as column-group bit words): bit-identity,
#                then timed beside the default and FA4 native, then the forward tests under it
#   frt          issue 14: rescale_tail (O's rescale beside P's conversion): bit-identity, timed
#                beside the default and FA4 native, then the forward + attention tests under it
#   fwr          issue 14: work_runs (the work list as runs, walked with a counter): bit-identity,
#                timed beside the default and FA4 native, then the forward + attention tests under it
#   fre          issue 14: runs_early (the producer's tile words loaded first thing, runs over set
#                bits): bit-identity vs work_runs, timed beside the default and FA4 native, then tests
#   fpd          issue 14: p_double (P in two register tensors, the P V wait after more of the exp2s):
#                identity, timed beside operands_early / the default / FA4 native, then the forward tests
#   frse         issue 14: rescale_early (O's rescale before the next P V issue, FA3's order) and operands_early
#                (GEMM operands sliced before the K wait): identity, timing of each and both, tests
#   bpers        issue 16: the persistent backward (BackwardConfig.persistent): a smoke under a hang guard,
#                its 14 gradient cases vs the grid, then bwd ms beside the default, schedule and dq_red at 8K
#   dqr          issue 15: dq_red (dQ by red.global.add.v4.f32 from registers; D 256 then fits 2 stages) and
#                D 192's double-buffered P^T / dS^T: dq_red's 8 gradient cases, then D 256 / 192 / 128 at 32K
#                beside the default and the peers
#   dvs          issue 15: dv_split / dk_split (dV, dK issued in pieces under the soft cap's MUFU work):
#                identity and softcap_r gradient cases, then D 128 with / without the cap timed (8K)
#   d192t        issue 15: D 192 / 128, ours beside FA4 native at its 64 x 96 tile and forced to 64 x 64
#   d192s        issue 15: BackwardConfig.dkv_swap (D 192 at 64 x 96, FA4's shape): its 12 gradient cases, then bwd ms beside FA4
#   i15          issue 15's candidates in one call: q128 / dq_red smokes under hang guards, then D 64, D 256,
#                D 192 and the capped D 128 at 32K, each beside its variants, FA4 native and cuDNN (prewarmed)
#   q128         issue 15: D 64's backward at 128 x 128 tiles (block_q=128): a gradient smoke under a hang
#                guard, D 64 causal 32K / 8K timed beside the default, FA4 native and cuDNN, then its tests
#   fss          issue 14: runs_early, slot_skip, mask_r2p: their bit-identity sets, timed at 8K / 32K
#                on causal, hstu, shared prompt, clear beside the default and FA4 native
#   rp           issue 16: residual_periodic (a predicate proved 8-periodic in the column index evaluated
#                once per column class, fwd + bwd): bit-identity, then masks16 with it beside Flex+FA4
#   fwdtable     issue 14's acceptance table at one N (JCM_BENCH_NS): Flex+FA4, then jcm + FA4 native
#   fsched       issue 14: the forward's longest-first order / persistent CTAs
#                (JCOMPILEMASK_CUTE_FWD_SCHEDULE=1 / persistent) and work list: tests, then the
#                forward timed per variant beside FA4 native
#   v5bench      bench_total 32K + 8K: default vs FA4 native and Flex+FA4 (JCM_BENCH_S seconds)
#   hdims        issue 15 (opt-in configs: soft cap in the backward, D 256, 192/128): a hang-guarded
#                smoke per config, a subset of tests/gpu/test_cute_head_dims.py, then
#                benchmarks/bench_head_dims.py (causal 32K + 8K beside FA4 native / cuDNN / xla)
#   hdimstests   all of tests/gpu/test_cute_head_dims.py (+ the forward's 192/128 cases), one process
#   jcmvar       jcm alone on JCM_BENCH_MASKS at JCM_BENCH_NS, once per JCM_MASKS16_VARIANTS entry
#   rdense       a dense mask known at run time: its preprocess parts timed (bench_runtime_dense.py),
#                then the packed documents as a MaskSpec beside the same mask as a traced array
#   shortcols    issue 16 on the H200: the short-column switches' identity cases under a hang
#                guard, then masks16 (dilated window 8K: default / hwlb / all / hi / persistent
#                / persistent + dkv_staged / the register epilogues nt, ntv beside Flex+FA4),
#                then ktimes (~590 s: JCM_STAGE_S=595)
#   rdcols       the run-time dense column pack as one CuTe kernel: its GPU cases, then rdense both ways
#   classes      issue 16: the dilated window as residue classes beside the residual lowering and Flex+FA4
#   h200cands    issue 16 on the H200 (session 41's plan): the dilated window beside Flex+FA4 at 8K
#                (default / prep / pz / post / hwlb / all / hi) then 32K (default / hi / prep /
#                post), none timed on an H200 yet, after pz's and post's own GPU cases and
#                the glue kernels alone (bench_glue.py) (~590 s: JCM_STAGE_S=595)
#   hdimspar     the same spread over JCM_PAR parallel pytest processes (JCM_PAR_SKIP: a regex of ids to leave out)
#   padded       head dims run zero-padded (96, 80, 160 / 128): their GPU cases, then timed beside D 128 and the peers
#   inplace      the same head dims read in place by the wider kernels' TMA boxes (the default): their GPU
#                cases, identity with the copies, then copies vs in place timed at 8K
#   native       the native D 80 / 96 forwards and D 96's backward (the default since session 47):
#                smokes under hang guards, their GPU cases (-k native),
#                then fwd / bwd at 8K beside in place, D 128 and FA4 native
#   multigpu     issue 19 on a multi-GPU kind: sharded training step + context parallelism (benchmarks/multi_gpu.py)
#   kernels      GPU tests of the CuTe forward kernel alone (48 variant cases)
#   forward      bench_forward (D = 128 causal vs FA4 native, same run) + the step-2 variants
#   peers        FlexAttention (Triton, FA4) / FA4 native / cuDNN forward at 2K and 8K
#   peers2k      the same at 2K alone
#   peers32      FlexAttention at 32K for the masks not yet measured there
#   total        training step (preprocess + fwd + bwd), jcm with the CuTe backward and peers
#                (run right after `tilelang` on the same warm machine for the TileLang preprocess)
#   tilelang     TileLang preprocess bit-exactness tests (and the registry choosing it) and the
#                preprocess benchmark
#   sanitize     compute-sanitizer memcheck + racecheck over a small CuTe backward run
#   profile      ncu on one clear forward launch at 32K (why 53 TF/s)
#   lb           BackwardConfig.late_balance (the last dQ-warp wait after the epilogue) and the `auto`
#                column order (the scheduled kernel only where tail's order moves a unit): tests, then bwd ms at 8K
#   s21          session 21's candidates (exact_columns, column_words, residual_words, the tail order): tests, then timed
#   bsched       the backward's key columns in the host's order (BackwardConfig.schedule) beside the grid: bwd ms per order policy
#   train        end-to-end Qwen3-0.6B training tokens/s (benchmarks/train_e2e.py), jcm vs cuDNN vs dense XLA at 8K and 32K (build .device-stage/train with scripts/train_bundle.sh; carry it too)
set -uo pipefail
stage=${1:?stage: correctness | bwdv1 | kernels | forward | peers | peers2k | peers32 | total | tilelang | sanitize | profile | v1prof | v5tests | v5bench | hdims | multigpu | ...}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
bundle=cute
[[ $stage == tilelang ]] && bundle=tilelang
# Kernels compiled before the call (scripts/kernel_cache.sh, which runs this script with
# JCM_COMPILE_ONLY=1 on a machine without a GPU; carry .device-stage/kernels too): unpacked
# into the disk cache, and CUTE_DSL_ARCH set as they were compiled (it is part of their
# key). On exit the stage says how many kernels it still had to compile.
# The kernels' host launchers are compiled for the packing machine's CPU (LLVM's native
# target: AVX-512 there): they are used only where this CPU has every instruction-set flag
# they need (.device-stage/kernels/HOST_FLAGS: the packing CPU's base vector flags and the
# optional extensions the launchers' instructions use, scripts/host_flags.py), else the
# call compiles as before.
kc_tar=.device-stage/kernels/kernels.tar.xz
kc_lacks=
if [[ -f $kc_tar ]]; then
  have=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  for f in $(cat .device-stage/kernels/HOST_FLAGS 2>/dev/null); do
    [[ $have == *" $f "* ]] || kc_lacks+=" $f"
  done
  [[ -z $kc_lacks ]] || echo "kernel cache: not used, this CPU lacks$kc_lacks"
fi
if [[ -z ${JCM_COMPILE_ONLY:-} && -f $kc_tar && -z $kc_lacks ]]; then
  kc_dir=${JCOMPILEMASK_CACHE_DIR:-$HOME/.cache/jcompilemask}
  mkdir -p "$kc_dir" && tar -xJf "$kc_tar" -C "$kc_dir" && touch "$kc_dir/.unpacked"
  export CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}
  echo "kernel cache: $(find "$kc_dir" -name kernel.o | wc -l) kernels shipped ($(cat .device-stage/kernels/REVISION 2>/dev/null))"
  # A pack of other kernel sources than this tree's loads nothing: say so up front.
  for fp in $(python3 -c 'from jcompilemask.kernels.cute import api; print(api._package_fingerprint(), api._glue_fingerprint())' 2>/dev/null); do
    grep -q "$fp" .device-stage/kernels/REVISION 2>/dev/null \
      || echo "kernel cache: the pack is not of this tree's kernel sources ($fp): its kernels compile in this call"
  done
  trap 'echo "kernel cache: $(find "$kc_dir" -name kernel.o -newer "$kc_dir/.unpacked" | wc -l) kernels compiled in this call"' EXIT
fi
if [[ -n ${JCM_COMPILE_ONLY:-} ]]; then
  # The stage's own command lines on this machine: benchmarks with --compile-only and
  # pytest with -p compile_only in the device's Python twin (scripts/kernel_cache.sh sets
  # JCM_DEVICE_PY, CUTE_DSL_ARCH and the cache); other Python programs, the installs, the
  # GPU tools and every pkill are skipped. Nothing is timed and no time limit applies.
  : "${JCM_DEVICE_PY:?JCM_COMPILE_ONLY needs JCM_DEVICE_PY (run scripts/kernel_cache.sh)}"
  export PYTHONPATH=$PWD:$PWD/benchmarks JCM_STAGE_S=100000
  wrap=$(mktemp -d)
  cat > "$wrap/python3" <<'WRAP'
#!/usr/bin/env bash
case "${1:-}" in
  benchmarks/bench_total.py|benchmarks/bench_head_dims.py|benchmarks/bench_forward.py)
    exec "$JCM_DEVICE_PY" "$1" --compile-only "${@:2}" ;;
  -m) [[ ${2:-} == pytest ]] && exec "$JCM_DEVICE_PY" -m pytest -p compile_only "${@:3}" ;;
esac
echo "compile-only: skipped python3 $*" | cut -c1-160 >&2
WRAP
  # timeout without its limit (this CPU is slower than the device's): first on PATH, so
  # the stage's calls and those through `env` both find it.
  cat > "$wrap/timeout" <<'WRAP'
#!/usr/bin/env bash
while [[ ${1:-} == -* ]]; do [[ $1 == -k || $1 == -s ]] && shift; shift; done
shift
exec "$@"
WRAP
  chmod +x "$wrap/python3" "$wrap/timeout"
  export PATH=$wrap:$PATH
  pkill() { :; }
  nvidia-smi() { :; }
  export JCM_BUNDLE_READY=1
fi
# h200-pair.sh unpacks once for both of its stages (two concurrent unpacks would race).
# JCM_BUNDLE_READY=1 skips the unpack on a machine still warm from the last call; when the
# machine was released in between (~30 s idle: a fresh one, nothing unpacked) the bundle's
# marker module is missing and the unpack runs anyway (session 17 lost a call to that).
ready_mod=cutlass
[[ $bundle == tilelang ]] && ready_mod=tilelang
if [[ -n ${JCM_BUNDLE_READY:-} ]] && ! python3 -c "import $ready_mod" >/dev/null 2>&1; then
  echo "JCM_BUNDLE_READY set but $ready_mod is not importable (a fresh machine): unpacking $bundle"
  unset JCM_BUNDLE_READY
fi
[[ -n ${JCM_BUNDLE_READY:-} ]] || python3 ".device-stage/$bundle/install.py" >/dev/null \
  || { echo "install of $bundle failed"; exit 2; }
[[ -n ${JCM_COMPILE_ONLY:-} ]] || \
  python3 -c 'import sympy, jax; print("sympy", sympy.__version__, "jax", jax.__version__, jax.devices())'
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader

# Seconds for a step: $1, or what is left of the call's plan (JCM_STAGE_S, default 570 s)
# when that is less (at least 5).
left() { local l=$(( ${JCM_STAGE_S:-570} - SECONDS )); (( l < $1 )) && echo $(( l > 5 ? l : 5 )) || echo $1; }

# A new kernel protocol's first GPU case (pytest args after $2: a node id, or a file and -k
# EXPR) under a hang guard of $2 seconds (a barrier or phase mistake hangs rather than
# fails), log tagged $1; returns pytest's rc.
bwd_smoke() {
  local tag=$1 s=$2; shift 2
  JCOMPILEMASK_CUTE_BACKWARD=1 timeout -k 5 $(left "$s") python3 -m pytest -q -x -p no:cacheprovider \
    "$@" > "$OUT/smoke-$tag.log" 2>&1
  local rc=$?; pkill -9 -f "pytest -q -x -p no:cacheprovider" 2>/dev/null
  echo "smoke $tag [$*] rc $rc ($SECONDS s)"; tail -2 "$OUT/smoke-$tag.log"
  return $rc
}

# The text pages of an ncu report /tmp/prof-TAG.ncu-rep ($1), if it was written: details to
# $OUT/ncu-TAG.txt (and its lines matching $2, at most $3, printed), the per-instruction SASS
# source counters to /tmp/sass-TAG.csv (for ncu_sass_summary.py) and $OUT/ncu-TAG-sass.csv.gz.
ncu_pages() {
  local tag=$1 pat=$2 n=$3
  [[ -f /tmp/prof-$tag.ncu-rep ]] || return 0
  timeout 40 ncu -i /tmp/prof-$tag.ncu-rep --page details > "$OUT/ncu-$tag.txt" 2>&1
  timeout 60 ncu -i /tmp/prof-$tag.ncu-rep --page source --csv --print-source sass > /tmp/sass-$tag.csv 2>&1
  gzip -c /tmp/sass-$tag.csv > "$OUT/ncu-$tag-sass.csv.gz"
  grep -E "$pat" "$OUT/ncu-$tag.txt" | head -"$n"
}

# A backward switch for the soft cap's cost, never run on a GPU before: the first gradient
# case of tests/gpu/test_cute_backward.py ($2, a node id) under a hang guard (a barrier
# slip hangs rather than fails), then ($3, a -k expression) the others, the bwd ms at
# JCM_HDIMS_NS (8K) of d128 / d128cap with bench_head_dims variants $4 beside the default and
# FA4 native, quick_summary's cap lines (the cost with and without the switch), then the
# capped head-dim cases (cap $6: a regex of head dims) under JCOMPILEMASK_CUTE_BWD_CONFIG=$5.
# Limits: JCM_SW_SMOKE_S, JCM_SW_IDENT_S, JCM_SW_S, JCM_SW_TEST_S. Tagged $1.
cap_switch_trial() {
  local tag=$1 t=tests/gpu/test_cute_backward.py
  export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
  bwd_smoke $tag ${JCM_SW_SMOKE_S:-120} "$t::$2" || return 0
  bwd_cases $tag ${JCM_SW_IDENT_S:-150} "$t" -k "$3"
  JCM_HDIMS_OUT=h200-head-dims-cap.json hdims_bench $tag ${JCM_SW_S:-220} ${JCM_HDIMS_NS:-8192} d128,d128cap \
    "$4" --impls jcm-cute,fa4-native
  python3 benchmarks/quick_summary.py "$OUT" | grep '^cap'
  JCOMPILEMASK_CUTE_BWD_CONFIG=$5 JCM_PAR_FILES=tests/gpu/test_cute_head_dims.py \
    JCM_PAR_ONLY="(builtin_grads|fp16_mqa|fully_masked_rows|no_column_view_uses_row_intervals|random_lowered_specs)\\[.*cap$6\\]" \
    JCM_STAGE_S=$(left ${JCM_SW_TEST_S:-200}) bash "$0" hdimspar
}

# Backward GPU cases (pytest args after $2) under `timeout $2`, one line per case; log tagged $1.
bwd_cases() {
  local tag=$1 s=$2; shift 2
  JCOMPILEMASK_CUTE_BACKWARD=1 timeout -k 5 $(left "$s") python3 -m pytest -v -rs -p no:cacheprovider \
    "$@" > "$OUT/pytest-$tag.log" 2>&1
  echo "pytest $tag rc $? ($SECONDS s)"; pkill -9 -f "pytest -v -rs -p no:cacheprovider" 2>/dev/null
  grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/pytest-$tag.log" | sed 's/ *\[ *[0-9]*%\]//'
  grep -E "^E  " "$OUT/pytest-$tag.log" | head -8
}

# bench_head_dims.py (causal, every config's default backward beside VARIANTS, FA4 native and
# cuDNN) in at most $2 seconds at NS ($3) on CONFIGS ($4) with VARIANTS ($5); more args go to
# the script (e.g. --prewarm). Records in $OUT/h200-head-dims.json, log tagged $1.
hdims_bench() {
  local tag=$1 b=$(left "$2") ns=$3 configs=$4 variants=$5; shift 5
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
  # JCM_HDIMS_OUT: the records' file under $OUT (one per part when a stage times several)
  timeout -k 5 $b python3 benchmarks/bench_head_dims.py --ns "$ns" --configs "$configs" \
    ${variants:+--jcm-variants "$variants"} --impls jcm-cute,fa4-native,jax-cudnn --min-repeat-s 0.15 \
    "$@" --budget-s $(( b - 30 )) --out "$OUT/${JCM_HDIMS_OUT:-h200-head-dims.json}" > "$OUT/bench-$tag.log" 2>&1
  echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_head_dims.py 2>/dev/null
  grep -E '^\{|budget' "$OUT/bench-$tag.log" | cut -c1-330 | tail -24
}

# The default backward's GPU test list (gradients of the built-ins, D 64 fp16 MQA, fully
# masked rows, row intervals, random lowered specs, the 20-rerun stress, two attention
# gradient cases) under `timeout $2`, JUnit / log tagged $1 (stages s8t, s9t).
bwd_default_tests() {
  local t=tests/gpu/test_cute_backward.py
  timeout -k 5 "$2" python3 -m pytest -q -rs -p no:cacheprovider "$t::test_builtin_grads" \
    "$t::test_head_dim_64_fp16_mqa" "$t::test_fully_masked_rows" "$t::test_no_column_view_uses_row_intervals" \
    "$t::test_random_lowered_specs" "$t::test_repeated_gradients_are_identical" \
    "tests/gpu/test_cute_attention.py::test_builtin[hstu]" "tests/gpu/test_cute_attention.py::test_builtin[shared_prompt]" \
    --junitxml="$OUT/junit-$1.xml" > "$OUT/pytest-$1.log" 2>&1
  echo "pytest $1 rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -4 "$OUT/pytest-$1.log"
}

# A forward switch's bit-identity tests (tests/gpu/test_cute_forward.py -k "$2") under a
# hang guard of $3 seconds, log tagged $1; the stage stops (exit 3) unless they pass.
identity_gate() {
  # JCM_SKIP_IDENT=1: timings only (a short call; the identity cases in a later one)
  [[ ${JCM_SKIP_IDENT:-0} == 1 ]] && { echo "identity skipped (JCM_SKIP_IDENT=1)"; return 0; }
  timeout -k 5 "$3" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_cute_forward.py \
    -k "$2" > "$OUT/pytest-$1-ident.log" 2>&1
  local rc=$?; echo "identity rc $rc ($SECONDS s)"; pkill -9 -f pytest; tail -4 "$OUT/pytest-$1-ident.log"
  (( rc == 0 )) || exit 3
}

# A forward switch (ENV=1; several: "ENV1 ENV2", all set) as a candidate default: its
# bit-identity cases under a hang guard (IDENT_S seconds at most), the forward timed with
# VARIANTS beside FA4 native at NS (JCM_BENCH_NS overrides) on MASKS (JCM_BENCH_MASKS
# overrides), then the forward + attention GPU tests under it.
# Usage: forward_switch_stage TAG IDENT_TESTS IDENT_S ENV NS MASKS VARIANTS
forward_switch_stage() {
  local tag=$1 ident=$2 ident_s=$3 env=$4 ns=$5 masks=$6 variants=$7
  export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
  identity_gate "$tag" "$ident" $(left "$ident_s")
  timeout -k 5 $(left 240) python3 benchmarks/bench_forward.py --ns ${JCM_BENCH_NS:-$ns} \
    --masks "${JCM_BENCH_MASKS:-$masks}" --fa4 --jcm-variants "$variants" \
    --out "$OUT/h200-fwd-$tag.json" > "$OUT/bench-$tag.log" 2>&1
  echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_forward; grep -E '^bench|^\{' "$OUT/bench-$tag.log" | tail -30 | cut -c1-200
  env $(printf '%s=1 ' $env) timeout -k 5 $(left 200) python3 -m pytest -q -rs -p no:cacheprovider \
    tests/gpu/test_cute_forward.py "tests/gpu/test_cute_attention.py::test_builtin" -k "not compiles" \
    --junitxml="$OUT/junit-$tag.xml" > "$OUT/pytest-$tag.log" 2>&1
  echo "pytest rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -3 "$OUT/pytest-$tag.log"
}

# Backward config variants (NAME=FIELD=VALUE,...) timed beside the default and FA4 native
# at 32K on MASKS (one run, $OUT/h200-bwd-TAG.json), then the default backward's GPU tests
# under the variant fastest at causal 32K when that is not the default; FORCED (non-empty)
# picks the tests' config instead. Usage: variants_then_tests TAG MASKS FORCED NAME=CFG...
variants_then_tests() {
  local tag=$1 masks=$2 forced=$3; shift 3
  export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
  local spec="base=" v b pick cfg=
  for v in "$@"; do spec+=";${v%%=*}=JCOMPILEMASK_CUTE_BWD_CONFIG=${v#*=}"; done
  b=$(left 280)
  timeout -k 5 $b python3 benchmarks/bench_total.py --ns 32768 --masks "$masks" \
    --impls jcm,fa4-native --jcm-variants "$spec" --min-repeat-s 0.25 --budget-s $(( b - 20 )) \
    --out "$OUT/h200-bwd-$tag.json" > "$OUT/bench-$tag.log" 2>&1
  echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{' "$OUT/bench-$tag.log" | cut -c1-170
  pick=$(python3 - "$OUT/h200-bwd-$tag.json" <<'PY'
import json, sys
try:
    recs = json.load(open(sys.argv[1]))["records"]
except Exception:
    recs = []
bwd = {r["impl"]: r["bwd_ms"] for r in recs if r["mask"] == "causal" and r["impl"].startswith("jcm-cute")}
best = min(bwd, key=bwd.get) if bwd else "jcm-cute"
print(best.replace("jcm-cute", "").lstrip("-") or "base")
PY
)
  for v in "$@"; do [[ ${v%%=*} == "$pick" ]] && cfg=${v#*=}; done
  cfg=${forced:-$cfg}
  echo "fastest at causal 32K: $pick; tests under: ${cfg:-(the default: skipped)}"
  [[ -n $cfg ]] && JCOMPILEMASK_CUTE_BWD_CONFIG=$cfg bwd_default_tests "$tag" $(left 290)
}

case $stage in
  s14b)
    # row_mask (session 13, compile-checked: shared prompt's masked tile 893 SASS instructions
    # instead of 2649 statically — the default's column-bits loop skips intervals that miss the
    # tile at run time, so the executed gain is what this measures): the default and rm beside
    # Flex+FA4 at 8K and 32K in one call (prewarmed), then the default backward's GPU tests
    # under rm. Clear's Flex+FA4 record is skipped (its 8K build never finishes; 32K: 0.80x).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)} FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    b=$(left ${JCM_BENCH_S:-330})
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns 8192,32768 --masks ${JCM_BENCH_MASKS:-shared_prompt,hstu,clear} \
      --impls jcm,flex-fa4 --skip flex-fa4:clear --min-repeat-s 0.25 --prewarm 6 --prewarm-s 150 --stack-after-s 150 \
      --jcm-variants "base=;rm=JCOMPILEMASK_CUTE_BWD_CONFIG=row_mask=1" --budget-s $(( b - 20 )) \
      --out "$OUT/h200-total-s14b.json" > "$OUT/bench-s14b.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\||FAILED|budget|prewarm' "$OUT/bench-s14b.log" | tail -30
    timeout -k 5 $(left 120) python3 -m pytest -q -rs -p no:cacheprovider \
      tests/gpu/test_cute_backward.py::test_row_mask_gives_the_default_gradients > "$OUT/pytest-rm-equal.log" 2>&1
    echo "row_mask == default rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -3 "$OUT/pytest-rm-equal.log"
    JCOMPILEMASK_CUTE_BWD_CONFIG=row_mask=1 bwd_default_tests s14b $(left 230)
    ;;
  s14a)
    # Session 13: (1) the CuTe kernels' disk cache on the GPU (a second process loads every
    # kernel, compiles none, same results); (2) the shared prompt 8K profile script without
    # ncu (it segfaulted under ncu right after the backward's compile); (3) issue 15's
    # hdims smoke for the configs in JCM_HDIMS_SMOKE (default d256 d192 cap128).
    timeout -k 5 $(left 200) python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_cute_disk_cache.py \
      --junitxml="$OUT/junit-disk.xml" > "$OUT/pytest-disk.log" 2>&1
    echo "disk cache rc $? ($SECONDS s)"; pkill -9 -f test_cute_disk_cache; tail -4 "$OUT/pytest-disk.log"
    timeout -k 5 $(left 120) python3 tests/scripts/gpu_backward_profile.py shared_prompt 8192 > "$OUT/prof-sp.log" 2>&1
    echo "profile script sp 8K rc $? ($SECONDS s)"; tail -3 "$OUT/prof-sp.log"
    t=tests/gpu/test_cute_head_dims.py
    for c in ${JCM_HDIMS_SMOKE:-d256 d192 cap128}; do
      timeout -k 5 $(left 75) python3 -m pytest -q -x -p no:cacheprovider "$t::test_fully_masked_rows[$c]" \
        > "$OUT/smoke-$c.log" 2>&1
      rc=$?; pkill -9 -f "pytest -q -x -p no:cacheprovider $t" 2>/dev/null
      echo "smoke $c rc $rc ($SECONDS s)"; tail -2 "$OUT/smoke-$c.log"
    done
    ;;
  correctness)
    timeout 560 python3 -m pytest -q -rs -p no:cacheprovider \
      tests/gpu/test_cute_backward.py tests/gpu/test_cute_attention.py \
      --junitxml="$OUT/junit-cute.xml" --durations=10 2>&1 | tee "$OUT/pytest-cute.log" | tail -40
    ;;
  bwdv1)
    # Backward v1 (BackwardConfig): a small smoke run first (a barrier mismatch would hang:
    # the timeout says so), then a subset of the GPU tests, then the config variants timed
    # beside FA4 native in one run.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    timeout 90 python3 tests/scripts/gpu_backward_small.py 2>&1 | grep -v Warning | tail -6 \
      || { echo "SMOKE FAILED OR HUNG"; exit 3; }
    t=tests/gpu/test_cute_backward.py
    timeout 250 python3 -m pytest -q -rs -p no:cacheprovider "$t::test_builtin_grads[causal]" \
      "$t::test_builtin_grads[hstu]" "$t::test_builtin_grads[shared_prompt]" "$t::test_builtin_grads[clear]" \
      "$t::test_builtin_grads[document]" "$t::test_builtin_grads[sliding_window]" \
      "$t::test_head_dim_64_fp16_mqa" "$t::test_fully_masked_rows" "$t::test_no_column_view_uses_row_intervals" \
      "$t::test_random_lowered_specs[0]" "$t::test_random_lowered_specs[1]" \
      --junitxml="$OUT/junit-bwdv1.xml" 2>&1 | tee "$OUT/pytest-bwdv1.log" | tail -12
    timeout 230 python3 benchmarks/bench_total.py --ns 32768 --masks causal,hstu --impls jcm,fa4-native \
      --jcm-variants "base=;early=JCOMPILEMASK_CUTE_BWD_CONFIG=stats_early=1;ds1=JCOMPILEMASK_CUTE_BWD_CONFIG=ds_stages=1" \
      --min-repeat-s 0.3 --budget-s 200 --out "$OUT/h200-bwd-v1.json" 2>&1 | grep -v Warning | tee "$OUT/bench-bwdv1.log" | grep '^|' | tail -12
    ;;
  bwdv1b)
    # The rest of backward v1's GPU tests, the non-finite GPU tests, and the four
    # workloads at 32K beside FA4 native (one short call).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    t=tests/gpu/test_cute_backward.py
    timeout 85 python3 -m pytest -q -rs -p no:cacheprovider "$t::test_fully_masked_rows" \
      "$t::test_no_column_view_uses_row_intervals" "$t::test_random_lowered_specs[0]" \
      "$t::test_random_lowered_specs[1]" 2>&1 | tee "$OUT/pytest-bwdv1b.log" | tail -8
    timeout 50 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_nonfinite_gpu.py 2>&1 \
      | tee "$OUT/pytest-nonfinite.log" | tail -12
    timeout 100 python3 benchmarks/bench_total.py --ns 32768 --masks causal,hstu,shared_prompt,clear \
      --impls jcm,fa4-native --min-repeat-s 0.25 --budget-s 90 --out "$OUT/h200-bwd-v1b.json" 2>&1 \
      | grep -v Warning | tee "$OUT/bench-bwdv1b.log" | grep '^|' | tail -8
    ;;
  bwdv1c)
    # The configs not yet run on the H200: correctness of each (ragged lengths: the TMA
    # store's clipping), the determinism stress test and the non-finite GPU tests
    # (~9 min); `bwdv1d` times them.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    t=tests/gpu/test_cute_backward.py
    # (work_list with list_chunk=16 makes every test sequence span many list chunks.)
    for cfg in column_registers=2 dkv_tma_store=1 lse_early=1,release_do_early=1 work_list=1 \
        work_list=1,list_chunk=16,deterministic=1; do
      JCOMPILEMASK_CUTE_BWD_CONFIG=$cfg timeout 75 python3 -m pytest -q -rs -p no:cacheprovider \
        "$t::test_builtin_grads[clear]" "$t::test_builtin_grads[causal]" "$t::test_head_dim_64_fp16_mqa" \
        2>&1 | tail -2 | sed "s/^/[$cfg] /" | tee -a "$OUT/pytest-bwdv1c.log"
    done
    timeout 120 python3 -m pytest -q -rs -p no:cacheprovider "$t::test_repeated_gradients_are_identical" \
      tests/gpu/test_nonfinite_gpu.py 2>&1 | tail -4 | tee -a "$OUT/pytest-bwdv1c.log"
    ;;
  bwdv1d)
    # The configs of bwdv1c timed beside the default and FA4 native (one run id).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    timeout 540 python3 benchmarks/bench_total.py --ns 32768 --masks causal,clear --impls jcm,fa4-native \
      --jcm-variants "base=;le=JCOMPILEMASK_CUTE_BWD_CONFIG=lse_early=1;rd=JCOMPILEMASK_CUTE_BWD_CONFIG=release_do_early=1;cr2=JCOMPILEMASK_CUTE_BWD_CONFIG=column_registers=2;dkvt=JCOMPILEMASK_CUTE_BWD_CONFIG=dkv_tma_store=1;det=JCOMPILEMASK_CUTE_BWD_CONFIG=deterministic=1;wl=JCOMPILEMASK_CUTE_BWD_CONFIG=work_list=1" \
      --min-repeat-s 0.3 --budget-s 500 --out "$OUT/h200-bwd-v1c.json" 2>&1 | grep -v Warning \
      | tee "$OUT/bench-bwdv1c.log" | grep '^|' | tail -16
    ;;
  v1prof)
    # Backward v1 profiled (ncu: stall reasons per SASS instruction, one causal 32K launch)
    # and the configs of bwdv1c timed beside the default and FA4 native at causal 32K.
    # ncu's output goes to a file (a pipe would outlive a timed-out ncu: its python child
    # keeps it open), and stragglers are killed.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    timeout -k 5 130 ncu --clock-control none --kernel-name regex:FlashBackward --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
      --section SourceCounters -o "$OUT/bwd" python3 tests/scripts/gpu_backward_profile.py \
      > "$OUT/ncu-run.log" 2>&1; echo "ncu rc $?"; pkill -9 -f gpu_backward_profile; tail -3 "$OUT/ncu-run.log"
    if [[ -f $OUT/bwd.ncu-rep ]]; then
      timeout 30 ncu -i "$OUT/bwd.ncu-rep" --page details > "$OUT/ncu-bwd.log" 2>&1
      grep -E "Busy|Stall|Registers|Issued|Eligible|Duration|Spill|Local" "$OUT/ncu-bwd.log" | head -30
      timeout 40 ncu -i "$OUT/bwd.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-bwd-sass.csv" 2>&1
      timeout 30 ncu -i "$OUT/bwd.ncu-rep" --page raw --csv > "$OUT/ncu-bwd-raw.csv" 2>&1
      ls -la "$OUT"
    fi
    timeout -k 5 230 python3 benchmarks/bench_total.py --ns 32768 --masks causal --impls jcm,fa4-native \
      --jcm-variants "base=;le=JCOMPILEMASK_CUTE_BWD_CONFIG=lse_early=1;rd=JCOMPILEMASK_CUTE_BWD_CONFIG=release_do_early=1;dkvt=JCOMPILEMASK_CUTE_BWD_CONFIG=dkv_tma_store=1;wl=JCOMPILEMASK_CUTE_BWD_CONFIG=work_list=1;det=JCOMPILEMASK_CUTE_BWD_CONFIG=deterministic=1" \
      --min-repeat-s 0.25 --budget-s 200 --out "$OUT/h200-bwd-v1prof.json" > "$OUT/bench-v1prof.log" 2>&1
    echo "bench rc $?"; pkill -9 -f bench_total; grep '^|' "$OUT/bench-v1prof.log" | tail -12
    ;;
  v5tests)
    # The default backward config (work list + dK / dV by TMA store) through the GPU
    # tests: smoke vs xla, every GPU case of test_cute_backward.py, the gradient cases of
    # test_cute_attention.py, the non-finite GPU tests, then list chunks of 16 query
    # tiles (every test sequence spans several chunks).
    t=tests/gpu/test_cute_backward.py
    timeout -k 5 90 python3 tests/scripts/gpu_backward_small.py > "$OUT/smoke.log" 2>&1 \
      || { echo "SMOKE FAILED OR HUNG"; tail -5 "$OUT/smoke.log"; pkill -9 -f gpu_backward_small; exit 3; }
    grep -v Warning "$OUT/smoke.log" | tail -4
    timeout -k 5 300 python3 -m pytest -q -rs -p no:cacheprovider "$t::test_builtin_grads" \
      "$t::test_head_dim_64_fp16_mqa" "$t::test_fully_masked_rows" "$t::test_no_column_view_uses_row_intervals" \
      "$t::test_random_lowered_specs" "$t::test_repeated_gradients_are_identical" \
      "tests/gpu/test_cute_attention.py::test_builtin[hstu]" "tests/gpu/test_cute_attention.py::test_builtin[document]" \
      tests/gpu/test_nonfinite_gpu.py --junitxml="$OUT/junit-v5.xml" > "$OUT/pytest-v5.log" 2>&1
    echo "pytest rc $?"; pkill -9 -f pytest; tail -12 "$OUT/pytest-v5.log"
    JCOMPILEMASK_CUTE_BWD_CONFIG=list_chunk=16 timeout -k 5 70 python3 -m pytest -q -rs -p no:cacheprovider \
      "$t::test_builtin_grads[causal]" "$t::test_builtin_grads[clear]" "$t::test_builtin_grads[hstu]" \
      > "$OUT/pytest-v5-chunk16.log" 2>&1; echo "chunk16 rc $?"; tail -3 "$OUT/pytest-v5-chunk16.log"
    ;;
  s6a)
    # Session 6: Kc > 2 column intervals re-read per masked tile into a bit mask
    # (column_bits; ptxas D 128 K 2 / Kc 13: 656 B of stack held -> 0): its gradient tests,
    # then shared_prompt / hstu / clear at 32K timed as held (base), re-read (cr2) and
    # re-read into bits (cb), same run.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    t=tests/gpu/test_cute_backward.py
    JCOMPILEMASK_CUTE_BWD_CONFIG=column_registers=2,column_bits=1 timeout -k 5 230 python3 -m pytest -q -rs \
      -p no:cacheprovider "$t::test_builtin_grads" "$t::test_random_lowered_specs" "$t::test_fully_masked_rows" \
      "$t::test_no_column_view_uses_row_intervals" --junitxml="$OUT/junit-s6a.xml" > "$OUT/pytest-s6a.log" 2>&1
    echo "pytest rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -8 "$OUT/pytest-s6a.log"
    b=$(( 560 - SECONDS )); (( b > 300 )) && b=300
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns 32768 --masks shared_prompt,hstu,clear --impls jcm \
      --jcm-variants "base=;cr2=JCOMPILEMASK_CUTE_BWD_CONFIG=column_registers=2;cb=JCOMPILEMASK_CUTE_BWD_CONFIG=column_registers=2,column_bits=1" \
      --min-repeat-s 0.25 --budget-s $(( b - 30 )) --out "$OUT/h200-bwd-s6a.json" > "$OUT/bench-s6a.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\||budget' "$OUT/bench-s6a.log" | tail -14
    ;;
  s6b)
    # Session 6's default (column_registers=2, column_bits=8) through the GPU backward
    # tests, then compute-sanitizer memcheck / racecheck / synccheck on the small run, then
    # list chunks of 16 on hstu, each capped by what is left of the call (570 s).
    t=tests/gpu/test_cute_backward.py
    timeout -k 5 $(left 230) python3 -m pytest -q -rs -p no:cacheprovider "$t::test_builtin_grads" \
      "$t::test_random_lowered_specs" "$t::test_fully_masked_rows" "$t::test_head_dim_64_fp16_mqa" \
      "tests/gpu/test_cute_attention.py::test_builtin[hstu]" "tests/gpu/test_cute_attention.py::test_builtin[shared_prompt]" \
      --junitxml="$OUT/junit-s6b.xml" > "$OUT/pytest-s6b.log" 2>&1
    echo "pytest rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -6 "$OUT/pytest-s6b.log"
    for tool in memcheck racecheck synccheck; do
      timeout -k 5 $(left 110) compute-sanitizer --tool $tool --print-limit 20 python3 tests/scripts/gpu_backward_small.py \
        > "$OUT/sanitize-$tool.log" 2>&1; echo "$tool rc $? ($SECONDS s)"; pkill -9 -f gpu_backward_small
      grep -v Warning "$OUT/sanitize-$tool.log" | tail -5
    done
    JCOMPILEMASK_CUTE_BWD_CONFIG=list_chunk=16 timeout -k 5 $(left 120) python3 -m pytest -q -rs -p no:cacheprovider \
      "$t::test_builtin_grads[hstu]" > "$OUT/pytest-s6b-chunk16.log" 2>&1; echo "chunk16 rc $? ($SECONDS s)"
    tail -3 "$OUT/pytest-s6b-chunk16.log"
    ;;
  sanitize1)
    # memcheck of one small case (JCM_SANITIZE_CASE, default hstu), host API errors off (the
    # driver bindings probe optional entry points: CUDA_ERROR_INVALID_VALUE from
    # cuGetProcAddress filled the print limit) and XLA command buffers off.
    export XLA_FLAGS="--xla_gpu_enable_command_buffer="
    for tool in ${JCM_SANITIZE_TOOLS:-memcheck}; do
      timeout -k 5 ${JCM_SANITIZE_S:-150} compute-sanitizer --tool $tool --report-api-errors no --print-limit 20 \
        python3 tests/scripts/gpu_backward_small.py ${JCM_SANITIZE_CASE:-hstu} > "$OUT/sanitize-$tool.log" 2>&1
      echo "$tool rc $? ($SECONDS s)"; pkill -9 -f gpu_backward_small; grep -v Warning "$OUT/sanitize-$tool.log" | tail -8
    done
    ;;
  anyk)
    # Issue 16 items 1-2: K > 8 row / Kc > 16 column intervals on the CuTe forward and
    # backward, and residual predicates emitted into both, against the dense oracle (all
    # 24 cases passed over two calls, session 16; the registry's default since).
    timeout -k 5 400 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_cute_any_k.py \
      tests/gpu/test_cute_residual.py \
      --junitxml="$OUT/junit-anyk.xml" > "$OUT/pytest-anyk.log" 2>&1
    echo "pytest rc $? ($SECONDS s)"; pkill -9 -f test_cute_any_k; tail -12 "$OUT/pytest-anyk.log"
    ;;
  sanitize2)
    # compute-sanitizer on the CuTe kernels with no JAX GPU client in the process
    # (tests/scripts/gpu_kernels_standalone.py: torch tensors through the kernels' TVM-FFI
    # functions; under the sanitizer JAX's runtime segfaulted it). Per case: prepare (jax on
    # CPU), a plain run (errors vs a float32 torch reference), then each tool.
    s=tests/scripts/gpu_kernels_standalone.py
    for c in ${JCM_SANITIZE_CASES:-hstu stripes clear}; do
      timeout -k 5 $(left 60) python3 $s prepare /tmp/$c.npz $c > "$OUT/prepare-$c.log" 2>&1; tail -1 "$OUT/prepare-$c.log"
      timeout -k 5 $(left 90) python3 $s run /tmp/$c.npz > "$OUT/run-$c.log" 2>&1
      echo "plain $c rc $? ($SECONDS s)"; grep -v Warning "$OUT/run-$c.log" | tail -3
      for tool in ${JCM_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
        timeout -k 5 $(left 120) compute-sanitizer --tool $tool --report-api-errors no --print-limit ${JCM_SANITIZE_LIMIT:-20} \
          python3 $s run /tmp/$c.npz > "$OUT/sanitize2-$c-$tool.log" 2>&1
        echo "$tool $c rc $? ($SECONDS s)"; pkill -9 -f gpu_kernels_standalone
        grep -E "max \|o" "$OUT/sanitize2-$c-$tool.log" | head -1
        python3 tests/scripts/sanitizer_summary.py "$OUT/sanitize2-$c-$tool.log" | head -12
      done
    done
    ;;
  s8t)
    # Next default candidate for the backward (session 7's timings: stats_shfl -2% causal,
    # column bits + skip -8% clear; NOTES.md "Session 7"): JCM_S8_CONFIG (default below;
    # the default config since session 8) through the GPU backward tests.
    JCOMPILEMASK_CUTE_BWD_CONFIG=${JCM_S8_CONFIG:-stats_shfl=1,column_bits=0,column_skip=1} \
      bwd_default_tests s8t $(left 540)
    ;;
  s9t)
    # Session 8's SASS change (the consumer warpgroup index made warp-uniform, forward and
    # backward: the same math, other instructions) through the default backward's GPU tests
    # (s8t's list, the 20-rerun stress among them) and the forward kernel's tests.
    bwd_default_tests s9t-bwd $(left 300)
    timeout -k 5 $(left 260) python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_jnp_preprocess_gpu.py \
      tests/gpu/test_cute_forward.py -k "not compiles" --junitxml="$OUT/junit-s9t-fwd.xml" > "$OUT/pytest-s9t-fwd.log" 2>&1
    echo "pytest fwd rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -4 "$OUT/pytest-s9t-fwd.log"
    ;;
  s10)
    # static_stage and lse_prefetch (compile-checked in session 9: D 128 unmasked tile 491 ->
    # 423 / 457 / 392 SASS instructions; 168 registers, 0 B stack): first the bwd of each and
    # of both beside the default and FA4 native (32K causal, hstu; one run), then the GPU
    # tests (s8t's list) under the variant fastest at causal 32K, when that is not the
    # default (JCM_S10_CONFIG forces one).
    variants_then_tests s10 causal,hstu "${JCM_S10_CONFIG:-}" ss=static_stage=1 \
      lp=lse_prefetch=1,stats_shfl=0 both=static_stage=1,lse_prefetch=1,stats_shfl=0
    ;;
  s11)
    # dv_early (session 10; compile-checked: the exp2 / bf16 conversion of P all before the
    # dP^T wait, dV issued there; default D 128 SASS has ptxas wait on dP^T after 6 of 32
    # MUFUs, FA4's after ~16): timed beside the default and FA4 native at 32K (causal, hstu,
    # shared prompt), then the default backward's GPU tests under it when it is the faster at
    # causal 32K (JCM_S11_CONFIG forces a config for the tests).
    variants_then_tests s11 causal,hstu,shared_prompt "${JCM_S11_CONFIG:-}" dve=dv_early=1
    ;;
  s12)
    # ds_first (session 11; ncu of the default at causal 32K: the fence after the dS^T
    # stores + DS_READY take 7% of our warps' stall samples, FA4's 0.7%; FA4 issues dV
    # between its dS^T stores and that fence): timed beside the default and FA4 native at
    # 32K (causal, hstu), then the default backward's GPU tests under it when it is the
    # faster at causal (JCM_S12_CONFIG forces a config for the tests).
    variants_then_tests s12 causal,hstu "${JCM_S12_CONFIG:-}" dsf=ds_first=1
    ;;
  s13)
    # entry_ahead (session 11; ncu of the default at causal 32K: the work-list entry's LDS +
    # R2UR at each tile's head ~2% of our warps' stall samples): each tile reads the next
    # entry before its last wgmma wait (SASS: the loop head is free of the LDS; 392 -> 403
    # instructions per unmasked tile, 168 registers, 0 B stack, no C7512 at D 64 / 128).
    # Timed beside the default and FA4 native (32K causal, hstu), then the default
    # backward's GPU tests under it when it is the faster at causal (JCM_S13_CONFIG forces).
    variants_then_tests s13 causal,hstu "${JCM_S13_CONFIG:-}" ea=entry_ahead=1
    ;;
  s17)
    # exp2_emu (session 16; compile-checked: 2 of every 8 columns' exp2 on the FMA pipe, 4: half;
    # ncu had our warps stalled on MUFU.EX2 in 5.9% of samples, FA4's 2.9%; SASS D 128 per
    # unmasked tile 392 -> 465 / 537 instructions, MUFU 32 -> 24 / 16, 168 registers, 0 B
    # stack): timed beside the default and FA4 native at 32K (causal, hstu, shared prompt),
    # then the default backward's GPU tests under the faster at causal 32K, then its own
    # gradient cases (tests/gpu/test_cute_backward.py::test_exp2_emu_grads).
    variants_then_tests s17 causal,hstu,shared_prompt "${JCM_S17_CONFIG:-}" e2=exp2_emu=2 e4=exp2_emu=4
    timeout -k 5 $(left 120) python3 -m pytest -q -rs -p no:cacheprovider \
      tests/gpu/test_cute_backward.py::test_exp2_emu_grads > "$OUT/pytest-s17-e2e.log" 2>&1
    echo "exp2_emu grads rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -4 "$OUT/pytest-s17-e2e.log"
    ;;
  s10x)
    # Issue 17's one-GPU checks: the CuTe path under shard_map / jax.jit with a sharding
    # (session 9's match_varying fix) and ring attention running the CuTe kernels per step.
    timeout -k 5 540 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_sharding_gpu.py \
      tests/gpu/test_ring_gpu.py --junitxml="$OUT/junit-s10x.xml" > "$OUT/pytest-s10x.log" 2>&1
    echo "pytest rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -8 "$OUT/pytest-s10x.log"
    ;;
  prepro)
    # Where the jnp preprocess's GPU time goes (shared prompt 8K: 3.54 ms in run
    # 2026-12-02T04:45:38Z, 1.60 at 32K; Flex's block mask 0.65): every kernel of one call
    # with its duration, largest first. JCM_PRE_MASK / JCM_PRE_N pick the workload.
    m=${JCM_PRE_MASK:-shared_prompt}; n=${JCM_PRE_N:-8192}
    timeout -k 5 $(left 120) python3 tests/scripts/gpu_preprocess_profile.py $m $n > "$OUT/prepro-run.log" 2>&1
    cat "$OUT/prepro-run.log" | tail -7
    # Kernels of calls 3 and 4 (the first two compile / warm up): skip what calls 1-2 launch.
    k=$(python3 - "$OUT/prepro-run.log" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
m = re.search(r"fusions / scatters / sorts / custom calls in the GPU program: (\d+) (\d+) (\d+) (\d+)", t)
print(sum(map(int, m.groups())) if m else 400)
PY
)
    timeout -k 5 $(left 300) ncu --clock-control none --section SpeedOfLight --launch-skip $(( 3 * k )) \
      --launch-count $(( 2 * k )) -o /tmp/prepro python3 tests/scripts/gpu_preprocess_profile.py $m $n \
      > "$OUT/prepro-ncu.log" 2>&1
    echo "ncu rc $? ($SECONDS s)"; pkill -9 -f gpu_preprocess_profile
    [[ -f /tmp/prepro.ncu-rep ]] && timeout 60 ncu -i /tmp/prepro.ncu-rep --page raw --csv \
      --metrics gpu__time_duration.sum > "$OUT/prepro-kernels.csv" 2>&1 && python3 - "$OUT/prepro-kernels.csv" <<'PY'
import csv, collections, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head = rows[0]
name, dur = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
tot = collections.Counter()
cnt = collections.Counter()
for r in rows[2:]:
    try:
        v = float(r[dur].replace(",", ""))
    except ValueError:
        continue
    tot[r[name][:90]] += v
    cnt[r[name][:90]] += 1
print(f"{sum(cnt.values())} kernels, {sum(tot.values()) / 1e3:.3f} us total (two calls)")
for k, v in tot.most_common(25):
    print(f"  {v / 1e3:10.2f} us  x{cnt[k]:3d}  {k}")
PY
    ;;
  s8b)
    # The candidate and its two parts beside the default and the peers, one run:
    # JCM_BENCH_NS (default 32768) — at 32K four jcm variants fit one call; at 8192 as well.
    # Issue 12's acceptance table when a candidate becomes the default. JCM_S8_VARIANTS
    # replaces the variant list (e.g. "base=;cand=..." so 32K and 8K fit one call).
    # JCM_BENCH_SKIP=flex-fa4:causal leaves out the causal Flex+FA4 records (FA4 native is
    # issue 12's causal peer) so the 8K CLEAR peer fits the call. JCM_BENCH_MASKS picks the
    # masks (CLEAR's Flex+FA4 record alone compiles for > 175 s at 8K: give it its own call).
    # JCM_FLEX_EAGER=clear@8192 builds CLEAR's 8K FlexAttention block mask uncompiled (its compiled
    # build sat in ptxas past every call at 8K; record field block_mask: eager).
    # JCM_PREWARM=P compiles every (N, mask) in P parallel workers first (bench_total.py
    # --prewarm; JCM_PREWARM_S caps that phase), with FA4's disk cache on, so the timed pass
    # loads kernels from disk and 8K + 32K fit one call.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    b=${JCM_BENCH_S:-560}
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns ${JCM_BENCH_NS:-32768} --masks ${JCM_BENCH_MASKS:-causal,hstu,shared_prompt,clear} \
      ${JCM_PREWARM:+--prewarm $JCM_PREWARM --prewarm-s ${JCM_PREWARM_S:-220}} --stack-after-s 150 \
      ${JCM_FLEX_EAGER:+--flex-eager-block-mask $JCM_FLEX_EAGER} \
      --impls jcm,fa4-native,flex-fa4 --min-repeat-s 0.25 ${JCM_BENCH_CHECK:+--check} --skip "${JCM_BENCH_SKIP:-}" \
      --jcm-variants "${JCM_S8_VARIANTS:-base=;sh=JCOMPILEMASK_CUTE_BWD_CONFIG=stats_shfl=1;cs=JCOMPILEMASK_CUTE_BWD_CONFIG=column_bits=0,column_skip=1;cand=JCOMPILEMASK_CUTE_BWD_CONFIG=${JCM_S8_CONFIG:-stats_shfl=1,column_bits=0,column_skip=1}}" \
      --budget-s $(( b - 40 )) --out "$OUT/h200-total-s8.json" > "$OUT/bench-s8.log" 2>&1
    echo "bench rc $?"; pkill -9 -f bench_total; grep -E '^\||FAILED|budget|prewarm' "$OUT/bench-s8.log" | tail -56
    ;;
  prof8)
    # ncu on one causal 32K backward launch of ours (the default, or JCOMPILEMASK_CUTE_BWD_CONFIG)
    # and one of FA4's, same call: where the remaining ~9% goes (tensor busy, stalls,
    # instruction mix side by side). Kernel-name regexes: ours FlashBackward, FA4's bwd
    # class (FlashAttentionBackwardSm90). Reports stay on the device; text pages come back.
    sec="--section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section InstructionStats --section SourceCounters --section MemoryWorkloadAnalysis"
    # JCM_PROF_PASS=fwd profiles the two forward kernels instead (issue 14; the same
    # scripts run forward + backward). JCM_PROF_MASK / JCM_PROF_N (default causal, 32768)
    # pick the workload; past causal the peer is FlexAttention with the FA4 backend
    # (tests/scripts/flex_backward_profile.py), e.g. shared_prompt 8192 (issue 12's cell).
    pm=${JCM_PROF_MASK:-causal}; pn=${JCM_PROF_N:-32768}
    peer=tests/scripts/fa4_backward_profile.py; pargs="$pn"
    [[ $pm == causal ]] || { peer=tests/scripts/flex_backward_profile.py; pargs="$pm $pn"; }
    # Our kernels compiled once outside ncu first (the disk cache keeps them; the run under
    # ncu then loads them): under ncu the process segfaulted right after compiling the
    # shared prompt 8K backward (Kc 13), while the same script ran fine without ncu.
    # FA4's disk cache is turned on for the peer's kernels likewise.
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    # A second prof8 on a warm machine must not report the last call's profiles (session 19:
    # ncu refused to overwrite them, and the summary below read the old ones).
    rm -f /tmp/prof-jcm.ncu-rep /tmp/prof-fa4.ncu-rep /tmp/sass-jcm.csv /tmp/sass-fa4.csv
    # JCM_PROF_DETAIL=0: only the every-kernel listing below (no per-launch profiles).
    [[ ${JCM_PROF_DETAIL:-1} == 0 || ${JCM_PROF_NOCACHE:-0} == 1 ]] || {
    timeout -k 5 $(left 120) python3 tests/scripts/gpu_backward_profile.py $pm $pn > "$OUT/prof-warm.log" 2>&1
    echo "compile outside ncu rc $? ($SECONDS s)"; }
    # JCM_PROF_WHO (default "jcm fa4") picks the sides; JCM_PROF_NOCACHE=1 profiles ours
    # compiled in the profiled process straight away (session 39: a residual kernel loaded
    # from the disk cache segfaults under ncu, the same kernel compiled in-process does not).
    [[ ${JCM_PROF_DETAIL:-1} == 0 ]] || for who in ${JCM_PROF_WHO:-jcm fa4}; do
      args="$pm $pn"
      if [[ ${JCM_PROF_PASS:-bwd} == fwd ]]; then
        if [[ $who == jcm ]]; then re=regex:FlashForwardSm90; script=tests/scripts/gpu_backward_profile.py
        else re=regex:ForwardSm90; script=$peer; args=$pargs; fi
      elif [[ $who == jcm ]]; then re=regex:FlashBackward; script=tests/scripts/gpu_backward_profile.py
      else re=regex:BackwardSm90; script=$peer; args=$pargs; fi
      rc=139
      if [[ $who != jcm || ${JCM_PROF_NOCACHE:-0} != 1 ]]; then
        timeout -k 5 $(left 150) ncu --clock-control none --kernel-name $re --launch-skip 1 --launch-count 1 \
          $sec -o /tmp/prof-$who -f python3 $script $args > "$OUT/ncu-run-$who.log" 2>&1
        rc=$?; echo "ncu $who rc $rc ($SECONDS s)"; pkill -9 -f _backward_profile; tail -2 "$OUT/ncu-run-$who.log"
      fi
      # Session 19: at shared prompt 8K ours segfaults under ncu with the disk cache on and
      # off alike, as its kernels are built or loaded (its causal forward profiles fine).
      # Session 18: ours segfaulted under ncu while loading its kernels from the disk cache
      # (an exported object file) right after they were compiled outside ncu; once more
      # with the disk cache off (the kernels compiled in the profiled process, as before
      # the disk cache existed).
      # Session 35: the dilated window's forward segfaulted both ways (loaded and compiled in
      # the profiled process), so the retry now also changes how ncu replays: the whole
      # application once per pass instead of saving and restoring device memory around the
      # kernel (--replay-mode application; the kernels load from the disk cache each time).
      if [[ $who == jcm && $rc == 139 ]]; then
        JCOMPILEMASK_CUTE_DISK_CACHE=0 timeout -k 5 $(left 170) ncu --clock-control none --kernel-name $re \
          --launch-skip 1 --launch-count 1 $sec -o /tmp/prof-$who -f python3 $script $args > "$OUT/ncu-run-$who-nocache.log" 2>&1
        rc=$?; echo "ncu $who (disk cache off) rc $rc ($SECONDS s)"; pkill -9 -f _backward_profile; tail -2 "$OUT/ncu-run-$who-nocache.log"
      fi
      if [[ $who == jcm && $rc == 139 ]]; then
        timeout -k 5 $(left 200) ncu --clock-control none --replay-mode application --kernel-name $re \
          --launch-skip 1 --launch-count 1 $sec -o /tmp/prof-$who -f python3 $script $args > "$OUT/ncu-run-$who-app.log" 2>&1
        echo "ncu $who (application replay) rc $? ($SECONDS s)"; pkill -9 -f _backward_profile; tail -2 "$OUT/ncu-run-$who-app.log"
      fi
      ncu_pages $who "Duration|Busy|Registers|Issued Ipc|Eligible|Stall|Spill|Local|Executed Instructions " 24
    done
    # Every kernel of the steps (forward, backward, the small XLA / FA4 kernels around them)
    # with its duration: what the bwd_ms figure holds besides the main kernel.
    [[ ${JCM_PROF_ALL:-1} == 0 ]] || for who in jcm fa4; do
      script=tests/scripts/gpu_backward_profile.py; args="$pm $pn"
      [[ $who == fa4 ]] && { script=$peer; args=$pargs; }
      timeout -k 5 $(left 90) ncu --clock-control none --section SpeedOfLight --launch-count 80 \
        -o /tmp/all-$who python3 $script $args > "$OUT/ncu-all-run-$who.log" 2>&1
      echo "ncu all $who rc $? ($SECONDS s)"; pkill -9 -f _backward_profile
      [[ -f /tmp/all-$who.ncu-rep ]] && timeout 30 ncu -i /tmp/all-$who.ncu-rep --page raw --csv \
        --metrics gpu__time_duration.sum > "$OUT/kernels-$who.csv" 2>&1 && python3 - "$OUT/kernels-$who.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head = rows[0]
name, dur = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
for r in rows[2:]:
    print(f"  {r[dur]:>14} {r[name][:110]}")
PY
    done
    [[ -f /tmp/sass-jcm.csv && -f /tmp/sass-fa4.csv ]] && python3 tests/scripts/ncu_sass_summary.py \
      /tmp/sass-jcm.csv /tmp/sass-fa4.csv --top 30 > "$OUT/ncu-compare.txt" 2>&1 && head -75 "$OUT/ncu-compare.txt"
    ;;
  dkl)
    # Issue 15's soft cap (session 33, compile-checked): BackwardConfig.dk_late, each tile's
    # dK += dS^T Q issued in the next tile after its S^T / dP^T, so it runs under that tile's
    # tanh / exp2 phase (capprof: the capped tile's 1024 extra MUFU cycles had only dP^T
    # beneath them; cost 1.19-1.20 against the 1.15 line). Never run on a GPU: one identity
    # case under a hang guard (a barrier or wait-count slip hangs rather than fails), the
    # other four only if it passes, then bwd ms at JCM_HDIMS_NS (8K) capped and uncapped
    # beside the default and FA4 native, then the capped head-dim gradient cases under it.
    # (Measured in session 34: slower, capped and not.)
    cap_switch_trial dkl "test_dk_late_gives_identical_gradients[causal-128-30.0-bfloat16]" \
      "dk_late_gives and not causal-128-30" "dkl@d128cap=dk_late=1;dkln@d128=dk_late=1" dk_late=1 '(64|128)'
    ;;
  wgq)
    # Issue 15's soft cap (session 34, compile-checked): BackwardConfig.wg_dq, each consumer
    # warpgroup's dQ over its own 64 keys, the two parts summed in the shared dQ tile, so
    # DS_READY no longer puts both warpgroups' tanh / exp2 phases together (capprof: the
    # capped tile's 1024 extra MUFU cycles hidden under nothing; dk_late moved the bubble,
    # session 34). Never run on a GPU: one gradient case under a hang guard (a barrier
    # generation slip hangs rather than fails), the other four only if it passes, then bwd
    # ms at JCM_HDIMS_NS (8K) capped and uncapped beside the default and FA4 native, the cap's
    # cost with and without it, then the capped head-dim cases under it.
    # wgq / wgqo (wg_dq_offset: warpgroup 1 starts once warpgroup 0 made its first dS^T)
    # capped; their -n twins uncapped.
    cap_switch_trial wgq "test_wg_dq_gradients_match_the_default[causal-30.0-bfloat16-wgq]" \
      "wg_dq_gradients and not causal-30.0-bfloat16-wgq" \
      "wgq@d128cap=wg_dq=1;wgqo@d128cap=wg_dq=1,wg_dq_offset=1;wgqn@d128=wg_dq=1;wgqon@d128=wg_dq=1,wg_dq_offset=1" \
      wg_dq=1 128
    ;;
  capprof)
    # Issue 15's soft cap (+20% at D 128 8K in sessions 29-32, whatever the instruction mix):
    # ncu on one causal backward launch of ours uncapped and capped (JCM_PROF_SOFTCAP, 30),
    # same call, before any schedule change is built (NOTES.md, session 32: the warpgroups'
    # MUFU phases, tensor busy, stall reasons side by side). JCM_PROF_N (default 8192).
    sec="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats --section InstructionStats --section SourceCounters"
    pn=${JCM_PROF_N:-8192}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    rm -f /tmp/prof-cap*.ncu-rep /tmp/sass-cap*.csv
    for cap in 0 30; do
      # Compiled (or loaded from the pack) outside ncu first, as prof8 does.
      JCM_PROF_SOFTCAP=$cap timeout -k 5 $(left 90) python3 tests/scripts/gpu_backward_profile.py causal $pn \
        > "$OUT/capprof-warm-$cap.log" 2>&1
      echo "warm cap $cap rc $? ($SECONDS s)"; tail -1 "$OUT/capprof-warm-$cap.log"
      JCM_PROF_SOFTCAP=$cap timeout -k 5 $(left 120) ncu --clock-control none --kernel-name regex:FlashBackward \
        --launch-skip 1 --launch-count 1 $sec -o /tmp/prof-cap$cap -f \
        python3 tests/scripts/gpu_backward_profile.py causal $pn > "$OUT/capprof-ncu-$cap.log" 2>&1
      echo "ncu cap $cap rc $? ($SECONDS s)"; pkill -9 -f _backward_profile
      ncu_pages cap$cap "Duration|Busy|Pipe|Issued Ipc|Eligible|Stall|Spill|Executed Instructions " 30
    done
    [[ -f /tmp/sass-cap0.csv && -f /tmp/sass-cap30.csv ]] && python3 tests/scripts/ncu_sass_summary.py \
      /tmp/sass-cap0.csv /tmp/sass-cap30.csv --top 30 > "$OUT/ncu-cap-compare.txt" 2>&1 && head -60 "$OUT/ncu-cap-compare.txt"
    ;;
  parts)
    # Issue 12: what the backward's figure holds besides the kernel. The XLA pieces around
    # it timed alone (dQ un-permute + scale + cast, the same from a blocked slot order, the
    # cast alone, delta, the zeroed accumulator; gpu_dq_post_time.py), then every kernel of
    # ours and FA4's causal steps with its duration under ncu (prof8's listing), at
    # JCM_PROF_N (default 8192: the cell where the kernel is the smallest share).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    timeout -k 5 $(left 120) python3 tests/scripts/gpu_dq_post_time.py ${JCM_PROF_N:-8192} > "$OUT/parts-post.log" 2>&1
    echo "post rc $? ($SECONDS s)"; grep -E '^\{' "$OUT/parts-post.log" | cut -c1-220
    JCM_BUNDLE_READY=1 JCM_PROF_DETAIL=0 JCM_PROF_N=${JCM_PROF_N:-8192} JCM_STAGE_S=$(left 450) bash scripts/h200.sh prof8
    ;;
  masks16|jcmvar)
    # Issue 16's timings (benchmarks/workloads.py MASKS_16): the block-causal mask written
    # with k // 64 <= q // 64 beside its interval spelling (jcm alone: the 1.1x line), a
    # dilated causal window and 16 global tokens + a 256-wide window beside Flex+FA4, forward
    # + backward, at JCM_BENCH_NS (default 8192; 32K in its own call: Flex's compiles).
    # JCM_MASKS16_VARIANTS: bench_total's --jcm-variants (e.g. session 21's candidates,
    # "base=;xc=JCOMPILEMASK_CUTE_BWD_EXACT_COLUMNS=1"), jcm timed once per entry.
    # jcmvar: jcm alone (no peer: their compiles cost a short call most of its time), by
    # default on the dilated window, e.g. a backward config beside the default:
    # JCM_BENCH_NS=8192,32768 JCM_MASKS16_VARIANTS='base=;ds=JCOMPILEMASK_CUTE_BWD_CONFIG=ds_words=1'.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    b=${JCM_BENCH_S:-480}
    masks=dilated_window,global_window,block_causal,block_causal_intervals impls=jcm,flex-fa4
    [[ $stage == jcmvar ]] && masks=dilated_window impls=jcm
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns ${JCM_BENCH_NS:-8192} \
      --masks ${JCM_BENCH_MASKS:-$masks} --impls $impls \
      --skip flex-fa4:block_causal,flex-fa4:block_causal_intervals --min-repeat-s 0.25 \
      ${JCM_MASKS16_VARIANTS:+--jcm-variants "$JCM_MASKS16_VARIANTS"} \
      --budget-s $(( b - 20 )) --out "$OUT/h200-$stage.json" > "$OUT/bench-$stage.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{' "$OUT/bench-$stage.log" | cut -c1-230
    ;;
  rdense)
    # Run-time dense masks (lower/dense_runtime.py): the preprocess's parts at JCM_BENCH_NS
    # (default 8192), then documents / documents_traced through bench_total (one run id).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    timeout -k 5 $(left ${JCM_RD_PARTS_S:-90}) python3 benchmarks/bench_runtime_dense.py \
      --ns ${JCM_BENCH_NS:-8192} --out "$OUT/h200-runtime-dense-parts.json" > "$OUT/bench-rdparts.log" 2>&1
    echo "parts rc $? ($SECONDS s)"; cat "$OUT/bench-rdparts.log" | grep -E '^\{' | cut -c1-200
    JCM_BENCH_MASKS=documents,documents_traced JCM_BENCH_S=$(left ${JCM_RD_BENCH_S:-120}) bash "$0" jcmvar
    ;;
  rdcols)
    # A run-time dense mask's column pack in one CuTe kernel (glue.TransposeWords, the
    # default since session 52; $JCOMPILEMASK_CUTE_TRANSPOSE_WORDS=0 is XLA's pack): its GPU
    # cases (bit for bit against XLA's pack, under vmap, attention with and without it),
    # then rdense with the plan and the step both ways (base: the kernel; xla: XLA's pack).
    # JCM_RDC_TESTS_S splits the stage.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    JCM_STAGE_S=$(left ${JCM_RDC_TESTS_S:-120}) JCM_PAR=${JCM_PAR:-2} JCM_PAR_ONLY='transpose_words' \
      JCM_PAR_FILES="tests/gpu/test_cute_runtime_dense.py tests/gpu/test_cute_glue.py" \
      OUT=$OUT/tw bash "$0" hdimspar
    JCM_STAGE_S=$(left 200) JCM_RD_PARTS_S=${JCM_RD_PARTS_S:-70} JCM_RD_BENCH_S=${JCM_RD_BENCH_S:-100} \
      JCM_MASKS16_VARIANTS='base=;xla=JCOMPILEMASK_CUTE_TRANSPOSE_WORDS=0' bash "$0" rdense
    ;;
  classes)
    # Issue 16: the dilated window as residue classes (lower/classes.py: (q - k) % 2 == 0 in
    # its rule, so each class of q % 2 runs a plain causal window 64 wide, the classes as
    # heads; no residual predicate, fewer and denser tiles) beside the residual lowering
    # (rc0: JCOMPILEMASK_ROW_CLASSES=0) and Flex+FA4, each jcm record checked against the
    # dense reference first (bench_total --check: dq, dk, dv at N=2048). JCM_CL_IMPLS,
    # JCM_CL_S (default 300), JCM_BENCH_NS (8192,32768), JCM_BENCH_MASKS (dilated_window),
    # JCM_CL_VARIANTS (bench_total's --jcm-variants; default base, rc0 and hi: heads_inner
    # on the class mask, whose merged heads are r H + h; 1.3% on the residual form at 32K
    # on an H100, session 38).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    b=$(left ${JCM_CL_S:-300})
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns ${JCM_BENCH_NS:-8192,32768} \
      --masks ${JCM_BENCH_MASKS:-dilated_window} --impls ${JCM_CL_IMPLS:-jcm,flex-fa4} --check \
      --min-repeat-s 0.25 \
      --jcm-variants "${JCM_CL_VARIANTS:-base=;rc0=JCOMPILEMASK_ROW_CLASSES=0;hi=JCOMPILEMASK_CUTE_BWD_CONFIG=heads_inner=1}" \
      --budget-s $(( b - 20 )) --out "$OUT/h200-masks16.json" > "$OUT/bench-classes.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{' "$OUT/bench-classes.log" | cut -c1-260
    ;;
  h200cands)
    # Issue 16's dilated window on the H200 (0.945x Flex+FA4 at 8K, 0.924x at 32K, session 40):
    # the candidates an H100 validated but could not judge, because there both kernels wait on
    # memory and these aim at what the H200's bandwidth leaves (NOTES.md, sessions 39-41):
    # the backward preprocess kernel (prep; pz: its zeros alone), held_words + late_balance
    # (hwlb), those + list_early + q_early (all), and heads_inner (hi: at 32K on an H100 it
    # took 1.3% off where one head's key columns fill the machine). 8K first, then 32K with
    # what targets the 32K penalty; post: dQ's conversion by the postprocess kernel (XLA's
    # pass runs at 4.0 TB/s there, FA4's kernel at 4.3); pp: prep and post together. JCM_C16_TESTS_S / JCM_C16_8K_S /
    # JCM_C16_32K_S split the stage.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    c=JCOMPILEMASK_CUTE_BWD_CONFIG p=JCOMPILEMASK_CUTE_BWD_PREP
    # pz's and post's own cases first (never run on a GPU yet: the zeros-only kernel, the dQ
    # postprocess kernel bit for bit against XLA's pass, their gradients; ~80 s from the pack)
    JCM_STAGE_S=$(left ${JCM_C16_TESTS_S:-100}) JCM_PAR_ONLY='zero_only|post_matches|post_gradients' \
      JCM_PAR_FILES=tests/gpu/test_cute_glue.py OUT=$OUT/pz bash "$0" hdimspar
    # the glue kernels alone beside the XLA passes (benchmarks/bench_glue.py, ~30 s)
    [[ -n ${JCM_COMPILE_ONLY:-} ]] || { timeout -k 5 $(left 45) python3 benchmarks/bench_glue.py \
      --ns 8192 --out "$OUT/h200-glue.json" > "$OUT/bench-glue.log" 2>&1; echo "glue rc $?"
      grep -E '^\{' "$OUT/bench-glue.log" | cut -c1-200; }
    JCM_BENCH_S=$(left ${JCM_C16_8K_S:-250}) JCM_BENCH_NS=8192 JCM_BENCH_MASKS=dilated_window \
      JCM_MASKS16_VARIANTS="base=;prep=$p=1;pz=$p=zero;post=JCOMPILEMASK_CUTE_BWD_POST=1;pp=$p=1 JCOMPILEMASK_CUTE_BWD_POST=1;hwlb=$c=held_words=1,late_balance=1;all=$c=held_words=1,late_balance=1,list_early=1,q_early=1;hi=$c=heads_inner=1" \
      OUT=$OUT/8k bash "$0" masks16
    JCM_BENCH_S=$(left ${JCM_C16_32K_S:-190}) JCM_BENCH_NS=32768 JCM_BENCH_MASKS=dilated_window \
      JCM_MASKS16_VARIANTS="base=;hi=$c=heads_inner=1;prep=$p=1;post=JCOMPILEMASK_CUTE_BWD_POST=1" OUT=$OUT/32k bash "$0" masks16
    ;;
  shortcols)
    # Session 39's H200 plan for issue 16 (NOTES.md, session 39): on an H100 both kernels wait
    # on their Q / dO loads and these switches moved no time; on the H200 the loads shorten
    # and our per-CTA waits (the column-table load, the last dQ-buffer wait, the first Q / dO
    # after the list) are what is left; dkv_staged (persistent CTAs whose next K / V load
    # under the last unit's epilogue) aims at each CTA's first K / V wait (14.2% of the
    # samples), on either card. First their identity cases (the held columns' early load
    # and dkv_staged are new: a barrier slip would hang), then the timings beside Flex+FA4
    # and the default's kernel split. JCM_SC_TESTS_S / JCM_SC_BENCH_S / JCM_SC_KT_S split the stage.
    # nt (session 40): dK / dV stored from registers (dkv_tma_store=0, element stores) instead
    # of staged in shared memory and TMA-stored: each CTA's tail (ncu: the storing warp's
    # EXIT waits for the store's read of shared memory, 8.7% of the samples) against more
    # store instructions; ntv the same with a column pair per 32-bit store (dkv_vec_store).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    c=JCOMPILEMASK_CUTE_BWD_CONFIG
    JCM_STAGE_S=$(left ${JCM_SC_TESTS_S:-180}) JCM_PAR_ONLY='short_column|held_words_gives|dkv_staged_gives' \
      JCM_PAR_FILES=tests/gpu/test_cute_backward.py bash "$0" hdimspar
    n=$(wc -l < "$OUT/par-ids.txt"); ok=$(cat "$OUT"/pytest-par-*.log 2>/dev/null | grep -cE '::[^ ]+ (PASSED|SKIPPED)')
    # (compile-only runs, kernel_cache.sh, fail every case by design: they go on)
    (( n > 0 && ok == n )) || [[ -n ${JCM_COMPILE_ONLY:-} ]] \
      || { echo "shortcols: $ok of $n identity cases passed: no timings"; exit 0; }
    JCM_BENCH_S=$(left ${JCM_SC_BENCH_S:-300}) JCM_BENCH_NS=8192 JCM_BENCH_MASKS=dilated_window \
      JCM_MASKS16_VARIANTS="base=;hwlb=$c=held_words=1,late_balance=1;all=$c=held_words=1,late_balance=1,list_early=1,q_early=1;hi=$c=heads_inner=1;pe=$c=schedule=1,persistent=1;pst=$c=schedule=1,persistent=1,dkv_staged=1;nt=$c=dkv_tma_store=0;ntv=$c=dkv_tma_store=0,dkv_vec_store=1" \
      bash "$0" masks16
    JCM_STAGE_S=$(left ${JCM_SC_KT_S:-120}) JCM_KT_MASKS=dilated_window bash "$0" ktimes
    ;;
  ktimes)
    # Where a step's GPU time goes, kernel by kernel, ours beside the peer's
    # (benchmarks/kernel_times.py: CUPTI through jax.profiler / torch.profiler, so it also
    # runs on the kernels ncu segfaults on). Issue 16: the dilated window's backward on the
    # H200 (1.43 ms vs Flex+FA4's 1.20, run 2026-12-06T02:35:31Z, where the H100 had them
    # even). JCM_KT_MASKS (default dilated_window,global_window), JCM_KT_N (8192),
    # JCM_KT_IMPLS (jcm,flex-fa4; fa4-native for causal), JCM_KT_VARIANTS (kernel_times'
    # --jcm-variants, e.g. 'base=;hi=JCOMPILEMASK_CUTE_BWD_CONFIG=heads_inner=1').
    # Each impl / variant is a child process (CUPTI: one profiler per process); on the H100
    # (session 38) a jcm child took ~50 s from the pack and Flex's first took more than the
    # 50 s left of a 100 s stage: give a mask with jcm x 2 + Flex ~200 s (JCM_STAGE_S).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    for m in $(echo ${JCM_KT_MASKS:-dilated_window,global_window} | tr , ' '); do
      timeout -k 5 $(left 300) python3 benchmarks/kernel_times.py --mask $m --n ${JCM_KT_N:-8192} \
        --impls ${JCM_KT_IMPLS:-jcm,flex-fa4} --steps ${JCM_KT_STEPS:-10} \
        ${JCM_KT_VARIANTS:+--jcm-variants "$JCM_KT_VARIANTS"} \
        --out "$OUT/kernel-times.json" > "$OUT/kt-$m.log" 2>&1
      echo "kernel_times $m rc $? ($SECONDS s)"; pkill -9 -f kernel_times.py
      grep -E '^(jcm|flex|fa4|  )' "$OUT/kt-$m.log" | cut -c1-150 | head -48
    done
    ;;
  qb)
    # Issue 12 (session 20): dq_blocked — the dQ slot in 8-column blocks (64-bit stores), so
    # the un-permute after the kernel moves 32-byte runs instead of gathering 8-byte pieces.
    # The XLA pieces around the kernel timed alone (gpu_dq_post_time.py at 8K), the
    # bit-identity cases (JCM_QB_TESTS, a -k filter; default the causal D 128 one), then the
    # backward timed beside the default and FA4 native (JCM_BENCH_NS, default 8K and 32K).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    timeout -k 5 $(left 90) python3 tests/scripts/gpu_dq_post_time.py 8192 > "$OUT/parts-post.log" 2>&1
    echo "post rc $? ($SECONDS s)"; grep -E '^\{' "$OUT/parts-post.log" | cut -c1-200
    JCOMPILEMASK_CUTE_BACKWARD=1 timeout -k 5 $(left 150) python3 -m pytest -q -rs -p no:cacheprovider \
      tests/gpu/test_cute_backward.py -k "dq_switch_gives and dq_blocked and (${JCM_QB_TESTS:-causal})" \
      > "$OUT/pytest-qb.log" 2>&1
    echo "identity rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -3 "$OUT/pytest-qb.log"
    b=$(left 330)
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns ${JCM_BENCH_NS:-8192,32768} \
      --masks ${JCM_BENCH_MASKS:-causal,shared_prompt} --impls jcm,fa4-native --min-repeat-s 0.25 \
      --jcm-variants "base=;qb=JCOMPILEMASK_CUTE_BWD_CONFIG=dq_blocked=1" --budget-s $(( b - 20 )) \
      --out "$OUT/h200-bwd-qb.json" > "$OUT/bench-qb.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{' "$OUT/bench-qb.log" | cut -c1-190
    ;;
  bsched)
    # Issue 12 / 16 (session 21): the backward's key columns in the host's order
    # (BackwardConfig.schedule, api.backward_schedule) beside the default grid, with each
    # order policy ($JCOMPILEMASK_CUTE_BWD_ORDER: hoist, global, group), FA4 native beside
    # causal. The masks whose long columns start late in the grid (causal / shared prompt 8K:
    # the last head's; CLEAR's text keys; the 16 global keys) at JCM_BENCH_NS (default 32K
    # and 8K). Every (N, mask) compiled first in JCM_PREWARM parallel workers (default 8).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    b=${JCM_BENCH_S:-540}
    sc="JCOMPILEMASK_CUTE_BWD_CONFIG=schedule=1"
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns ${JCM_BENCH_NS:-32768,8192} \
      --masks ${JCM_BENCH_MASKS:-global_window,clear,causal,shared_prompt} --impls jcm,fa4-native \
      --prewarm ${JCM_PREWARM:-8} --prewarm-s ${JCM_PREWARM_S:-200} --min-repeat-s 0.25 \
      --jcm-variants "${JCM_SCHED_VARIANTS:-base=;hoist=$sc;glob=$sc JCOMPILEMASK_CUTE_BWD_ORDER=global;grp=$sc JCOMPILEMASK_CUTE_BWD_ORDER=group}" \
      --budget-s $(( b - 20 )) --out "$OUT/h200-bwd-sched.json" > "$OUT/bench-sched.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{|prewarm' "$OUT/bench-sched.log" | cut -c1-200
    ;;
  s21)
    # Session 21's compile-checked candidates (issue 16's dilated / global-window masks, and
    # every masked tile): BackwardKey.exact_columns ($JCOMPILEMASK_CUTE_BWD_EXACT_COLUMNS=1:
    # one-region masks drop the row path), BackwardConfig.column_words (masked tiles from
    # column-group words), the forward's residual_words ($JCOMPILEMASK_CUTE_FWD_RESIDUAL_WORDS=1)
    # and the backward's `tail` column order. First their bit-identity / gradient cases in
    # JCM_PAR parallel pytest processes (default 4), then bwd / fwd ms beside the default at
    # JCM_BENCH_NS (default 8192) on JCM_BENCH_MASKS.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    if [[ ${JCM_S21_TESTS:-1} == 1 ]]; then
      python3 -m pytest --collect-only -q -p no:cacheprovider tests/gpu/test_cute_backward.py tests/gpu/test_cute_residual.py 2>/dev/null \
        | grep -E 'exact_columns_and_column_words_give|residual_words_forward_is_bit|schedule_gives' > "$OUT/s21-ids.txt"
      np=${JCM_PAR:-4}; echo "$(wc -l < "$OUT/s21-ids.txt") cases over $np processes"
      for i in $(seq 0 $(( np - 1 ))); do
        awk -v i=$i -v n=$np '(NR - 1) % n == i' "$OUT/s21-ids.txt" > /tmp/s21-$i.txt
        [[ -s /tmp/s21-$i.txt ]] || continue
        JCOMPILEMASK_CUTE_BACKWARD=1 timeout -k 5 $(left 260) python3 -m pytest -v -rs -p no:cacheprovider \
          $(cat /tmp/s21-$i.txt) > "$OUT/pytest-s21-$i.log" 2>&1 &
      done
      wait; echo "tests done ($SECONDS s)"
      cat "$OUT"/pytest-s21-*.log | grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" | sed 's/ *\[ *[0-9]*%\]//' | head -40
      grep -h -E "^E  " "$OUT"/pytest-s21-*.log | head -12
    fi
    b=$(left 400)
    sc="JCOMPILEMASK_CUTE_BWD_CONFIG=schedule=1 JCOMPILEMASK_CUTE_BWD_ORDER=tail"
    xc="JCOMPILEMASK_CUTE_BWD_EXACT_COLUMNS=1"
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns ${JCM_BENCH_NS:-8192} \
      --masks ${JCM_BENCH_MASKS:-dilated_window,global_window,causal,shared_prompt,clear} --impls jcm \
      --min-repeat-s 0.25 \
      --jcm-variants "${JCM_S21_VARIANTS:-base=;xc=$xc;xccw=$xc JCOMPILEMASK_CUTE_BWD_CONFIG=column_words=1;rw=JCOMPILEMASK_CUTE_FWD_RESIDUAL_WORDS=1;tail=$sc}" \
      --budget-s $(( b - 20 )) --out "$OUT/h200-s21.json" > "$OUT/bench-s21.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{' "$OUT/bench-s21.log" | cut -c1-170
    ;;
  lb)
    # BackwardConfig.late_balance (session 23: the consumers' last DQ_EMPTY wait after the
    # dK / dV epilogue), list_early (session 24: the first list's tile words loaded first
    # thing), mask_r2p (session 24: the masked tile's bit tests as R2P) and ds_words
    # (session 25: dS^T's masked pairs zeroed by the mask's words, not a P == 0 guard): their
    # 4 + 4 + 4 + 8 bit-identity cases under a hang guard, then bwd ms beside
    # the default at JCM_BENCH_NS (default 8192) on JCM_BENCH_MASKS (the short columns of
    # issue 16 first, where ncu put 4.2% of the kernel on that wait).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    if [[ ${JCM_LB_TESTS:-1} == 1 ]]; then
      JCOMPILEMASK_CUTE_BACKWARD=1 timeout -k 5 $(left 260) python3 -m pytest -v -rs -p no:cacheprovider \
        tests/gpu/test_cute_backward.py -k "(dq_switch_gives and (late_balance or list_early or mask_r2p)) or (schedule_gives and auto) or ds_words_gives" > "$OUT/pytest-lb.log" 2>&1
      echo "pytest rc $? ($SECONDS s)"; pkill -9 -f pytest
      grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/pytest-lb.log" | sed 's/ *\[ *[0-9]*%\]//'; grep -E "^E  " "$OUT/pytest-lb.log" | head -8
    fi
    b=$(left 380)
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns ${JCM_BENCH_NS:-8192} \
      --masks ${JCM_BENCH_MASKS:-dilated_window,global_window,causal,shared_prompt,clear} --impls jcm \
      --min-repeat-s 0.25 --jcm-variants "${JCM_LB_VARIANTS:-base=;lb=JCOMPILEMASK_CUTE_BWD_CONFIG=late_balance=1;le=JCOMPILEMASK_CUTE_BWD_CONFIG=list_early=1;r2p=JCOMPILEMASK_CUTE_BWD_CONFIG=mask_r2p=1;dsw=JCOMPILEMASK_CUTE_BWD_CONFIG=ds_words=1;au=JCOMPILEMASK_CUTE_BWD_CONFIG=schedule=1 JCOMPILEMASK_CUTE_BWD_ORDER=auto}" \
      --budget-s $(( b - 20 )) --out "$OUT/h200-lb.json" > "$OUT/bench-lb.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{' "$OUT/bench-lb.log" | cut -c1-170
    ;;
  shfl)
    # Session 6's compile-checked knobs, tested then timed: stats_shfl (lse / delta by shfl),
    # column_skip (unrolled column bits skip intervals that miss the tile), the forward's
    # bit-mask path for K <= 8 ($JCOMPILEMASK_CUTE_FWD_BITS_ABOVE=0; clear: K 6).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    t=tests/gpu/test_cute_backward.py
    JCOMPILEMASK_CUTE_BWD_CONFIG=stats_shfl=1,column_bits=0,column_skip=1 JCOMPILEMASK_CUTE_FWD_BITS_ABOVE=0 \
      timeout -k 5 $(left 200) python3 -m pytest -q -rs -p no:cacheprovider \
      "$t::test_builtin_grads" "$t::test_random_lowered_specs" "$t::test_fully_masked_rows" "$t::test_head_dim_64_fp16_mqa" \
      --junitxml="$OUT/junit-shfl.xml" > "$OUT/pytest-shfl.log" 2>&1
    echo "pytest rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -6 "$OUT/pytest-shfl.log"
    b=$(left 170)
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns 32768 --masks causal,hstu --impls jcm,fa4-native \
      --jcm-variants "base=;sh=JCOMPILEMASK_CUTE_BWD_CONFIG=stats_shfl=1" \
      --min-repeat-s 0.25 --budget-s $(( b - 20 )) --out "$OUT/h200-bwd-shfl.json" > "$OUT/bench-shfl.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\||budget' "$OUT/bench-shfl.log" | tail -8
    b=$(left 200)
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns 32768 --masks shared_prompt,clear --impls jcm \
      --jcm-variants "base=;cs=JCOMPILEMASK_CUTE_BWD_CONFIG=column_bits=0,column_skip=1;fb=JCOMPILEMASK_CUTE_FWD_BITS_ABOVE=0" \
      --min-repeat-s 0.25 --budget-s $(( b - 20 )) --out "$OUT/h200-bwd-shfl.json" > "$OUT/bench-cs.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\||budget' "$OUT/bench-cs.log" | tail -8
    ;;
  fwl)
    # Issue 14 item 1: the forward's compact work list (the default since session 17, after
    # all 109 cases below passed under it): the forward GPU tests and the gradient cases
    # through it, then the forward timed beside the bitmap walk
    # ($JCOMPILEMASK_CUTE_FWD_WORK_LIST=0, variant bm) and FA4 native (32K, 8K).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    JCOMPILEMASK_CUTE_FWD_WORK_LIST=1 timeout -k 5 $(left 260) python3 -m pytest -q -rs -p no:cacheprovider \
      tests/gpu/test_cute_forward.py tests/gpu/test_cute_attention.py -k "not compiles" \
      --junitxml="$OUT/junit-fwl.xml" > "$OUT/pytest-fwl.log" 2>&1
    echo "pytest rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -6 "$OUT/pytest-fwl.log"
    b=$(left 290)
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns 32768,8192 --masks causal,hstu,shared_prompt \
      --impls jcm,fa4-native --jcm-variants "base=;bm=JCOMPILEMASK_CUTE_FWD_WORK_LIST=0" \
      --min-repeat-s 0.25 --budget-s $(( b - 20 )) --out "$OUT/h200-fwd-wl.json" > "$OUT/bench-fwl.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\||budget' "$OUT/bench-fwl.log" | tail -12
    ;;
  fka)
    # Issue 14 (compile-checked in session 9): K(t + 1) loaded before V(t)
    # (JCOMPILEMASK_CUTE_FWD_K_AHEAD=1, FA4's producer order), with the work list (the
    # default) and the bitmap walk (WORK_LIST=0): bit-identity vs the default order under a
    # hang guard (an ordering mistake deadlocks), the forward + attention GPU tests under
    # k_ahead + work list, then the forward timed per variant beside FA4 native.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    identity_gate fka k_ahead_forward_is_bit_identical $(left 120)
    JCOMPILEMASK_CUTE_FWD_K_AHEAD=1 JCOMPILEMASK_CUTE_FWD_WORK_LIST=1 timeout -k 5 $(left 200) \
      python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_cute_forward.py \
      "tests/gpu/test_cute_attention.py::test_builtin" -k "not compiles" \
      --junitxml="$OUT/junit-fka.xml" > "$OUT/pytest-fka.log" 2>&1
    echo "pytest rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -3 "$OUT/pytest-fka.log"
    timeout -k 5 $(left 300) python3 benchmarks/bench_forward.py --ns ${JCM_BENCH_NS:-32768,8192} \
      --masks causal,hstu --fa4 --jcm-variants "base=;ka=JCOMPILEMASK_CUTE_FWD_K_AHEAD=1;bm=JCOMPILEMASK_CUTE_FWD_WORK_LIST=0;bmka=JCOMPILEMASK_CUTE_FWD_WORK_LIST=0 JCOMPILEMASK_CUTE_FWD_K_AHEAD=1" \
      --out "$OUT/h200-fwd-ka.json" > "$OUT/bench-fka.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_forward; grep -E '^bench|^\{' "$OUT/bench-fka.log" | tail -30 | cut -c1-200
    ;;
  fgm)
    # Issue 14 item 3 (compile-checked in session 17): group_mask — a masked tile's rows as
    # column-group bit words ($JCOMPILEMASK_CUTE_FWD_GROUP_MASK=1; SASS per masked tile, D 128:
    # K 1 765 -> 627, K 2 893 -> 675, K 6 1661 -> 875 instructions; unmasked unchanged):
    # bit-identity vs the default (8 cases, hang-guarded), the forward timed beside the
    # default, k_ahead (session 16's state-carry fix passed its bit-identity cases in session
    # 17) and FA4 native (32K by default, JCM_BENCH_NS; clear and shared prompt are the masks
    # with the most masked tiles), then the forward + attention GPU tests under it.
    forward_switch_stage fgm group_mask_forward_is_bit_identical 200 JCOMPILEMASK_CUTE_FWD_GROUP_MASK \
      32768 clear,shared_prompt,hstu,causal \
      "${JCM_FGM_VARIANTS:-base=;gm=JCOMPILEMASK_CUTE_FWD_GROUP_MASK=1;ka=JCOMPILEMASK_CUTE_FWD_K_AHEAD=1}"
    ;;
  frt)
    # Issue 14 (compile-checked in session 19): rescale_tail — O's rescale in the tile loop's
    # tail beside P's conversion ($JCOMPILEMASK_CUTE_FWD_RESCALE_TAIL=1; the 32 F2FP and 64
    # FMUL interleave instead of two bursts): bit-identity vs the default (6 cases,
    # hang-guarded), the forward timed beside the default and FA4 native (32K, 8K, 2K by
    # default: JCM_BENCH_NS), then the forward + attention GPU tests under it.
    forward_switch_stage frt rescale_tail_forward_is_bit_identical 180 JCOMPILEMASK_CUTE_FWD_RESCALE_TAIL \
      32768,8192,2048 causal,hstu,shared_prompt \
      "${JCM_FRT_VARIANTS:-base=;rt=JCOMPILEMASK_CUTE_FWD_RESCALE_TAIL=1}"
    ;;
  fwr)
    # Issue 14 (compile-checked in session 24): work_runs — the forward's work list as runs of
    # one kind, producer and consumers looping over a run's tiles with a counter (the per-tile
    # list entry's load / decode / branch gone: 491 SASS instructions per full tile against
    # 513): bit-identity vs the per-tile list (10 cases, hang-guarded), timed beside the
    # default and FA4 native (32K, 8K, 2K: JCM_BENCH_NS), then the forward + attention tests.
    forward_switch_stage fwr work_runs_forward_is_bit_identical 200 JCOMPILEMASK_CUTE_FWD_WORK_RUNS \
      32768,8192,2048 causal,hstu,shared_prompt \
      "${JCM_FWR_VARIANTS:-base=;wr=JCOMPILEMASK_CUTE_FWD_WORK_RUNS=1}"
    ;;
  frse)
    # Issue 14 (compile-checked in session 26), two switches from the session's ncu pair
    # (causal 8K: our unmasked step sampled 2.7% more than FA4's): rescale_early — O's
    # rescale by a step's row factors in the next step, after its S GEMM issue and before its
    # P V issue (FA3's order; the 64 FMULs had all run after the 64 exp2s, behind the P V
    # wait) — and operands_early — the GEMM operand slices taken before the K wait and the
    # scheduler barrier (16 instructions from that barrier to the first S HGMMA, FA4's 6).
    # Both bit-identical: their identity cases (9 + 7) under a hang guard, then fwd ms of
    # each and both beside the default and FA4 native (JCM_BENCH_NS, default 8K and 32K;
    # causal and hstu, the masks under the line), then the forward tests under both.
    rse=JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY; oe=JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY
    forward_switch_stage frse "rescale_early_forward_is_bit_identical or operands_early_forward_is_bit_identical" \
      240 "$rse $oe" 8192,32768 causal,hstu \
      "${JCM_FRSE_VARIANTS:-base=;rse=$rse=1;oe=$oe=1;both=$rse=1 $oe=1}"
    ;;
  fpd)
    # Issue 14 (compile-checked in session 30): p_double — P in two register tensors by step
    # parity, so P's conversion no longer waits for the previous P V, and ptxas puts that wait
    # after 15 of the step's 64 exp2s instead of 0 (FA4: 10; our causal 8K forward is 0.976x
    # FA4's). Bit-identical: its 7 identity cases under a hang guard, then fwd ms beside
    # operands_early and the default and FA4 native (8K then 32K; causal, hstu, shared
    # prompt), then the forward tests under it with operands_early.
    pd=JCOMPILEMASK_CUTE_FWD_P_DOUBLE; oe=JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY
    forward_switch_stage fpd "p_double_forward_is_bit_identical" 200 "$pd $oe" 8192,32768 \
      causal,hstu,shared_prompt "${JCM_FPD_VARIANTS:-base=;off=$oe=0 $pd=0;oe=$oe=1 $pd=0;pd=$oe=0 $pd=1}"
    ;;
  fre)
    # Issue 14 (compile-checked in session 24): runs_early — work_runs' remaining gap to FA4
    # fits a fixed ~0.7 us per CTA (8192 CTAs at every N); the list, and so the first K / V
    # load, waited for the producer's tile-word load. The word is now the kernel's first LDG
    # and the runs are built over the set bits only. Bit-identity vs work_runs (8 cases),
    # timed beside the default and FA4 native (8K, 2K, 32K), then the forward + attention tests.
    forward_switch_stage fre runs_early_forward_is_bit_identical 160 JCOMPILEMASK_CUTE_FWD_RUNS_EARLY \
      8192,2048,32768 causal,hstu,shared_prompt \
      "${JCM_FRE_VARIANTS:-base=;re=JCOMPILEMASK_CUTE_FWD_RUNS_EARLY=1}"
    ;;
  fss)
    # Issue 14 (all compile-checked in session 24): runs_early (see fre), slot_skip (a masked
    # tile builds an interval slot's runs only where the slot reaches into the tile for some
    # row of the warp: clear's K 6 masked step is issue-bound) and mask_r2p (the masked
    # tile's bit tests as R2P). Their bit-identity cases (20, one guard), then fwd ms at 8K
    # and 32K beside the default and FA4 native for the rest of the call, clear first (the
    # variants' kernels compile on the device: ~10 s each). The forward tests under a winner
    # take a later call (hdimspar with JCOMPILEMASK_CUTE_FWD_...=1).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    identity_gate fss "runs_early_forward_is_bit_identical or slot_skip_forward_is_bit_identical or mask_r2p_forward_is_bit_identical" $(left 220)
    timeout -k 5 $(left 560) python3 benchmarks/bench_forward.py --ns ${JCM_BENCH_NS:-8192,32768} \
      --masks ${JCM_BENCH_MASKS:-clear,causal,hstu,shared_prompt} --fa4 \
      --jcm-variants "${JCM_FSS_VARIANTS:-base=;re=JCOMPILEMASK_CUTE_FWD_RUNS_EARLY=1;r2p=JCOMPILEMASK_CUTE_FWD_MASK_R2P=1;all=JCOMPILEMASK_CUTE_FWD_RUNS_EARLY=1 JCOMPILEMASK_CUTE_FWD_SLOT_SKIP=1 JCOMPILEMASK_CUTE_FWD_MASK_R2P=1}" \
      --out "$OUT/h200-fwd-fss.json" > "$OUT/bench-fss.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_forward; grep -E '^bench' "$OUT/bench-fss.log" | tail -40 | cut -c1-120
    ;;
  rp)
    # Issue 16 (compile-checked in session 24): residual_periodic, forward and backward — the
    # dilated window's (q - k) % 2 == 0 takes one value per row and column class, so its
    # masked tiles are word tests only (static SASS: forward masked tile 896 -> 730, the
    # backward kernel 3352 -> 3200). Forward bit-identity (6 residual masks) and gradient
    # bit-identity (4), hang-guarded; then issue 16's masks (masks16) with it beside
    # Flex+FA4 at JCM_BENCH_NS (default 8192).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    JCOMPILEMASK_CUTE_BACKWARD=1 timeout -k 5 $(left 200) python3 -m pytest -v -rs -p no:cacheprovider \
      tests/gpu/test_cute_residual.py tests/gpu/test_cute_backward.py -k "residual_periodic and not compiles" \
      > "$OUT/pytest-rp.log" 2>&1
    rc=$?; echo "pytest rc $rc ($SECONDS s)"; pkill -9 -f pytest
    grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/pytest-rp.log" | sed 's/ *\[ *[0-9]*%\]//'; grep -E "^E  " "$OUT/pytest-rp.log" | head -8
    (( rc == 0 )) || exit 3
    b=$(left 360)
    timeout -k 5 $b python3 benchmarks/bench_total.py --ns ${JCM_BENCH_NS:-8192} \
      --masks ${JCM_BENCH_MASKS:-dilated_window,global_window} --impls jcm,flex-fa4 --min-repeat-s 0.25 \
      --jcm-variants "${JCM_RP_VARIANTS:-base=;rp=JCOMPILEMASK_CUTE_FWD_RESIDUAL_PERIODIC=1 JCOMPILEMASK_CUTE_BWD_CONFIG=residual_periodic=1}" \
      --budget-s $(( b - 20 )) --out "$OUT/h200-masks16.json" > "$OUT/bench-rp.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{' "$OUT/bench-rp.log" | cut -c1-230
    ;;
  fwdtable)
    # JCM_FLEX_MASKS defaults to shared_prompt,hstu,clear (CLEAR last: its block mask stalled
    # ptxas at 8K until session 26 gave bench_peers the block-mask form of its mask_mod).
    # Issue 14's acceptance table for one N per call (JCM_BENCH_NS, default 32768; 8192 and
    # 2048 in later calls: Flex's torch.compile of four masks does not fit one call at every
    # N): Flex+FA4 on hstu / shared prompt / clear first (its compiles are the long part;
    # torch's inductor cache stays on a warm machine), then the jcm default (work list +
    # group_mask) on all four masks beside FA4 native causal, one JCM_RUN_ID for both files.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    ns=${JCM_BENCH_NS:-32768}
    # One process per Flex mask, each under its own limit (JCM_FLEX_MASK_S): session 25's
    # 8K call lost every Flex figure to CLEAR's compile (> 300 s; at 32K each mask took
    # ~60 s). bench_peers merges each run's records into the same file.
    end=$(( SECONDS + ${JCM_FLEX_S:-330} ))
    flex_masks=${JCM_FLEX_MASKS:-shared_prompt,hstu,clear}
    for m in ${flex_masks//,/ }; do
      b=$(left $(( end - SECONDS < ${JCM_FLEX_MASK_S:-150} ? end - SECONDS : ${JCM_FLEX_MASK_S:-150} )))
      (( b > 20 )) || { echo "flex $m: no time left"; continue; }
      # JCM_FLEX_EAGER (default clear@8192): CLEAR's 8K block mask built uncompiled (its compiled
      # build outlasted 150-200 s in sessions 25, 26, 29 and 35, the tensor-width form included).
      timeout -k 5 $b python3 benchmarks/bench_peers.py --ns $ns --masks $m --impls flex-fa4 \
        --flex-eager-block-mask "${JCM_FLEX_EAGER-clear@8192}" \
        --budget-s $(( b - 10 )) --out "$OUT/h200-forward-peers.json" >> "$OUT/bench-peers.log" 2>&1
      echo "peers $m rc $? ($SECONDS s)"; pkill -9 -f bench_peers
    done
    grep -E '^\{' "$OUT/bench-peers.log" | cut -c1-200
    timeout -k 5 $(left 300) python3 benchmarks/bench_forward.py --ns $ns --masks causal,hstu,shared_prompt,clear \
      --fa4 --out "$OUT/h200-forward.json" > "$OUT/bench-fwd.log" 2>&1
    echo "forward rc $? ($SECONDS s)"; pkill -9 -f bench_forward; grep -E '^bench' "$OUT/bench-fwd.log" | tail -12
    ;;
  fsched)
    # Issue 14 item 2 (compile-checked in session 7): the forward's longest-first order
    # (JCOMPILEMASK_CUTE_FWD_SCHEDULE=1) and persistent CTAs (=persistent), with the work list
    # (the default) and the bitmap walk (WORK_LIST=0): first the bit-identity tests under a hang guard (a persistent barrier
    # mismatch hangs), then the forward + attention GPU tests under each, then the
    # forward alone timed per variant beside FA4 native (bench_forward.py).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    identity_gate fsched scheduled_forward_is_bit_identical $(left 120)
    for mode in persistent 1; do
      JCOMPILEMASK_CUTE_FWD_SCHEDULE=$mode JCOMPILEMASK_CUTE_FWD_WORK_LIST=1 timeout -k 5 $(left 130) \
        python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_cute_forward.py \
        "tests/gpu/test_cute_attention.py::test_builtin" -k "not compiles" \
        --junitxml="$OUT/junit-fsched-$mode.xml" > "$OUT/pytest-fsched-$mode.log" 2>&1
      echo "pytest $mode rc $? ($SECONDS s)"; pkill -9 -f pytest; tail -3 "$OUT/pytest-fsched-$mode.log"
    done
    timeout -k 5 $(left 300) python3 benchmarks/bench_forward.py --ns ${JCM_BENCH_NS:-32768,2048} \
      --masks causal,hstu --fa4 --jcm-variants "base=;ls=JCOMPILEMASK_CUTE_FWD_SCHEDULE=1;lp=JCOMPILEMASK_CUTE_FWD_SCHEDULE=persistent;bm=JCOMPILEMASK_CUTE_FWD_WORK_LIST=0;lpbm=JCOMPILEMASK_CUTE_FWD_SCHEDULE=persistent JCOMPILEMASK_CUTE_FWD_WORK_LIST=0" \
      --out "$OUT/h200-fwd-sched.json" > "$OUT/bench-fsched.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_forward; grep -E '^bench' "$OUT/bench-fsched.log" | tail -30
    ;;
  v5bench)
    # bench_total at 32K then 8K: the default beside FA4 native (causal) and Flex+FA4.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    timeout -k 5 ${JCM_BENCH_S:-300} python3 benchmarks/bench_total.py --ns 32768,8192 \
      --masks causal,hstu,shared_prompt,clear --impls jcm,fa4-native,flex-fa4 --min-repeat-s 0.25 ${JCM_BENCH_CHECK:+--check} \
      --budget-s $(( ${JCM_BENCH_S:-300} - 50 )) --out "$OUT/h200-total-v5.json" > "$OUT/bench-v5.log" 2>&1
    echo "bench rc $?"; pkill -9 -f bench_total; grep -E '^\||FAILED|budget' "$OUT/bench-v5.log" | tail -22
    ;;
  hdims)
    # Issue 15's configs, none of which has run on a GPU before: each first gets one small
    # gradient test under its own timeout (a barrier mismatch hangs rather than fails), and
    # only the configs that pass are timed. Every step writes to a file (no pipes that
    # could outlive a timeout), stragglers are killed by pid pattern of this stage's own
    # scripts, and each timeout is capped by what is left of the call (570 s).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    t=tests/gpu/test_cute_head_dims.py
    # JCM_HDIMS_OK: configs whose smoke passed in an earlier call (session 13, s14a: d256
    # d192 cap128), timed without repeating it.
    ok=" ${JCM_HDIMS_OK:-}"
    # JCM_HDIMS_BENCH_ONLY=1: no smoke, no tests (they ran in earlier calls: hdimspar); the
    # whole call times. JCM_HDIMS_VARIANTS: bench_head_dims.py --jcm-variants (backward
    # configs beside the default, e.g. 'sdp@d192=split_sdp=1,ds_stages=1').
    [[ -n ${JCM_HDIMS_BENCH_ONLY:-} ]] && JCM_HDIMS_SMOKE=none
    for c in ${JCM_HDIMS_SMOKE:-cap128 d256 d192 cap64 d256cap}; do
      [[ $c == none ]] && break   # JCM_HDIMS_SMOKE: a subset, in order
      timeout -k 5 $(left 75) python3 -m pytest -q -x -p no:cacheprovider "$t::test_fully_masked_rows[$c]" \
        > "$OUT/smoke-$c.log" 2>&1
      rc=$?; pkill -9 -f "pytest -q -x -p no:cacheprovider $t" 2>/dev/null
      echo "smoke $c rc $rc ($SECONDS s)"; tail -2 "$OUT/smoke-$c.log"
      [[ $rc == 0 ]] && ok="$ok $c"
    done
    echo "passed smoke:$ok"
    [[ -z ${JCM_HDIMS_BENCH_ONLY:-} ]] && timeout -k 5 $(left 200) python3 -m pytest -q -rs -p no:cacheprovider \
      "$t::test_builtin_grads[causal-cap128]" "$t::test_builtin_grads[hstu-d256]" \
      "$t::test_builtin_grads[clear-d192]" "$t::test_builtin_grads[document-cap64]" \
      "$t::test_fp16_mqa" "$t::test_random_lowered_specs[0-d256]" "$t::test_random_lowered_specs[0-cap128]" \
      "$t::test_random_lowered_specs[0-d192]" "$t::test_forward_192_128" \
      --junitxml="$OUT/junit-hdims.xml" > "$OUT/pytest-hdims.log" 2>&1
    echo "pytest rc $? ($SECONDS s)"; pkill -9 -f "pytest -q -rs -p no:cacheprovider $t" 2>/dev/null
    tail -12 "$OUT/pytest-hdims.log"
    # Timed: the no-cap D 128 and D 64 baselines always; the new configs if their smoke passed.
    cfgs="d128"
    [[ $ok == *cap128* ]] && cfgs="$cfgs,d128cap"
    [[ $ok == *d256\ * || $ok == *d256 ]] && cfgs="$cfgs,d256"
    [[ $ok == *d192* ]] && cfgs="$cfgs,d192"
    cfgs="$cfgs,d64"
    b=$(left ${JCM_HDIMS_BENCH_S:-260})
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    timeout -k 5 $b python3 benchmarks/bench_head_dims.py --ns ${JCM_HDIMS_NS:-32768,8192} --configs "$cfgs" \
      ${JCM_HDIMS_VARIANTS:+--jcm-variants "$JCM_HDIMS_VARIANTS"} \
      --impls jcm-cute,fa4-native,jax-cudnn,jcm-xla --xla-ns 8192 --min-repeat-s 0.15 \
      ${JCM_HDIMS_PREWARM:+--prewarm $JCM_HDIMS_PREWARM --prewarm-s ${JCM_HDIMS_PREWARM_S:-120}} \
      --budget-s $(( b - 40 )) --out "$OUT/h200-head-dims.json" > "$OUT/bench-hdims.log" 2>&1
    echo "bench rc $? ($SECONDS s; configs $cfgs)"; pkill -9 -f bench_head_dims.py 2>/dev/null
    grep -E '^\{|budget' "$OUT/bench-hdims.log" | cut -c1-330 | tail -40
    ;;
  padded)
    # Head dims without kernels of their own, run zero-padded (backends.cute_head_dims):
    # their gradient cases against the reference (test_cute_head_dims.py -k padded, 4
    # processes), then causal fwd / bwd at JCM_PADDED_NS (8K) for D 96 / 80 / 160-128 beside
    # D 128, FA4 native (where it has the head dim), cuDNN and the xla backward they ran before.
    # (The default form, in place since session 45; JCOMPILEMASK_CUTE_HEAD_DIM_PAD=copy for the copies.
    # D 96 / 80 on D 128's kernels: the native ones, the default since session 47, are off here.)
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export JCOMPILEMASK_CUTE_FWD_NATIVE=0 JCOMPILEMASK_CUTE_BWD_NATIVE=0
    OUT=$OUT/tests JCM_PAR_ONLY=padded JCM_PAR_FILES=tests/gpu/test_cute_head_dims.py \
      JCM_STAGE_S=$(left ${JCM_PADDED_TEST_S:-200}) bash "$0" hdimspar
    b=$(left ${JCM_PADDED_BENCH_S:-200})
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    timeout -k 5 $b python3 benchmarks/bench_head_dims.py --ns ${JCM_PADDED_NS:-8192} \
      --configs ${JCM_PADDED_CONFIGS:-d96,d128,d80,d160} \
      --impls jcm-cute,fa4-native,jax-cudnn,jcm-xla --xla-ns ${JCM_PADDED_NS:-8192} --min-repeat-s 0.15 \
      --budget-s $(( b - 30 )) --out "$OUT/h200-head-dims.json" > "$OUT/bench-padded.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_head_dims.py 2>/dev/null
    grep -E '^\{|budget' "$OUT/bench-padded.log" | cut -c1-330 | tail -30
    ;;
  inplace)
    # Head dims without kernels of their own read in place (JCOMPILEMASK_CUTE_HEAD_DIM_PAD=tma,
    # the default: the wider kernels' TMA boxes zero-fill past them; no padded copies): their gradient
    # cases and the bit-identity with the copies (test_cute_head_dims.py -k in_place, 4
    # processes), then causal fwd / bwd at JCM_INPLACE_NS (8K), copies beside in place, with
    # D 128 and FA4 native (D 96 / 80 on D 128's kernels: the native ones are off here).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export JCOMPILEMASK_CUTE_FWD_NATIVE=0 JCOMPILEMASK_CUTE_BWD_NATIVE=0
    OUT=$OUT/tests JCM_PAR_ONLY=in_place JCM_PAR_FILES=tests/gpu/test_cute_head_dims.py \
      JCM_STAGE_S=$(left ${JCM_INPLACE_TEST_S:-200}) bash "$0" hdimspar
    b=$(left ${JCM_INPLACE_BENCH_S:-200})
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    copy=JCOMPILEMASK_CUTE_HEAD_DIM_PAD=copy    # in place is the default (jcm-cute)
    timeout -k 5 $b python3 benchmarks/bench_head_dims.py --ns ${JCM_INPLACE_NS:-8192} \
      --configs ${JCM_INPLACE_CONFIGS:-d96,d80,d128} --impls jcm-cute,fa4-native --min-repeat-s 0.15 \
      --jcm-variants "copy96@d96:$copy;copy80@d80:$copy;copy160@d160:$copy" \
      --budget-s $(( b - 30 )) --out "$OUT/h200-head-dims.json" > "$OUT/bench-inplace.log" 2>&1
    echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_head_dims.py 2>/dev/null
    grep -E '^\{|budget' "$OUT/bench-inplace.log" | cut -c1-330 | tail -30
    ;;
  native)
    # The native D 80 / 96 forwards and D 96's backward (kernels.cute.api.FWD_NATIVE_HEAD_DIMS /
    # BWD_NATIVE_HEAD_DIMS; the default since session 47, off with JCOMPILEMASK_CUTE_FWD_NATIVE=0,
    # JCOMPILEMASK_CUTE_BWD_NATIVE=0): one bit-identity case of each first under a hang guard,
    # then the rest of test_cute_head_dims.py -k native (4 processes), then causal fwd / bwd at
    # JCM_NATIVE_NS (8K): both native (the default, jcm-cute) beside the native forward alone
    # (nf), D 128's kernels in place (ip), D 128 and FA4 native.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    t=tests/gpu/test_cute_head_dims.py
    if { bwd_smoke native 120 "$t::test_native_forward_matches_in_place[hstu-n96]" \
         && bwd_smoke nativeb 120 "$t::test_native_backward_matches_in_place[hstu-n96]"; } \
        || [[ -n ${JCM_COMPILE_ONLY:-} ]]; then      # compile-only: no case passes, go on
      OUT=$OUT/tests JCM_PAR_ONLY=native JCM_PAR_FILES=tests/gpu/test_cute_head_dims.py \
        JCM_STAGE_S=$(left ${JCM_NATIVE_TEST_S:-200}) bash "$0" hdimspar
      b=$(left ${JCM_NATIVE_BENCH_S:-200})
      export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
      nf=JCOMPILEMASK_CUTE_BWD_NATIVE=0; ip="JCOMPILEMASK_CUTE_FWD_NATIVE=0 JCOMPILEMASK_CUTE_BWD_NATIVE=0"
      timeout -k 5 $b python3 benchmarks/bench_head_dims.py --ns ${JCM_NATIVE_NS:-8192} \
        --configs ${JCM_NATIVE_CONFIGS:-d96,d80,d128} --impls jcm-cute,fa4-native --min-repeat-s 0.15 \
        --jcm-variants "nf96@d96:$nf;ip96@d96:$ip;nf80@d80:$nf;ip80@d80:$ip" \
        --budget-s $(( b - 30 )) --out "$OUT/h200-head-dims.json" > "$OUT/bench-native.log" 2>&1
      echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_head_dims.py 2>/dev/null
      grep -E '^\{|budget' "$OUT/bench-native.log" | cut -c1-330 | tail -30
    fi
    ;;
  bpers)
    # Issue 16 (compile-checked in session 27): persistent backward CTAs (one per SM, a row of
    # persistent_schedule's units each; pipeline states, list count and K / V carried over).
    # One case first under a short guard (5 CTAs: several units each), the rest only if it
    # passes, then the timings.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    if bwd_smoke bpers 100 "tests/gpu/test_cute_backward.py::test_persistent_gives_the_default_gradients[causal-128-128-bfloat16--5]"; then
      bwd_cases bpers 230 tests/gpu/test_cute_backward.py -k persistent_gives
      b=$(left 300)
      timeout -k 5 $b python3 benchmarks/bench_total.py --ns ${JCM_BENCH_NS:-8192} \
        --masks ${JCM_BENCH_MASKS:-dilated_window,global_window,causal,shared_prompt} --impls jcm \
        --min-repeat-s 0.25 --jcm-variants "${JCM_BPERS_VARIANTS:-base=;sch=JCOMPILEMASK_CUTE_BWD_CONFIG=schedule=1;pers=JCOMPILEMASK_CUTE_BWD_CONFIG=schedule=1,persistent=1;dqr=JCOMPILEMASK_CUTE_BWD_CONFIG=dq_red=1;pdqr=JCOMPILEMASK_CUTE_BWD_CONFIG=schedule=1,persistent=1,dq_red=1}" \
        --budget-s $(( b - 20 )) --out "$OUT/h200-bpers.json" > "$OUT/bench-bpers.log" 2>&1
      echo "bench rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{' "$OUT/bench-bpers.log" | cut -c1-170
    fi
    ;;
  i15)
    # Issue 15's candidates of session 27, timed together (one call instead of three): D 64 at
    # 128 x 128 (q128), D 256 with dq_red and two stages, D 192 with two P^T / dS^T pairs, the
    # capped D 128 with lse / delta by shfl (and static_stage) and rcp_emu. q128 and dq_red
    # change the kernel's protocol (a hang is possible): one gradient case each under a guard
    # first, and a variant is timed only if its case passed. The rest are same-protocol
    # switches (their bit-identity cases: hdimspar with JCM_PAR_ONLY='softcap_switch|d192_switch').
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    v="ds2@d192=ds_stages=2,static_stage=1;sh@d128cap=stats_shfl=1;shss@d128cap=stats_shfl=1,static_stage=1;r4@d128cap=rcp_emu=4"
    t=tests/gpu/test_cute_backward.py
    if bwd_smoke q128 110 "$t" -k "q128_gradients_match_the_reference and causal and not deterministic and not chunked"; then
      v="$v;q128@d64=block_q=128,ds_first=1;q128w@d64=block_q=128,ds_first=1,column_words=1,residual_periodic=1"
    fi
    if bwd_smoke dqr 110 "$t" -k "dq_red_gives and hstu"; then
      v="$v;dqr2@d256=dq_red=1,num_stages=2;ds2r@d192=ds_stages=2,dq_red=1;s3r@d192=ds_stages=2,dq_red=1,num_stages=3"
    fi
    echo "variants: $v"
    hdims_bench i15 440 ${JCM_HDIMS_NS:-32768} ${JCM_I15_CONFIGS:-d64,d256,d192,d128cap} "$v" \
      --prewarm ${JCM_HDIMS_PREWARM:-6} --prewarm-s ${JCM_HDIMS_PREWARM_S:-150}
    ;;
  dvs)
    # Issue 15, the soft cap's cost (compile-checked in session 30): BackwardConfig.dv_split issues
    # dV in pieces as the capped P^T is made, so it runs under the tanh / exp2 (3 MUFU ops a
    # score) instead of after them; beside softcap_r the capped tile keeps 0 B of stack; dk_split
    # issues dK's pieces the same way (dQ is then the tile's last GEMM). Same
    # protocol (only where dV's wgmmas are issued): its bit-identity cases and softcap_r's
    # gradients first (test_cute_head_dims.py; JCM_DVS_TESTS=0 skips them), then D 128 with and
    # without the cap in one run beside FA4 native (the cost is the capped / uncapped ratio) at
    # 8K; JCM_HDIMS_NS=32768 for the other line.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    if [[ ${JCM_DVS_TESTS:-1} == 1 ]]; then
      bwd_cases dvs ${JCM_DVS_TESTS_S:-250} tests/gpu/test_cute_head_dims.py \
        -k "dv_split or softcap_r_grads or (softcap_switch and dvs)"
    fi
    hdims_bench dvs ${JCM_DVS_BENCH_S:-300} ${JCM_HDIMS_NS:-8192} ${JCM_DVS_CONFIGS:-d128,d128cap} \
      "${JCM_DVS_VARIANTS:-scr@d128cap=softcap_r=1;dvs2r@d128cap=dv_split=2,softcap_r=1;dvs2rk@d128cap=dv_split=2,softcap_r=1,dk_split=1;dvs4rk@d128cap=dv_split=4,softcap_r=1,dk_split=1;dvs2rks@d128cap=dv_split=2,softcap_r=1,dk_split=1,stats_shfl=1}" \
      --prewarm ${JCM_HDIMS_PREWARM:-6} --prewarm-s ${JCM_HDIMS_PREWARM_S:-90}
    ;;
  quick)
    # One short call's decisions for issues 14-16, timings only, each beside its peer in the
    # same run (device time was scarce in sessions 30-31: ~1 start a session). Each part is
    # packed (scripts/kernel_cache.sh 'quick'); FA4 compiles its own on the device. In issue
    # order, each with its share of JCM_STAGE_S:
    # 1. the forward at causal 8K: default (operands_early + p_double at D 128 since session
    #    33), both off, FA4 native;
    # 2. D 128 with and without the soft cap at 8K: the cap's cost under dv_split + dk_split
    #    (+ softcap_r) against the default cap;
    # 3. D 192 / 128 at 8K: ours beside FA4 at its 64 x 96 and forced to 64 x 64;
    # 4. the dilated window and global + window at 8K: the backward's auto order and the
    #    forward's p_double beside the default.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
    pd=JCOMPILEMASK_CUTE_FWD_P_DOUBLE; oe=JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY
    parts=",${JCM_QUICK:-fwd,cap,d192,masks},"
    if [[ $parts == *,fwd,* ]]; then
      timeout -k 5 $(left 110) python3 benchmarks/bench_forward.py --ns 8192 --masks causal --fa4 \
        --jcm-variants "base=;off=$oe=0 $pd=0" \
        --out "$OUT/h200-fwd-quick.json" > "$OUT/bench-quick-fwd.log" 2>&1
      echo "fwd rc $? ($SECONDS s)"; pkill -9 -f bench_forward; grep -E '^bench|^\{' "$OUT/bench-quick-fwd.log" | tail -12 | cut -c1-200
    fi
    if [[ $parts == *,cap,* ]]; then
      JCM_HDIMS_OUT=h200-head-dims-cap.json hdims_bench quick-cap 130 8192 d128,d128cap \
        "dvs2rk@d128cap=dv_split=2,softcap_r=1,dk_split=1;dvs2rks@d128cap=dv_split=2,softcap_r=1,dk_split=1,stats_shfl=1;scr@d128cap=softcap_r=1" \
        --impls jcm-cute,fa4-native --prewarm 2 --prewarm-s 80   # FA4's two compile side by side
    fi
    if [[ $parts == *,d192,* ]]; then
      JCM_HDIMS_OUT=h200-head-dims-d192.json hdims_bench quick-d192 100 8192 d192 "" \
        --impls jcm-cute,fa4-native,fa4-native-t64x64
    fi
    if [[ $parts == *,masks,* ]]; then
      b=$(left 120)
      timeout -k 5 $b python3 benchmarks/bench_total.py --ns 8192 --masks dilated_window,global_window \
        --impls jcm --min-repeat-s 0.25 --budget-s $(( b - 15 )) \
        --jcm-variants "base=;au=JCOMPILEMASK_CUTE_BWD_CONFIG=schedule=1 JCOMPILEMASK_CUTE_BWD_ORDER=auto;pd=$pd=1" \
        --out "$OUT/h200-quick-masks.json" > "$OUT/bench-quick-masks.log" 2>&1
      echo "masks rc $? ($SECONDS s)"; pkill -9 -f bench_total; grep -E '^\{' "$OUT/bench-quick-masks.log" | cut -c1-170
    fi
    python3 benchmarks/quick_summary.py "$OUT"    # the ratio each decision rests on
    ;;
  d192t)
    # Issue 15's last head-dim gap (D 192 / 128 at 0.84x FA4 native): FA4 runs 64 x 96 tiles with
    # dK / dV swapped, ours 64 x 64. FA4 with its backward tile forced to 64 x 64 in the same run
    # says how much of the gap is the tile width (NOTES.md, session 30: the design that would
    # follow). JCM_HDIMS_NS (default 8192).
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    hdims_bench d192t ${JCM_D192T_S:-480} ${JCM_HDIMS_NS:-8192} d192 "" \
      --impls jcm-cute,fa4-native,fa4-native-t64x64
    ;;
  d192s)
    # Issue 15's D 192 / 128 design (kernels/cute/D192_64x96_PLAN.md): BackwardConfig.dkv_swap,
    # 64 x 96 tiles with S = Q K^T per query row and dK^T / dV^T from shared memory (FA4's D 192
    # shape). Its 24 gradient cases of tests/gpu/test_cute_head_dims.py (the D 192 ids, with and
    # without a cap) in JCM_PAR processes under a guard, then bwd ms at 8K: the default (64 x 64), the swap
    # (+ dv_early: dV^T issued under dS; + dq_red with two dS stages), FA4 native at its 64 x 96
    # and forced to 64 x 64.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    swp=block_kv=96,split_dkv=0,split_sdp=0,dkv_swap=1
    if [[ -z ${JCM_D192S_BENCH_ONLY:-} ]]; then
      JCOMPILEMASK_CUTE_BWD_CONFIG=$swp JCM_PAR_FILES=tests/gpu/test_cute_head_dims.py \
        JCM_PAR_ONLY='d192(cap)?\]' JCM_STAGE_S=${JCM_D192S_TEST_S:-200} bash "$0" hdimspar
    fi
    hdims_bench d192s ${JCM_D192S_S:-300} ${JCM_HDIMS_NS:-8192} d192 \
      "${JCM_D192S_VARIANTS:-swp@d192=$swp;swpe@d192=$swp,dv_early=1;swpr@d192=$swp,dq_red=1,ds_stages=2}" \
      --impls ${JCM_D192S_IMPLS:-jcm-cute,fa4-native,fa4-native-t64x64}
    ;;
  dqr)
    # Issue 15 (compile-checked in session 27): BackwardConfig.dq_red — each consumer thread adds
    # its dQ chunks to the tile's global slot with red.global.add.v4.f32 (no shared staging
    # buffer, no DQ_FULL / DQ_EMPTY handoff with the dQ warp). At D 256 the freed 64 KB take a
    # second Q / dO stage (FA4 runs 2 Q stages there; ours had 1: 0.86x cuDNN). The 8 gradient
    # cases (dK / dV bit for bit with the default) under a guard, then the timings.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    bwd_cases dqr 220 tests/gpu/test_cute_backward.py -k dq_red_gives
    hdims_bench dqr 330 ${JCM_HDIMS_NS:-32768} ${JCM_DQR_CONFIGS:-d256,d192,d128} \
      "${JCM_DQR_VARIANTS:-dqr2@d256=dq_red=1,num_stages=2;ds2@d192=ds_stages=2,static_stage=1;ds2r@d192=ds_stages=2,dq_red=1;dqr@d128=dq_red=1}"
    ;;
  q128)
    # Issue 15 (compile-checked in session 27): D 64 at FlashAttention's hdim-64 backward tile,
    # 128 queries x 128 keys (BackwardConfig.block_q=128, with ds_first; the dQ product split
    # along the queries), against the 64 x 128 default (0.87-0.88x FA4 native; the line is
    # 0.9x). Never run on a GPU: one gradient case under a hang guard first, timed only if it
    # passes; then the 31 gradient cases (policy vs the dense oracle) in what is left.
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    if bwd_smoke q128 120 "tests/gpu/test_cute_backward.py::test_q128_gradients_match_the_reference[causal]"; then
      hdims_bench q128 ${JCM_Q128_BENCH_S:-250} ${JCM_HDIMS_NS:-32768,8192} d64 "q128@d64=block_q=128,ds_first=1"
      bwd_cases q128 400 tests/gpu/test_cute_backward.py -k "q128_gradients or q128_column_words"
    fi
    ;;
  hdimspar|hdimstests)
    # The GPU tests of JCM_PAR_FILES (default: issue 15's head-dim file and the forward's
    # 192 / 128 compile case) spread round-robin over JCM_PAR pytest processes on the one GPU
    # (default 4; hdimstests: 1, the whole file in one process): each case compiles its own kernels
    # (30-40 s of CPU, several threads each: 8 processes loaded 16 cores to 47 and finished
    # no case in 260 s, session 15), so a few parallel processes fit more of a file's cases
    # into one call; kernels land in the disk cache, so a rerun on the same warm machine
    # reaches further. JCM_PAR_ONLY (a regex) keeps only the ids it matches, e.g. the D 192
    # cases under a backward config override (JCOMPILEMASK_CUTE_BWD_CONFIG applies to every
    # head dim): JCM_PAR_FILES=tests/gpu/test_cute_head_dims.py JCM_PAR_ONLY='d192'.
    # Cases whose id matches the regex JCM_PAR_SKIP, or equals a line of
    # the file JCM_PAR_SKIP_FILE (passed in an earlier call: scripts/device-lists/), are
    # left out. E.g. session 17 ran the 61 forward cases left after session 16 (all passed):
    #   JCOMPILEMASK_CUTE_FWD_WORK_LIST=1 JCM_PAR_FILES="tests/gpu/test_cute_forward.py
    #   tests/gpu/test_cute_attention.py" JCM_PAR_SKIP=compiles
    #   JCM_PAR_SKIP_FILE=scripts/device-lists/fwl-passed.txt bash scripts/h200.sh hdimspar
    # Each process runs `pytest -v` under `timeout JCM_STAGE_S - 20`
    # (a killed pytest writes no JUnit: the per-case summary reads the -v logs).
    files=${JCM_PAR_FILES:-tests/gpu/test_cute_head_dims.py tests/gpu/test_cute_forward.py::test_head_dim_192_128_compiles_for_sm90}
    [[ $stage == hdimstests ]] && JCM_PAR=${JCM_PAR:-1}
    python3 -m pytest --collect-only -q -p no:cacheprovider $files 2>/dev/null | grep '::' \
      | { if [[ -n ${JCM_PAR_ONLY:-} ]]; then grep -E "$JCM_PAR_ONLY"; else cat; fi; } \
      | { if [[ -n ${JCM_PAR_SKIP:-} ]]; then grep -Ev "$JCM_PAR_SKIP"; else cat; fi; } \
      | { if [[ -n ${JCM_PAR_SKIP_FILE:-} ]]; then grep -vxF -f "$JCM_PAR_SKIP_FILE"; else cat; fi; } \
      > "$OUT/par-ids.txt"
    np=${JCM_PAR:-4}; echo "$(wc -l < "$OUT/par-ids.txt") cases over $np processes"
    for i in $(seq 0 $(( np - 1 ))); do
      awk -v i=$i -v n=$np '(NR - 1) % n == i' "$OUT/par-ids.txt" > "$OUT/par-$i.txt"
      [[ -s $OUT/par-$i.txt ]] || continue
      timeout -k 5 $(( ${JCM_STAGE_S:-540} - 20 )) python3 -m pytest -v -rs -p no:cacheprovider \
        $(cat "$OUT/par-$i.txt") > "$OUT/pytest-par-$i.log" 2>&1 &
    done
    wait; echo "all done ($SECONDS s)"
    # The id lists were inputs: a call brings back at most 8 files from $OUT (session 19
    # lost a later stage's JSON to that count), so they go.
    rm -f "$OUT"/par-[0-9]*.txt
    python3 - "$OUT" <<'PY'
import glob, re, sys
out = sys.argv[1]
want = [l.strip() for l in open(f"{out}/par-ids.txt") if l.strip()]
seen = {}
for f in glob.glob(f"{out}/pytest-par-*.log"):
    for line in open(f, errors="replace"):
        m = re.match(r"(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", line)
        if m:
            seen[m.group(1)] = m.group(2).lower()
counts = {}
for w in want:
    kind = seen.get(w, "not reached")
    counts[kind] = counts.get(kind, 0) + 1
    print(f"{kind:12s} {w}")
print("summary:", counts)
PY
    grep -h -E "^(FAILED|ERROR) |^E  " "$OUT"/pytest-par-*.log | head -30
    ;;
  multigpu)
    # Issue 19, on a multi-GPU kind (nvidia-h200-x2 / -x4 / -x8; ask status first): the
    # batch-sharded training step (weak scaling vs one GPU) and context parallelism
    # (HSTU, shared prompt, causal at 64K and 128K) in one call; records after each
    # configuration. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
    export NCCL_NVLS_ENABLE=0 JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    nvidia-smi -L
    timeout -k 5 540 python3 benchmarks/multi_gpu.py --budget-s 480 --min-repeat-s 0.25 \
      --out "$OUT/h200-multi-gpu.json" > "$OUT/multi-gpu.log" 2>&1
    echo "multi_gpu rc $?"; pkill -9 -f multi_gpu.py; grep -E '^\||FAILED|budget' "$OUT/multi-gpu.log" | tail -40
    ;;
  kernels)
    timeout 560 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_cute_forward.py \
      --junitxml="$OUT/junit-kernels.xml" 2>&1 | tee "$OUT/pytest-kernels.log" | tail -20
    ;;
  forward)
    cp benchmarks/results/h200-forward.json "$OUT/" 2>/dev/null
    timeout 280 python3 benchmarks/bench_forward.py --check --bench --fa4 --masks hstu,shared_prompt,clear --out "$OUT/h200-forward.json" \
      2>&1 | grep -v Warning | tee "$OUT/bench_forward.log" | tail -12
    timeout 280 python3 benchmarks/bench_cute_variants.py --ns 8192,32768 --out "$OUT/h200-variants.json" \
      2>&1 | grep -v Warning | tee "$OUT/bench_variants.log" | tail -25
    ;;
  peers)
    cp benchmarks/results/h200-forward-peers.json "$OUT/" 2>/dev/null
    timeout 560 python3 benchmarks/bench_peers.py --ns 8192,2048 --budget-s 500 \
      --out "$OUT/h200-forward-peers.json" 2>&1 | grep -v Warning | tee "$OUT/bench_peers.log" | tail -30
    ;;
  peers2k)
    cp benchmarks/results/h200-forward-peers.json "$OUT/" 2>/dev/null
    timeout 400 python3 benchmarks/bench_peers.py --ns 2048 --budget-s 340 \
      --out "$OUT/h200-forward-peers.json" 2>&1 | grep -v Warning | tee "$OUT/bench_peers2k.log" | tail -14
    ;;
  peers32)
    cp benchmarks/results/h200-forward-peers.json "$OUT/" 2>/dev/null
    timeout 560 python3 benchmarks/bench_peers.py --ns 32768 --masks hstu,shared_prompt,clear \
      --impls flex-fa4,flex-triton --budget-s 500 --out "$OUT/h200-forward-peers.json" 2>&1 \
      | grep -v Warning | tee "$OUT/bench_peers32.log" | tail -20
    ;;
  total)
    # With the tilelang bundle unpacked by an earlier `tilelang` call on this (warm)
    # machine, the preprocess is TileLang's; compile its programs in parallel first.
    python3 -c 'import tilelang' 2>/dev/null && timeout 120 python3 benchmarks/bench_preprocess.py \
      --warm-only --ns 32768,8192,2048 | tail -2
    timeout 440 python3 benchmarks/bench_total.py --ns 32768,8192,2048 --budget-s 380 \
      --out "$OUT/h200-total.json" 2>&1 | grep -v Warning | tee "$OUT/bench_total.log" | tail -30
    ;;
  sanitize)
    # Memory errors and shared-memory races of the CuTe backward on a small case.
    # (Output to files: a pipe would outlive a timed-out sanitizer, whose python child
    # holds it open.) synccheck too: the issue's acceptance names all three tools.
    for tool in memcheck racecheck synccheck; do
      timeout -k 5 180 compute-sanitizer --tool $tool --print-limit 20 python3 tests/scripts/gpu_backward_small.py \
        > "$OUT/sanitize-$tool.log" 2>&1; echo "$tool rc $?"; pkill -9 -f gpu_backward_small
      grep -v Warning "$OUT/sanitize-$tool.log" | tail -6
    done
    ;;
  profile)
    # Nsight Compute on one forward launch of the clear mask at 32K (the slow workload).
    # Output to a file (a pipe outlives a timed-out ncu: its python child holds it open).
    timeout -k 5 400 ncu --clock-control none --kernel-name regex:FlashForward --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
      --section SourceCounters -o "$OUT/fwd-clear" python3 benchmarks/bench_forward.py --ns 32768 --masks clear \
      --out /tmp/ncu-forward.json > "$OUT/ncu-clear-run.log" 2>&1; echo "ncu rc $?"; pkill -9 -f bench_forward
    [[ -f $OUT/fwd-clear.ncu-rep ]] && timeout 60 ncu -i "$OUT/fwd-clear.ncu-rep" --page details > "$OUT/ncu-clear.log" 2>&1
    grep -E "Busy|Stall|Registers|Duration|Throughput" "$OUT/ncu-clear.log" | head -30
    ;;
  tilelang)
    export JCOMPILEMASK_CACHE_DIR=$PWD/.jcm-cache
    # The cache key of one program, to compare with the same command's output where the
    # cache was built (a mismatch says which field: source = lowering output, versions...).
    python3 -c 'import jcompilemask as jcm
from jcompilemask.kernels.tilelang.api import program_for, _target_key, KernelConfig
from jcompilemask.lower.descriptor import TileConfig
cm = jcm.compile(jcm.masks.causal()); t = TileConfig(64, 64, 32, 64); cfg = KernelConfig()
print("causal key:", _target_key(cm, t, cfg, program_for(cm, t, cfg)).as_json())'
    # Compile every test program in parallel first (16 cores: ~20 s; a carried cache
    # only hits when this machine's sympy lowers to the same generated source).
    timeout 200 python3 -c 'from jcompilemask.kernels.tilelang.testing import warm_all
for name, sec, err in warm_all(workers=16): print(f"{name}: {sec:.1f}s {err or ""}")' | tail -5
    timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_tilelang_preprocess.py tests/gpu/test_preprocess_choice.py \
      --junitxml="$OUT/junit-tilelang.xml" 2>&1 | tee "$OUT/pytest-tilelang.log" | tail -8
    ;;
  train)
    # End-to-end training step of a Qwen3-style NNX model; flax/optax come from the train
    # bundle. JCM_TRAIN_MODELS / JCM_TRAIN_NS pick other configurations (e.g. qwen3-1.7b,
    # or 32768 alone when 8K and 32K do not both fit the call); records are written after
    # each configuration, so a cut-short call keeps what it measured.
    python3 .device-stage/train/install.py >/dev/null || { echo "install of train bundle failed"; exit 2; }
    export JCM_RUN_ID=${JCM_RUN_ID:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
    timeout 540 python3 benchmarks/train_e2e.py --models "${JCM_TRAIN_MODELS:-qwen3-0.6b}" \
      --ns "${JCM_TRAIN_NS:-8192,32768}" --steps 3 --warmup 1 --budget-s 440 \
      --out "$OUT/h200-train-e2e.json" 2>&1 | grep -v Warning | tee "$OUT/train-e2e.log" | tail -40
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
