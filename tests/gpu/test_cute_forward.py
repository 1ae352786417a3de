"""CuTe DSL SM90 forward kernel: compiles without a GPU, matches the reference on one.

The compile tests need only nvidia-cutlass-dsl (they set CUTE_DSL_ARCH=sm_90a before
cutlass is imported, so they run on CPU-only CI machines that have it installed).
The run tests need an SM90 GPU and jax-tvm-ffi; elsewhere they skip, saying why.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from gpu_cases import compile_checking_remarks, sm90_gpu_reason  # noqa: E402  (tests/gpu is on sys.path under pytest)

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")
# Compile checks of opt-in benchmark knobs (not what the registry runs): `make test-kernels-all`
# runs them, CI's `make test-kernels` leaves them out (pyproject.toml's `knob` marker).
knob = pytest.mark.knob


def registry_switches(monkeypatch, head_dim, head_dim_v, block_q, block_kv, num_stages, **changes):
    """The ForwardKey switch fields the registry compiles by default (api.forward_switches
    with no JCOMPILEMASK_CUTE_FWD_* variable set), updated by ``changes``."""
    from jcompilemask.kernels.cute import api
    for name in (api.FWD_WORK_LIST_ENV, api.FWD_GROUP_MASK_ENV, api.FWD_SCHEDULE_ENV,
                 api.FWD_K_AHEAD_ENV, api.FWD_BITS_ABOVE_ENV, api.FWD_RESCALE_TAIL_ENV,
                 api.FWD_WORK_RUNS_ENV, api.FWD_RUNS_EARLY_ENV, api.FWD_SLOT_SKIP_ENV,
                 api.FWD_MASK_R2P_ENV, api.FWD_RESIDUAL_PERIODIC_ENV, api.FWD_RESCALE_EARLY_ENV,
                 api.FWD_OPERANDS_EARLY_ENV, api.FWD_P_DOUBLE_ENV, api.FWD_INTERVAL_UNROLL_ENV):
        monkeypatch.delenv(name, raising=False)
    switches = {**api.forward_switches(head_dim, head_dim_v, block_q, block_kv, num_stages), **changes}
    if "work_runs" not in changes and (switches["rescale_tail"] or not switches["work_list"]):
        switches["work_runs"] = False      # runs are a form of the list, never with rescale_tail
    if not switches["work_runs"] and "runs_early" not in changes:
        switches["runs_early"] = False
    if "p_double" not in changes and (not switches["work_runs"] or switches["rescale_tail"]
                                      or switches["rescale_early"]):
        switches["p_double"] = False       # D 128's default, never beside these
    return switches


def test_import_needs_no_gpu():
    from jcompilemask.kernels.cute import api

    assert api.ForwardKey("bfloat16", 128, 128, 1, 128, 128, True, True, 0.1).target_name


def test_key_rejects_unsupported():
    from jcompilemask.kernels.cute.api import ForwardKey

    with pytest.raises(ValueError, match="head dim"):
        ForwardKey("bfloat16", 112, 112, 1, 128, 128, True, True, 0.1)
    with pytest.raises(ValueError, match="Dv == D"):
        ForwardKey("bfloat16", 128, 64, 1, 128, 128, True, True, 0.1)
    with pytest.raises(ValueError, match="preferred_forward_tiles"):
        ForwardKey("bfloat16", 128, 128, 1, 64, 128, True, True, 0.1)
    with pytest.raises(ValueError, match="preferred_forward_tiles"):
        ForwardKey("bfloat16", 256, 256, 1, 128, 128, True, True, 0.1)
    with pytest.raises(ValueError, match="shared memory"):
        ForwardKey("bfloat16", 256, 256, 1, 128, 80, True, True, 0.1, num_stages=3)
    with pytest.raises(ValueError, match="softcap"):
        ForwardKey("bfloat16", 128, 128, 1, 128, 128, True, True, 0.1, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        ForwardKey("bfloat16", 128, 128, 1, 128, 128, True, True, 0.1, softcap_fast_tanh=True)
    with pytest.raises(ValueError, match="K must be >= 1"):
        ForwardKey("bfloat16", 128, 128, 0, 128, 128, True, True, 0.1)
    ForwardKey("bfloat16", 128, 128, 25, 128, 128, True, True, 0.1)   # any K (loops past 8)


def test_key_of_softcap_and_head_dims():
    from jcompilemask.kernels.cute.api import (ForwardKey, forward_smem_bytes, preferred_forward_stages,
                                               preferred_forward_tiles)

    assert preferred_forward_tiles(128) == (128, 128) and preferred_forward_stages(128) == 2
    assert preferred_forward_tiles(64, "float16") == (128, 128)
    assert preferred_forward_tiles(256) == (128, 80)
    for d in (64, 128, 256):
        bq, bk = preferred_forward_tiles(d)
        assert forward_smem_bytes(d, bq, bk, preferred_forward_stages(d)) <= 227 * 1024
    plain = ForwardKey("bfloat16", 128, 128, 1, 128, 128, True, True, 0.1)
    capped = ForwardKey("bfloat16", 128, 128, 1, 128, 128, True, True, 0.1, softcap=30.0)
    fast = ForwardKey("bfloat16", 128, 128, 1, 128, 128, True, True, 0.1, softcap=30.0, softcap_fast_tanh=True)
    assert len({plain, capped, fast}) == 3
    assert len({plain.target_name, capped.target_name, fast.target_name}) == 3
    # The names of uncapped kernels are those of before the soft cap existed.
    assert plain.target_name.endswith("_s2_3fb999999999999a")


def test_descriptor_at_head_dim_256_tiles():
    """The preprocess builds 128 x 80 tile states exactly as the kernel's test helper does."""
    import jcompilemask as jcm
    from jcompilemask.kernels.cute.testing import tiles_from_intervals

    n = 1000
    md = {"context_len": np.array([300]), "history_end": np.array([n - 24]), "group_size": np.array([4])}
    for spec, meta in ((jcm.masks.causal(), None), (jcm.masks.hstu(), md)):
        desc = jcm.compile(spec).instantiate(meta, n, n, block_q=128, block_kv=80, bwd_block_q=64,
                                             bwd_block_kv=128)
        iv = np.asarray(desc.fwd_intervals)
        assert np.array_equal(tiles_from_intervals(iv, n, 128, 80), np.asarray(desc.fwd_tiles))


def test_registry_accepts_step2_variants():
    """The cute backend's supports()/tiles() (checked without a GPU: availability aside)."""
    from jcompilemask import backends

    cute = backends.get("cute")

    def call(d, dv=None, dtype="bfloat16", softcap=False, k=1):
        return backends.Call(dtype=dtype, head_dim=d, head_dim_v=dv or d, num_heads=4, num_kv_heads=1,
                             softcap=softcap, has_fallback=False, num_intervals=k)

    for d in (64, 128, 256):
        for dtype in ("bfloat16", "float16"):
            assert cute.supports(call(d, dtype=dtype, softcap=True, k=6)) is None
    # head dims without kernels of their own run zero-padded (tests/test_head_dim_padding.py)
    assert cute.supports(call(96)) is None and cute.supports(call(128, 64)) is None
    assert cute.tiles(call(96)) == cute.tiles(call(128))
    assert "head dims 320/320" in cute.supports(call(320))
    assert "head dims 128/300" in cute.supports(call(128, 300))
    assert "dtype" in cute.supports(call(128, dtype="float32"))
    assert cute.supports(call(128, k=9)) is None and cute.supports(call(128, k=32)) is None  # any K
    assert (cute.tiles(call(256)).block_q, cute.tiles(call(256)).block_kv) == (128, 80)
    assert (cute.tiles(call(64)).block_q, cute.tiles(call(64)).block_kv) == (128, 128)


def test_reference_softcap_matches_policy_reference():
    """The interval-table reference and jcompilemask.testing's dense one agree on soft cap."""
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute.testing import check_case_intervals, dense_mask, reference_attention
    from jcompilemask.testing import reference_attention as dense_reference

    iv, _ = check_case_intervals("random3", np.random.default_rng(3), 1, 50, 70, 2)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = 3 * jax.random.normal(ks[0], (1, 50, 2, 16))
    k = jax.random.normal(ks[1], (1, 70, 1, 16))
    v = jax.random.normal(ks[2], (1, 70, 1, 16))
    o, lse = reference_attention(q, k, v, iv, 0.25, softcap=2.0)
    o2, lse2 = dense_reference(q, k, v, dense_mask(iv, 70), scale=0.25, softcap=2.0)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o2), atol=1e-5)
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse2))
    fin = ~np.isneginf(np.asarray(lse2))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse2)[fin], atol=1e-5)


