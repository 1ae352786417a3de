"""The TileLang preprocess program on the CPU: generated source, its logic (run by the
mock interpreter, bit-for-bit against the jnp preprocess) and, where tilelang and nvcc
are installed, a compile for sm_90a (no GPU needed)."""
from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

import jcompilemask as jcm
from jcompilemask.kernels.tilelang import (KernelConfig, generate, mock_preprocess,
                                           program_for, unsupported_reason)
from jcompilemask.kernels.tilelang.testing import (builtin_masks, descriptors_equal,
                                                  random_specs, sample_metadata)
from jcompilemask.lower.descriptor import TileConfig
from jcompilemask.lower.preprocess import build_descriptor
from strategies import hstu_one_region

BUILTINS = builtin_masks()
# small launch shapes so the interpreter is quick and chunking / scans are exercised
CASES = [(KernelConfig(32, 16), TileConfig(8, 16, 4, 8)),
         (KernelConfig(64, 32), TileConfig(16, 8, 8, 16)),
         (KernelConfig(32, 16), TileConfig(5, 3, 7, 4))]


def _check(spec, seed):
    cm = jcm.compile(spec)
    rng = np.random.default_rng(seed)
    for i, (cfg, tiles) in enumerate(CASES):
        ql = int(rng.integers(20, 60))
        kl = ql if i != 1 else int(rng.integers(20, 60))
        meta = sample_metadata(spec, 2, ql, kl, rng, ordered=(i != 2))
        ref = jax.jit(lambda m: build_descriptor(cm, m, ql, kl, tiles))(meta)
        got = mock_preprocess(cm, meta, ql, kl, tiles, cfg)
        bad = descriptors_equal(ref, got)
        assert not bad, f"{spec.name} q_len={ql} kv_len={kl} {tiles}: {bad}"


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_program_matches_jnp(name):
    _check(BUILTINS[name], 0)


@pytest.mark.parametrize("spec", random_specs(6), ids=lambda s: s.name)
def test_random_program_matches_jnp(spec):
    _check(spec, 1)


