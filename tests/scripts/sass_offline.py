"""Static SASS of the CuTe backward's tile loop, ours and FlashAttention-4's, without a GPU.

    python tests/scripts/sass_offline.py ours [CONFIG] [--d 128] [--k 1 --kc 1] [--dilated]   # e.g. CONFIG static_stage=1
        [--dv 128] [--cap 30]     # D != Dv (192 / 128); a soft cap (the config of a capped model)
    python tests/scripts/sass_offline.py fa4 [--d 128]              # FA4's SM90 backward, causal (its tiles at D)
    python tests/scripts/sass_offline.py ours-fwd [--d 128] [--k 1] [--dilated] [FIELD=VALUE,...] | fa4-fwd
        # the forwards (ours: K intervals, ForwardKey changes such as group_mask=1; --dilated:
        # the dilated window's residual program (window 128, dilation 2); FA4: causal)

Compiles for sm_90a (``CUTE_DSL_ARCH``), keeps the cubin, disassembles it with ``cuobjdump``
(the ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` wheels; ``$CUOBJDUMP_DIR`` is their
``bin`` folder, else ``PATH``) and prints registers / stack and, per copy of the tile loop
(from the Q-stage barrier wait to the stage release), its instruction count and opcode mix.
The mix counts instructions per visited tile and warp, the unit of ncu's per-tile figures in
``kernels/cute/NOTES.md``. ``JCM_SASS_OUT=FILE`` also writes the whole SASS there.

``fa4`` needs the flash-attn-4 and quack-kernels wheels of ``../shared/device/make-bundles``
(``~/.cache/device-bundles/wheels``). It imports their SM90 backward class with stand-ins
for torch and triton (only their import-time use; nothing of them is called to compile the
kernel) and compiles it on fake CuTe tensors, the tile config FA4 picks for causal D 128 on
SM90 (64 x 128, 2 Q / dO / dS stages, S^T / dP^T swapped).
"""
from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def _tool(name):
    d = os.environ.get("CUOBJDUMP_DIR")
    path = os.path.join(d, name) if d else shutil.which(name)
    if not path or not os.path.exists(path):
        raise SystemExit(f"{name} not found: pip download nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, "
                         "unzip them and set CUOBJDUMP_DIR to their nvidia/cu13/bin")
    return path


def _sass(dump_dir):
    cubin = glob.glob(os.path.join(dump_dir, "*.cubin"))[0]
    env = dict(os.environ, PATH=os.path.dirname(_tool("nvdisasm")) + os.pathsep + os.environ["PATH"])
    usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin], env=env,
                           capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], env=env, capture_output=True,
                          text=True, check=True).stdout
    return re.search(r"REG:\d+ STACK:\d+", usage).group(0), sass.splitlines()


def _loops(lines, start_re, end_re):
    """(start, end) line spans from each wait matching start_re to the next end_re."""
    out, start = [], None
    for i, ln in enumerate(lines):
        if re.search(start_re, ln):
            start = i
        elif start is not None and re.search(end_re, ln):
            out.append((start, i))
            start = None
    return out


def _mix(lines):
    ops = []
    for ln in lines:
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln)
        if m:
            ops.append(m.group(1))
    return ops


def _dump(lines):
    """``JCM_SASS_OUT=FILE``: the whole SASS there, to read where waits and spills sit."""
    if os.environ.get("JCM_SASS_OUT"):
        with open(os.environ["JCM_SASS_OUT"], "w") as fh:
            fh.write("\n".join(lines) + "\n")


def _report(name, usage, lines, spans):
    print(f"{name}: {usage}, {len(lines)} SASS lines")
    _dump(lines)
    for a, b in spans:
        ops = _mix(lines[a:b + 1])
        base = collections.Counter(o.split(".")[0] for o in ops)
        uni = sum(v for k, v in base.items() if k.startswith("U") and k != "UBLKRED")
        local = base.get("LDL", 0) + base.get("STL", 0)
        print(f"  tile loop copy at SASS line {a}: {len(ops)} instructions, {uni} uniform, "
              f"{local} local (LDL / STL), {base.get('LDG', 0)} LDG; " + ", ".join(f"{k} {v}" for k, v in base.most_common(14)))