def test_tile_states_of_causal():
    from jcompilemask.kernels.cute.testing import causal_intervals, tiles_from_intervals

    t = tiles_from_intervals(causal_intervals(300), 300, 128, 128)  # Tq = Tk = 3
    states = [[(int(t[0, 0, i, 0]) >> (2 * j)) & 3 for j in range(3)] for i in range(3)]
    # diagonal partial (3), below full (1), above empty (2); the ragged corner tile
    # (rows 256..299, keys 256..299) is still partial: only in-range elements count.
    assert states == [[3, 2, 2], [1, 3, 2], [1, 1, 3]]


@needs_cutlass
@pytest.mark.parametrize(
    "num_intervals,broadcast_batch,broadcast_head", [(1, True, True), (2, False, True), (3, False, False)]
)
def test_compiles_for_sm90(num_intervals, broadcast_batch, broadcast_head, monkeypatch, capfd):
    from jcompilemask.kernels.cute.api import ForwardKey, compile_forward

    key = ForwardKey("bfloat16", 128, 128, num_intervals, 128, 128, broadcast_batch, broadcast_head, 128**-0.5,
                     **registry_switches(monkeypatch, 128, 128, 128, 128, 2))    # the registry's default
    assert key.work_list and key.group_mask
    assert compile_checking_remarks(compile_forward, key, monkeypatch, capfd) is not None


# The native D 80 / 96 forwards (api.FWD_NATIVE_HEAD_DIMS, D 128's switches): (D, dtype, K,
# broadcast batch / head, soft cap, residual program, the arrays' head dims when narrower:
# D 72 runs the 80 kernel in place). 168 registers, 0 B of stack for each (sessions 46's
# static SASS: 14 / 13 HGMMAs per tile at D 96 / 80 against 16 at D 128).
_NATIVE_KEYS = {
    "d96": (96, "bfloat16", 1, True, True, None, False, None),
    "d80_fp16_cap_k3": (80, "float16", 3, False, False, 20.0, False, None),
    "d96_k12": (96, "bfloat16", 12, False, True, None, False, None),
    "d96_residual": (96, "bfloat16", 0, False, True, None, True, None),
    "d80_io72": (80, "bfloat16", 1, True, True, None, False, (72, 72)),
}


@needs_cutlass
@pytest.mark.parametrize("case", sorted(_NATIVE_KEYS))
def test_native_head_dims_compile_for_sm90(case, monkeypatch, capfd):
    """The native D 80 / 96 forwards compile for sm_90a under the registry's switches
    (64B- / 32B-swizzled Q / K / V rows), without C7512."""
    import jcompilemask as jcm
    from jcompilemask.kernels.cute import api
    from jcompilemask.lower.residual_program import ResidualProgram
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    d, dtype, kk, bb, bh, cap, residual, io = _NATIVE_KEYS[case]
    prog = None
    if residual:
        monkeypatch.setenv("JCOMPILEMASK_ROW_CLASSES", "0")
        cm = jcm.compile(MaskSpec([Region((0, q_len), (k <= q) & (k > q - 128) & ((q - k) % 2 == 0))]),
                         warn=False)
        prog, kk = ResidualProgram.forward(cm), cm.num_intervals
    bq, bk = api.preferred_forward_tiles(d)
    stages = api.preferred_forward_stages(d)
    registry_switches(monkeypatch, d, d, bq, bk, stages)    # no JCOMPILEMASK_CUTE_FWD_* set
    key = api.ForwardKey(dtype, d, d, kk, bq, bk, bb, bh, d ** -0.5, num_stages=stages, softcap=cap,
                         residual=prog, io_head_dims=io,
                         **api.forward_switches(d, d, bq, bk, stages, residual=prog))
    assert key.work_runs and key.operands_early and key.p_double
    assert compile_checking_remarks(api.compile_forward, key, monkeypatch, capfd) is not None


@needs_cutlass
@knob
def test_bits_path_below_k8_compiles_for_sm90():
    """The benchmark knob bits_above (clear's K 6 through the bit-mask path, slots unrolled)."""
    from jcompilemask.kernels.cute.api import ForwardKey, compile_forward
    key = ForwardKey("bfloat16", 128, 128, 6, 128, 128, False, False, 128**-0.5, bits_above=0)
    assert compile_forward(key) is not None and _tagged(key, "ba0")


@needs_cutlass
@pytest.mark.parametrize("head_dim,num_intervals", [(128, 1), (64, 6), (128, 25)])
def test_work_list_forward_compiles_for_sm90(head_dim, num_intervals):
    """The forward's compact work list (issue 14 item 1): the producer warp builds the row's
    visited key tiles (common.build_tile_list) and both sides iterate it."""
    from jcompilemask.kernels.cute.api import (ForwardKey, compile_forward, preferred_forward_stages,
                                               preferred_forward_tiles)
    bq, bk = preferred_forward_tiles(head_dim)
    key = ForwardKey("bfloat16", head_dim, head_dim, num_intervals, bq, bk, False, True,
                     head_dim**-0.5, num_stages=preferred_forward_stages(head_dim), work_list=True)
    assert compile_forward(key) is not None and _tagged(key, "wl")


def test_work_list_env(monkeypatch):
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.FWD_WORK_LIST_ENV, raising=False)
    assert api._fwd_work_list(128, 128, 128, 128, 2)          # the default
    monkeypatch.setenv(api.FWD_WORK_LIST_ENV, "0")
    assert not api._fwd_work_list(128, 128, 128, 128, 2)
    monkeypatch.setenv(api.FWD_WORK_LIST_ENV, "1")
    assert api._fwd_work_list(128, 128, 128, 128, 2)
    monkeypatch.setenv(api.FWD_WORK_LIST_ENV, "yes")
    with pytest.raises(ValueError, match="JCOMPILEMASK_CUTE_FWD_WORK_LIST"):
        api._fwd_work_list(128, 128, 128, 128, 2)
    monkeypatch.delenv(api.FWD_WORK_LIST_ENV, raising=False)
    bq, bk = api.preferred_forward_tiles(256)
    assert not api._fwd_work_list(256, 256, bq, bk, 2)       # 2 KB more than D 256's 2 stages fit


def test_bits_above_env(monkeypatch):
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.FWD_BITS_ABOVE_ENV, raising=False)
    assert api._fwd_bits_above() == 8
    monkeypatch.setenv(api.FWD_BITS_ABOVE_ENV, "0")
    assert api._fwd_bits_above() == 0
    monkeypatch.setenv(api.FWD_BITS_ABOVE_ENV, "-1")
    with pytest.raises(ValueError, match=">= 0"):
        api._fwd_bits_above()


@needs_cutlass
@pytest.mark.parametrize("head_dim,num_intervals,softcap", [(128, 25, None), (64, 9, 30.0), (256, 32, None)])
def test_any_k_compiles_for_sm90(head_dim, num_intervals, softcap, monkeypatch):
    """K > 8: a masked tile walks the row's intervals (not unrolled), skipping those that
    miss the tile, into its bit words (ptxas, D 128 / 64 / 256 at K 25: no stack)."""
    from jcompilemask.kernels.cute.api import (ForwardKey, compile_forward, preferred_forward_stages,
                                               preferred_forward_tiles)

    bq, bk = preferred_forward_tiles(head_dim)
    stages = preferred_forward_stages(head_dim)
    key = ForwardKey("bfloat16", head_dim, head_dim, num_intervals, bq, bk, False, False,
                     head_dim**-0.5, num_stages=stages, softcap=softcap,
                     **registry_switches(monkeypatch, head_dim, head_dim, bq, bk, stages))
    assert compile_forward(key) is not None


def test_interval_unroll_env_and_key(monkeypatch):
    """ForwardKey.interval_unroll (the K > 8 mask loop's unroll factor): its variable, its
    tag in the target name, and bad values refused."""
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.FWD_INTERVAL_UNROLL_ENV, raising=False)
    assert api._fwd_interval_unroll() == 1
    assert api.forward_switches(128, 128, 128, 128, 2)["interval_unroll"] == 1
    # the default past K 8 (a measured factor); K <= 8 never unrolls (same key)
    sw = lambda k: api.forward_switches(128, 128, 128, 128, 2, num_intervals=k)["interval_unroll"]  # noqa: E731
    assert (sw(8), sw(9), sw(25)) == (1, 4, 4)
    monkeypatch.setenv(api.FWD_INTERVAL_UNROLL_ENV, "4")
    assert api._fwd_interval_unroll() == 4
    assert api.forward_switches(128, 128, 128, 128, 2)["interval_unroll"] == 4
    assert (sw(1), sw(25)) == (1, 4)
    monkeypatch.setenv(api.FWD_INTERVAL_UNROLL_ENV, "1")
    assert sw(25) == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(api.FWD_INTERVAL_UNROLL_ENV, bad)
        with pytest.raises(ValueError, match="JCOMPILEMASK_CUTE_FWD_INTERVAL_UNROLL"):
            api._fwd_interval_unroll()
    base = api.ForwardKey("bfloat16", 128, 128, 25, 128, 128, False, False, 0.1)
    assert "_iu" not in base.target_name
    assert _tagged(api.ForwardKey("bfloat16", 128, 128, 25, 128, 128, False, False, 0.1,
                                  interval_unroll=4), "iu4")
    with pytest.raises(ValueError, match="interval_unroll"):
        api.ForwardKey("bfloat16", 128, 128, 25, 128, 128, False, False, 0.1, interval_unroll=0)


