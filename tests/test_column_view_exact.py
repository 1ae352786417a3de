"""CompiledMask.column_view_exact: a static promise that every descriptor's column view is
exact (``bwd_exact`` all True), which lets the CuTe backward compile its masked tiles
without the row path (BackwardKey.exact_columns). Checked against instantiated
descriptors on random metadata of every built-in mask, hstu written as one region, and a
residual mask."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings

import jcompilemask as jcm
from jcompilemask.spec import MaskSpec, Region, k, q, q_len

from strategies import builtin_case, hstu_one_region


@settings(max_examples=40, deadline=None)
@given(builtin_case())
def test_promise_holds_on_random_metadata(case):
    name, _, spec, md, nq, nk = case
    cm = jcm.compile(spec, warn=False)
    desc = cm.instantiate(md, nq, nk, preprocess="jnp")
    exact = np.asarray(desc.bwd_exact)
    if cm.column_view_exact:
        assert exact.all(), (name, exact)
    assert cm.column_view_exact == (cm.num_bwd_intervals > 0 and len(cm.regions) == 1)


def test_which_masks_promise_it():
    yes = [jcm.masks.causal(), jcm.masks.sliding_window(3, 1), hstu_one_region(),
           MaskSpec([Region((0, q_len), (k <= q) & (k > q - 128) & ((q - k) % 2 == 0))])]
    no = [jcm.masks.hstu(), jcm.masks.shared_prompt(2), jcm.masks.clear(4, 1)]
    assert all(jcm.compile(s, warn=False).column_view_exact for s in yes)
    assert not any(jcm.compile(s, warn=False).column_view_exact for s in no)


def test_nested_regions_break_it_at_run_time():
    """Two regions whose row ranges nest for some metadata: the column view is not exact
    there, and the mask makes no promise."""
    from jcompilemask.spec import Scalar
    a, b = Scalar("a", max=q_len), Scalar("b", max=q_len)
    spec = MaskSpec([Region((a, b), k <= q), Region((0, q_len), k < 2)])
    cm = jcm.compile(spec, warn=False)
    assert not cm.column_view_exact
    desc = cm.instantiate({"a": np.array([3], np.int32), "b": np.array([5], np.int32)}, 8, 8,
                          preprocess="jnp")
    assert not np.asarray(desc.bwd_exact).all()
