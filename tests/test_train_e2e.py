"""benchmarks/train_e2e.py on CPU: the mask is built once per step (not per layer, not per
recomputation), gradients through the rematerialised model equal the plain ones, the
packed-HSTU mask is what it says, and ``--smoke`` trains and writes its records."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jcompilemask.lower.compiled import CompiledMask  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def e2e():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "train_e2e", os.path.join(ROOT, "benchmarks", "train_e2e.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_e2e"] = mod       # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _tiny(e2e, layers=3):
    return dataclasses.replace(e2e.CONFIGS["tiny"], layers=layers)


def _step_inputs(e2e, cfg, workload, n=64, batch=2, dtype=jnp.bfloat16, remat=True,
                 scan=True):
    model = e2e.Qwen3(cfg, dtype=dtype, remat=remat, scan=scan, rngs=nnx.Rngs(0))
    tx = e2e.make_optimizer()
    graphdef, params, opt = e2e.init_state(model, tx)
    data = e2e.make_batch(workload, n, batch, cfg.vocab)
    args = (jnp.asarray(data["tokens"]), jnp.asarray(data["positions"]),
            jnp.asarray(data["weights"]), jax.tree.map(jnp.asarray, data["metadata"]))
    return graphdef, tx, params, opt, args


def _count_prims(jaxpr, names, counts=None):
    """Occurrences of primitives ``names`` in a jaxpr, nested jaxprs included (jit,
    scan, checkpoint, custom_vjp bodies)."""
    counts = {n: 0 for n in names} if counts is None else counts
    for eq in jaxpr.eqns:
        if eq.primitive.name in counts:
            counts[eq.primitive.name] += 1
        for v in eq.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _count_prims(sub, names, counts)
    return counts


# Segment starts / ends are running max / min scans: the preprocess's signature ops,
# which the model itself never uses.
_PREPROCESS_PRIMS = ("cummax", "cummin")


@pytest.mark.parametrize("layers", [2, 4])
def test_preprocess_ops_once_in_step_jaxpr(e2e, layers):
    """The traced step (unrolled blocks, remat, backward, update) holds the preprocess
    ops of exactly one instantiate, whatever the layer count."""
    cfg = _tiny(e2e, layers=layers)
    graphdef, tx, params, opt, args = _step_inputs(e2e, cfg, "hstu", scan=False)
    step = e2e.make_train_step(graphdef, tx, e2e.mask_builder("hstu", "jcm"),
                               e2e.jcm_attend(), jit=False)
    got = _count_prims(jax.make_jaxpr(step)(params, opt, *args).jaxpr, _PREPROCESS_PRIMS)
    cm = e2e.jcm.compile(e2e.spec_for("hstu"))
    one = _count_prims(jax.make_jaxpr(lambda md: cm.instantiate(md, 64, 64))(args[3]).jaxpr,
                       _PREPROCESS_PRIMS)
    assert sum(one.values()) > 0
    assert got == one, (got, one)


@pytest.mark.parametrize("scan,remat", [(False, False), (False, True), (True, True)],
                         ids=["unrolled", "unrolled-remat", "scan-remat"])
def test_instantiate_once_per_step(e2e, monkeypatch, scan, remat):
    """Tracing one training step (forward, backward through remat'ed blocks, update)
    calls CompiledMask.instantiate once, while attention is traced once per layer."""
    calls = {"instantiate": 0, "attend": 0}
    real = CompiledMask.instantiate

    def counting(self, *a, **kw):
        calls["instantiate"] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(CompiledMask, "instantiate", counting)
    inner = e2e.jcm_attend()

    def attend(*a):
        calls["attend"] += 1
        return inner(*a)

    cfg = _tiny(e2e, layers=3)
    graphdef, tx, params, opt, args = _step_inputs(e2e, cfg, "hstu", scan=scan, remat=remat)
    step = e2e.make_train_step(graphdef, tx, e2e.mask_builder("hstu", "jcm"), attend,
                               jit=False)
    jaxpr = jax.make_jaxpr(step)(params, opt, *args)
    assert calls["instantiate"] == 1, calls
    # The plain loop traces each of the 3 blocks; scan traces its body once, and
    # jax.checkpoint reuses one trace for blocks of identical input types.
    assert calls["attend"] == (cfg.layers if not (scan or remat) else 1), calls
    assert jaxpr.jaxpr.eqns


def test_instantiate_count_detects_per_layer_masks(e2e, monkeypatch):
    """The counter of the test above sees a mask built inside every layer (so a pass
    there means once per step, not a blind counter)."""
    calls = {"n": 0}
    real = CompiledMask.instantiate

    def counting(self, *a, **kw):
        calls["n"] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(CompiledMask, "instantiate", counting)
    cm = e2e.jcm.compile(e2e.spec_for("hstu"))
    inner = e2e.jcm_attend()

    def per_layer(qh, kh, vh, md):
        return inner(qh, kh, vh, cm.instantiate(md, qh.shape[1], qh.shape[1]))

    cfg = _tiny(e2e, layers=3)
    graphdef, tx, params, opt, args = _step_inputs(e2e, cfg, "hstu", scan=False, remat=False)
    step = e2e.make_train_step(graphdef, tx, lambda md, n: md, per_layer, jit=False)
    jax.make_jaxpr(step)(params, opt, *args)
    assert calls["n"] == cfg.layers


def test_remat_gradients_match(e2e):
    cfg = _tiny(e2e, layers=2)
    grads = {}
    for remat in (True, False):
        graphdef, _, params, _, (tok, pos, w, md) = _step_inputs(
            e2e, cfg, "hstu", dtype=jnp.float32, remat=remat, scan=remat)
        build = e2e.mask_builder("hstu", "jcm")
        attend = e2e.jcm_attend()

        @jax.jit
        def grad(params, tok, pos, w, md):
            desc = build(md, tok.shape[1])

            def loss(p):
                logits = nnx.merge(graphdef, p)(tok, pos, desc, attend)
                return e2e.loss_from_logits(logits, tok, w)
            return jax.value_and_grad(loss)(params)

        grads[remat] = grad(params, tok, pos, w, md)
    (l1, g1), (l0, g0) = grads[True], grads[False]
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g1))


def _hstu_oracle(md):
    """Per user [s, e): context [s, a) sees [s, a); history rows causal from s; target
    rows see [s, b) and their group causally; padding rows see themselves."""
    users, ctx, tgt, tail = (md[k] for k in ("user_ids", "context_ids", "target_ids",
                                             "tail_ids"))
    bsz, n = users.shape
    out = np.zeros((bsz, n, n), bool)
    for b in range(bsz):
        for i in range(n):
            if users[b, i] < 0:
                out[b, i, i] = True
                continue
            s = i
            while s > 0 and users[b, s - 1] == users[b, i]:
                s -= 1
            a = s
            while a < n and ctx[b, a] >= 0 and users[b, a] == users[b, i]:
                a += 1
            hb = s
            while users[b, hb] == users[b, i] and tail[b, hb] < 0:
                hb += 1
            if i < a:
                out[b, i, s:a] = True
            elif i < hb:
                out[b, i, s:i + 1] = True
            else:
                g0 = i
                while g0 > hb and tgt[b, g0 - 1] == tgt[b, i]:
                    g0 -= 1
                out[b, i, s:hb] = True
                out[b, i, g0:i + 1] = True
    return out


def test_hstu_packed_mask_matches_oracle(e2e):
    data = e2e.make_batch("hstu", 256, 2, 16, seed=1)
    md = data["metadata"]
    users = md["user_ids"][1]
    assert len(set(users)) > 2                                 # several users packed
    last = users == users[-1]                                  # its last user -> padding
    for name in md:
        md[name][1, last] = -1
    dense = np.asarray(e2e.hstu_packed().as_dense(md, 256, 256))[:, 0]
    np.testing.assert_array_equal(dense, _hstu_oracle(md))
    desc = e2e.jcm.compile(e2e.hstu_packed()).instantiate(md, 256, 256)
    np.testing.assert_array_equal(np.asarray(desc.as_dense("fwd"))[:, 0], dense)
    np.testing.assert_array_equal(np.asarray(desc.as_dense("bwd"))[:, 0], dense)


def test_smoke_writes_records_and_table(e2e, tmp_path):
    out = tmp_path / "train.json"
    records = e2e.main(["--smoke", "--workloads", "hstu", "--impls", "jcm,cudnn-causal,no-attention",
                        "--out", str(out)])
    doc = json.loads(out.read_text())
    assert len(doc["records"]) == len(records) == 3
    for r in doc["records"]:
        assert r["status"] == "ok", r
        for key in ("model", "workload", "n", "impl", "tokens_per_s", "peak_gib", "run",
                    "step_ms", "sm_clock_mhz"):
            assert key in r, key
        assert r["loss_last"] < r["loss_first"]
    assert {r["impl"] for r in records} == {"jcm", "cudnn-causal", "no-attention"}
    jcm_rec = next(r for r in doc["records"] if r["impl"] == "jcm")
    assert jcm_rec["attention_ms"] == pytest.approx(jcm_rec["step_ms"] - jcm_rec["rest_ms"])
    md = (tmp_path / "train.md").read_text()
    assert "| hstu |" in md and "jcm" in md and "[wrong mask]" in md
    # The plot: PNG through matplotlib, else the same bars as well-formed SVG.
    if not (tmp_path / "train.png").exists():
        import xml.etree.ElementTree as ET
        root = ET.fromstring((tmp_path / "train.svg").read_text())
        assert sum(1 for el in root.iter() if el.tag.endswith("rect")) >= 2 + 2


def test_dense_baseline_in_a_fresh_process(e2e, tmp_path, monkeypatch):
    """--dense-process on: the xla-dense records come from a child process with the same run
    id, run before this process uses the device and merged after the others (on a GPU that
    is the default: the dense step then meets a device whose memory no other step holds)."""
    monkeypatch.setenv("JCM_RUN_ID", "test-run")
    out = tmp_path / "train.json"
    records = e2e.main(["--smoke", "--workloads", "hstu", "--impls", "jcm,xla-dense",
                        "--dense-process", "on", "--out", str(out)])
    assert [r["impl"] for r in records] == ["jcm", "xla-dense"]
    dense = records[1]
    assert dense["status"] == "ok" and dense["run"] == records[0]["run"] == "test-run", dense
    assert dense["loss_last"] < dense["loss_first"]
    assert [r["impl"] for r in json.loads(out.read_text())["records"]] == ["jcm", "xla-dense"]