@needs_cutlass
@knob
def test_interval_unroll_compiles_for_sm90(monkeypatch, capfd):
    """The registry's K 25 forward with its interval loop unrolled by 4: no stack, no
    serialized wgmma (static SASS, session 48: 168 registers, 0 B, 16 LDG per masked-tile
    copy in flight where the loop had 4)."""
    from jcompilemask.kernels.cute import api
    bq, bk = api.preferred_forward_tiles(128)
    stages = api.preferred_forward_stages(128)
    key = api.ForwardKey("bfloat16", 128, 128, 25, bq, bk, False, False, 128**-0.5,
                         num_stages=stages,
                         **registry_switches(monkeypatch, 128, 128, bq, bk, stages,
                                             interval_unroll=4))
    assert key.group_mask and _tagged(key, "iu4")
    assert compile_checking_remarks(api.compile_forward, key, monkeypatch, capfd) is not None


@needs_cutlass
@pytest.mark.parametrize("case", ["dilated", "divisor", "two_regions", "per_head"])
def test_residual_forward_compiles_for_sm90(case):
    """Residual predicates emitted into the forward's partial tiles (issue 16 item 2):
    a constant modulus, a metadata divisor (parameter table), two regions with different
    residuals in one slot (row regions), a per-head residual; ptxas: no stack."""
    import jcompilemask as jcm
    from jcompilemask.kernels.cute.api import ForwardKey, compile_forward
    from jcompilemask.lower.residual_program import ResidualProgram
    from jcompilemask.spec import MaskSpec, Region, Scalar, h, k, q, q_len

    d = Scalar("d", min=1, max=9)
    specs = {
        "dilated": MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % 2 == 0))]),
        "divisor": MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % d == 0))]),
        "two_regions": MaskSpec([Region((0, 10), (k <= q) & (k % 2 == 0)),
                                 Region((10, q_len), (k <= q) & (k % 3 == 0))]),
        "per_head": MaskSpec([Region((0, q_len), (k <= q) & ((q + h) % 2 == k % 2))], num_heads=2),
    }
    cm = jcm.compile(specs[case], warn=False)
    prog = ResidualProgram.forward(cm)
    assert not prog.exact
    key = ForwardKey("bfloat16", 128, 128, cm.num_intervals, 128, 128, False, case != "per_head",
                     128**-0.5, residual=prog)
    assert compile_forward(key) is not None
    assert f"_r{prog.tag}" in key.target_name


# Step 2 variants: every head dim x dtype x soft cap; the interval counts cycle through
# 1, 2 and 6 so that each head dim sees all three (K = 6 at D = 256 reloads the intervals
# per masked tile instead of keeping them in registers), with the broadcast flags varied.
_K_OF = {("bfloat16", None): 1, ("bfloat16", 30.0): 6, ("float16", None): 6, ("float16", 30.0): 2}
_BROADCAST_OF_K = {1: (True, True), 2: (False, True), 6: (False, False)}
VARIANTS = [(d, dt, cap, _K_OF[dt, cap]) for d in (64, 128, 256) for dt in ("bfloat16", "float16")
            for cap in (None, 30.0)]


@needs_cutlass
@pytest.mark.parametrize("head_dim,dtype,softcap,num_intervals", VARIANTS)
def test_variant_compiles_for_sm90(head_dim, dtype, softcap, num_intervals, monkeypatch):
    """Each head dim x dtype x soft cap as the registry compiles it (its tiles, stages and
    the work list where it fits); the bitmap walk (``$JCOMPILEMASK_CUTE_FWD_WORK_LIST=0``)
    at D 64 / 128 is a knob case below."""
    from jcompilemask.kernels.cute.api import (ForwardKey, compile_forward, preferred_forward_stages,
                                               preferred_forward_tiles)

    bq, bk = preferred_forward_tiles(head_dim, dtype)
    stages = preferred_forward_stages(head_dim, dtype)
    key = ForwardKey(dtype, head_dim, head_dim, num_intervals, bq, bk, *_BROADCAST_OF_K[num_intervals],
                     head_dim**-0.5, num_stages=stages, softcap=softcap,
                     **registry_switches(monkeypatch, head_dim, head_dim, bq, bk, stages))
    assert compile_forward(key) is not None


@needs_cutlass
@knob
@pytest.mark.parametrize("head_dim,softcap,num_intervals", [(64, None, 6), (128, 30.0, 2)])
def test_bitmap_walk_compiles_for_sm90(head_dim, softcap, num_intervals):
    """The forward without the work list (``$JCOMPILEMASK_CUTE_FWD_WORK_LIST=0``)."""
    from jcompilemask.kernels.cute.api import (ForwardKey, compile_forward, preferred_forward_stages,
                                               preferred_forward_tiles)
    bq, bk = preferred_forward_tiles(head_dim)
    key = ForwardKey("bfloat16", head_dim, head_dim, num_intervals, bq, bk, False, True,
                     head_dim**-0.5, num_stages=preferred_forward_stages(head_dim), softcap=softcap)
    assert compile_forward(key) is not None and not _tagged(key, "wl")


@needs_cutlass
@pytest.mark.parametrize("dtype,softcap,num_intervals,changes", [
    pytest.param("bfloat16", None, 1, {}, id="bfloat16-None-1"),
    pytest.param("float16", None, 2, {}, id="float16-None-2"),
    pytest.param("bfloat16", 30.0, 6, {}, id="bfloat16-30.0-6"),
    pytest.param("bfloat16", None, 1, {"rescale_early": True, "operands_early": True}, marks=knob,
                 id="bfloat16-None-1-early")])
def test_head_dim_192_128_compiles_for_sm90(dtype, softcap, num_intervals, changes, monkeypatch):
    """DeepSeek-style D 192 / Dv 128 (compiled; the registry runs it only with the opt-in);
    the knob case with rescale_early + operands_early (O's Dv-wide rescale before P V)."""
    from jcompilemask.kernels.cute.api import (ForwardKey, compile_forward, preferred_forward_stages,
                                               preferred_forward_tiles)

    bq, bk = preferred_forward_tiles(192, dtype)
    stages = preferred_forward_stages(192, dtype)
    key = ForwardKey(dtype, 192, 128, num_intervals, bq, bk, *_BROADCAST_OF_K[num_intervals],
                     192**-0.5, num_stages=stages, softcap=softcap,
                     **registry_switches(monkeypatch, 192, 128, bq, bk, stages, **changes))
    assert compile_forward(key) is not None
    assert "_d192x128_" in key.target_name


def test_head_dim_192_128_key():
    from jcompilemask.kernels.cute.api import ForwardKey, forward_smem_bytes, preferred_forward_tiles

    assert preferred_forward_tiles(192) == (128, 128)
    # Q 48 KB + 2 x (K 48 KB + V 32 KB) + barriers: fits; a third stage would not.
    assert forward_smem_bytes(192, 128, 128, 2, head_dim_v=128) == 1024 + 212992
    assert forward_smem_bytes(192, 128, 128, 3, head_dim_v=128) > 232448
    ForwardKey("bfloat16", 192, 128, 1, 128, 128, True, True, 0.1)
    with pytest.raises(ValueError, match="head dims"):
        ForwardKey("bfloat16", 192, 192, 1, 128, 128, True, True, 0.1)