def ours(config: str, d: int, k: int = 1, kc: int = 1, dv=None, cap=None, dilated=False):
    """Our backward at D ``d``; K ``k`` row / Kc ``kc`` column intervals (K 1 / Kc 1: the
    causal key, mask broadcast over batch and heads; otherwise a per-batch mask, as the
    built-ins with metadata: shared prompt K 2 / Kc 13, HSTU 2 / 4, CLEAR 6 / 7);
    ``dilated``: the dilated window's residual programs (window 128, dilation 2) instead."""
    sys.path.insert(0, ROOT)
    from jcompilemask.kernels.cute import api
    dump = tempfile.mkdtemp(prefix="jcm-sass-")
    os.environ["JCOMPILEMASK_CUTE_DUMP_DIR"] = dump
    os.environ[api.BWD_CONFIG_ENV] = config
    cfg = api._config_from_env(api.preferred_backward_config(d, softcap=cap is not None))
    residual, exact = None, False
    if dilated:
        cm = _dilated_window()
        from jcompilemask.lower.residual_program import ResidualProgram
        residual, k, kc = ResidualProgram.pair(cm), cm.num_intervals, cm.num_bwd_intervals
        # as the registry compiles it: without the row path where the column view is exact
        exact = bool(cm.column_view_exact) and api._bwd_exact_columns(d, dv or d, cap)
    causal = (k, kc) == (1, 1)
    key = api.BackwardKey(dtype="bfloat16", head_dim=d, num_intervals=k, num_bwd_intervals=kc,
                          broadcast_batch=causal, broadcast_head=True, scale=d ** -0.5, config=cfg,
                          softcap=cap, head_dim_v=dv, residual=residual, exact_columns=exact)
    api.compile_backward(key)
    usage, lines = _sass(dump)
    # From the Q stage's full-barrier wait (+0x10) to the dO stage's release (+0x40).
    extra = (f" Dv {dv}" if dv else "") + (f" cap {cap:g}" if cap else "")
    _report(f"ours {cfg.tag} D {d}{extra} K {k} Kc {kc}", usage, lines,
            _loops(lines, r"TRYWAIT P0, \[UR\d+\+0x10\]", r"SYNCS.ARRIVE.TRANS64.A1T0 RZ, \[UR\d+\+0x40\]"))


def _fa4_import():
    """Make FA4's CuTe modules importable (from the bundle's wheels) without torch."""
    wheels = os.path.expanduser("~/.cache/device-bundles/wheels")
    site = tempfile.mkdtemp(prefix="fa4-site-")
    for pat in ("flash_attn_4-*.whl", "quack_kernels-*.whl"):
        found = glob.glob(os.path.join(wheels, pat))
        if not found:
            raise SystemExit(f"no {pat} in {wheels}: run ../shared/device/make-bundles first")
        zipfile.ZipFile(found[0]).extractall(site)

    class _Meta(type):                       # any attribute / call: a class (isinstance works)
        def __getattr__(cls, n):
            return _Stub

        def __call__(cls, *a, **k):
            return _Stub
    _Stub = _Meta("_Stub", (), {})
    for name in ("torch", "torch.version", "torch.utils", "torch.utils.dlpack", "torch._guards",
                 "torch._subclasses", "torch._subclasses.fake_tensor", "torch.nn",
                 "torch.nn.functional", "triton", "triton.testing", "triton.runtime"):
        mod = types.ModuleType(name)
        mod.__getattr__ = lambda n: _Stub
        mod.__path__ = []
        sys.modules[name] = mod
    # The packages without their __init__ (which set up torch-side entry points).
    for name, sub in (("quack", "quack"), ("flash_attn", "flash_attn"),
                      ("flash_attn.cute", os.path.join("flash_attn", "cute"))):
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(site, sub)]
        sys.modules[name] = mod
    sys.path.insert(0, site)
    import quack.dsl  # noqa: F401  (its tensor-indexing patches, which FA4's code relies on)


def _fake_bshd(d):
    import cutlass
    import cutlass.cute as cute
    sym, sym64 = cute.sym_int, cute.sym_int64
    dims = (sym(), sym(), sym())

    def bshd():
        return cute.runtime.make_fake_tensor(cutlass.BFloat16, dims + (d,), stride=(
            sym64(divisibility=8), sym64(divisibility=8), d, 1), assumed_align=16)
    return dims, bshd


