"""The MaskSpec language and its dense oracle (issue 2).

* hand-written expected matrices per built-in mask on tiny sizes;
* an independent element-wise numpy definition of every built-in, written from the
  issue text and docs/workloads.md (not from the spec code), compared with ``as_dense``
  on random metadata;
* expression evaluation against Python integers with the documented semantics;
* one error test per bad input; printing; per-head specs; the checkify path; x64.
"""
from __future__ import annotations

import contextlib
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, strategies as st
from jax.experimental import checkify

import jcompilemask as jcm
from jcompilemask.spec import (FALSE, TRUE, MaskSpec, MetadataError, Region, Scalar,
                               SegmentIds, Vector, h, k, kv_len, maximum, minimum, q,
                               q_len)
from jcompilemask.spec.evaluate import Env, evaluate
from strategies import BUILTINS, builtin_case

M = jcm.masks


def mat(text: str) -> np.ndarray:
    """'10\\n11' -> bool [[1, 0], [1, 1]] (blank lines and spaces ignored)."""
    rows = [r.replace(" ", "") for r in text.strip().splitlines() if r.strip()]
    return np.array([[c == "1" for c in r] for r in rows], bool)


def dense(spec, md, nq, nk=None):
    return np.asarray(spec.as_dense(md, nq, nk))


# =======================================================================================
# Hand-written expected matrices
# =======================================================================================
HAND = {
    "causal": (M.causal(), None, 4, 4, """
        1000
        1100
        1110
        1111"""),
    "causal_rect": (M.causal(), None, 3, 5, """
        10000
        11000
        11100"""),
    "full": (M.full(), None, 2, 3, """
        111
        111"""),
    "sliding_window": (M.sliding_window(1, 1), None, 5, 5, """
        11000
        11100
        01110
        00111
        00011"""),
    "sliding_window_left": (M.sliding_window(2), None, 5, 5, """
        10000
        11000
        11100
        01110
        00111"""),
    "chunked_causal": (M.chunked_causal(2), None, 5, 5, """
        10000
        11000
        00100
        00110
        00001"""),
    "prefix_lm": (M.prefix_lm(), {"prefix_len": [2]}, 4, 4, """
        1100
        1100
        1110
        1111"""),
    "document": (M.document(), {"segment_ids": [[0, 0, 1, 1, 1, -1]]}, 6, 6, """
        100000
        110000
        001000
        001100
        001110
        000000"""),
    "document_bidir": (M.document(causal=False), {"segment_ids": [[0, 0, 1, 1, 1, -1]]},
                       6, 6, """
        110000
        110000
        001110
        001110
        001110
        000000"""),
    # the same id after another one starts a new segment; a lone token is a segment
    "document_runs": (M.document(causal=False), {"segment_ids": [[2, 2, 5, 2, -1, -1]]},
                      6, 6, """
        110000
        110000
        001000
        000100
        000000
        000000"""),
    # context a=2, history to b=4, targets in groups of g=2: s(4)=s(5)=4, s(6)=s(7)=6
    "hstu": (M.hstu(), {"context_len": [2], "history_end": [4], "group_size": [2]}, 8, 8, """
        11000000
        11000000
        11100000
        11110000
        11111000
        11111100
        11110010
        11110011"""),
    # history_end (1) before context_len (3): rows < 3 are context (first match), the
    # rest are targets with b = 1, g = 2: s(3)=s(4)=3, s(5)=5
    "hstu_b_before_a": (M.hstu(), {"context_len": [3], "history_end": [1],
                                   "group_size": [2]}, 6, 6, """
        111000
        111000
        111000
        100100
        100110
        100001"""),
    # prompt of 2, responses [2, 4) and [4, 7)
    "shared_prompt": (M.shared_prompt(2), {"prompt_len": [2], "response_starts": [[2, 4]]},
                      7, 7, """
        1000000
        1100000
        1110000
        1111000
        1100100
        1100110
        1100111"""),
    # the middle response is empty (equal consecutive starts)
    "shared_prompt_empty": (M.shared_prompt(3), {"prompt_len": [1],
                                                 "response_starts": [[1, 3, 3]]}, 5, 5, """
        10000
        11000
        11100
        10010
        10011"""),
    # text 2, image 7 tokens of width 3 (rows of 3, 3, 1: partial last row), 1 padding
    # row; radius 1 = the 4-neighbourhood, no wrap-around between image rows
    "clear": (M.clear(3, 1), {"text_len": [2], "image_len": [7]}, 10, 10, """
        1111111110
        1111111110
        1111010000
        1111101000
        1101100100
        1110011010
        1101011100
        1100101100
        1100010010
        0000000000"""),
}


