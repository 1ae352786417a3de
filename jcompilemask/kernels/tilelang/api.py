"""``tilelang_preprocess``: the GPU preprocess (metadata -> ExecutionDescriptor).

One FFI call per descriptor runs the generated program (see :mod:`.codegen`); the
segment run tables of ``SegmentIds`` metadata are computed in jnp before it (by
``MaskSpec.normalize_metadata``, as in the jnp preprocess). The compiled kernel depends
on the mask's structure, the tile shapes and the launch config only: lengths, batch and
metadata values are run-time arguments, so new lengths never recompile.
"""
from __future__ import annotations

import functools
import warnings
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ...ffi.registry import match_varying
from ...lower.descriptor import ExecutionDescriptor, TileConfig
from .codegen import KernelConfig, Program, generate, unsupported_reason

__all__ = ["tilelang_preprocess", "mock_preprocess", "program_for", "compile_program",
           "compiled_function", "warm_cache", "unsupported_reason"]

I32 = jnp.int32


def _cdiv(a, b):
    return -(-a // b)


@functools.lru_cache(maxsize=128)
def _program_cached(cm, tiles: TileConfig, cfg: KernelConfig) -> Program:
    return generate(cm, tiles, cfg)


def program_for(cm, tiles: TileConfig, config: KernelConfig | None = None) -> Program:
    """The generated program of a CompiledMask (cached per mask structure and tiles)."""
    return _program_cached(cm, tiles, config or KernelConfig())


def _out_shapes(prog: Program, b: int, q_len: int, kv_len: int, tiles: TileConfig):
    hm, k, kc = prog.mask_heads, prog.num_intervals, prog.num_bwd_intervals
    tqf = _cdiv(q_len, tiles.block_q)
    wkf = _cdiv(_cdiv(kv_len, tiles.block_kv), 16)
    tkb = _cdiv(kv_len, tiles.bwd_block_kv)
    wqb = _cdiv(_cdiv(q_len, tiles.bwd_block_q), 16)
    shapes = {"row_region": ((b, q_len), np.int32),
              "fwd_iv": ((b, hm, q_len, k, 2), np.int32),
              "fwd_tiles": ((b, hm, tqf, wkf), np.uint32),
              "bwd_tiles": ((b, hm, tkb, wqb), np.uint32)}
    if prog.has_columns:
        shapes["bwd_iv"] = ((b, hm, kv_len, kc, 2), np.int32)
        shapes["bwd_exact"] = ((b,), np.uint8)
    dims = {"B": b, "NQ": q_len, "NK": kv_len, "TQF": tqf, "WKF": wkf, "TKB": tkb,
            "WQB": wqb}
    return shapes, dims


def _operands(prog: Program, meta: Mapping):
    ops = []
    for inp in prog.inputs:
        if inp[0] == "seg":
            ops.append((f"G_{inp[1]}_{inp[2]}", meta[inp[1]][inp[2]]))
        else:
            ops.append((f"M_{inp[1]}", meta[inp[1]]))
    return ops


def _assemble(cm, outs: dict, b, q_len, kv_len, tiles, prog) -> ExecutionDescriptor:
    hm = prog.mask_heads
    if prog.has_columns:
        bwd_iv = outs["bwd_iv"]
        bwd_exact = outs["bwd_exact"].astype(bool)
    else:
        bwd_iv = jnp.zeros((b, hm, kv_len, 0, 2), I32)
        bwd_exact = jnp.zeros((b,), bool)
    return ExecutionDescriptor(outs["fwd_iv"], bwd_iv, outs["fwd_tiles"], outs["bwd_tiles"],
                               outs["row_region"], bwd_exact, {}, mask=cm, q_len=q_len,
                               kv_len=kv_len, tiles=tiles)


def _normalize(cm, metadata, q_len, kv_len):
    meta, b = cm.spec.normalize_metadata(metadata, q_len, kv_len)
    return meta, b


# ---------------------------------------------------------------------------------------
def mock_preprocess(cm, metadata, q_len: int, kv_len: int, tiles: TileConfig,
                    config: KernelConfig | None = None) -> ExecutionDescriptor:
    """Run the generated program on the CPU interpreter (tests; small shapes only)."""
    from .mock import run_program
    prog = program_for(cm, tiles, config)
    meta, b = _normalize(cm, metadata, q_len, kv_len)
    shapes, dims = _out_shapes(prog, b, q_len, kv_len, tiles)
    env = dict(dims)
    for name, arr in _operands(prog, meta):
        env[name] = np.asarray(arr, np.int32)
    for inp in prog.inputs:
        if inp[0] == "seg":
            env[f"NT_{inp[1]}"] = env[f"G_{inp[1]}_{inp[2]}"].shape[1]
    outs = {}
    rng = np.random.default_rng(0)
    for name, (shape, dt) in shapes.items():
        outs[name] = rng.integers(0, 200, shape).astype(dt)    # poison: all must be written
        env[name] = outs[name]
    env["q_len"], env["kv_len"] = q_len, kv_len
    run_program(prog, env)
    outs = {k: jnp.asarray(v) for k, v in outs.items()}
    return _assemble(cm, outs, b, q_len, kv_len, tiles, prog)


# ---------------------------------------------------------------------------------------
def _target_key(cm, tiles: TileConfig, cfg: KernelConfig, prog: Program):
    from ...ffi import KernelKey, versions
    return KernelKey(
        kind="tilelang-preprocess",
        mask_fingerprint=cm.fingerprint(),
        shape_class=("dynamic-lengths", f"Hm={prog.mask_heads}", f"K={prog.num_intervals}",
                     f"Kc={prog.num_bwd_intervals}"),
        dtypes=("int32", "uint32", "uint8"),
        tile_config=(tiles.block_q, tiles.block_kv, tiles.bwd_block_q, tiles.bwd_block_kv,
                     cfg.threads, cfg.chunk),
        source_fingerprint=prog.fingerprint(),
        versions=versions("tilelang", "apache-tvm-ffi", "jax-tvm-ffi") + (("arch", "sm_90a"),),
    )


def compile_program(prog: Program, *, target: dict | None = None):
    """TileLang-compile a generated program; returns the ``tilelang`` JITKernel.

    Needs tilelang and nvcc, not a GPU: ``target`` defaults to ``sm_90a``.
    """
    from ...ffi import require_gpu_extras
    require_gpu_extras(("tilelang",))
    import tilelang
    import tilelang.language as T
    import linecache
    # TileLang re-parses the prim_func from its source (inspect): register the text.
    filename = f"<jcompilemask-tilelang-{prog.fingerprint()}>"
    linecache.cache[filename] = (len(prog.source), None, prog.source.splitlines(True),
                                 filename)
    ns: dict = {"T": T}
    exec(compile(prog.source, filename, "exec"), ns)  # noqa: S102 - our generated text
    func = ns["main"]
    return tilelang.compile(func, target=target or {"kind": "cuda", "arch": "sm_90a"},
                            execution_backend="tvm_ffi")


def _load(path):
    import tilelang  # noqa: F401 - registers the CUDA module loader used by the .so
    import tvm_ffi
    return tvm_ffi.load_module(path)["main"]


def _save(executable, path):
    executable.export_library(path)


def compiled_function(cm, tiles: TileConfig, config: KernelConfig | None = None):
    """The compiled program as a ``tvm_ffi.Function`` (memory / disk cache, or compile).

    Needs tilelang and nvcc but no GPU (the target is ``sm_90a``).
    """
    from ... import ffi
    cfg = config or KernelConfig()
    prog = program_for(cm, tiles, cfg)
    key = _target_key(cm, tiles, cfg, prog)

    def build():
        return compile_program(prog).adapter.get_exportable_executable()

    return key, ffi.default_cache().get_or_build(key, build, load=_load, save=_save,
                                                 source=prog.source)


def _warm_one(args):
    cm, tiles, cfg = args
    import time
    t = time.perf_counter()
    try:
        compiled_function(cm, tiles, cfg)
        return cm.spec.name, time.perf_counter() - t, None
    except Exception as e:  # reported, not raised: one bad mask must not stop the rest
        return cm.spec.name, time.perf_counter() - t, f"{type(e).__name__}: {e}"


def warm_cache(cms, tiles: TileConfig | None = None, config: KernelConfig | None = None,
               workers: int | None = None):
    """Compile many masks' programs into the disk cache in parallel processes.

    ``cms``: CompiledMasks (built at ``tiles``) or ``(cm, tiles)`` pairs. TileLang spends
    most of a compile in TVM passes (10 s - 3 min per program), so test and benchmark
    scripts compile everything up front. Returns ``[(name, seconds, error)]``.
    """
    import concurrent.futures as cf
    import multiprocessing as mp
    import os
    cfg = config or KernelConfig()
    pairs = [c if isinstance(c, tuple) else (c, tiles) for c in cms]
    todo = [(cm, t, cfg) for cm, t in pairs if unsupported_reason(cm) is None]
    workers = workers or max(1, min(len(todo), os.cpu_count() or 1))
    if workers == 1:
        return [_warm_one(a) for a in todo]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(_warm_one, todo))