@needs_cutlass
def test_fast_tanh_softcap_compiles_for_sm90():
    from jcompilemask.kernels.cute.api import ForwardKey, compile_forward

    key = ForwardKey("bfloat16", 128, 128, 2, 128, 128, True, True, 128**-0.5, softcap=30.0,
                     softcap_fast_tanh=True)
    assert compile_forward(key) is not None


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("case", ["causal", "prefix_window", "random3", "random6"])
def test_variant_matches_reference_on_gpu(head_dim, dtype, softcap, case):
    """Output and LSE within the tolerance policy (jcompilemask.testing) of a float32 reference,
    for each head dim, dtype and soft cap; GQA (4 query heads on 2 KV heads, MQA for fp16),
    ragged Nq / Nk, per-head masks and fully masked rows (random3, random6)."""
    reason = sm90_gpu_reason()
    if reason:
        pytest.skip(reason)
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute.api import cute_forward, preferred_forward_tiles
    from jcompilemask.kernels.cute.testing import check_case_intervals, dense_mask, tiles_from_intervals
    from jcompilemask.testing import assert_within_policy, reference_attention

    dt = jnp.dtype(dtype)
    B, Nq, Nk, H = 2, 700, 900, 4
    Hkv = 1 if dtype == "float16" else 2
    if not case.startswith("random"):
        Nk = Nq
    iv, _ = check_case_intervals(case, np.random.default_rng(1), B, Nq, Nk, H)
    bq, bk = preferred_forward_tiles(head_dim, dtype)
    tiles = tiles_from_intervals(iv, Nk, bq, bk)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(7), 3)
    # With a cap, logits of spread ~3x the cap's knee so that tanh saturates somewhere.
    q_gain = 1.0 if softcap is None else 3.0
    q = (q_gain * jax.random.normal(kq, (B, Nq, H, head_dim))).astype(dt)
    k = jax.random.normal(kk, (B, Nk, Hkv, head_dim)).astype(dt)
    v = jax.random.normal(kv, (B, Nk, Hkv, head_dim)).astype(dt)
    scale = 1 / math.sqrt(head_dim)
    o, lse = jax.jit(lambda *a: cute_forward(*a, scale=scale, softcap=softcap, block_q=bq, block_kv=bk))(
        q, k, v, jnp.asarray(iv), jnp.asarray(tiles))
    mask = dense_mask(iv, Nk)
    hi = reference_attention(q, k, v, mask, scale=scale, softcap=softcap, precision="high")
    lo = reference_attention(q, k, v, mask, scale=scale, softcap=softcap, precision="input")
    assert_within_policy(o, hi[0], lo[0], "out")
    assert_within_policy(lse, hi[1], lo[1], "lse")
    empty = np.isneginf(np.asarray(hi[1]))
    if case.startswith("random"):
        assert empty.any(), "the case must contain fully masked rows"
    assert np.all(np.transpose(np.asarray(o.astype(jnp.float32)), (0, 2, 1, 3))[empty] == 0)


def _case_inputs(case, seed, key, heads=4, kv_heads=4, B=2, Nq=700, Nk=900, head_dim=128):
    """A check case's intervals and tile states (the head dim's forward tiles: 128 x 128 at
    D 128) and bf16 q, k, v (Nk = Nq except for the random cases)."""
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute.api import preferred_forward_tiles
    from jcompilemask.kernels.cute.testing import check_case_intervals, tiles_from_intervals
    if not case.startswith("random"):
        Nk = Nq
    iv, _ = check_case_intervals(case, np.random.default_rng(seed), B, Nq, Nk, heads)
    tiles = tiles_from_intervals(iv, Nk, *preferred_forward_tiles(head_dim))
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(key), 3)
    q = jax.random.normal(kq, (B, Nq, heads, head_dim)).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (B, Nk, kv_heads, head_dim)).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (B, Nk, kv_heads, head_dim)).astype(jnp.bfloat16)
    return q, k, v, iv, tiles


def _assert_switch_is_bit_identical(monkeypatch, env, inputs, **kwargs):
    """cute_forward's o and lse with ``$env`` = 0 and = 1 (each traced afresh) are equal bit
    for bit on `inputs` (_case_inputs' q, k, v, intervals, tiles)."""
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute import api
    q, k, v, iv, tiles = inputs
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv(env, flag)
        f = jax.jit(lambda *a: api.cute_forward(*a, **kwargs))      # a new lambda: traced per run
        outs.append([np.asarray(x) for x in f(q, k, v, jnp.asarray(iv), jnp.asarray(tiles))])
    (o0, l0), (o1, l1) = outs
    assert np.array_equal(o0.view(np.uint16), o1.view(np.uint16))
    assert np.array_equal(l0, l1, equal_nan=True)


def _switch_case_is_bit_identical(monkeypatch, env, case, seed, key, head_dim=128, softcap=None,
                                  shape=None, extra=()):
    """_assert_switch_is_bit_identical on check case ``case`` (GQA 4 / 2 heads, ragged Nq 700 /
    Nk 900, or ``shape`` = (Nq, Nk) with one batch and 2 / 1 heads) at ``head_dim``'s forward
    tiles; ``extra``: "NAME" or "NAME=VALUE" variables set for both runs (1 by default).
    Skips without an SM90 GPU."""
    reason = sm90_gpu_reason()
    if reason:
        pytest.skip(reason)
    from jcompilemask.kernels.cute import api

    for item in extra:
        name, _, value = item.partition("=")
        monkeypatch.setenv(name, value or "1")
    bq, bk = api.preferred_forward_tiles(head_dim)
    dims = dict(kv_heads=2) if shape is None else dict(B=1, heads=2, kv_heads=1, Nq=shape[0], Nk=shape[1])
    _assert_switch_is_bit_identical(monkeypatch, env, _case_inputs(case, seed, key, head_dim=head_dim, **dims),
                                    softcap=softcap, block_q=bq, block_kv=bk)


# A plain D 128 key's fields, for the tests of which switch combinations a ForwardKey refuses.
_KEY_FIELDS = dict(dtype="bfloat16", head_dim=128, head_dim_v=128, num_intervals=1, block_q=128,
                   block_kv=128, broadcast_batch=False, broadcast_head=True, scale=0.1)


def _tagged(key, *tags):
    """Whether ``key``'s target name carries every switch tag in ``tags`` (``_tag`` parts)."""
    return all(f"_{t}_" in key.target_name + "_" for t in tags)


def _registry_key(monkeypatch, head_dim, num_intervals, broadcast_head, softcap=None, **changes):
    """A bf16 ForwardKey at ``head_dim``'s tiles and stages with the registry's switches,
    updated by ``changes`` (registry_switches)."""
    from jcompilemask.kernels.cute.api import ForwardKey, preferred_forward_stages, preferred_forward_tiles
    bq, bk = preferred_forward_tiles(head_dim)
    stages = preferred_forward_stages(head_dim)
    return ForwardKey("bfloat16", head_dim, head_dim, num_intervals, bq, bk, False, broadcast_head,
                      head_dim**-0.5, num_stages=stages, softcap=softcap,
                      **registry_switches(monkeypatch, head_dim, head_dim, bq, bk, stages, **changes))


@pytest.mark.parametrize("case", ["causal", "document", "prefix_window", "random3"])
def test_matches_reference_on_gpu(case):
    reason = sm90_gpu_reason()
    if reason:
        pytest.skip(reason)
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute.api import cute_forward
    from jcompilemask.kernels.cute.testing import reference_attention

    q, k, v, iv, tiles = _case_inputs(case, 1, 7)
    scale = 1 / math.sqrt(128)
    o, lse = jax.jit(lambda *a: cute_forward(*a, scale=scale))(q, k, v, jnp.asarray(iv), jnp.asarray(tiles))
    o_ref, lse_ref = reference_attention(q, k, v, iv, scale)
    o, o_ref = np.asarray(o.astype(jnp.float32)), np.asarray(o_ref)
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) < 1e-2
    empty = np.isneginf(lse_ref)
    assert np.array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], lse_ref[~empty], atol=2e-2)
    assert np.all(np.transpose(o, (0, 2, 1, 3))[empty] == 0)


@needs_cutlass
@pytest.mark.parametrize("case,persistent", [("work_list", True)] + [
    pytest.param(c, p, marks=knob) for c in ("plain", "gqa_per_batch_k6", "residual", "work_list")
    for p in (False, True) if (c, p) != ("work_list", True)])
def test_scheduled_forward_compiles_for_sm90(case, persistent):
    """The forward on a 1-D grid in the host's work-unit order, or on persistent CTAs
    dealt that order (issue 14 item 2): plain, per-batch masks with K 6, with a residual
    program (its own entry), with the work list. ptxas: no stack (NOTES.md)."""
    import jcompilemask as jcm
    from jcompilemask.kernels.cute.api import ForwardKey, compile_forward
    from jcompilemask.lower.residual_program import ResidualProgram
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    residual, kk, bb = None, 1, True
    if case == "gqa_per_batch_k6":
        kk, bb = 6, False
    if case == "residual":
        cm = jcm.compile(MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % 2 == 0))]), warn=False)
        residual, kk = ResidualProgram.forward(cm), cm.num_intervals
    key = ForwardKey("bfloat16", 128, 128, kk, 128, 128, bb, True, 128**-0.5, residual=residual,
                     schedule=True, work_list=case == "work_list", persistent=persistent)
    assert compile_forward(key) is not None
    assert key.target_name.endswith("_lp" if persistent else "_ls")


@pytest.mark.parametrize("mode", ["1", "persistent"])
@pytest.mark.parametrize("case", ["causal", "document", "random3"])
def test_scheduled_forward_is_bit_identical_on_gpu(case, mode, monkeypatch):
    """The work-unit order (and persistent CTAs running several units each) changes which
    CTA runs a unit, never its arithmetic: o and lse equal the default grid's bit for bit
    (and so the reference, by the test above). 2 x 4 heads x 6 query tiles = 48 units on
    the GPU's SMs, and on 5 CTAs (num_sms patched) so that each runs ~10."""
    reason = sm90_gpu_reason()
    if reason:
        pytest.skip(reason)
    import jax
    import jax.numpy as jnp

    from jcompilemask.kernels.cute import api

    q, k, v, iv, tiles = _case_inputs(case, 2, 8, kv_heads=2)
    outs = []
    runs = [("0", None), (mode, None)] + ([(mode, 5)] if mode == "persistent" else [])
    for flag, ctas in runs:
        monkeypatch.setenv(api.FWD_SCHEDULE_ENV, flag)
        if ctas is not None:
            monkeypatch.setattr(api, "num_sms", lambda default=132: ctas)
        f = jax.jit(lambda *a: api.cute_forward(*a))      # traced per run (a new lambda)
        outs.append([np.asarray(x) for x in f(q, k, v, jnp.asarray(iv), jnp.asarray(tiles))])
    o0, l0 = outs[0]
    for o1, l1 in outs[1:]:
        assert np.array_equal(o0.view(np.uint16), o1.view(np.uint16))
        assert np.array_equal(l0, l1, equal_nan=True)