@pytest.mark.parametrize("case", sorted(HAND))
def test_hand_written_matrix(case):
    spec, md, nq, nk, text = HAND[case]
    want = mat(text)
    assert want.shape == (nq, nk)
    got = dense(spec, md, nq, nk)
    assert got.shape == (1, 1, nq, nk)
    np.testing.assert_array_equal(got[0, 0].astype(int), want.astype(int))


def test_batched_metadata_gives_batch_axis():
    md = {"prefix_len": np.array([0, 2, 4], np.int32)}
    got = dense(M.prefix_lm(), md, 4, 4)
    assert got.shape == (3, 1, 4, 4)
    np.testing.assert_array_equal(got[0, 0], np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(got[1, 0], mat(HAND["prefix_lm"][4]))
    assert got[2, 0].all()


# =======================================================================================
# Independent element-wise definitions (from the issue text / docs/workloads.md)
# =======================================================================================
def _runs(ids):
    """Run number of each token: a new run starts wherever the id changes."""
    out, r = [], 0
    for p, v in enumerate(ids):
        if p > 0 and v != ids[p - 1]:
            r += 1
        out.append(r)
    return out


def reference(name, params, md, nq, nk) -> np.ndarray:
    """bool [B, 1, nq, nk], one element at a time."""
    b = 1 if md is None else len(next(iter(md.values())))
    out = np.zeros((b, 1, nq, nk), bool)
    for s in range(b):
        get = (lambda key: int(md[key][s])) if md else None
        for i in range(nq):
            for j in range(nk):
                out[s, 0, i, j] = _ref_elem(name, params, md, s, get, i, j, nq)
    return out


def _ref_elem(name, params, md, s, get, i, j, nq):
    if name == "causal":
        return j <= i
    if name == "full":
        return True
    if name == "sliding_window":
        near = i - params["left"] <= j <= i + params["right"]
        return near or (j < params.get("sinks", 0) and j <= i + params["right"])
    if name == "chunked_causal":
        c = params["chunk"]
        return i // c == j // c and j <= i
    if name == "prefix_lm":
        return j < get("prefix_len") or j <= i
    if name in ("document", "document_bidir"):
        ids = [int(v) for v in md["segment_ids"][s]]
        runs = _runs(ids)
        if ids[i] < 0:
            return False
        same = runs[i] == runs[j]
        return same and (j <= i if name == "document" else True)
    if name == "hstu":
        a, bb, g = get("context_len"), get("history_end"), get("group_size")
        if i < a:                       # context rows (listed first: they win)
            return j < a
        if i < bb:                      # history rows
            return j <= i
        start = bb + (i - bb) // g * g  # target rows: own group, causally
        return j < bb or start <= j <= i
    if name == "shared_prompt":
        p = get("prompt_len")
        starts = [int(v) for v in md["response_starts"][s]]
        if i < p:
            return j <= i
        for r, lo in enumerate(starts):
            hi = starts[r + 1] if r + 1 < len(starts) else nq
            if lo <= i < hi:
                return j < p or lo <= j <= i
        return False                    # a row in no response sees nothing
    if name == "clear":
        w, rad = params["width"], params["radius"]
        t, n = get("text_len"), get("image_len")
        if i < t:
            return j < t + n
        if i >= t + n:
            return False
        if j < t:
            return True
        if j >= t + n:
            return False
        (y, x), (y2, x2) = divmod(i - t, w), divmod(j - t, w)
        return (y2 - y) ** 2 + (x2 - x) ** 2 <= rad * rad
    raise AssertionError(name)


@pytest.mark.parametrize("builtin", BUILTINS)
@given(data=st.data())
def test_builtins_match_independent_definition(builtin, data):
    name, params, spec, md, nq, nk = data.draw(builtin_case([builtin]))
    want = reference(name, params, md, nq, nk)
    got = dense(spec, md, nq, nk)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want, err_msg=f"{name} {params} {md}")


