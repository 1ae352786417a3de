"""SASS identity of the CuTe backward across a code change, without a GPU.

    python tests/scripts/sass_identity.py OUTDIR [KEY ...]       # compile, write KEY.sass
    python tests/scripts/sass_identity.py --compare DIR_A DIR_B  # same / DIFF per key

Compiles a fixed set of 15 backward keys and 8 forward ones (``fwd_*``: the registry's
forward switches at D 64 / 128 / 256, K 1-12, fp16, a soft cap, a residual program) (D 64 / 128 / 256 / 192-128, fp16, Kc 0 / 7 / 13 / 26,
soft cap, a residual program, deterministic, the opt-in knobs) for sm_90a and writes each
one's SASS with addresses and the function name stripped, so a refactor that must not change
code can be checked key by key (run it before and after). Needs the compile extra and the
``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` wheels' bin folder in ``$CUOBJDUMP_DIR``
(see ``sass_offline.py``).
"""
import os, sys, glob, subprocess, dataclasses, hashlib, tempfile, re
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
if sys.argv[1:2] == ["--compare"]:
    a, b = sys.argv[2], sys.argv[3]
    bad = 0
    for n in sorted(os.listdir(a)):
        same = os.path.exists(os.path.join(b, n)) and open(os.path.join(a, n)).read() == open(os.path.join(b, n)).read()
        bad += not same
        print("same" if same else "DIFF", n)
    raise SystemExit(1 if bad else 0)
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
import jcompilemask as jcm
from jcompilemask.spec import MaskSpec, Region, k, q, q_len, Scalar
from jcompilemask.kernels.cute import api
from jcompilemask.lower.residual_program import ResidualProgram
P = api.preferred_backward_config
B = dataclasses.replace
keys = {
 "d128_k1": api.BackwardKey("bfloat16", 128, 1, 1, True, True, 128**-0.5, P(128)),
 "d64_hstu": api.BackwardKey("bfloat16", 64, 2, 4, False, True, 64**-0.5, P(64)),
 "d128_clear_fp16": api.BackwardKey("float16", 128, 6, 7, False, False, 128**-0.5, P(128, "float16")),
 "d128_kc0": api.BackwardKey("bfloat16", 128, 1, 0, False, True, 128**-0.5, P(128)),
 "d128_kc13_bits": api.BackwardKey("bfloat16", 128, 2, 13, False, False, 128**-0.5, B(P(128), column_bits=8)),
 "d128_anyk": api.BackwardKey("bfloat16", 128, 25, 26, False, False, 128**-0.5, P(128)),
 "d128_cap": api.BackwardKey("bfloat16", 128, 1, 1, True, True, 128**-0.5, P(128, softcap=True), softcap=30.0),
 "d256": api.BackwardKey("bfloat16", 256, 6, 7, False, False, 256**-0.5, P(256)),
 "d192": api.BackwardKey("float16", 192, 2, 4, False, True, 192**-0.5, P(192), softcap=30.0, head_dim_v=128),
 "d128_det": api.BackwardKey("bfloat16", 128, 1, 1, True, True, 128**-0.5, B(P(128), deterministic=True)),
 "d128_sslp": api.BackwardKey("bfloat16", 128, 1, 1, True, True, 128**-0.5, B(P(128), static_stage=True, lse_prefetch=True, stats_shfl=False)),
 "d64_v1": api.BackwardKey("bfloat16", 64, 1, 1, False, True, 64**-0.5, B(api.BackwardConfig(), ds_stages=1, release_do_early=True)),
 "d128_se": api.BackwardKey("bfloat16", 128, 1, 1, False, True, 128**-0.5, B(api.BackwardConfig(), stats_early=True)),
 "d128_ea": api.BackwardKey("bfloat16", 128, 1, 1, True, True, 128**-0.5, B(P(128), entry_ahead=True)),
}
d = Scalar("d", min=1, max=9)
cm = jcm.compile(MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % d == 0))]), warn=False)
pair = ResidualProgram.pair(cm)
keys["d128_residual"] = api.BackwardKey("bfloat16", 128, cm.num_intervals, cm.num_bwd_intervals, False, True, 128**-0.5, P(128), residual=pair)


def fwd_key(d, k_, broadcast, dtype="bfloat16", softcap=None, residual=None, **changes):
    """A forward key as the registry builds it (tiles, stages, forward_switches), plus changes."""
    bq, bk = api.preferred_forward_tiles(d)
    stages = api.preferred_forward_stages(d)
    sw = {**api.forward_switches(d, d, bq, bk, stages, residual=residual), **changes}
    return api.ForwardKey(dtype, d, d, k_, bq, bk, broadcast, broadcast, d ** -0.5, softcap=softcap,
                          num_stages=stages, residual=residual, **sw)


# The forward's keys (the registry's default switches): causal, the built-ins' K, D 64 / 256,
# fp16, a soft cap, K 12, a residual program.
keys.update({
 "fwd_d128_k1": fwd_key(128, 1, True),
 "fwd_d128_k2": fwd_key(128, 2, False),
 "fwd_d128_k6_fp16": fwd_key(128, 6, False, "float16"),
 "fwd_d128_k12": fwd_key(128, 12, False),
 "fwd_d128_cap": fwd_key(128, 1, True, softcap=30.0),
 "fwd_d64_k3": fwd_key(64, 3, False),
 "fwd_d256_k1": fwd_key(256, 1, True),
 "fwd_d128_residual": fwd_key(128, cm.num_intervals, False, residual=ResidualProgram.forward(cm)),
})
only = sys.argv[2:] or list(keys)
bin_ = os.environ.get("CUOBJDUMP_DIR", os.path.dirname(__import__("shutil").which("cuobjdump") or "/"))
env = dict(os.environ, PATH=bin_ + ":" + os.environ["PATH"])
for name in only:
    dump = tempfile.mkdtemp(prefix="sid-")
    os.environ["JCOMPILEMASK_CUTE_DUMP_DIR"] = dump
    api._compiled.clear()
    (api.compile_forward if name.startswith("fwd_") else api.compile_backward)(keys[name])
    cubin = glob.glob(dump + "/*.cubin")[0]
    sass = subprocess.run([bin_ + "/cuobjdump", "-sass", cubin], env=env, capture_output=True, text=True).stdout
    sass = "\n".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", l) for l in sass.splitlines() if "Function :" not in l)
    open(os.path.join(out, name + ".sass"), "w").write(sass)
    print(name, hashlib.sha1(sass.encode()).hexdigest()[:12], len(sass.splitlines()), flush=True)
