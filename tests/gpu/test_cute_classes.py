"""Residue classes on the CuTe kernels (issue 16): masks whose rule pairs each query only
with keys of its own class mod ``c`` run one class's mask with the classes as heads
(``jcompilemask.lower.classes``; ``mask_attention`` views [B, N, H, D] as
[B, N / c, c * H, D]), forward and backward against the dense oracle under the tolerance
policy, the registry choosing cute for them on its own; and the classes give the residual
lowering's results (``$JCOMPILEMASK_ROW_CLASSES=0``) within the policy. Packed documents
with a dilated window: each class its own segment ids and descriptor (the call's heads
read their class's tables). On CI (no GPU) they
skip; tests/test_row_classes.py runs the same checks on the xla backend.

    python3 -m pytest -q tests/gpu/test_cute_classes.py        # on the H200
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jcompilemask import backends
from jcompilemask.lower.classes import find_row_classes
from jcompilemask.spec import MaskSpec, Region, SegmentIds, k, q, q_len
from gpu_cases import check_attention, metadata, registry_names_cute  # noqa: E402  (tests/gpu is on sys.path)

_why = backends.get("cute").available()
needs_gpu = pytest.mark.skipif(_why is not None, reason=f"cute backend unavailable: {_why}")

CASES = {
    # the benchmark's dilated window: 128 wide, dilation 2 (a causal window 64 per class)
    "dilated_window": (k <= q) & (k > q - 128) & ((q - k) % 2 == 0),
    # bidirectional, dilation 3 (class windows of 22 / 21 keys)
    "dilated_bidirectional3": (q % 3 == k % 3) & (q - k < 64) & (k - q < 64),
    # dilation 4, causal, unbounded: every fourth earlier key
    "strided_causal4": (k <= q) & ((q - k) % 4 == 0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_registry_runs_the_classes_on_cute(name):
    """CPU twin of the registry's choice: the class mask (no residual) takes cute, with the
    classes as heads (explain names it)."""
    spec = MaskSpec([Region((0, q_len), CASES[name])])
    rc = find_row_classes(spec)
    assert rc is not None
    registry_names_cute(rc.spec, hq=8 * rc.factor, hkv=8 * rc.factor, mark_available=True)
    text = registry_names_cute(spec, mark_available=True)
    assert f"residue classes mod {rc.factor}" in text and "on: cute" in text, text


@needs_gpu
@pytest.mark.parametrize("dtype, hq, hkv", [(jnp.bfloat16, 4, 2), (jnp.float16, 2, 2)],
                         ids=["bf16-gqa", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_classes_match_the_oracle(name, dtype, hq, hkv):
    spec = MaskSpec([Region((0, q_len), CASES[name])])
    n = 12 * 64 if name != "dilated_bidirectional3" else 3 * 256      # multiples of c
    check_attention(spec, None, 2, n, hq, hkv, 128, dtype, "cute", seed=1)


@needs_gpu
def test_classes_against_the_residual_lowering(monkeypatch):
    """The same call with the classes off runs the residual kernels; both within the policy
    of the oracle (check_attention), so the two paths serve one semantics."""
    spec = MaskSpec([Region((0, q_len), CASES["dilated_window"])])
    check_attention(spec, None, 2, 1024, 4, 2, 64, jnp.bfloat16, "cute", seed=2)
    monkeypatch.setenv("JCOMPILEMASK_ROW_CLASSES", "0")
    check_attention(spec, None, 2, 1024, 4, 2, 64, jnp.bfloat16, "cute", seed=2)


_SEG = SegmentIds("segment_ids")
PACKED = MaskSpec([Region((0, q_len), (k >= _SEG.start(q)) & (k < _SEG.end(q))
                          & CASES["dilated_window"])])


def test_registry_runs_packed_classes_on_cute():
    rc = find_row_classes(PACKED)
    assert rc is not None and rc.segments == ("segment_ids",)
    registry_names_cute(rc.spec, hq=8 * rc.factor, hkv=8 * rc.factor, mark_available=True)
    text = registry_names_cute(PACKED, mark_available=True)
    assert "each with its own segment ids" in text and "on: cute" in text, text


@needs_gpu
@pytest.mark.parametrize("dtype, hq, hkv", [(jnp.bfloat16, 4, 2), (jnp.float16, 2, 2)],
                         ids=["bf16-gqa", "fp16"])
def test_packed_documents_with_a_dilated_window(dtype, hq, hkv):
    md = metadata("document", 2, 768, np.random.default_rng(4))
    check_attention(PACKED, md, 2, 768, hq, hkv, 128, dtype, "cute", seed=3)