@pytest.mark.parametrize("name", ["hstu", "clear", "shared_prompt", "document"])
def test_builtin_under_jit_matches_eager(name):
    """The oracle is jit-able: traced metadata gives the same mask."""
    case = {"hstu": (M.hstu(), {"context_len": [2, 5], "history_end": [1, 6],
                                "group_size": [3, 1]}),
            "clear": (M.clear(3, 2), {"text_len": [2, 0], "image_len": [8, 13]}),
            "shared_prompt": (M.shared_prompt(2), {"prompt_len": [3, 0],
                                                   "response_starts": [[3, 3], [5, 2]]}),
            "document": (M.document(), {"segment_ids": [[0] * 4 + [1] * 5 + [-1] * 4,
                                                        list(range(13))]})}[name]
    spec, md = case
    md = {key: jnp.asarray(v, jnp.int32) for key, v in md.items()}
    eager = spec.as_dense(md, 13, 13)
    jitted = jax.jit(lambda m: spec.as_dense(m, 13, 13))(md)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


# The named edge cases, pinned explicitly (hypothesis also reaches them).
EDGE_CASES = [
    ("hstu", {}, {"context_len": [5], "history_end": [2], "group_size": [2]}, 9, 9),
    ("hstu", {}, {"context_len": [0], "history_end": [0], "group_size": [4]}, 9, 9),
    ("hstu", {}, {"context_len": [9], "history_end": [9], "group_size": [1]}, 9, 9),
    ("clear", {"width": 4, "radius": 2}, {"text_len": [3], "image_len": [9]}, 13, 13),
    ("clear", {"width": 4, "radius": 1}, {"text_len": [0], "image_len": [5]}, 8, 8),
    ("clear", {"width": 3, "radius": 2}, {"text_len": [6], "image_len": [6]}, 9, 9),
    ("document", {}, {"segment_ids": [[0, 1, 2, 3, 4, 5, 6]]}, 7, 7),
    ("document_bidir", {}, {"segment_ids": [[-1, 0, -1, -1, 1, 1, -3]]}, 7, 7),
    ("document", {}, {"segment_ids": [[0, 0, 1, 1, 1, 2, 2, 2]]}, 5, 8),
    ("document_bidir", {}, {"segment_ids": [[0, 0, 1, 1, 1, 2, 2, 2]]}, 8, 3),
    ("shared_prompt", {}, {"prompt_len": [2], "response_starts": [[2, 2, 5, 5]]}, 8, 8),
    ("shared_prompt", {}, {"prompt_len": [4], "response_starts": [[2, 6, 6, 8]]}, 8, 8),
    ("prefix_lm", {}, {"prefix_len": [6]}, 4, 7),
    ("sliding_window", {"left": 2, "right": 1}, None, 4, 7),
    ("sliding_window", {"left": 1, "right": 0, "sinks": 2}, None, 7, 7),
    ("sliding_window", {"left": 0, "right": 1, "sinks": 9}, None, 5, 4),
    ("chunked_causal", {"chunk": 3}, None, 7, 4),
]