def fa4_forward():
    _fa4_import()
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.utils import AuxData
    d = 128
    # FA4's SM90 choice for causal D 128: 128 x 128, P@V from registers, intra-warpgroup
    # overlap, 2 K/V stages, 3 warpgroups.
    obj = FlashAttentionForwardSm90(cutlass.BFloat16, d, d, 1, is_causal=True, is_local=False,
                                    pack_gqa=False, tile_m=128, tile_n=128, num_stages=2,
                                    num_threads=384, Q_in_regs=False, intra_wg_overlap=True,
                                    mma_pv_is_rs=True, mask_mod=None, score_mod=None,
                                    has_aux_tensors=False, q_subtile_factor=None)
    (b, s_, h), bshd = _fake_bshd(d)
    lse = cute.runtime.make_fake_tensor(cutlass.Float32, (b, h, s_), stride=(
        cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1), assumed_align=16)
    dump = tempfile.mkdtemp(prefix="fa4-sass-")
    cute.compile(obj, bshd(), bshd(), bshd(), bshd(), lse, cutlass.Float32(d ** -0.5), None, None,
                 None, None, None, None, None, None, None, AuxData(None, None), None, None,
                 cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                 options=f"--enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir={dump}")
    usage, lines = _sass(dump)
    print(f"FA4 FlashAttentionForwardSm90 causal D 128: {usage}, {len(lines)} SASS lines")
    _hgmma_blocks(lines)


def _dilated_window():
    """The benchmarks' dilated causal window (window 128, dilation 2), compiled."""
    import jcompilemask as jcm
    from jcompilemask.spec import MaskSpec, Region, k as k_, q, q_len
    return jcm.compile(MaskSpec([Region((0, q_len), (k_ <= q) & (k_ > q - 128) & ((q - k_) % 2 == 0))]),
                       warn=False)


def ours_forward(d: int, k: int = 1, fields: str = "", dilated: bool = False):
    """Our forward as the registry compiles it (tiles, stages, api.forward_switches) for K
    intervals (K > 1: per-batch, per-head masks), with ForwardKey FIELD=VALUE,...
    changes (e.g. group_mask=0)."""
    sys.path.insert(0, ROOT)
    from jcompilemask.kernels.cute import api
    dump = tempfile.mkdtemp(prefix="jcm-sass-")
    os.environ["JCOMPILEMASK_CUTE_DUMP_DIR"] = dump
    bq, bk = api.preferred_forward_tiles(d)
    stages = api.preferred_forward_stages(d)
    changes = {}
    for item in filter(None, fields.split(",")):
        name, value = item.split("=")
        changes[name] = int(value) if name in ("bits_above", "interval_unroll") else value not in ("0", "false", "False")
    residual = None
    if dilated:
        from jcompilemask.lower.residual_program import ResidualProgram
        cm = _dilated_window()
        residual, k = ResidualProgram.forward(cm), cm.num_intervals
    switches = {**api.forward_switches(d, d, bq, bk, stages, residual=residual), **changes}
    if "work_runs" not in changes and (switches["rescale_tail"] or not switches["work_list"]):
        switches["work_runs"] = False      # runs are a form of the list, never with rescale_tail
    if not switches["work_runs"] and "runs_early" not in changes:
        switches["runs_early"] = False
    key = api.ForwardKey("bfloat16", d, d, k, bq, bk, k == 1, k == 1, d ** -0.5, num_stages=stages,
                         residual=residual, **switches)
    api.compile_forward(key)
    usage, lines = _sass(dump)
    print(f"ours forward D {d} K {k}{' dilated window' if dilated else ''} {fields or '(default)'}: "
          f"{usage}, {len(lines)} SASS lines")
    _hgmma_blocks(lines)


def _ends(lines):
    """The code before the first HGMMA (the prologue every CTA runs, producer and consumer
    paths together) and after the last (the epilogue: O's scaling, store and lse), sizes and
    mixes: issue 14's fixed cost per CTA."""
    ops_at = [i for i, ln in enumerate(lines) if _mix([ln])]
    gemm = [i for i in ops_at if "HGMMA" in lines[i]]
    if not gemm:
        return
    for name, part in (("before the first HGMMA", [i for i in ops_at if i < gemm[0]]),
                       ("after the last HGMMA", [i for i in ops_at if i > gemm[-1]])):
        base = collections.Counter(o.split(".")[0] for o in _mix([lines[i] for i in part]))
        print(f"  {name}: {len(part)} instructions; " + ", ".join(f"{k} {v}" for k, v in base.most_common(12)))


def _hgmma_blocks(lines):
    """The forward's loop bodies have no single barrier pattern to cut at: print each run of
    code between consecutive QK^T GEMMs (the first HGMMA of a run of 64 x 128 S products)
    with its size and mix, the largest first; then the code before the first GEMM and
    after the last (_ends)."""
    _dump(lines)
    _ends(lines)
    starts = [i for i, ln in enumerate(lines) if "HGMMA" in ln and "RZ, !UPT" in ln]
    spans = [(a, b) for a, b in zip(starts, starts[1:])]
    spans.sort(key=lambda ab: -(ab[1] - ab[0]))
    for a, b in spans[:6]:
        ops = _mix(lines[a:b])
        base = collections.Counter(o.split(".")[0] for o in ops)
        uni = sum(v for k, v in base.items() if k.startswith("U"))
        print(f"  from the zero-init HGMMA at line {a}: {len(ops)} instructions to the next, {uni} "
              "uniform; " + ", ".join(f"{k} {v}" for k, v in base.most_common(14)))