def _ffi_target(cm, tiles: TileConfig, cfg: KernelConfig, prog: Program) -> str:
    """Compile (or load from cache) and register; returns the FFI target name."""
    from ... import ffi
    key = _target_key(cm, tiles, cfg, prog)
    name = key.target_name()
    if ffi.is_registered(name):
        return name
    ffi.require_gpu_extras(("tilelang", "tvm_ffi", "jax_tvm_ffi"))
    ffi.require_sm90()
    _, fn = compiled_function(cm, tiles, cfg)
    ffi.register_ffi_kernel(name, fn, platform="gpu",
                            arg_spec=["args", "rets", "attrs.q_len", "attrs.kv_len"])
    return name


def tilelang_preprocess(cm, metadata, q_len: int, kv_len: int | None = None,
                        tiles: TileConfig | None = None, *,
                        config: KernelConfig | None = None,
                        strict: bool = False) -> ExecutionDescriptor:
    """Build the :class:`ExecutionDescriptor` with the generated TileLang kernels (jit-able).

    Equal, bit for bit, to ``lower.preprocess.build_descriptor`` (the jnp preprocess).
    Masks the kernels cannot serve (fallback regions, ``from_dense``) keep the jnp
    preprocess with a warning saying why, or raise ``ValueError`` when ``strict``.
    Needs an SM90 GPU and the GPU extras (tilelang, apache-tvm-ffi, jax-tvm-ffi).

    Args:
      cm: a CompiledMask (or a MaskSpec, compiled here).
      metadata: the spec's run-time metadata (arrays, traced or concrete).
      q_len, kv_len: static lengths (``kv_len`` defaults to ``q_len``).
      tiles: the TileConfig to build tile states at (default: the preferred tiles).
      config: launch shape of the kernels (threads, chunk).
    """
    from ...lower.compiled import compile as _compile, resolve_tiles
    cm = _compile(cm)
    kv_len = q_len if kv_len is None else kv_len
    tiles = tiles or resolve_tiles()
    cfg = config or KernelConfig()
    why = unsupported_reason(cm)
    if why is not None:
        if strict:
            raise ValueError(f"tilelang_preprocess: {why}")
        warnings.warn(f"tilelang_preprocess: {why}; using the jnp preprocess", stacklevel=2)
        from ...lower.preprocess import build_descriptor
        return build_descriptor(cm, metadata, q_len, kv_len, tiles)
    prog = program_for(cm, tiles, cfg)
    meta, b = _normalize(cm, metadata, q_len, kv_len)
    name = _ffi_target(cm, tiles, cfg, prog)
    operands = [jnp.asarray(a, I32) for _, a in _operands(prog, meta)]

    def call_for(batch):
        # Each sequence is built on its own: under jit with batch-sharded metadata every
        # device runs the kernel on its sequences (attention.partition.batch_sharded).
        shapes, _ = _out_shapes(prog, batch, q_len, kv_len, tiles)
        out_types = tuple(jax.ShapeDtypeStruct(*shapes[n]) for n in prog.outputs)
        call = jax.ffi.ffi_call(name, out_types, vmap_method="sequential")

        def run(*ops):
            return match_varying(call(*ops, q_len=np.int32(q_len), kv_len=np.int32(kv_len)), *ops)
        return run
    from ...attention.partition import batch_sharded
    res = batch_sharded(call_for, b, *operands)
    outs = dict(zip(prog.outputs, res))
    return _assemble(cm, outs, b, q_len, kv_len, tiles, prog)