@needs_cutlass
@pytest.mark.parametrize("case", ["work_list", pytest.param("plain", marks=knob),
                                  pytest.param("persistent_work_list", marks=knob)])
def test_k_ahead_forward_compiles_for_sm90(case):
    """K(t + 1) loaded before V(t) (issue 14, FA4's producer order): the bitmap walk, the
    work list (its chunk's last V issued before the list is freed) and persistent CTAs."""
    from jcompilemask.kernels.cute.api import ForwardKey, compile_forward
    key = ForwardKey("bfloat16", 128, 128, 2, 128, 128, False, True, 128**-0.5, k_ahead=True,
                     work_list=case != "plain", schedule=case.startswith("persistent"),
                     persistent=case.startswith("persistent"))
    assert compile_forward(key) is not None and _tagged(key, "ka")


@pytest.mark.parametrize("env,reader,field", [("FWD_K_AHEAD_ENV", "_fwd_k_ahead", "k_ahead"),
                                               ("FWD_RESCALE_TAIL_ENV", "_fwd_rescale_tail", "rescale_tail")])
def test_opt_in_switch_env(env, reader, field, monkeypatch):
    """The forward's 0 / 1 benchmark switches: off unless set, on with 1 (and in
    forward_switches, what cute_forward compiles), anything else an error naming 0 or 1."""
    from jcompilemask.kernels.cute import api
    name, read = getattr(api, env), getattr(api, reader)
    monkeypatch.delenv(name, raising=False)
    assert not read() and not api.forward_switches(128, 128, 128, 128, 2)[field]
    monkeypatch.setenv(name, "1")
    assert read() and api.forward_switches(128, 128, 128, 128, 2)[field]
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        read()


@pytest.mark.parametrize("work_list", ["0", "1"])
@pytest.mark.parametrize("case", ["causal", "document", "random3"])
def test_k_ahead_forward_is_bit_identical_on_gpu(case, work_list, monkeypatch):
    """The producer's load order changes when K / V arrive, never the arithmetic: o and lse
    equal the default order's bit for bit, with the bitmap walk and with the work list."""
    reason = sm90_gpu_reason()
    if reason:
        pytest.skip(reason)
    from jcompilemask.kernels.cute import api

    monkeypatch.setenv(api.FWD_WORK_LIST_ENV, work_list)
    _assert_switch_is_bit_identical(monkeypatch, api.FWD_K_AHEAD_ENV, _case_inputs(case, 2, 8, kv_heads=2))


@needs_cutlass
@knob
@pytest.mark.parametrize("head_dim,num_intervals,softcap", [(128, 6, None), (128, 1, None), (64, 2, 30.0),
                                                           (256, 6, None), (128, 25, None)])
def test_without_group_mask_compiles_for_sm90(head_dim, num_intervals, softcap, monkeypatch):
    """The opt-out of group_mask ($JCOMPILEMASK_CUTE_FWD_GROUP_MASK=0): a masked tile tests
    each interval per element (D 128 K 6 SASS per masked tile 875 -> 1661 instructions,
    NOTES.md); K 25 on the bit-mask path one interval at a time."""
    from jcompilemask.kernels.cute.api import compile_forward
    key = _registry_key(monkeypatch, head_dim, num_intervals, num_intervals < 6, softcap, group_mask=False)
    assert compile_forward(key) is not None and not _tagged(key, "gm")


def test_group_mask_env_and_key(monkeypatch):
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.FWD_GROUP_MASK_ENV, raising=False)
    assert api._fwd_group_mask()                                   # the default (session 18)
    monkeypatch.setenv(api.FWD_GROUP_MASK_ENV, "0")
    assert not api._fwd_group_mask()
    monkeypatch.setenv(api.FWD_GROUP_MASK_ENV, "1")
    assert api._fwd_group_mask()
    monkeypatch.setenv(api.FWD_GROUP_MASK_ENV, "on")
    with pytest.raises(ValueError, match="0 or 1"):
        api._fwd_group_mask()
    base = dict(dtype="bfloat16", head_dim=128, head_dim_v=128, block_q=128, block_kv=128,
                broadcast_batch=False, broadcast_head=True, scale=0.1)
    assert api.ForwardKey(**base, num_intervals=25, group_mask=True).target_name.endswith("_gm")


@pytest.mark.parametrize("head_dim,case,softcap", [(128, "random6", None), (128, "random3", None),
                                                   (128, "causal", None), (128, "random6", 5.0),
                                                   (64, "random6", None), (256, "random6", None),
                                                   (256, "prefix_window", None), (128, "random12", None)])
def test_group_mask_forward_is_bit_identical_on_gpu(head_dim, case, softcap, monkeypatch):
    """group_mask changes how a masked tile finds its visible keys, not which: o and lse
    equal the default's bit for bit (ragged Nq 700 / Nk 900, per-head masks, fully masked
    rows, GQA; D 256's 80-key tiles; K 12 on the bit-mask path)."""
    from jcompilemask.kernels.cute import api
    _switch_case_is_bit_identical(monkeypatch, api.FWD_GROUP_MASK_ENV, case, 3, 11, head_dim, softcap)


@needs_cutlass
@pytest.mark.parametrize("head_dim,num_intervals,softcap", [
    (128, 1, None),                                  # the causal-like default
    pytest.param(128, 6, None, marks=knob), pytest.param(64, 2, 30.0, marks=knob),
    pytest.param(256, 6, None, marks=knob), pytest.param(128, 25, None, marks=knob)])
def test_rescale_tail_compiles_for_sm90(head_dim, num_intervals, softcap, monkeypatch):
    """rescale_tail ($JCOMPILEMASK_CUTE_FWD_RESCALE_TAIL=1, issue 14): O's rescale in the tile
    loop's tail beside P's conversion (and, with the work list, the row's first tile out of
    the loop), on the registry's switches; no stack (SASS at D 128 K 1, NOTES.md "Session
    19": 493 instructions per unmasked tile with F2FP and FMUL interleaved, against 513)."""
    from jcompilemask.kernels.cute.api import compile_forward
    key = _registry_key(monkeypatch, head_dim, num_intervals, num_intervals < 6, softcap, rescale_tail=True)
    assert compile_forward(key) is not None and _tagged(key, "rt")


@pytest.mark.parametrize("head_dim,case,softcap", [(128, "causal", None), (128, "random6", None),
                                                   (128, "random6", 5.0), (64, "random3", None),
                                                   (256, "random6", None), (128, "random12", None)])
def test_rescale_tail_forward_is_bit_identical_on_gpu(head_dim, case, softcap, monkeypatch):
    """rescale_tail moves O's rescale, not its arithmetic (the same products in the same
    order): o and lse equal the default's bit for bit (ragged Nq 700 / Nk 900, per-head
    masks, fully masked rows, GQA, a soft cap, K 12 on the bit-mask path)."""
    from jcompilemask.kernels.cute import api
    _switch_case_is_bit_identical(monkeypatch, api.FWD_RESCALE_TAIL_ENV, case, 3, 11, head_dim, softcap)


@needs_cutlass
@pytest.mark.parametrize("case", ["k1", pytest.param("k6", marks=knob), pytest.param("d64_cap", marks=knob),
                                  pytest.param("k_ahead", marks=knob), pytest.param("persistent", marks=knob),
                                  pytest.param("k25", marks=knob), pytest.param("late_words", marks=knob)])
def test_work_runs_compiles_for_sm90(case, monkeypatch):
    """work_runs ($JCOMPILEMASK_CUTE_FWD_WORK_RUNS=1, issue 14 item 1): the work list as runs
    of one kind, walked with a counter; no stack (SASS at D 128 K 1, NOTES.md "Session 24":
    the full-tile loop is 491 instructions per tile, P's conversion and O's rescale inside
    it, against 513 with the per-tile list entry). With K(t + 1) before V(t), persistent
    CTAs, a soft cap at D 64, K 25 on the bit-mask path, and without runs_early (the tile
    words loaded when the runs are built: $JCOMPILEMASK_CUTE_FWD_RUNS_EARLY=0)."""
    from jcompilemask.kernels.cute.api import compile_forward
    head_dim = 64 if case == "d64_cap" else 128
    k = {"k6": 6, "k25": 25, "persistent": 2}.get(case, 1)
    key = _registry_key(monkeypatch, head_dim, k, k < 6, 30.0 if case == "d64_cap" else None,
                        work_runs=True, k_ahead=case == "k_ahead", schedule=case == "persistent",
                        persistent=case == "persistent", runs_early=case != "late_words")
    assert key.work_list and compile_forward(key) is not None and _tagged(key, "wr")
    assert key.runs_early == (case != "late_words")