@pytest.mark.parametrize("name,params,md,nq,nk", EDGE_CASES)
def test_named_edge_cases(name, params, md, nq, nk):
    ctor = {"document_bidir": lambda: M.document(causal=False),
            "shared_prompt": lambda: M.shared_prompt(len(md["response_starts"][0]))}
    spec = ctor[name]() if name in ctor else getattr(M, name)(**params)
    md_np = None if md is None else {key: np.asarray(v, np.int32) for key, v in md.items()}
    np.testing.assert_array_equal(dense(spec, md_np, nq, nk),
                                  reference(name, params, md_np, nq, nk))


# =======================================================================================
# Expression evaluation vs Python integers
# =======================================================================================
_OPS = ["+", "-", "*", "//", "%", "min", "max"]
_INT32 = 2 ** 31


def _wrap(x: int) -> int:
    """int32 two's-complement wrap (all MaskSpec values are int32)."""
    return (x + _INT32) % (2 * _INT32) - _INT32


def _py_op(op, a, b):
    if op in ("//", "%"):
        d = b if b > 0 else 1          # documented: a non-positive divisor acts as 1
        return _wrap(a // d if op == "//" else a % d)
    return _wrap({"+": operator.add, "-": operator.sub, "*": operator.mul,
                  "min": min, "max": max}[op](a, b))


_SCALARS = {n: Scalar(n, min=-100) for n in ("a", "b")}

_leaf = st.one_of(st.sampled_from(["q", "k", "a", "b"]), st.integers(-9, 9))
_tree = st.recursive(_leaf, lambda kids: st.tuples(st.sampled_from(_OPS), kids, kids),
                     max_leaves=10)


def _build(t):
    """(Expr or int, python evaluator env -> int)."""
    if isinstance(t, int):
        return t, (lambda env: t)
    if isinstance(t, str):
        node = {"q": q, "k": k, **_SCALARS}[t]
        return node, (lambda env: env[t])
    op, ta, tb = t
    ea, fa = _build(ta)
    eb, fb = _build(tb)
    f = (lambda env: _py_op(op, fa(env), fb(env)))
    if op == "min":
        return minimum(ea, eb), f
    if op == "max":
        return maximum(ea, eb), f
    pyop = {"+": operator.add, "-": operator.sub, "*": operator.mul,
            "//": operator.floordiv, "%": operator.mod}[op]
    if isinstance(ea, int) and isinstance(eb, int):
        if op in ("//", "%") and eb <= 0:
            return _py_op(op, ea, eb), f     # plain Python ints: fold with our semantics
        return _wrap(pyop(ea, eb)), f
    return pyop(ea, eb), f


@given(_tree, st.lists(st.tuples(st.integers(-20, 40), st.integers(-20, 40),
                                  st.integers(-30, 30), st.integers(-30, 30)),
                        min_size=1, max_size=6))
def test_expression_evaluation_matches_python(tree, points):
    try:
        expr, ref = _build(tree)
    except ValueError as e:              # a constant divisor <= 0 is refused when built
        assert "divisor" in str(e)
        return
    if isinstance(expr, int):
        assume(False)
    qs, ks, as_, bs = (np.array(c, np.int32) for c in zip(*points))
    env = Env(2, {"q": jnp.asarray(qs)[None], "k": jnp.asarray(ks)[None]}, 64, 64,
              {"a": jnp.asarray(as_), "b": jnp.asarray(bs)})
    got = np.asarray(jnp.broadcast_to(evaluate(expr, env), (len(points), len(points))))
    for n, (qv, kv, av, bv) in enumerate(points):
        want = ref({"q": qv, "k": kv, "a": av, "b": bv})
        assert int(got[n, n]) == want, f"{expr} at q={qv} k={kv} a={av} b={bv}"


@given(st.integers(-50, 50), st.integers(-6, 6))
def test_runtime_division_semantics(x, d):
    """Floor division / modulo; a run-time divisor <= 0 acts as 1."""
    a, b = Scalar("a", min=-100), Scalar("b", min=-100)
    env = Env(1, {}, 8, 8, {"a": jnp.array([x], jnp.int32), "b": jnp.array([d], jnp.int32)})
    dd = d if d > 0 else 1
    assert int(evaluate(a // b, env)[0]) == x // dd
    assert int(evaluate(a % b, env)[0]) == x % dd


@given(st.integers(-9, 9), st.integers(-9, 9), st.sampled_from(["<", "<=", ">", ">=", "==", "!="]))
def test_predicate_evaluation(x, y, op):
    a, b = Scalar("a", min=-100), Scalar("b", min=-100)
    env = Env(1, {}, 8, 8, {"a": jnp.array([x], jnp.int32), "b": jnp.array([y], jnp.int32)})
    pyop = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
            "==": operator.eq, "!=": operator.ne}[op]
    p = pyop(a, b)
    for pred, want in ((p, pyop(x, y)), (~p, not pyop(x, y)),
                       (p & (a >= b), pyop(x, y) and x >= y),
                       (p | (a == 3), pyop(x, y) or x == 3),
                       (p & TRUE, pyop(x, y)), (p | FALSE, pyop(x, y))):
        assert bool(jnp.broadcast_to(evaluate(pred, env), (1,))[0]) == want, str(pred)


def test_segment_reads():
    seg = SegmentIds("s")
    from jcompilemask.spec.evaluate import segment_tables
    ids = jnp.array([[3, 3, -1, 3, 7, 7, 7, -1]], jnp.int32)
    tab = segment_tables(ids)
    assert tab["start"].tolist() == [[0, 0, 2, 3, 4, 4, 4, 7]]
    assert tab["end"].tolist() == [[2, 2, 2, 4, 7, 7, 7, 7]]
    env = Env(2, {"q": jnp.arange(-1, 10, dtype=jnp.int32)[None]}, 8, 8, {"s": tab})
    # positions outside [0, N) read the nearest end
    assert evaluate(seg.start(q), env).tolist() == [[0, 0, 0, 2, 3, 4, 4, 4, 7, 7, 7]]
    assert evaluate(seg.id(q), env).tolist() == [[3, 3, 3, -1, 3, 7, 7, 7, -1, -1, -1]]


# =======================================================================================
# Errors: each bad input raises, saying what to do
# =======================================================================================
def test_bool_of_predicate_raises():
    with pytest.raises(TypeError, match="&"):
        bool(k <= q)
    with pytest.raises(TypeError, match="&"):
        if (k <= q) and (k >= 0):   # noqa: SIM102 - the point is that `and` raises
            pass
    with pytest.raises(TypeError, match="&"):
        not (k < q)                 # noqa: B015
    with pytest.raises(TypeError):
        bool(k + 1)


def test_chained_comparison_raises():
    a = Scalar("a")
    with pytest.raises(TypeError, match="a <= k & k < b"):
        a < k < q_len               # noqa: B015


def test_python_min_max_raise():
    with pytest.raises(TypeError, match="minimum"):
        min(q, k)
    with pytest.raises(TypeError):
        max(q, 3)


def test_provable_overlap_raises():
    a = Scalar("a", max=q_len)
    with pytest.raises(ValueError, match="provably overlap"):
        MaskSpec([Region((0, q_len), k <= q), Region((0, q_len), TRUE)])
    with pytest.raises(ValueError, match="provably overlap"):
        MaskSpec([Region((0, a + 1), k <= q), Region((a, a + 2), TRUE)])
    # overlap only for some values: fine (first match; check_metadata reports it)
    MaskSpec([Region((0, a), k <= q), Region((3, q_len), TRUE)])


def test_unknown_metadata_raises():
    a, b = Scalar("a"), Scalar("b")
    with pytest.raises(ValueError, match=r"unknown metadata \['b'\]"):
        MaskSpec([Region((0, q_len), (k < a) | (k < b))], metadata=[a])
    with pytest.raises(ValueError, match="declared twice"):
        MaskSpec([Region((0, q_len), (k < Scalar("a", min=0)) | (k < Scalar("a", min=1)))])
    spec = MaskSpec([Region((0, q_len), k < a)], metadata=[a, b])
    assert sorted(spec.metadata) == ["a", "b"]


@pytest.mark.parametrize("bad", [1.5, 2.0, np.float32(3.0)])
def test_non_integer_constant_raises(bad):
    with pytest.raises(TypeError, match="constants must be"):
        k < q + bad                 # noqa: B015
    with pytest.raises(TypeError):
        Region((0, bad), k <= q)


def test_true_division_raises():
    with pytest.raises(TypeError, match="//"):
        q / 2                       # noqa: B018


def test_constant_divisor_must_be_positive():
    with pytest.raises(ValueError, match="divisor"):
        q // 0
    with pytest.raises(ValueError, match="divisor"):
        q % -2


def test_constant_out_of_int32_raises():
    with pytest.raises(ValueError, match="int32"):
        k < q + 2 ** 31             # noqa: B015
    with pytest.raises(ValueError, match="int32"):
        k < q + 2 ** 20 * 2 ** 20   # noqa: B015 - folded before it reaches the tree


def test_non_boolean_rule_raises():
    with pytest.raises(TypeError, match="must be boolean"):
        Region((0, q_len), k + 1)
    with pytest.raises(TypeError):
        Region((0, q_len), 1)
    with pytest.raises(TypeError):
        Region((0, q_len), "k <= q")


def test_region_bounds_may_not_use_indices():
    with pytest.raises(ValueError, match="bounds"):
        Region((0, q), TRUE)
    with pytest.raises(TypeError, match="boolean"):
        Region((k < 3, q_len), TRUE)


def test_num_heads_required_when_h_used():
    with pytest.raises(ValueError, match="num_heads"):
        MaskSpec([Region((0, q_len), k <= q + h)])
    with pytest.raises(ValueError, match="num_heads"):
        MaskSpec([Region((0, q_len), k <= q)], num_heads=0)


def test_builtin_argument_errors():
    for bad in (lambda: M.sliding_window(-1), lambda: M.chunked_causal(0),
                lambda: M.shared_prompt(0), lambda: M.clear(0), lambda: M.clear(4, -1),
                lambda: M.sliding_window(2.0)):
        with pytest.raises(ValueError):
            bad()


# -- metadata errors, each naming the key ----------------------------------------------
HSTU_OK = {"context_len": np.array([2, 3], np.int32),
           "history_end": np.array([4, 6], np.int32),
           "group_size": np.array([2, 1], np.int32)}


def _hstu_with(**changes):
    md = dict(HSTU_OK)
    for key, v in changes.items():
        if v is None:
            del md[key]
        else:
            md[key] = v
    return md


@pytest.mark.parametrize("md,key,what", [
    (_hstu_with(group_size=None), "group_size", "missing"),
    ({**HSTU_OK, "contxt_len": np.array([1, 1], np.int32)}, "contxt_len", "unexpected"),
    (_hstu_with(context_len=np.array([[2], [3]], np.int32)), "context_len", "shape"),
    (_hstu_with(context_len=np.int32(2)), "context_len", "shape"),
    (_hstu_with(history_end=np.array([4, 6, 6], np.int32)), "history_end", "batch"),
    (_hstu_with(context_len=np.array([2.0, 3.0])), "context_len", "integer dtype"),
    (_hstu_with(context_len=np.array([2.0, 3.0], np.float32)), "context_len", "integer dtype"),
    (_hstu_with(context_len=np.array([True, False])), "context_len", "integer dtype"),
    (_hstu_with(context_len=np.array([2, 9], np.int32)), "context_len", "above its maximum"),
    (_hstu_with(history_end=np.array([-1, 2], np.int32)), "history_end", "below its minimum"),
    (_hstu_with(group_size=np.array([0, 1], np.int32)), "group_size", "below its minimum"),
])
def test_bad_metadata_raises_naming_the_key(md, key, what):
    with pytest.raises(MetadataError, match=what) as info:
        M.hstu().as_dense(md, 8, 8)
    assert repr(key) in str(info.value) or key in str(info.value)


@pytest.mark.parametrize("md,key,what", [
    ({"prompt_len": np.array([2], np.int32),
      "response_starts": np.array([[2, 4, 5]], np.int32)}, "response_starts", "shape"),
    ({"prompt_len": np.array([2], np.int32),
      "response_starts": np.array([[2, 9]], np.int32)}, "response_starts", "above"),
    ({"prompt_len": np.array([2], np.int32),
      "response_starts": np.array([2, 4], np.int32)}, "response_starts", "shape"),
])
def test_bad_vector_metadata(md, key, what):
    with pytest.raises(MetadataError, match=what) as info:
        M.shared_prompt(2).as_dense(md, 8, 8)
    assert key in str(info.value)


def test_bad_segment_ids():
    with pytest.raises(MetadataError, match=r"segment_ids.*\[B, 8\]"):
        M.document().as_dense({"segment_ids": np.zeros((1, 6), np.int32)}, 8, 8)
    with pytest.raises(MetadataError, match="segment_ids.*integer"):
        M.document().as_dense({"segment_ids": np.zeros((1, 8), np.float32)}, 8, 8)
    with pytest.raises(MetadataError, match="segment_ids.*missing|missing.*segment_ids"):
        M.document().as_dense({}, 8, 8)
    with pytest.raises(MetadataError, match="unexpected"):
        M.causal().as_dense({"segment_ids": np.zeros((1, 8), np.int32)}, 8, 8)


def test_bad_lengths():
    with pytest.raises(ValueError, match="q_len"):
        M.causal().as_dense(None, 0)
    with pytest.raises(ValueError, match="kv_len"):
        M.causal().as_dense(None, 4, 2.0)


def test_metadata_lists_and_int64_accepted():
    got = M.prefix_lm().as_dense({"prefix_len": [1]}, 3, 3)
    got64 = M.prefix_lm().as_dense({"prefix_len": np.array([1], np.int64)}, 3, 3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(got64))


# =======================================================================================
# Printing, heads, checkify, x64
# =======================================================================================
def test_str_is_readable():
    s = str(M.hstu())
    assert "MaskSpec 'hstu'" in s
    assert "region 0 'context': rows [0, context_len)" in s
    assert "visible: k < context_len" in s
    assert "region 2 'targets': rows [history_end, q_len)" in s
    assert "history_end + (q - history_end) // group_size * group_size" in s
    assert "group_size: int[B] in [1, q_len]" in s
    assert str(M.causal()).splitlines()[-1].strip() == "visible: k <= q"
    assert str((k >= q - 3) & (k <= q)) == "(k >= q - 3) & (k <= q)"
    assert str(minimum(q + 1, kv_len) // 2) == "min(q + 1, kv_len) // 2"
    assert str(q - (k - 1)) == "q - (k - 1)"
    assert str(~(k < q)) == "~(k < q)"
    vec = Vector("starts", 3)
    assert str(vec[1] + vec[-1]) == "starts[1] + starts[2]"
    assert "MaskSpec" in repr(M.causal())


def test_per_head_spec_has_num_heads_mask_heads():
    spec = MaskSpec([Region((0, q_len), (k <= q) & (k >= q - h))], num_heads=3)
    assert spec.mask_heads == 3
    d = dense(spec, None, 5, 5)
    assert d.shape == (1, 3, 5, 5)
    for hh in range(3):
        i, j = np.meshgrid(np.arange(5), np.arange(5), indexing="ij")
        np.testing.assert_array_equal(d[0, hh], (j <= i) & (j >= i - hh))
    # num_heads without h: Hm stays 1
    assert MaskSpec([Region((0, q_len), k <= q)], num_heads=4).mask_heads == 1


def test_spec_identity():
    assert M.hstu() == M.hstu()
    assert hash(M.hstu()) == hash(M.hstu())
    assert M.hstu().fingerprint() == M.hstu().fingerprint()
    assert M.sliding_window(2) != M.sliding_window(3)
    assert not M.causal().batched and M.hstu().batched


def _checked(spec, md, n):
    f = checkify.checkify(lambda m: spec.check_metadata(m, n, n))
    err, _ = jax.jit(f)({key: jnp.asarray(v, jnp.int32) for key, v in md.items()})
    return err.get()


def test_check_metadata_reports_bad_values_inside_jit():
    assert _checked(M.hstu(), HSTU_OK, 8) is None
    msg = _checked(M.hstu(), _hstu_with(context_len=np.array([2, 9], np.int32)), 8)
    assert msg is not None and "context_len" in msg and "maximum" in msg
    msg = _checked(M.hstu(), _hstu_with(group_size=np.array([0, 1], np.int32)), 8)
    assert msg is not None and "group_size" in msg
    msg = _checked(M.shared_prompt(2), {"prompt_len": [2], "response_starts": [[2, 12]]}, 8)
    assert msg is not None and "response_starts" in msg


def test_check_metadata_reports_runtime_overlap_inside_jit():
    # history_end before context_len: the targets region starts inside the context
    msg = _checked(M.hstu(), _hstu_with(history_end=np.array([1, 6], np.int32)), 8)
    assert msg is not None and "regions 0 and 2 overlap" in msg
    # a response starting inside the prompt
    msg = _checked(M.shared_prompt(2), {"prompt_len": [4], "response_starts": [[2, 5]]}, 8)
    assert msg is not None and "overlap" in msg
    assert _checked(M.shared_prompt(2), {"prompt_len": [2],
                                         "response_starts": [[2, 5]]}, 8) is None
    # the eager path does not reject an overlap (first match is defined behaviour)
    M.hstu().as_dense(_hstu_with(history_end=np.array([1, 6], np.int32)), 8, 8)


def test_jit_clamps_out_of_range_values():
    """Inside jit values are not validated: out-of-range ones are clamped into their
    declared range (no error; check_metadata reports them)."""
    spec = M.prefix_lm()
    got = jax.jit(lambda m: spec.as_dense(m, 4, 4))({"prefix_len": jnp.array([9, -2])})
    want = spec.as_dense({"prefix_len": np.array([4, 0], np.int32)}, 4, 4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    md = {"context_len": jnp.array([2]), "history_end": jnp.array([3]),
          "group_size": jnp.array([-2])}
    got = jax.jit(lambda m: M.hstu().as_dense(m, 8, 8))(md)
    want = M.hstu().as_dense({**md, "group_size": np.array([1], np.int32)}, 8, 8)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@contextlib.contextmanager
def _x64(on: bool):
    old = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


@pytest.mark.parametrize("on", [False, True])
def test_x64_on_and_off(on):
    with _x64(on):
        for name, params, md in [
                ("hstu", {}, {"context_len": np.array([2, 4]), "history_end": [5, 3],
                              "group_size": np.array([2, 3], np.int64)}),
                ("clear", {"width": 3, "radius": 2}, {"text_len": np.array([2]),
                                                      "image_len": np.array([7])}),
                ("document", {}, {"segment_ids": np.array([[0, 0, 1, -1, 2, 2, 2, 3, 3]])})]:
            spec = getattr(M, name)(**params)
            got = spec.as_dense(md, 9, 9)
            assert got.dtype == jnp.bool_
            md_np = {key: np.asarray(v) for key, v in md.items()}
            np.testing.assert_array_equal(np.asarray(got), reference(name, params, md_np, 9, 9))
            # jitted, with 64-bit metadata when x64 is on
            md_j = {key: jnp.asarray(v) for key, v in md.items()}
            np.testing.assert_array_equal(
                np.asarray(jax.jit(lambda m: spec.as_dense(m, 9, 9))(md_j)), np.asarray(got))
        env = Env(1, {"q": jnp.arange(4, dtype=jnp.int32)}, 4, 4, {})
        assert evaluate(q * 3 // 2 - 1, env).dtype == jnp.int32