def fa4(d: int = 128):
    """FA4's SM90 backward, causal, at head dim ``d`` (64 or 128) with the tile config its
    interface picks there (64 x 128 at D 128, 128 x 128 at D 64)."""
    _fa4_import()
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.utils import AuxData
    # Its interface's _tile_size_bwd_sm90 for causal D 64 / 128 (the interface module itself
    # needs torch-side packages): (tile_m, tile_n, AtomLayoutMdQ).
    tile_m, tile_n, atom_mdq = {64: (128, 128, 2), 128: (64, 128, 1)}[d]
    obj = FlashAttentionBackwardSm90(
        cutlass.BFloat16, d, d, 1, True, is_local=False, deterministic=False, tile_m=tile_m,
        tile_n=tile_n, Q_stage=2, dO_stage=2, PdS_stage=2, SdP_swapAB=True, dKV_swapAB=False,
        dQ_swapAB=False, AtomLayoutMSdP=1, AtomLayoutNdKV=2, AtomLayoutMdQ=atom_mdq,
        num_threads=384, V_in_regs=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
        has_aux_tensors=False, q_subtile_factor=None, dQ_single_wg=False)
    sym, sym64 = cute.sym_int, cute.sym_int64
    b, s, h, sr = sym(), sym(), sym(), sym()

    def bshd():
        return cute.runtime.make_fake_tensor(cutlass.BFloat16, (b, s, h, d), stride=(
            sym64(divisibility=8), sym64(divisibility=8), d, 1), assumed_align=16)

    def f32_rows(n):
        return cute.runtime.make_fake_tensor(cutlass.Float32, (b, h, n), stride=(
            sym64(divisibility=4), sym64(divisibility=4), 1), assumed_align=16)
    dump = tempfile.mkdtemp(prefix="fa4-sass-")
    cute.compile(obj, bshd(), bshd(), bshd(), bshd(), f32_rows(sr), f32_rows(sr), f32_rows(sym()),
                 bshd(), bshd(), cutlass.Float32(d ** -0.5), None, None, None, None, None, None,
                 None, None, None, AuxData(None, None), None, None,
                 cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                 options=f"--enable-tvm-ffi --keep-ptx --keep-cubin --dump-dir={dump}")
    usage, lines = _sass(dump)
    # From the Q stage's wait (a try_wait, then the blocking one) to dO's release (+0x10
    # here: FA4's barrier layout differs from ours).
    spans = _loops(lines, r"TRYWAIT P0, \[UR\d+\], R", r"SYNCS.ARRIVE.TRANS64.A1T0 RZ, \[UR\d+\+0x10\]")
    _report(f"FA4 FlashAttentionBackwardSm90 causal D {d} ({tile_m} x {tile_n})",
            usage, lines, spans[:1])


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] not in ("ours", "fa4", "ours-fwd", "fa4-fwd"):
        raise SystemExit(__doc__)
    if args[0] == "fa4":
        fa4(int(args[args.index("--d") + 1]) if "--d" in args else 128)
    elif args[0] == "fa4-fwd":
        fa4_forward()
    elif args[0] == "ours-fwd":
        rest = [a for i, a in enumerate(args[1:], 1)
                if a not in ("--d", "--k", "--dilated") and args[i - 1] not in ("--d", "--k")]
        ours_forward(int(args[args.index("--d") + 1]) if "--d" in args else 128,
                     int(args[args.index("--k") + 1]) if "--k" in args else 1, rest[0] if rest else "",
                     dilated="--dilated" in args)
    else:
        opts = {o: float(args[args.index(o) + 1])
                for o in ("--d", "--k", "--kc", "--dv", "--cap") if o in args}
        rest = [a for i, a in enumerate(args[1:], 1)
                if a not in opts and a != "--dilated" and args[i - 1] not in opts]
        dv = int(opts["--dv"]) if "--dv" in opts else None
        ours(rest[0] if rest else "", int(opts.get("--d", 128)), int(opts.get("--k", 1)),
             int(opts.get("--kc", 1)), dv, opts.get("--cap"), dilated="--dilated" in args)