def test_work_runs_env_and_key(monkeypatch):
    """On by default at D 64 / 128 (where its GPU cases ran), off at 192 / 128 unless
    $JCOMPILEMASK_CUTE_FWD_WORK_RUNS=1; =0 turns it off; only with the work list (not at
    D 256, where the list does not fit) and never with rescale_tail; the key refuses the
    others."""
    from jcompilemask.kernels.cute import api
    for name in (api.FWD_WORK_RUNS_ENV, api.FWD_WORK_LIST_ENV, api.FWD_RESCALE_TAIL_ENV):
        monkeypatch.delenv(name, raising=False)
    assert api.forward_switches(128, 128, 128, 128, 2)["work_runs"]
    assert api.forward_switches(64, 64, 128, 128, 2)["work_runs"]
    bq, bk = api.preferred_forward_tiles(192)
    st = api.preferred_forward_stages(192)
    assert api.forward_switches(192, 128, bq, bk, st)["work_list"]
    assert not api.forward_switches(192, 128, bq, bk, st)["work_runs"]
    monkeypatch.setenv(api.FWD_WORK_RUNS_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2)["work_runs"]
    monkeypatch.setenv(api.FWD_WORK_RUNS_ENV, "1")
    assert api.forward_switches(192, 128, bq, bk, st)["work_runs"]
    assert api.forward_switches(128, 128, 128, 128, 2)["work_runs"]
    assert api.forward_switches(64, 64, 128, 128, 2)["work_runs"]
    bq, bk = api.preferred_forward_tiles(256)
    sw = api.forward_switches(256, 256, bq, bk, api.preferred_forward_stages(256))
    assert not sw["work_list"] and not sw["work_runs"]
    monkeypatch.setenv(api.FWD_WORK_LIST_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2)["work_runs"]
    monkeypatch.setenv(api.FWD_WORK_LIST_ENV, "1")
    monkeypatch.setenv(api.FWD_RESCALE_TAIL_ENV, "1")
    assert not api.forward_switches(128, 128, 128, 128, 2)["work_runs"]
    monkeypatch.setenv(api.FWD_WORK_RUNS_ENV, "on")
    with pytest.raises(ValueError, match="0 or 1"):
        api.forward_switches(128, 128, 128, 128, 2)
    base = _KEY_FIELDS
    with pytest.raises(ValueError, match="work_list=True"):
        api.ForwardKey(**base, work_runs=True)
    with pytest.raises(ValueError, match="rescale_tail"):
        api.ForwardKey(**base, work_list=True, work_runs=True, rescale_tail=True)
    key = api.ForwardKey(**base, work_list=True, work_runs=True)
    assert _tagged(key, "wr") and key.list_smem == 2 * api._WORK_LIST_SMEM - 32


@needs_cutlass
@pytest.mark.parametrize("case", ["k1", pytest.param("k_ahead", marks=knob), pytest.param("persistent", marks=knob),
                                  pytest.param("d64_cap", marks=knob)])
def test_runs_early_compiles_for_sm90(case, monkeypatch):
    """runs_early ($JCOMPILEMASK_CUTE_FWD_RUNS_EARLY=1, issue 14): the producer's tile words
    loaded first thing (the kernel's first LDG, before the barriers' setup) and the runs
    built over the set bits only; with K(t + 1) before V(t), persistent CTAs (which load
    their words per unit), a soft cap at D 64."""
    from jcompilemask.kernels.cute.api import compile_forward
    head_dim = 64 if case == "d64_cap" else 128
    key = _registry_key(monkeypatch, head_dim, 1, True, 30.0 if case == "d64_cap" else None,
                        work_runs=True, runs_early=True, k_ahead=case == "k_ahead",
                        schedule=case == "persistent", persistent=case == "persistent")
    assert compile_forward(key) is not None and _tagged(key, "wr", "re")


def test_runs_early_env_and_key(monkeypatch):
    from jcompilemask.kernels.cute import api
    for name in (api.FWD_WORK_RUNS_ENV, api.FWD_RUNS_EARLY_ENV, api.FWD_WORK_LIST_ENV):
        monkeypatch.delenv(name, raising=False)
    assert api.forward_switches(128, 128, 128, 128, 2)["runs_early"]       # the default
    assert api.forward_switches(64, 64, 128, 128, 2)["runs_early"]
    assert not api.forward_switches(256, 256, 128, 80, 2)["runs_early"]   # no runs at D 256
    monkeypatch.setenv(api.FWD_RUNS_EARLY_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2)["runs_early"]
    monkeypatch.setenv(api.FWD_RUNS_EARLY_ENV, "1")
    monkeypatch.setenv(api.FWD_WORK_RUNS_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2)["runs_early"]
    base = _KEY_FIELDS
    with pytest.raises(ValueError, match="work_runs=True"):
        api.ForwardKey(**base, work_list=True, runs_early=True)


@needs_cutlass
@pytest.mark.parametrize("head_dim,num_intervals,softcap", [(128, 6, None), pytest.param(128, 2, None, marks=knob),
                                                           pytest.param(64, 3, 30.0, marks=knob)])
def test_slot_skip_compiles_for_sm90(head_dim, num_intervals, softcap, monkeypatch):
    """slot_skip ($JCOMPILEMASK_CUTE_FWD_SLOT_SKIP=1, issue 14 item 3): a masked tile builds
    a slot's runs only where the slot reaches into the tile for some row of the warp (a
    VOTE.ANY and a uniform branch per slot); no stack (SASS at D 128 K 6, NOTES.md "Session
    24": 1052 static instructions per masked tile against 946, ~70 fewer per skipped slot)."""
    from jcompilemask.kernels.cute.api import compile_forward
    key = _registry_key(monkeypatch, head_dim, num_intervals, False, softcap, slot_skip=True)
    assert compile_forward(key) is not None and _tagged(key, "ss")


@pytest.mark.parametrize("env,field", [("FWD_SLOT_SKIP_ENV", "slot_skip"), ("FWD_MASK_R2P_ENV", "mask_r2p")])
def test_masked_tile_switch_env(env, field, monkeypatch):
    from jcompilemask.kernels.cute import api
    name = getattr(api, env)
    monkeypatch.delenv(name, raising=False)
    assert api.forward_switches(128, 128, 128, 128, 2)[field]             # the default
    monkeypatch.setenv(name, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2)[field]
    monkeypatch.setenv(name, "2")
    with pytest.raises(ValueError, match="0 or 1"):
        api.forward_switches(128, 128, 128, 128, 2)


@needs_cutlass
@pytest.mark.parametrize("head_dim,num_intervals", [(128, 1), pytest.param(128, 12, marks=knob),
                                                    pytest.param(64, 6, marks=knob)])
def test_mask_r2p_compiles_for_sm90(head_dim, num_intervals, monkeypatch):
    """mask_r2p ($JCOMPILEMASK_CUTE_FWD_MASK_R2P=1): ptxas emits R2P for the masked tile's
    bit tests (D 128 K 1: 8 R2P, 698 -> 650 instructions per masked tile); K 12 takes the
    bit-mask path, whose words go through the same tests."""
    from jcompilemask.kernels.cute.api import compile_forward
    key = _registry_key(monkeypatch, head_dim, num_intervals, num_intervals == 1, mask_r2p=True)
    assert compile_forward(key) is not None and _tagged(key, "r2p")


@pytest.mark.parametrize("head_dim,case,softcap", [(128, "causal", None), (128, "random6", None),
                                                   (128, "random6", 5.0), (64, "random3", None),
                                                   (128, "random12", None), (128, "document", None)])
def test_mask_r2p_forward_is_bit_identical_on_gpu(head_dim, case, softcap, monkeypatch):
    """mask_r2p reorders independent selects: o and lse equal the default's bit for bit
    (ragged Nq 700 / Nk 900, the columns past Nk, fully masked rows, a soft cap, D 64, K 12
    on the bit-mask path)."""
    from jcompilemask.kernels.cute import api
    _switch_case_is_bit_identical(monkeypatch, api.FWD_MASK_R2P_ENV, case, 9, 19, head_dim, softcap)


@pytest.mark.parametrize("head_dim,case,softcap", [(128, "random6", None), (128, "random3", None),
                                                   (128, "prefix_window", None), (128, "random6", 5.0),
                                                   (64, "random6", None), (128, "random12", None)])
