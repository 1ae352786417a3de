"""int32 safety of metadata and expressions, and provably empty regions: errors instead
of silently wrapped or empty masks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jcompilemask as jcm
from jcompilemask.spec import (TRUE, MaskSpec, Region, Scalar, SegmentIds, Vector, k,
                               kv_len, maximum, minimum, q, q_len)
from jcompilemask.spec.maskspec import MetadataError
from jcompilemask.spec.ranges import Int32RangeError, expr_range


def _readme_hstu():
    # As the README writes it: group_size has no declared max.
    a, b = Scalar("context_len", max=q_len), Scalar("history_end", max=q_len)
    g = Scalar("group_size", min=1)
    return MaskSpec([Region((0, a), k < a), Region((a, b), k <= q),
                     Region((b, q_len), (k < b) | ((k >= b + (q - b) // g * g) & (k <= q)))])


def _md(group_size):
    return {"context_len": np.array([4, 2]), "history_end": np.array([10, 9]),
            "group_size": np.array(group_size, np.int64)}


# -- metadata values that do not fit int32 ---------------------------------------------------
def test_int64_metadata_out_of_int32_is_an_eager_error():
    spec = _readme_hstu()
    with pytest.raises(MetadataError, match=r"'group_size' \(int64\) has values outside "
                                            r"int32.*declare the range"):
        spec.as_dense(_md([2 ** 32 + 4, 3]), 16, 16)
    with pytest.raises(MetadataError, match="group_size"):
        jcm.compile(spec).instantiate(_md([3, -2 ** 31 - 1]), 16, 16)
    with pytest.raises(MetadataError, match="group_size"):
        jcm.mask_attention(*(jnp.zeros((2, 16, 1, 8)),) * 3, spec,
                           metadata=_md([2 ** 32 + 4, 3]))
    # values that fit pass, whatever the integer dtype
    spec.as_dense(_md([2 ** 31 - 1, 3]), 16, 16)


def test_out_of_int32_segment_ids_are_an_eager_error():
    # 0 and 2**32 would wrap to the same id and merge two documents.
    ids = np.zeros((1, 8), np.int64)
    ids[0, 4:] = 2 ** 32
    with pytest.raises(MetadataError, match="'segment_ids'.*outside int32"):
        jcm.masks.document().as_dense({"segment_ids": ids}, 8, 8)


def test_out_of_int32_metadata_is_reported_and_saturates_inside_jit():
    spec = _readme_hstu()
    prev = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)      # int64 arrays reach jit as int64
    try:
        md = {n: jnp.asarray(v) for n, v in _md([2 ** 32 + 4, 3]).items()}
        err, _ = jax.jit(checkify.checkify(lambda m: spec.check_metadata(m, 16, 16)))(md)
        assert "group_size" in err.get() and "outside int32" in err.get()
        dense = jax.jit(lambda m: spec.as_dense(m, 16, 16))(md)
        saturated = spec.as_dense(_md([2 ** 31 - 1, 3]), 16, 16)
        wrapped = spec.as_dense(_md([4, 3]), 16, 16)
        np.testing.assert_array_equal(dense, saturated)
        assert not np.array_equal(dense, wrapped)
    finally:
        jax.config.update("jax_enable_x64", prev)


def test_in_range_metadata_gives_no_report():
    spec = _readme_hstu()
    err, _ = jax.jit(checkify.checkify(lambda m: spec.check_metadata(m, 16, 16)))(
        {n: jnp.asarray(v, jnp.int32) for n, v in _md([3, 2]).items()})
    assert err.get() is None


# -- expression arithmetic that can overflow ---------------------------------------------------
def test_overflowing_expression_is_rejected_for_the_lengths_in_use():
    spec = MaskSpec([Region((0, q_len), k <= q * 1000000 // 1000000)])
    assert spec.as_dense(None, 8, 8).sum() == 36           # fine while q * 1e6 fits
    with pytest.raises(Int32RangeError, match=r"q \* 1000000 can reach 4095000000.*"
                                              r"region 0 rule.*q_len=4096"):
        spec.as_dense(None, 4096, 4096)
    with pytest.raises(Int32RangeError, match="region 0 rule"):
        jcm.compile(spec).instantiate(None, 4096, 4096)
    with pytest.raises(Int32RangeError):
        jcm.mask_attention(*(jnp.zeros((1, 4096, 1, 8)),) * 3, spec)


def test_unbounded_metadata_in_a_product_names_the_fix():
    w = Scalar("width")
    spec = MaskSpec([Region((0, q_len), k >= q - w * 4)])
    with pytest.raises(Int32RangeError, match=r"declare the range of metadata \['width'\]"):
        spec.as_dense({"width": np.array([2])}, 8, 8)
    bounded = MaskSpec([Region((0, q_len), k >= q - Scalar("width", max=q_len) * 4)])
    bounded.as_dense({"width": np.array([2])}, 8, 8)


def test_region_bounds_and_vectors_are_checked():
    v = Vector("starts", 2, max=kv_len)
    spec = MaskSpec([Region((0, v[0] * 70000), k <= q)])
    spec.as_dense({"starts": np.array([[1, 2]])}, 64, 64)
    with pytest.raises(Int32RangeError, match="region 0 rows hi"):
        spec.as_dense({"starts": np.array([[1, 2]])}, 65536, 65536)


@pytest.mark.parametrize("n", [1, 1000, 131072, 2 ** 20])
def test_builtins_pass_at_long_lengths(n):
    for spec in (jcm.masks.hstu(), jcm.masks.clear(1024), jcm.masks.shared_prompt(6),
                 jcm.masks.chunked_causal(64), jcm.masks.sliding_window(100, 3, 4),
                 jcm.masks.prefix_lm(), jcm.masks.document(), _readme_hstu()):
        jcm.compile(spec).check_ranges(n, n)


def test_round_down_to_a_multiple_is_bounded_tightly():
    g = Scalar("g", min=1)                         # anything in [1, 2**31 - 1]
    a = Scalar("a", max=q_len)
    lo, hi = expr_range((q - a) // g * g, 1000, 1000)
    assert -2 ** 31 < lo and hi == 999
    assert expr_range(g * (q // g), 1000, 1000) == (0, 999)
    # a plain product of the same ranges is not bounded (and is rejected when used)
    assert expr_range((q - a) // g * Scalar("c", min=1), 1000, 1000)[0] < -2 ** 31


def test_min_max_mod_ranges():
    assert expr_range(minimum(q, 5) + maximum(k, 2), 10, 20) == (2, 24)
    assert expr_range(q % 7, 100, 100) == (0, 6)
    seg = SegmentIds("s")
    assert expr_range(seg.end(q) - seg.start(k), 10, 30) == (-30, 30)


# -- provably empty or reversed regions -----------------------------------------------------
@pytest.mark.parametrize("rows", [(10, 5), (0, 0), (0, -3), (-5, 0), (q_len, q_len),
                                  (q_len, q_len + 4), (q_len + 1, 2 * q_len)],
                         ids=str)
def test_provably_empty_region_raises(rows):
    with pytest.raises(ValueError, match=r"are empty for every q_len and metadata value"):
        Region(rows, TRUE)


def test_provably_empty_metadata_region_raises():
    a = Scalar("a", max=q_len)
    with pytest.raises(ValueError, match=r"\[a, a\).*hi <= lo.*\(a, a\)"):
        Region((a, a), k <= q)
    with pytest.raises(ValueError, match="hi <= lo"):
        Region((a + 1, a), k <= q)
    with pytest.raises(ValueError, match="hi <= lo"):
        Region((a + 5, a + 2), k <= q)


@pytest.mark.parametrize("rows", [(0, 1), (-5, 1), (10, q_len), (q_len - 3, q_len),
                                  (0, kv_len), ("a", "b"), ("a", q_len), (0, "a")], ids=str)
def test_regions_empty_only_for_some_values_keep_clamp_semantics(rows):
    named = {"a": Scalar("a", max=q_len), "b": Scalar("b", max=q_len)}
    lo, hi = (named.get(x, x) if isinstance(x, str) else x for x in rows)
    Region((lo, hi), TRUE)
    # e.g. (10, q_len) at q_len = 8: clamped to empty, rows see nothing (documented)
    spec = MaskSpec([Region((10, q_len), TRUE)])
    assert not spec.as_dense(None, 8, 8).any()