def _shared_slot_specs():
    from jcompilemask.spec import MaskSpec, Region, Scalar
    from jcompilemask.spec.expr import k, q, q_len
    a = Scalar("a", max=q_len)
    return [hstu_one_region(),
            MaskSpec([Region((0, q_len), ((q < a) & (k < 2)) | ((q >= a) & (k >= q)))],
                     name="row_bound_slots"),
            MaskSpec([Region((0, q_len // 2), k <= q),
                      Region((q_len // 2, q_len), ((q < a + 8) & (k < a)) | ((q >= a + 8) & (k >= a) & (k <= q)))],
                     name="two_regions_slots")]


@pytest.mark.parametrize("i", range(3))
def test_shared_slot_program_matches_jnp(i):
    """Slot groups (intervals whose row conditions exclude each other share a table slot:
    one run per group, [min lo, max hi) of the active members) in the generated program."""
    spec = _shared_slot_specs()[i]
    cm = jcm.compile(spec, warn=False)
    assert cm.shares_slots and unsupported_reason(cm) is None
    for seed in range(3):
        _check(spec, seed)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_source_is_generated_from_the_lowering(name):
    cm = jcm.compile(BUILTINS[name])
    prog = program_for(cm, TileConfig(128, 128, 64, 128))
    assert "@T.prim_func" in prog.source and "q_len: T.int32" in prog.source
    # lengths are run-time values: no length or metadata value is baked into the source
    for d in cm.spec.metadata.values():
        assert d.name in prog.source
    assert prog.num_intervals == cm.num_intervals
    assert prog.num_bwd_intervals == cm.num_bwd_intervals
    assert ("cols" in [k[0] for k in prog.kernels]) == (cm.num_bwd_intervals > 0)
    compile(prog.source, "<generated>", "exec")          # valid Python
    compile(prog.mock_source, "<generated-mock>", "exec")


def test_program_depends_on_structure_only():
    a = program_for(jcm.compile(jcm.masks.hstu()), TileConfig(128, 128, 64, 128))
    b = program_for(jcm.compile(jcm.masks.hstu()), TileConfig(128, 128, 64, 128))
    assert a.fingerprint() == b.fingerprint()
    c = program_for(jcm.compile(jcm.masks.hstu()), TileConfig(64, 128, 64, 128))
    assert c.fingerprint() != a.fingerprint()


def test_fallback_masks_are_refused_with_a_reason():
    from jcompilemask.spec import MaskSpec, Region
    from jcompilemask.spec.expr import k, q, q_len
    cm = jcm.compile(MaskSpec([Region((0, q_len), (k % 4) <= (q % 4))]), warn=False)
    assert "residual" in unsupported_reason(cm)
    with pytest.raises(ValueError, match="residual"):
        generate(cm, TileConfig(64, 64, 64, 64))


def _text_artifacts():
    """(calls, build, save, load) of a cache test: builds count in ``calls``; the artifact
    is a text file and a load marks what it read."""
    calls = []

    def build():
        calls.append(1)
        return "built"

    def save(obj, path):
        open(path, "w").write(obj)

    def load(path):
        return open(path).read() + "+loaded"
    return calls, build, save, load


def test_cache_key_is_typed_and_stable(tmp_path):
    from jcompilemask.ffi import CompileCache, KernelKey
    key = KernelKey("tilelang-preprocess", "abc", ("dyn",), ("int32",), (128, 128), "f00",
                    (("tilelang", "0.1.15"),))
    assert key.digest() == KernelKey(**{f: getattr(key, f) for f in key.__dataclass_fields__}).digest()
    assert key.target_name().startswith("jcm_tilelang_preprocess_")
    cache = CompileCache(tmp_path)
    calls, build, save, load = _text_artifacts()

    assert cache.get_or_build(key, build, load=load, save=save) == "built+loaded"
    assert CompileCache(tmp_path).get_or_build(key, build, load=load, save=save) == "built+loaded"
    assert len(calls) == 1
    with pytest.raises(TypeError):
        cache.get_or_build(("not", "a key"), build)

    # An artifact that does not load (foreign toolchain, corrupt file) is rebuilt, loudly.
    def bad_load(path):
        raise OSError("undefined symbol")

    with pytest.warns(RuntimeWarning, match="did not load .*undefined symbol.*rebuilding"):
        CompileCache(tmp_path).get_or_build(key, build, load=bad_load, save=save)
    assert len(calls) == 2


def test_cache_without_reload_keeps_the_build(tmp_path):
    """reload=False (the CuTe kernels): the building process keeps its own object; the
    next process loads the saved one; a save that fails warns and keeps the build."""
    from jcompilemask.ffi import CompileCache, KernelKey
    key = KernelKey("cute-forward", "", ("t",), ("bfloat16",), (), "f00", (("x", "1"),))
    calls, build, save, load = _text_artifacts()
    kw = dict(load=load, save=save, reload=False, announce=False)
    assert CompileCache(tmp_path).get_or_build(key, build, **kw) == "built"
    assert CompileCache(tmp_path).get_or_build(key, build, **kw) == "built+loaded"
    assert len(calls) == 1

    def bad_save(obj, path):
        raise RuntimeError("export failed")

    with pytest.warns(RuntimeWarning, match="disk copy .* failed .*export failed.*fresh build"):
        assert CompileCache(tmp_path / "other").get_or_build(
            key, build, load=load, save=bad_save, reload=False) == "built"
    assert not list((tmp_path / "other").rglob("kernel.so"))


def test_gpu_errors_are_clear():
    from jcompilemask import ffi
    with pytest.raises(ffi.GpuExtrasMissing, match="pip install"):
        ffi.require_gpu_extras(("surely_not_a_module_jcm",))
    if not ffi.gpu_available():
        with pytest.raises(ffi.UnsupportedGpu, match="SM90"):
            ffi.require_sm90()


def _can_compile():
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return shutil.which("nvcc") is not None


@pytest.mark.skipif(not _can_compile(), reason="needs tilelang and nvcc (no GPU needed)")
def test_causal_program_compiles_for_sm90a():
    from jcompilemask.kernels.tilelang import compile_program
    prog = program_for(jcm.compile(jcm.masks.causal()), TileConfig(128, 128, 64, 128))
    kernel = compile_program(prog)
    src = kernel.get_kernel_source()
    assert "__global__" in src and "AtomicAdd" in src