def test_slot_skip_forward_is_bit_identical_on_gpu(head_dim, case, softcap, monkeypatch):
    """slot_skip leaves out only runs that are empty: o and lse equal the default's bit for
    bit (ragged Nq 700 / Nk 900, per-head masks, fully masked rows, GQA, a soft cap, D 64;
    K 12 takes the bit-mask path, where the switch does nothing)."""
    from jcompilemask.kernels.cute import api
    _switch_case_is_bit_identical(monkeypatch, api.FWD_SLOT_SKIP_ENV, case, 7, 17, head_dim, softcap)


@pytest.mark.parametrize("case,shape,extra", [
    ("causal", None, None), ("document", None, None), ("prefix_window", None, None),
    ("random6", None, None), ("random12", None, None),
    ("random6", (256, 70000), None),                   # two list chunks
    ("random3", None, "JCOMPILEMASK_CUTE_FWD_K_AHEAD"),
    ("document", None, "JCOMPILEMASK_CUTE_FWD_SCHEDULE=persistent")])
def test_runs_early_forward_is_bit_identical_on_gpu(case, shape, extra, monkeypatch):
    """runs_early builds the same runs earlier: o and lse equal work_runs' bit for bit."""
    from jcompilemask.kernels.cute import api
    _switch_case_is_bit_identical(monkeypatch, api.FWD_RUNS_EARLY_ENV, case, 5, 13, shape=shape,
                                  extra=(api.FWD_WORK_LIST_ENV, api.FWD_WORK_RUNS_ENV) + ((extra,) if extra else ()))


@pytest.mark.parametrize("head_dim,case,softcap,shape,extra", [
    (128, "causal", None, None, None), (128, "document", None, None, None),
    (128, "prefix_window", None, None, None), (128, "random6", None, None, None),
    (128, "random6", 5.0, None, None), (64, "random3", None, None, None),
    (128, "random12", None, None, None),
    (128, "random6", None, (256, 70000), None),         # 547 key tiles: two list chunks
    (128, "random3", None, None, "JCOMPILEMASK_CUTE_FWD_K_AHEAD"),
    (128, "document", None, None, "JCOMPILEMASK_CUTE_FWD_SCHEDULE=persistent")])
def test_work_runs_forward_is_bit_identical_on_gpu(head_dim, case, softcap, shape, extra, monkeypatch):
    """work_runs changes how both sides walk the visited tiles, not which or in what order:
    o and lse equal the per-tile work list's bit for bit (ragged Nq 700 / Nk 900, so a ragged
    last tile inside a full run; per-head masks, fully masked rows, GQA, a soft cap, K 12 on
    the bit-mask path, two list chunks, K(t + 1) before V(t), persistent CTAs)."""
    from jcompilemask.kernels.cute import api
    _switch_case_is_bit_identical(monkeypatch, api.FWD_WORK_RUNS_ENV, case, 3, 11, head_dim, softcap,
                                  shape=shape, extra=(api.FWD_WORK_LIST_ENV,) + ((extra,) if extra else ()))


def test_rescale_early_env_and_key(monkeypatch):
    """Off unless $JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY=1; never with rescale_tail (the key
    refuses the pair)."""
    from jcompilemask.kernels.cute import api
    for name in (api.FWD_RESCALE_EARLY_ENV, api.FWD_RESCALE_TAIL_ENV):
        monkeypatch.delenv(name, raising=False)
    assert not api.forward_switches(128, 128, 128, 128, 2)["rescale_early"]
    monkeypatch.setenv(api.FWD_RESCALE_EARLY_ENV, "1")
    assert api.forward_switches(128, 128, 128, 128, 2)["rescale_early"]
    monkeypatch.setenv(api.FWD_RESCALE_TAIL_ENV, "1")
    assert not api.forward_switches(128, 128, 128, 128, 2)["rescale_early"]
    base = _KEY_FIELDS
    with pytest.raises(ValueError, match="rescale_early"):
        api.ForwardKey(**base, rescale_tail=True, rescale_early=True)


@pytest.mark.parametrize("head_dim,case,softcap,shape,extra", [
    (128, "causal", None, None, None), (128, "document", None, None, None),
    (128, "prefix_window", None, None, None), (128, "random6", 5.0, None, None),
    (64, "random3", None, None, None), (256, "random6", None, None, None),
    (128, "random12", None, None, None),
    (128, "random6", None, (256, 70000), None),         # two list chunks
    (128, "document", None, None, "JCOMPILEMASK_CUTE_FWD_SCHEDULE=persistent")])
def test_rescale_early_forward_is_bit_identical_on_gpu(head_dim, case, softcap, shape, extra, monkeypatch):
    """rescale_early moves O's rescale, not its arithmetic (the same multiplies and
    accumulations on O in the same order; factor 1 on the still-zero O before the first
    P V): o and lse equal the default's bit for bit (ragged Nq 700 / Nk 900, per-head masks,
    fully masked rows, GQA, a soft cap, D 64 / 256, K 12 on the bit-mask path, two list
    chunks, persistent CTAs)."""
    from jcompilemask.kernels.cute import api
    _switch_case_is_bit_identical(monkeypatch, api.FWD_RESCALE_EARLY_ENV, case, 25, 27, head_dim, softcap,
                                  shape=shape, extra=(extra,) if extra else ())


@needs_cutlass
@pytest.mark.parametrize("field,tag", [("rescale_early", "rse"), ("operands_early", "oe")])
@pytest.mark.parametrize("case", ["k1", pytest.param("k6_d64_cap", marks=knob), pytest.param("k25", marks=knob),
                                  pytest.param("d256", marks=knob), pytest.param("persistent", marks=knob)])
def test_early_switches_compile_for_sm90(field, tag, case, monkeypatch):
    """rescale_early ($JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY=1, issue 14): O's rescale by the
    last step's row factors between the S GEMM issue and the P V issue (SASS, D 128 K 1: the
    unmasked step's 64 FMULs before its P V HGMMAs, only P's conversion after the P V wait).
    operands_early ($JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY=1): a step's GEMM operand slices
    taken before its K wait and the scheduler barrier (14-15 -> 9-11 instructions from the
    barrier to the first S HGMMA). Both 168 registers, no stack. D 64 with K 6 and a soft
    cap, K 25 on the bit-mask path, D 256 (no runs; with rescale_early), persistent CTAs."""
    from jcompilemask.kernels.cute.api import compile_forward
    head_dim = {"k6_d64_cap": 64, "d256": 256}.get(case, 128)
    k = {"k6_d64_cap": 6, "k25": 25}.get(case, 1)
    changes = {field: True, **({"rescale_early": True} if case == "d256" else {}),
               **(dict(schedule=True, persistent=True) if case == "persistent" else {})}
    key = _registry_key(monkeypatch, head_dim, k, k == 1, 30.0 if case == "k6_d64_cap" else None, **changes)
    assert compile_forward(key) is not None and _tagged(key, tag)


def test_operands_early_env(monkeypatch):
    """operands_early: the default at D 128 (timed there), off at D 64 unless asked for;
    $JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY=0 turns it off."""
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.FWD_OPERANDS_EARLY_ENV, raising=False)
    assert api.forward_switches(128, 128, 128, 128, 2)["operands_early"]
    assert not api.forward_switches(64, 64, 128, 128, 2)["operands_early"]
    monkeypatch.setenv(api.FWD_OPERANDS_EARLY_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2)["operands_early"]
    monkeypatch.setenv(api.FWD_OPERANDS_EARLY_ENV, "1")
    assert api.forward_switches(64, 64, 128, 128, 2)["operands_early"]


@pytest.mark.parametrize("head_dim,case,softcap,extra", [
    (128, "causal", None, None), (128, "document", None, None), (128, "random6", 5.0, None),
    (64, "random3", None, None), (128, "random12", None, None),
    (128, "causal", None, "JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY"),     # with it: as rescale_early alone
    (128, "document", None, "JCOMPILEMASK_CUTE_FWD_SCHEDULE=persistent")])
def test_operands_early_forward_is_bit_identical_on_gpu(head_dim, case, softcap, extra, monkeypatch):
    """operands_early changes where the GEMM operands are sliced, not the GEMMs: o and lse
    equal the default's bit for bit (with rescale_early set for both runs: equal to
    rescale_early alone, itself checked against the default)."""
    from jcompilemask.kernels.cute import api
    _switch_case_is_bit_identical(monkeypatch, api.FWD_OPERANDS_EARLY_ENV, case, 29, 31, head_dim, softcap,
                                  extra=(extra,) if extra else ())


@needs_cutlass
@pytest.mark.parametrize("case", ["k1", pytest.param("k1_oe", marks=knob), pytest.param("k6_d64_cap", marks=knob),
                                  pytest.param("k25", marks=knob), pytest.param("persistent", marks=knob),
                                  pytest.param("k2", marks=knob)])
