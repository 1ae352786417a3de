"""Lowering and the Execution Descriptor (issue 3).

For every built-in mask, ``from_dense`` masks and hypothesis-generated MaskSpecs on
random metadata: both dense views of the descriptor equal ``spec.as_dense``, and every
tile state is exactly right (empty: no visible in-range element; full: no masked in-range
element) at several tile shapes, ragged last tiles and different forward / backward
tiles included. The packed tile words are decoded here independently, from the layout
written in ``lower/descriptor.py``. Also: the interval counts K of the built-ins,
``explain()``, and that instantiation inside ``jit`` traces once.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import jcompilemask as jcm
from jcompilemask.spec import (FALSE, TRUE, MaskSpec, Region, Scalar, SegmentIds, Vector,
                               h, k, kv_len, maximum, minimum, q, q_len)
from jcompilemask.spec.expr import Const
from strategies import BUILTINS, builtin_case, segment_ids

M = jcm.masks

# ((block_q, block_kv), (bwd_block_q, bwd_block_kv)): 1-wide tiles, tiles that do not
# divide the sizes (ragged last tiles), a tile larger than the whole mask, different
# forward and backward shapes. A short fixed list: every new shape is an XLA compilation.
TILE_CONFIGS = [((4, 4), (2, 4)), ((3, 5), (5, 3)), ((1, 1), (16, 16)), ((8, 8), (8, 8)),
                ((32, 8), (2, 3))]
tiles_st = st.sampled_from(TILE_CONFIGS)


def _tile_kwargs(tiles):
    (bq, bk), (bbq, bbk) = tiles
    return dict(block_q=bq, block_kv=bk, bwd_block_q=bbq, bwd_block_kv=bbk)


@functools.lru_cache(maxsize=None)
def jitted_instantiate(cm, nq, nk, tiles):
    """One jitted preprocess per (mask, sizes, tiles): hypothesis examples that share
    them (different metadata values) reuse the compilation."""
    return jax.jit(lambda m: cm.instantiate(m, nq, nk, **_tile_kwargs(tiles)))


# =======================================================================================
# Checkers
# =======================================================================================
def expected_states(dense: np.ndarray, bq: int, bk: int) -> np.ndarray:
    """uint8 [B, Hm, Tq, Tk]: bit 0 = some in-range element visible, bit 1 = some
    in-range element masked (elements past q_len / kv_len do not count)."""
    b, hm, nq, nk = dense.shape
    tq, tk = -(-nq // bq), -(-nk // bk)
    vis = np.zeros((b, hm, tq * bq, tk * bk), bool)
    inside = np.zeros((tq * bq, tk * bk), bool)
    vis[:, :, :nq, :nk] = dense
    inside[:nq, :nk] = True
    vis = vis.reshape(b, hm, tq, bq, tk, bk)
    inside = inside.reshape(tq, bq, tk, bk)
    any_vis = vis.any(axis=(3, 5))
    any_mask = (inside[None, None] & ~vis).any(axis=(3, 5))
    return (any_vis * 1 + any_mask * 2).astype(np.uint8)


def decode_fwd(words: np.ndarray, tk: int) -> np.ndarray:
    """Documented forward packing: tile (ti, tj) at word [ti, tj // 16], bits 2*(tj % 16)."""
    tj = np.arange(tk)
    return ((words[..., tj // 16] >> (2 * (tj % 16)).astype(np.uint32)) & 3).astype(np.uint8)


def decode_bwd(words: np.ndarray, tq: int) -> np.ndarray:
    """Documented backward packing: tile (ti, tj) at word [tj, ti // 16], bits
    2*(ti % 16); returned row-major [.., Tq, Tk]."""
    ti = np.arange(tq)
    col_major = (words[..., ti // 16] >> (2 * (ti % 16)).astype(np.uint32)) & 3
    return np.swapaxes(col_major, -1, -2).astype(np.uint8)


def _views(desc):
    return ({v: desc.as_dense(v) for v in ("fwd", "bwd")},
            {v: desc.tile_states(v) for v in ("fwd", "bwd")})


# (treedef, leaf avals) -> compiled program; HLO text -> compiled program.
_VIEWS_BY_TREE: dict = {}
_VIEWS_BY_HLO: dict = {}


def _dense_views(desc):
    """Both dense views and both passes' decoded tile states of a descriptor, as one
    compiled program: evaluated eagerly each op compiles on its own, ~5x the time (the
    descriptor fuzz stage spent a fifth of its time there).

    The program is a function of the descriptor's arrays; the descriptor's static data
    (its mask among them) is closed over. A plain ``jax.jit`` caches per mask, but masks
    without residual predicates give the same program at the same shapes (half of this
    file's compilations of it were repeats): a program is compiled once per distinct
    lowered text and reused for every descriptor that lowers to it."""
    leaves, treedef = jax.tree_util.tree_flatten(desc)
    key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
    exe = _VIEWS_BY_TREE.get(key)
    if exe is None:
        # keep_unused: every leaf a parameter, in order, so equal text is an equal
        # signature as well as an equal computation
        lowered = jax.jit(lambda xs: _views(jax.tree_util.tree_unflatten(treedef, xs)),
                          keep_unused=True).lower(leaves)
        text = lowered.as_text()
        exe = _VIEWS_BY_HLO.get(text)
        if exe is None:
            exe = _VIEWS_BY_HLO[text] = lowered.compile()
        _VIEWS_BY_TREE[key] = exe
    return exe(leaves)


@pytest.fixture(autouse=True, scope="module")
def _release_views():
    """Drop the compiled dense-view programs with this module (they hold executables;
    tests/compiled_programs.py bounds the process's)."""
    yield
    _VIEWS_BY_TREE.clear()
    _VIEWS_BY_HLO.clear()


def check_descriptor(desc, want: np.ndarray, nq: int, nk: int, expect_column_view=None):
    """Both dense views == ``want`` [B, Hm, nq, nk]; every tile state exact; layout."""
    want = np.asarray(want)
    b, hm = want.shape[:2]
    t = desc.tiles
    # -- shapes and dtypes of the documented fields ------------------------------------
    kk, kc = desc.num_intervals, desc.num_bwd_intervals
    assert desc.fwd_intervals.shape == (b, hm, nq, kk, 2)
    assert desc.fwd_intervals.dtype == jnp.int32
    assert desc.bwd_intervals.shape == (b, hm, nk, kc, 2)
    assert desc.bwd_intervals.dtype == jnp.int32
    tq, tk = -(-nq // t.block_q), -(-nk // t.block_kv)
    btq, btk = -(-nq // t.bwd_block_q), -(-nk // t.bwd_block_kv)
    assert desc.fwd_tiles.shape == (b, hm, tq, -(-tk // 16))
    assert desc.bwd_tiles.shape == (b, hm, btk, -(-btq // 16))
    assert desc.fwd_tiles.dtype == jnp.uint32 and desc.bwd_tiles.dtype == jnp.uint32
    assert desc.row_region.shape == (b, nq) and desc.bwd_exact.shape == (b,)
    # -- interval invariants ---------------------------------------------------------------
    fwd = np.asarray(desc.fwd_intervals)
    assert (fwd[..., 0] >= 0).all() and (fwd[..., 1] >= 0).all()
    assert (fwd[..., 0] + fwd[..., 1] <= nk).all()
    assert (fwd[..., 0][fwd[..., 1] == 0] == 0).all(), "unused slots are (0, 0)"
    bwd = np.asarray(desc.bwd_intervals)
    assert (bwd[..., 0] >= 0).all() and (bwd[..., 1] >= 0).all()
    assert (bwd[..., 0] + bwd[..., 1] <= nq).all()
    assert (bwd[..., 0][bwd[..., 1] == 0] == 0).all()
    # -- dense views ---------------------------------------------------------------------
    dense, states = _dense_views(desc)
    for view in ("fwd", "bwd"):
        got = np.asarray(dense[view])
        assert got.shape == want.shape, view
        np.testing.assert_array_equal(got, want, err_msg=f"{view} view")
    if expect_column_view:
        assert kc > 0 and np.asarray(desc.bwd_exact).all(), "column view not used"
        # the column view alone (not the row-interval fallback) reproduces the mask
        rows = np.arange(nq)
        d = (rows[None, None, :, None, None] - bwd[:, :, None, :, :, 0]).astype(np.uint32)
        col_vis = (d < bwd[:, :, None, :, :, 1].astype(np.uint32)).any(-1)   # [B,Hm,Nq,Nk]
        np.testing.assert_array_equal(col_vis, want, err_msg="column intervals")
    # -- tile states, decoded independently and through the descriptor's decoder --------
    for view, (bq, bk), words, decode, n in (
            ("fwd", (t.block_q, t.block_kv), desc.fwd_tiles, decode_fwd, tk),
            ("bwd", (t.bwd_block_q, t.bwd_block_kv), desc.bwd_tiles, decode_bwd, btq)):
        exp = expected_states(want, bq, bk)
        mine = decode(np.asarray(words), n)
        np.testing.assert_array_equal(np.asarray(states[view]), mine)
        if getattr(desc.mask, "residual_regions", ()):
            check_safe_states(mine, exp, f"{view} tile states {bq}x{bk}")
        else:
            np.testing.assert_array_equal(mine, exp, err_msg=f"{view} tile states {bq}x{bk}")


def check_safe_states(got: np.ndarray, exact: np.ndarray, what: str):
    """Tile states of a mask with residual predicates: EMPTY and FULL are exact claims
    (a tile marked empty has no visible element, one marked full no masked one); a tile
    the hulls touch but a residual may cut is PARTIAL (lower/descriptor.py)."""
    EMPTY, FULL, PARTIAL = 2, 1, 3
    assert np.isin(got, (EMPTY, FULL, PARTIAL)).all(), what
    bad = ((got == EMPTY) & (exact != EMPTY)) | ((got == FULL) & (exact != FULL))
    assert not bad.any(), f"{what}: unsafe state at {np.argwhere(bad)[:5].tolist()}"


def _expect_column_view(name, md):
    """Built-ins whose row ranges are contiguous for these values use the column view."""
    if name == "shared_prompt":
        s = np.asarray(md["response_starts"])
        p = np.asarray(md["prompt_len"])
        return bool((np.diff(s, axis=1) >= 0).all() and (s[:, 0] >= p).all())
    return True


# =======================================================================================
# Built-in masks
# =======================================================================================
# (sizes, tiles) drawn together: eager preprocessing compiles each op once per shape, so
# three layouts keep the suite fast while covering square and rectangular masks (both
# ways), ragged last tiles in both passes, 1x1 tiles, tiles that divide the sizes and
# tiles larger than the whole mask, with forward and backward shapes always different.
LAYOUTS = [((13, 13), ((4, 4), (2, 4))), ((7, 11), ((1, 1), (5, 3))),
           ((12, 5), ((3, 5), (32, 8)))]


@pytest.mark.parametrize("builtin", BUILTINS)
@given(data=st.data())
def test_builtin_descriptor_matches_oracle(builtin, data):
    size, tiles = data.draw(st.sampled_from(LAYOUTS))
    name, params, spec, md, nq, nk = data.draw(
        builtin_case([builtin], sizes=[size], batch=(2, 2)))
    cm = jcm.compile(spec)
    desc = cm.instantiate(md, nq, nk, **_tile_kwargs(tiles))
    want = spec.as_dense(md, nq, nk)
    check_descriptor(desc, want, nq, nk,
                     expect_column_view=_expect_column_view(name, md))


@pytest.mark.parametrize("builtin,params", [
    ("hstu", None), ("shared_prompt", {"num_responses": 3}),
    ("clear", {"width": 3, "radius": 2}), ("document", None), ("prefix_lm", None)])
@given(data=st.data())
def test_builtin_descriptor_under_jit(builtin, params, data):
    """Traced metadata (the normal use): same tables as the oracle, one compilation."""
    name, params, spec, md, nq, nk = data.draw(
        builtin_case([builtin], sizes=[(13, 13)], params=params, batch=(2, 2)))
    tiles = data.draw(st.sampled_from(TILE_CONFIGS[:2]))
    cm = jcm.compile(spec)
    md = {key: jnp.asarray(v) for key, v in md.items()}
    desc = jitted_instantiate(cm, nq, nk, tiles)(md)
    check_descriptor(desc, spec.as_dense(md, nq, nk), nq, nk,
                     expect_column_view=_expect_column_view(name, md))


@functools.lru_cache(maxsize=None)
def _count_le_programs(n):
    """count_le_sorted at ``n`` keys, unbatched and vmapped, each jitted once per ``n``
    (and compiled once per input length): the 80 examples below draw only ~22 distinct
    (length, n) pairs, and a fresh ``jax.jit`` per example (or eager dispatch, every op
    compiled on its own) recompiled each."""
    from jcompilemask.lower.preprocess import count_le_sorted
    return (jax.jit(lambda x: count_le_sorted(x, n)),
            jax.jit(jax.vmap(lambda x: count_le_sorted(x, n))))


@settings(max_examples=80, deadline=None)
@given(v=st.lists(st.integers(-4, 24), min_size=1, max_size=30), n=st.integers(1, 20))
def test_count_le_sorted_matches_a_count(v, n):
    """The column view's per-key row count (one scatter with distinct runs, no histogram)
    equals a brute count on every non-decreasing input, endpoints out of range included."""
    single, batched = _count_le_programs(n)
    v = np.sort(np.asarray(v, np.int32))
    want = [int(np.sum(v <= j)) for j in range(n)]
    assert np.asarray(single(jnp.asarray(v))).tolist() == want
    got = batched(jnp.asarray(np.stack([v, v])))
    assert np.asarray(got).tolist() == [want, want]


def _num_intervals(spec):
    return jcm.compile(spec).num_intervals


def test_interval_counts():
    assert _num_intervals(M.causal()) == 1
    assert _num_intervals(M.full()) == 1
    assert _num_intervals(M.sliding_window(128, 0)) == 1
    assert _num_intervals(M.sliding_window(3, 5)) == 1
    assert _num_intervals(M.chunked_causal(64)) == 1
    assert _num_intervals(M.prefix_lm()) <= 2
    assert _num_intervals(M.document()) == 1
    assert _num_intervals(M.document(causal=False)) == 1
    assert _num_intervals(M.hstu()) <= 2
    for r in (1, 2, 6):
        assert _num_intervals(M.shared_prompt(r)) <= 2
    for w in (1, 3, 16, 181, 256):
        assert _num_intervals(M.clear(w, 2)) <= 6
    assert _num_intervals(M.clear(8, 1)) <= 4
    for cm in map(jcm.compile, (M.causal(), M.hstu(), M.shared_prompt(6), M.clear(64),
                                M.document(), M.prefix_lm(), M.chunked_causal(8))):
        assert cm.has_column_view and cm.num_bwd_intervals > 0, cm.explain()
        assert not cm.fallback_regions


def test_explain_lists_intervals():
    text = jcm.compile(M.hstu()).explain()
    assert "K = 2" in text
    assert "region 2 'targets'" in text
    assert "history_end + (q - history_end) // group_size * group_size" in text
    assert "column view: derived" in text


def test_explain_mentions_fallback_reasons():
    a = Scalar("a", max=q_len)
    spec = MaskSpec([Region((0, a), k * k <= q, name="square"),
                     Region((a, q_len), (k % 3 == q % 3) & (k <= q), name="stride")])
    cm = jcm.compile(spec, warn=False)
    text = cm.explain()
    assert cm.fallback_regions == cm.residual_regions == (0, 1)
    assert "residual predicate: k * k <= q" in text
    assert "residual predicate: k % 3 == q % 3" in text
    assert text.count("backend: cute on an SM90 GPU (hull intervals, the residual predicate") == 2
    assert cm.regions[0].residual_reason.startswith("atom `k * k <= q` is not an interval")
    # a lowered rule whose lower bound decreases in q: intervals, but no column view
    cm2 = jcm.compile(MaskSpec([Region((0, q_len), (k + q >= a) & (k <= q))]))
    assert not cm2.fallback_regions and not cm2.has_column_view
    assert "no column view" in cm2.explain() and "column view: none" in cm2.explain()


# =======================================================================================
# Hypothesis-generated MaskSpecs
# =======================================================================================
A = Scalar("a", max=q_len)
B = Scalar("b", max=q_len)
C = Scalar("c", min=1, max=q_len)
V = Vector("v", 2, max=q_len)
SEG = SegmentIds("seg")
CSEG = SegmentIds("cseg", contiguous=True)     # each id one run (issue 16)

# Atoms linear in k, with bounds over q and metadata (some monotone, some not).
K_ATOMS = [
    lambda c: k <= q + c,
    lambda c: k >= q - c,
    lambda c: k < q - c,
    lambda c: k > q + c,
    lambda c: k < A + c,
    lambda c: k >= A - c,
    lambda c: k < kv_len - c,
    lambda c: k >= SEG.start(q),
    lambda c: k < SEG.end(q),
    lambda c: k >= q // (c + 1) * (c + 1),
    lambda c: k >= (q - A) // C * C + A,
    lambda c: 2 * k <= q + c,
    lambda c: k * 3 > q - c,
    lambda c: k >= maximum(q - c, B),
    lambda c: k < minimum(q + c + 1, V[0]),
    lambda c: k + q >= A + c,            # lower bound decreasing in q: no column view
    lambda c: k - A <= q // 2,
    lambda c: k == q - c,
    lambda c: k != q - c,
    lambda c: k >= q % (c + 2),          # % in a bound: lowered, monotonicity unknown
    lambda c: k < c,
    lambda c: (2 * k + 2) // 2 <= q + c,      # linear in k only after sympy simplifies
    lambda c: maximum(k, 0 - 1) < A,          # max(k, -1) is k: k is non-negative
    lambda c: k // (c + 1) <= q // (c + 1),   # k // c atoms solve exactly (issue 16)
    lambda c: k // C >= q // C - 1,
    lambda c: CSEG.id(k) == CSEG.id(q),       # the run of q's id (contiguous ids)
    lambda c: CSEG.id(k) != CSEG.id(q - c),
    lambda c: k < CSEG.start(q) + V[CSEG.id(q)],   # a per-segment vector entry
]
# Row conditions (no k).
ROW_ATOMS = [
    lambda c: q >= A,
    lambda c: q < B + c,
    lambda c: A > c,
    lambda c: q % 2 == 0,
    lambda c: q * 2 >= B,
    lambda c: V[1] <= q,
    lambda c: q == V[0],                      # a special row: keeps the column view
    lambda c: q == A + c,
]
# k inside a non-linear function: the region keeps a residual predicate (k // 3 == q // 3
# lowers exactly since issue 16, and stays here as the block spelling next to residuals).
NONLINEAR_ATOMS = [
    lambda c: k // 3 == q // 3,
    lambda c: (q - k) % 2 == 0,
    lambda c: k % C != c % 2,
    lambda c: k * k <= q,
    lambda c: SEG.id(k) == SEG.id(q),
    lambda c: k % 4 == c % 4,
    lambda c: minimum(k, q) >= c,
]
HEAD_ATOMS = [lambda c: k <= q + h, lambda c: k >= q - 2 * h - c]

BOUNDS = [0, 3, q_len, q_len - 3, A, B, A + 2, V[0], V[1], minimum(A, B), maximum(A, B)]


@st.composite
def atoms(draw, nonlinear: bool, heads: bool):
    pools = [K_ATOMS, K_ATOMS, ROW_ATOMS]
    if nonlinear:
        pools.append(NONLINEAR_ATOMS)
    if heads:
        pools.append(HEAD_ATOMS)
    pool = draw(st.sampled_from(pools))
    return draw(st.sampled_from(pool))(draw(st.integers(0, 3)))


@st.composite
def rules(draw, nonlinear: bool, heads: bool, depth: int = 2):
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        if draw(st.integers(0, 15)) == 0:
            return draw(st.sampled_from([TRUE, FALSE]))
        return draw(atoms(nonlinear, heads))
    kind = draw(st.sampled_from(["&", "&", "|", "|", "~"]))
    a = draw(rules(nonlinear, heads, depth - 1))
    if kind == "~":
        return ~a
    b = draw(rules(nonlinear, heads, depth - 1))
    return a & b if kind == "&" else a | b


@st.composite
def random_specs(draw):
    nonlinear = draw(st.integers(0, 3)) == 0
    heads = draw(st.integers(0, 4)) == 0
    n = draw(st.integers(1, 3))
    regions = []
    try:
        for i in range(n):
            lo, hi = draw(st.sampled_from(BOUNDS)), draw(st.sampled_from(BOUNDS))
            regions.append(Region((lo, hi), draw(rules(nonlinear, heads)), name=f"r{i}"))
        spec = MaskSpec(regions, num_heads=2 if heads else None)
    except ValueError as e:
        assert "provably overlap" in str(e) or "are empty for every" in str(e)
        assume(False)
    return spec


@st.composite
def contiguous_segment_ids(draw, b, n):
    """Each id (padding ids too) one run, in any order of ids."""
    rows = []
    for _ in range(b):
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=min(5, n - 1))))
        values = draw(st.permutations([0, 1, 2, 3, -1, -2]))
        bounds = [0] + cuts + [n]
        rows.append([values[r] for r in range(len(bounds) - 1)
                     for _ in range(bounds[r + 1] - bounds[r])])
    return np.array(rows, np.int32)


def random_metadata(draw, spec, nq, nk, b, spill=0):
    """Metadata in the declared ranges, or up to ``spill`` outside them (jit only)."""
    md = {}
    for name, decl in spec.metadata.items():
        if name in ("a", "b"):
            md[name] = np.array(draw(st.lists(st.integers(-spill, nq + spill), min_size=b,
                                              max_size=b)), np.int32)
        elif name == "c":
            md[name] = np.array(draw(st.lists(st.integers(1 - spill, 4), min_size=b,
                                              max_size=b)), np.int32)
        elif name == "v":
            md[name] = np.array(draw(st.lists(st.lists(st.integers(-spill, nq + spill),
                                                       min_size=2, max_size=2),
                                              min_size=b, max_size=b)), np.int32)
        elif name == "seg":
            md[name] = draw(segment_ids(b, max(nq, nk)))
        elif name == "cseg":
            md[name] = draw(contiguous_segment_ids(b, max(nq, nk)))
        else:  # pragma: no cover
            raise AssertionError(name)
    return md


@given(spec=random_specs(), data=st.data())
def test_random_specs(spec, data):
    (nq, nk), tiles = data.draw(st.sampled_from(LAYOUTS))
    b = data.draw(st.integers(1, 2))
    md = random_metadata(data.draw, spec, nq, nk, b)
    desc = jcm.compile(spec).instantiate(md, nq, nk, **_tile_kwargs(tiles))
    check_descriptor(desc, spec.as_dense(md, nq, nk), nq, nk)


@settings(max_examples=max(3, settings().max_examples // 3))
@given(spec=random_specs(), data=st.data())
def test_random_specs_under_jit(spec, data):
    """Traced metadata: no eager validation, region bounds overlap or nest at run time,
    and values may leave their declared ranges (they are clamped into them)."""
    nq, nk = 12, 12
    md = random_metadata(data.draw, spec, nq, nk, 2, spill=data.draw(st.sampled_from([0, 4])))
    tiles = TILE_CONFIGS[0]
    cm = jcm.compile(spec)
    jmd = {key: jnp.asarray(v) for key, v in md.items()}
    desc = jitted_instantiate(cm, nq, nk, tiles)(jmd)
    want = jax.jit(lambda m: spec.as_dense(m, nq, nk))(jmd)
    clamped = {key: np.clip(v, *_declared_range(spec.metadata[key], nq, nk))
               for key, v in md.items()}
    np.testing.assert_array_equal(np.asarray(want),
                                  np.asarray(spec.as_dense(clamped, nq, nk)))
    check_descriptor(desc, want, nq, nk)


def _declared_range(decl, nq, nk):
    from jcompilemask.spec.maskspec import _eval_static
    lens = {"q_len": nq, "kv_len": nk}
    lo, hi = getattr(decl, "min", None), getattr(decl, "max", None)
    return (None if lo is None else _eval_static(lo, lens),
            None if hi is None else _eval_static(hi, lens))


@settings(max_examples=6)
@given(spec=random_specs(), data=st.data())
def test_stacked_column_counts_give_the_same_descriptor(spec, data):
    """$JCOMPILEMASK_PREPROCESS_COLUMN_COUNTS=stacked (all 2 Kc bounds through one count,
    the GPU's default) gives auto's descriptor on a CPU (one count per bound), field by
    field, and the oracle's, under jit."""
    from jcompilemask.lower import preprocess as pp
    (nq, nk), tiles = data.draw(st.sampled_from(LAYOUTS))
    b = data.draw(st.integers(1, 2))
    md = random_metadata(data.draw, spec, nq, nk, b)
    md = {key: jnp.asarray(v) for key, v in md.items()}
    cm = jcm.compile(spec, warn=False)
    got = {}
    for mode in ("auto", "stacked"):            # auto: one count per bound on a CPU
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(pp.COLUMN_COUNTS_ENV, mode)
            got[mode] = jax.jit(lambda m: cm.instantiate(m, nq, nk, **_tile_kwargs(tiles)))(md)
    check_descriptor(got["stacked"], spec.as_dense(md, nq, nk), nq, nk)
    for x, y in zip(jax.tree_util.tree_leaves(got["auto"]), jax.tree_util.tree_leaves(got["stacked"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_column_counts_mode_rejects_unknown_values(monkeypatch):
    from jcompilemask.lower import preprocess as pp
    monkeypatch.setenv(pp.COLUMN_COUNTS_ENV, "fused")
    with pytest.raises(ValueError, match="JCOMPILEMASK_PREPROCESS_COLUMN_COUNTS='fused'"):
        jcm.compile(M.shared_prompt(3)).instantiate(
            {"prompt_len": np.array([4]), "response_starts": np.array([[4, 7, 10]])}, 13, 13)


def test_out_of_range_metadata_under_jit_is_clamped():
    """Inside jit values are not validated; out-of-range ones are clamped into their
    declared range by the oracle and the preprocess alike. Without that, the lowering's
    proofs (which assume the ranges) gave descriptors that disagreed with the oracle:
    a merged interval covering a gap, a column view of a decreasing bound."""
    c = Scalar("c", max=q_len)
    cases = [
        (MaskSpec([Region((0, q_len), (k < c + 5) | ((k >= 5 - c) & (k <= q)))]),
         {"c": [-3, 40]}, {"c": [0, 12]}),
        (MaskSpec([Region((0, q_len), (k >= c * q + 8) & (k <= q + 3))]),
         {"c": [-1, 2]}, {"c": [0, 2]}),
        (M.hstu(), {"context_len": [-2, 3], "history_end": [5, 30], "group_size": [-1, 0]},
         {"context_len": [0, 3], "history_end": [5, 12], "group_size": [1, 1]}),
        (M.prefix_lm(), {"prefix_len": [99, -5]}, {"prefix_len": [12, 0]}),
    ]
    for spec, raw, clamped in cases:
        cm = jcm.compile(spec)
        jmd = {key: jnp.asarray(v, jnp.int32) for key, v in raw.items()}
        desc = jitted_instantiate(cm, 12, 12, TILE_CONFIGS[0])(jmd)
        want = jax.jit(lambda m: spec.as_dense(m, 12, 12))(jmd)
        np.testing.assert_array_equal(np.asarray(want),
                                      np.asarray(spec.as_dense(clamped, 12, 12)))
        check_descriptor(desc, want, 12, 12)
        with pytest.raises(jcm.spec.MetadataError):
            spec.as_dense(raw, 12, 12)          # eager: refused, naming the key


def test_nonlinear_rules_fall_back_and_stay_exact():
    a = Scalar("a", max=q_len)
    spec = MaskSpec([Region((0, a), (k // 3 == q // 3) & (k <= q)),
                     Region((a, q_len), (k * k <= q) | (k >= q - 1) & (k <= q))])
    cm = jcm.compile(spec, warn=False)
    # k // 3 == q // 3 is a block interval (issue 16); k * k <= q keeps a residual
    assert cm.fallback_regions == (1,)
    for av in (0, 4, 11):
        md = {"a": np.array([av], np.int32)}
        for tiles in (((4, 4), (2, 4)), ((3, 5), (5, 3))):
            desc = cm.instantiate(md, 11, 11, **_tile_kwargs(tiles))
            check_descriptor(desc, spec.as_dense(md, 11, 11), 11, 11)


def test_mixed_fallback_and_lowered_regions():
    a = Scalar("a", max=q_len)
    spec = MaskSpec([Region((0, a), k <= q),
                     Region((a, q_len), (k < a) | (k % 2 == q % 2) & (k <= q))])
    cm = jcm.compile(spec)
    assert cm.fallback_regions == (1,)
    md = {"a": np.array([3, 9], np.int32)}
    desc = jax.jit(lambda m: cm.instantiate(m, 12, 12, block_q=4, block_kv=4,
                                            bwd_block_q=3, bwd_block_kv=5))(md)
    check_descriptor(desc, spec.as_dense(md, 12, 12), 12, 12)


@pytest.mark.parametrize("bounds", [
    # nested: region 0 strictly inside region 1 (region 1's rows are two ranges)
    [(4, 7), (0, q_len)],
    # overlapping, and the later region first in row order
    [(5, q_len), (0, 8)],
    # three regions, out of order, one empty at these lengths (clamped to [0, q_len])
    [(6, 9), (14, q_len), (0, q_len)],
])
def test_runtime_nested_regions(bounds):
    rules_ = [k <= q, (k >= q - 2) & (k <= q + 1), k < 5]
    spec = MaskSpec([Region(bd, r) for bd, r in zip(bounds, rules_)])
    cm = jcm.compile(spec)
    desc = jax.jit(lambda: cm.instantiate(None, 12, 12, block_q=4, block_kv=4,
                                          bwd_block_q=2, bwd_block_kv=4))()
    check_descriptor(desc, spec.as_dense(None, 12, 12), 12, 12)


def test_runtime_nested_regions_with_metadata():
    a, b = Scalar("a", max=q_len), Scalar("b", max=q_len)
    spec = MaskSpec([Region((a, b), k <= q), Region((0, q_len), k >= q - 1)])
    cm = jcm.compile(spec)
    md = {"a": np.array([3, 0, 5, 7], np.int32), "b": np.array([6, 12, 5, 2], np.int32)}
    desc = jax.jit(lambda m: cm.instantiate(m, 12, 12, block_q=5, block_kv=3,
                                            bwd_block_q=4, bwd_block_kv=4))(md)
    check_descriptor(desc, spec.as_dense(md, 12, 12), 12, 12)
    # sequence 0 has region 0 strictly inside region 1: the column view is not exact
    assert np.asarray(desc.bwd_exact).tolist() == [False, True, True, True]


# =======================================================================================
# from_dense
# =======================================================================================
@st.composite
def bool_arrays(draw):
    heads = draw(st.sampled_from([None, 1, 3]))
    nq, nk = draw(st.sampled_from([(1, 1), (7, 11), (13, 13)]))
    density = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
    seed = draw(st.integers(0, 2 ** 16))
    shape = (nq, nk) if heads is None else (heads, nq, nk)
    arr = np.random.default_rng(seed).random(shape) < density
    if draw(st.booleans()):     # some structure: rows of runs
        arr = arr | np.tril(np.ones((nq, nk), bool))
    return arr


@settings(max_examples=max(5, settings().max_examples // 2))
@given(arr=bool_arrays(), tiles=tiles_st)
def test_from_dense(arr, tiles):
    dm = jcm.from_dense(arr)
    arr3 = arr if arr.ndim == 3 else arr[None]
    runs = lambda x: (np.diff(np.concatenate(  # noqa: E731
        [np.zeros(x.shape[:-1] + (1,), int), x.astype(int)], -1), axis=-1) == 1).sum(-1)
    assert dm.num_intervals == max(int(runs(arr3).max()), 1)
    assert dm.num_bwd_intervals == max(int(runs(np.swapaxes(arr3, -1, -2)).max()), 1)
    assert dm.mask_heads == arr3.shape[0]
    nq, nk = arr3.shape[1:]
    # Built under jit: one compiled program per example; eagerly every op of the
    # instantiation compiled on its own at each new shape (~4x the time). The eager
    # path is compared with this one field by field in test_from_dense_under_jit.
    desc = jax.jit(lambda: dm.instantiate(None, **_tile_kwargs(tiles)))()
    check_descriptor(desc, arr3[None], nq, nk, expect_column_view=True)


def test_from_dense_under_jit():
    arr = np.random.default_rng(0).random((2, 9, 7)) < 0.4
    dm = jcm.from_dense(arr)
    desc = jax.jit(lambda: dm.instantiate(None, 9, 7, block_q=4, block_kv=4,
                                          bwd_block_q=2, bwd_block_kv=3))()
    check_descriptor(desc, arr[None], 9, 7, expect_column_view=True)
    # outside jit (the path test_from_dense took per example): the same descriptor
    eager = dm.instantiate(None, 9, 7, block_q=4, block_kv=4, bwd_block_q=2, bwd_block_kv=3)
    check_descriptor(eager, arr[None], 9, 7, expect_column_view=True)
    assert jax.tree_util.tree_structure(eager) == jax.tree_util.tree_structure(desc)
    for x, y in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(desc)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_from_dense_errors():
    with pytest.raises(TypeError, match="boolean"):
        jcm.from_dense(np.ones((4, 4), np.int32))
    with pytest.raises(ValueError, match="shape"):
        jcm.from_dense(np.ones((2, 2, 4, 4), bool))
    dm = jcm.from_dense(np.ones((4, 6), bool))
    with pytest.raises(ValueError, match="built for"):
        dm.instantiate(None, 8, 8)
    with pytest.raises(ValueError, match="no metadata"):
        dm.instantiate({"a": np.array([1])}, 4, 6)


# =======================================================================================
# Jit: metadata values never retrace
# =======================================================================================
def test_instantiate_traces_once():
    cm = jcm.compile(M.hstu())
    n = 64
    traces = []

    def build(md):
        traces.append(1)
        return cm.instantiate(md, n, n, block_q=16, block_kv=16, bwd_block_q=8,
                          bwd_block_kv=16)

    f = jax.jit(build)
    for a, b_, g in ((8, 40, 3), (30, 10, 1), (0, 64, 64), (64, 0, 5)):
        md = {"context_len": jnp.array([a, a // 2], jnp.int32),
              "history_end": jnp.array([b_, b_], jnp.int32),
              "group_size": jnp.array([g, 2], jnp.int32)}
        desc = f(md)
        check_descriptor(desc, M.hstu().as_dense(md, n, n), n, n)
    assert len(traces) == 1
    if hasattr(f, "_cache_size"):
        assert f._cache_size() == 1


def test_descriptor_is_a_pytree_passed_through_jit():
    cm = jcm.compile(M.prefix_lm())
    md = {"prefix_len": jnp.array([3, 0], jnp.int32)}
    desc = cm.instantiate(md, 10, 10, block_q=4, block_kv=4, bwd_block_q=4, bwd_block_kv=4)
    out = jax.jit(lambda d: d)(desc)
    assert out.tiles == desc.tiles and out.mask == desc.mask and out.q_len == 10
    np.testing.assert_array_equal(np.asarray(out.as_dense()), np.asarray(desc.as_dense()))


def test_to_string_draws_tiles():
    d = jcm.compile(M.causal()).instantiate(None, 10, 10, block_q=4, block_kv=4,
                                            bwd_block_q=4, bwd_block_kv=4)
    text = d.to_string()
    assert text.splitlines()[1:4] == ["+..", "#+.", "##+"]
    assert "full 3, partial 3, empty 3" in text
    assert "bwd tiles 4x4" in d.to_string("bwd")


def test_bad_tiles_raise():
    cm = jcm.compile(M.causal())
    for bad in (dict(block_q=0), dict(bwd_block_kv=-4), dict(block_kv=2.0),
                dict(bwd_block_q=True)):
        with pytest.raises(ValueError, match="positive int"):
            cm.instantiate(None, 8, 8, **bad)


def test_default_tiles_are_used_when_none():
    d = jcm.compile(M.causal()).instantiate(None, 8, 8)
    t = d.tiles
    assert min(t.block_q, t.block_kv, t.bwd_block_q, t.bwd_block_kv) >= 1


@pytest.mark.parametrize("on", [False, True])
def test_x64_on_and_off(on):
    """Index arrays and tables are int32 (tiles uint32) whichever x64 mode is on."""
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", on)
    try:
        a = Scalar("a", max=q_len)
        cases = [
            (M.hstu(), {"context_len": np.array([3, 1]), "history_end": np.array([7, 9]),
                        "group_size": np.array([2, 3])}),
            (M.clear(3, 2), {"text_len": np.array([2, 4]), "image_len": np.array([9, 5])}),
            (MaskSpec([Region((0, a), k * k <= q), Region((a, q_len), k <= q)]),
             {"a": np.array([5])}),
        ]
        for spec, md in cases:
            cm = jcm.compile(spec)
            # numpy int64 metadata: 64-bit inside jit when x64 is on
            desc = jax.jit(lambda m: cm.instantiate(m, 12, 12, block_q=4, block_kv=4,
                                                    bwd_block_q=3, bwd_block_kv=5))(md)
            for leaf in (desc.fwd_intervals, desc.bwd_intervals, desc.row_region):
                assert leaf.dtype == jnp.int32
            assert desc.fwd_tiles.dtype == jnp.uint32
            assert desc.bwd_tiles.dtype == jnp.uint32
            check_descriptor(desc, spec.as_dense(md, 12, 12), 12, 12)
    finally:
        jax.config.update("jax_enable_x64", old)


def test_symbolic_proofs():
    """The merge proofs: sound (never claim a false <=) and strong enough for the
    built-ins (prefix-LM's two intervals merge into one)."""
    from jcompilemask.lower.symbolic import monotone, provably_le
    a = Scalar("a", max=q_len)
    assert provably_le(q, q + 1) and not provably_le(q + 1, q)
    assert provably_le(Const(0), a) and not provably_le(a, Const(0))
    assert not provably_le(q, q // 4 * 4)
    assert not provably_le(q - 3, a)
    assert provably_le(a, q, row_lo=a) and not provably_le(a + 1, q, row_lo=a)
    assert _num_intervals(M.prefix_lm()) == 1
    assert monotone(q // 3 * 3 + a) == "inc" and monotone(a - q) == "dec"
    assert monotone(q % 3) is None and monotone(SEG.start(q)) == "inc"


def test_compile_cache_keeps_the_callers_names():
    """compile() caches by structure; a structurally equal spec with other names must
    still be explained (and warned about) under its own names."""
    from jcompilemask.spec import MaskSpec, Region, k, q, q_len
    rule = (k <= q) & (k % 3 == 0)
    plain = jcm.compile(MaskSpec([Region((0, q_len), rule)]), warn=False)
    named = jcm.compile(MaskSpec([Region((0, q_len), rule, name="every_third")], name="thirds"),
                        warn=False)
    assert "region 0 'every_third'" in named.explain()
    assert named.explain().startswith("CompiledMask thirds:")
    assert "every_third" not in plain.explain()
    assert plain == named and hash(plain) == hash(named)