def test_p_double_compiles_for_sm90(case, monkeypatch):
    """p_double ($JCOMPILEMASK_CUTE_FWD_P_DOUBLE=1, issue 14): P in two register tensors by
    step parity, so P's conversion does not wait for the previous P V; each step kind is
    compiled once per parity. SASS, D 128 K 1: 168 registers, 0 B of stack; the P V wait
    comes after 15 of the step's 64 exp2s (one P: after 0; FA4: 10)."""
    from jcompilemask.kernels.cute.api import compile_forward
    head_dim = 64 if case == "k6_d64_cap" else 128
    k = {"k6_d64_cap": 6, "k25": 25, "k2": 2}.get(case, 1)
    changes = {"p_double": True, **({"operands_early": True} if case == "k1_oe" else {}),
               **(dict(schedule=True, persistent=True) if case == "persistent" else {})}
    key = _registry_key(monkeypatch, head_dim, k, k == 1, 30.0 if case == "k6_d64_cap" else None,
                        **changes)
    assert compile_forward(key) is not None and _tagged(key, "pd")


def test_p_double_env(monkeypatch):
    """p_double: the default at D 128 (timed there); $JCOMPILEMASK_CUTE_FWD_P_DOUBLE=1 turns it
    on at D 64 too and 0 off; only where the forward walks work runs, never beside the
    rescale knobs or at D 256."""
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.FWD_P_DOUBLE_ENV, raising=False)
    monkeypatch.delenv(api.FWD_RESCALE_EARLY_ENV, raising=False)
    assert api.forward_switches(128, 128, 128, 128, 2)["p_double"]
    assert not api.forward_switches(64, 64, 128, 128, 2)["p_double"]
    monkeypatch.setenv(api.FWD_P_DOUBLE_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2)["p_double"]
    monkeypatch.setenv(api.FWD_P_DOUBLE_ENV, "1")
    assert api.forward_switches(128, 128, 128, 128, 2)["p_double"]
    assert api.forward_switches(64, 64, 128, 128, 2)["p_double"]
    bq, bk = api.preferred_forward_tiles(256)
    assert not api.forward_switches(256, 256, bq, bk, api.preferred_forward_stages(256))["p_double"]
    monkeypatch.setenv(api.FWD_RESCALE_EARLY_ENV, "1")
    assert not api.forward_switches(128, 128, 128, 128, 2)["p_double"]


@pytest.mark.parametrize("head_dim,case,softcap,extra", [
    (128, "causal", None, None), (128, "document", None, None), (128, "random6", 5.0, None),
    (64, "random3", None, None), (128, "random12", None, None),
    (128, "causal", None, "JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY"),     # with it: as operands_early alone
    (128, "document", None, "JCOMPILEMASK_CUTE_FWD_SCHEDULE=persistent")])
def test_p_double_forward_is_bit_identical_on_gpu(head_dim, case, softcap, extra, monkeypatch):
    """p_double changes which registers hold P, not a product or its order: o and lse equal
    the default's bit for bit (odd and even run lengths, masked runs, persistent units)."""
    from jcompilemask.kernels.cute import api
    _switch_case_is_bit_identical(monkeypatch, api.FWD_P_DOUBLE_ENV, case, 33, 35, head_dim, softcap,
                                  extra=(extra,) if extra else ())


def _dilated_window_key(case, **fields):
    """A ForwardKey for the dilated window (window 128, dilation 2) or, "mixed", 16 global
    keys | that window (slots with and without a predicate), with ``fields``."""
    import jcompilemask as jcm
    from jcompilemask.kernels.cute.api import ForwardKey, preferred_forward_stages, preferred_forward_tiles
    from jcompilemask.lower.residual_program import ResidualProgram
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    window = (k <= q) & (k > q - 128) & ((q - k) % 2 == 0)
    spec = MaskSpec([Region((0, q_len), window if case == "dilated_window" else (k < 16) | window)])
    cm = jcm.compile(spec, warn=False)
    bq, bk = preferred_forward_tiles(128)
    return ForwardKey("bfloat16", 128, 128, cm.num_intervals, bq, bk, True, True, 128**-0.5,
                      num_stages=preferred_forward_stages(128), residual=ResidualProgram.forward(cm),
                      work_list=True, residual_words=True, **fields)


@needs_cutlass
@pytest.mark.parametrize("case", ["dilated_window", pytest.param("mixed", marks=knob)])
@pytest.mark.parametrize("fields,suffix", [
    ({}, "_rw"), ({"work_runs": True, "residual_periodic": True}, "_rp")], ids=["words", "periodic"])
def test_residual_word_paths_compile_for_sm90(case, fields, suffix):
    """residual_words ($JCOMPILEMASK_CUTE_FWD_RESIDUAL_WORDS=1, issue 16): a residual mask's
    masked tile from column-group words; no stack. The dilated window (K 1, D 128): 815 /
    704 instructions per masked step against 1246 / 1108 (NOTES.md, session 21).
    residual_periodic ($JCOMPILEMASK_CUTE_FWD_RESIDUAL_PERIODIC=1): a slot whose predicate
    is proved 8-periodic in k is evaluated once per row and column class: 896 -> 730 SASS
    instructions per masked tile (NOTES.md, session 24)."""
    from jcompilemask.kernels.cute.api import compile_forward
    key = _dilated_window_key(case, **fields)
    assert compile_forward(key) is not None and _tagged(key, suffix[1:])


@needs_cutlass
@pytest.mark.parametrize("case", ["dilated_window", pytest.param("mixed", marks=knob)])
def test_residual_regs_compiles_for_sm90(case):
    """residual_regs ($JCOMPILEMASK_CUTE_FWD_RESIDUAL_REGS=1, issue 16, session 35): the row
    intervals and regions of a residual mask in registers (K <= 2) on the default residual
    path (words, runs, periodic slots); no stack (the compile test's remarks)."""
    from jcompilemask.kernels.cute.api import compile_forward
    key = _dilated_window_key(case, work_runs=True, residual_periodic=True, residual_regs=True)
    assert compile_forward(key) is not None and _tagged(key, "rr")


def test_residual_regs_env_and_key(monkeypatch):
    """On by default (session 36) for residual masks on the words path, 0 opts out; never
    without a residual program; a key refuses it without residual_words."""
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.FWD_RESIDUAL_REGS_ENV, raising=False)
    monkeypatch.delenv(api.FWD_RESIDUAL_WORDS_ENV, raising=False)
    assert api.forward_switches(128, 128, 128, 128, 2, residual=object())["residual_regs"]
    assert not api.forward_switches(128, 128, 128, 128, 2)["residual_regs"]
    assert not api.forward_switches(64, 64, 128, 128, 2, residual=object())["residual_regs"]
    monkeypatch.setenv(api.FWD_RESIDUAL_REGS_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2, residual=object())["residual_regs"]
    with pytest.raises(ValueError, match="residual_words=True"):
        api.ForwardKey(**_KEY_FIELDS, residual_regs=True)


def test_residual_periodic_env_and_key(monkeypatch):
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.FWD_RESIDUAL_PERIODIC_ENV, raising=False)
    monkeypatch.delenv(api.FWD_RESIDUAL_WORDS_ENV, raising=False)
    assert api.forward_switches(128, 128, 128, 128, 2, residual=object())["residual_periodic"]
    assert not api.forward_switches(128, 128, 128, 128, 2)["residual_periodic"]
    monkeypatch.setenv(api.FWD_RESIDUAL_PERIODIC_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2, residual=object())["residual_periodic"]
    monkeypatch.setenv(api.FWD_RESIDUAL_PERIODIC_ENV, "1")
    monkeypatch.setenv(api.FWD_RESIDUAL_WORDS_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2, residual=object())["residual_periodic"]
    base = _KEY_FIELDS
    with pytest.raises(ValueError, match="residual_words=True"):
        api.ForwardKey(**base, residual_periodic=True)


def test_residual_words_env_and_key(monkeypatch):
    """Unset: on for residual masks at D 128 (the head dim it was timed at), off elsewhere;
    =0 / =1 force it; never without a residual program."""
    from jcompilemask.kernels.cute import api
    monkeypatch.delenv(api.FWD_RESIDUAL_WORDS_ENV, raising=False)
    assert api._fwd_residual_words() and not api._fwd_residual_words(64)
    assert api.forward_switches(128, 128, 128, 128, 2, residual=object())["residual_words"]
    assert not api.forward_switches(64, 64, 128, 128, 2, residual=object())["residual_words"]
    monkeypatch.setenv(api.FWD_RESIDUAL_WORDS_ENV, "0")
    assert not api.forward_switches(128, 128, 128, 128, 2, residual=object())["residual_words"]
    monkeypatch.setenv(api.FWD_RESIDUAL_WORDS_ENV, "1")
    assert api.forward_switches(128, 128, 128, 128, 2, residual=object())["residual_words"]
    assert api.forward_switches(64, 64, 128, 128, 2, residual=object())["residual_words"]
    assert not api.forward_switches(128, 128, 128, 128, 2)["residual_words"]
    with pytest.raises(ValueError, match="residual_words"):
        api.ForwardKey("bfloat16", 128, 128, 1, 128, 128, True, True, 0.1, residual_words=True)
