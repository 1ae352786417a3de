"""benchmarks/report.py: tables, ratios and well-formed SVG from results records."""
from __future__ import annotations

import importlib.util
import json
import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    """benchmarks/NAME.py as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report():
    return _load("report")


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def test_report_tables_ratios_and_svg(tmp_path):
    rep = _report()
    _write(tmp_path / "a-forward.json", {"records": [
        {"mask": "causal", "n": 2048, "impl": "jcm-cute", "fwd_ms": 1.0, "fwd_tflops": 400.0},
        {"mask": "causal", "n": 2048, "impl": "fa4-native", "fwd_ms": 1.0, "fwd_tflops": 500.0},
        {"mask": "hstu", "n": 32768, "impl": "jcm-cute", "fwd_ms": 1.0, "fwd_tflops": 600.0},
    ]})
    _write(tmp_path / "b-peers.json", {"device": "x", "records": [
        # measured again in a peers-only run: the same-run figure (500) must win
        {"mask": "causal", "n": 2048, "impl": "fa4-native", "fwd_ms": 1.0, "fwd_tflops": 800.0},
        {"mask": "hstu", "n": 32768, "impl": "flex-fa4", "fwd_ms": 1.0, "fwd_tflops": 300.0},
        {"mask": "clear", "n": 2048, "impl": "flex-fa4", "error": "failed"},
    ]})
    _write(tmp_path / "d-variants.json", {"records": [
        {"mask": "causal", "n": 8192, "impl": "jcm-cute-d64-s3", "head_dim": 64,
         "fwd_ms": 1.0, "fwd_tflops": 432.0}]})
    _write(tmp_path / "c-pre.json", [
        {"mask": "clear", "n": 1024, "impl": "jcm-tilelang", "ms": 0.1},
        {"mask": "clear", "n": 1024, "impl": "flex-create-block-mask", "ms": 7.0},
    ])
    hd = dict(mask="causal", n=32768, run="r1", head_dim=128, head_dim_v=128, softcap=None,
              fwd_ms=10.0)
    _write(tmp_path / "e-head-dims.json", {"records": [
        dict(hd, impl="jcm-cute", config="d128", bwd_ms=40.0, sm_clock_mhz=1700.0),
        dict(hd, impl="fa4-native", config="d128", bwd_ms=36.0),
        dict(hd, impl="jcm-cute", config="d128cap", softcap=30.0, bwd_ms=46.0),
        dict(hd, impl="jax-cudnn", config="d128cap", softcap=30.0, bwd_ms=None,
             error="no soft cap"),
        dict(hd, impl="jcm-xla", config="d128", bwd_ms=720.0, fwd_ms=180.0),
        dict(hd, impl="jcm-xla", config="d128cap", softcap=30.0, bwd_ms=730.0, fwd_ms=181.0),
    ]})
    paths = rep.build(str(tmp_path))
    md = (tmp_path / "REPORT.md").read_text()
    assert ("| r1 | d128 (128/128) | 32K | 10.00 / 40.00 (1700) | fa4-native 36.00 | 0.90x |  |"
            in md)
    assert "| r1 | d128cap (128/128, cap 30) | 32K | 10.00 / 46.00 | - | - | +15% |" in md
    assert "| r1 | d128 (128/128) | 32K | 180.00 / 720.00 | 40.00 | fa4-native 36.00 | 20.0x |" in md
    assert "| r1 | d128cap (128/128, cap 30) | 32K | 181.00 / 730.00 | 46.00 | - | - |" in md
    assert "| causal | 2K | 400 | 500 |  | 0.80 |  | 0.80 |" in md
    assert "| hstu | 32K | 600 |  | 300 |  | 2.00 | 2.00 |" in md
    assert "| clear | 1K | 0.1 | 7 | 70.0x |" in md
    assert "| jcm-cute-d64-s3 | 432 |" in md and "jcm-cute-d64-s3 |" not in md.split("##")[1]
    for p in paths:
        if p.endswith(".svg"):
            root = ET.parse(p).getroot()
            assert root.tag.endswith("svg") and len(root) > 10


def test_report_of_committed_results_builds(tmp_path):
    rep = _report()
    src = os.path.join(ROOT, "benchmarks", "results")
    for name in os.listdir(src):
        if name.endswith(".json"):
            (tmp_path / name).write_text(open(os.path.join(src, name)).read())
    rep.build(str(tmp_path))
    md = (tmp_path / "REPORT.md").read_text()
    assert "## Forward TF/s" in md and "## Preprocess" in md
    assert "## Backward per head-dim configuration" in md
    assert "## End-to-end training" in md


def test_report_training_table(tmp_path):
    rep = _report()
    base = dict(model="m", run="r", peak_gib=35.0)
    _write(tmp_path / "h200-train-e2e.json", {"run": "r", "records": [
        dict(base, workload="hstu", n=8192, impl="jcm", status="ok", tokens_per_s=90000.0,
             step_ms=360.0, attention_ms=120.0),
        dict(base, workload="hstu", n=8192, impl="cudnn-causal", status="ok", tokens_per_s=60000.0,
             step_ms=540.0),
        dict(base, workload="hstu", n=8192, impl="xla-dense", status="oom", error="RESOURCE_EXHAUSTED"),
        dict(base, workload="hstu", n=8192, impl="no-attention", status="ok", tokens_per_s=1.0,
             step_ms=240.0),
        dict(base, workload="causal", n=8192, impl="jcm", status="ok", tokens_per_s=50000.0,
             step_ms=600.0),
        dict(base, workload="causal", n=8192, impl="xla-dense", status="ok", tokens_per_s=25000.0,
             step_ms=1200.0),
    ]})
    rep.build(str(tmp_path))
    md = (tmp_path / "REPORT.md").read_text()
    assert "| r | m | 8K | hstu | 90,000 (120) | 60,000 [wrong mask] | 1.50x | oom | 35.0 |" in md
    assert "| r | m | 8K | causal | 50,000 | - | - | 25,000 (2.00x) | 35.0 |" in md
    assert md.index("| hstu |") < md.index("| causal |")
    assert "rest of the step without attention, m 8K (run r): 240 ms" in md


def test_bench_total_smoke_runs_on_cpu(tmp_path):
    """The training-step benchmark's jcompilemask path (preprocess, forward, backward
    through the registry's backend) at tiny shapes; peers need the GPU."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "bench_total", os.path.join(ROOT, "benchmarks", "bench_total.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "total.json"
    recs = mod.main(["--smoke", "--masks", "hstu,clear", "--out", str(out)])
    assert [r["mask"] for r in recs] == ["hstu", "clear"]
    for r in recs:
        assert "error" not in r, r
        assert r["impl"].startswith("jcm-") and r["pairs"] > 0
        assert r["step_ms"] >= r["fwd_ms"] > 0 and r["total_tflops"] > 0
    saved = json.loads(out.read_text())
    assert saved["smoke"] is True and len(saved["records"]) == 2
    # smoke files are not results: the report skips them
    rep = _report()
    assert rep.load(str(tmp_path))[3] == []  # total records


def test_bench_total_smoke_runs_issue_16_masks(tmp_path):
    """Issue 16's workloads (block-causal in both spellings, the dilated window with its
    residual predicate, global tokens + window) through the same benchmark path."""
    mod = _bench_module("bench_total")
    import workloads as W
    recs = mod.main(["--smoke", "--masks", ",".join(W.MASKS_16), "--out", str(tmp_path / "m.json")])
    assert [r["mask"] for r in recs] == list(W.MASKS_16)
    assert all("error" not in r and r["pairs"] > 0 for r in recs), recs
    pairs = {r["mask"]: r["pairs"] for r in recs}
    assert pairs["block_causal"] == pairs["block_causal_intervals"]


def test_bench_total_smoke_runs_packed_dilated_documents(tmp_path):
    """The per-class workload (packed documents under the dilated window): the class
    descriptor's pairs are its classes' own, and the check against the dense reference
    passes."""
    mod = _bench_module("bench_total")
    recs = mod.main(["--smoke", "--masks", "dilated_documents", "--check",
                     "--out", str(tmp_path / "d.json")])
    assert len(recs) == 1 and recs[0]["check"] == "ok", recs
    import workloads as W
    import jcompilemask as jcm
    n = recs[0]["n"]
    md = W.metadata_for("dilated_documents", n, batch=1)
    d = jcm.compile(W.spec_for("dilated_documents", n)).instantiate(md, n, n)
    assert d.per_class
    assert W.descriptor_pairs(d) == int(np.asarray(d.mask.spec.as_dense(md, n)).sum())


def _bench_module(name):
    import sys
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_total_records_run_and_clock_fields(tmp_path):
    """Every record carries the run id and the clock / power medians; with no GPU to
    sample they are null, not missing."""
    mod = _bench_module("bench_total")
    import clocks
    recs = mod.main(["--smoke", "--masks", "causal", "--out", str(tmp_path / "t.json")])
    assert len(recs) == 1
    r = recs[0]
    for key in ("run", "sm_clock_mhz", "power_w", "check"):
        assert key in r, key
    assert r["run"] == clocks.run_id() and r["check"] is None
    if clocks.sampler().source is None:        # no pynvml, no nvidia-smi: a CPU machine
        assert r["sm_clock_mhz"] is None and r["power_w"] is None
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["run"] == r["run"]


def test_bench_total_records_the_switches_in_effect(tmp_path, monkeypatch):
    """A jcm record names the JCOMPILEMASK_* variables it was timed under (the process's and
    its --jcm-variants entry's) in ``env``; with none set it has no ``env`` field."""
    mod = _bench_module("bench_total")
    for name in [k for k in os.environ if k.startswith("JCOMPILEMASK_")]:
        monkeypatch.delenv(name)
    recs = mod.main(["--smoke", "--masks", "causal", "--out", str(tmp_path / "a.json")])
    assert "env" not in recs[0]
    monkeypatch.setenv("JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY", "1")
    recs = mod.main(["--smoke", "--masks", "causal", "--out", str(tmp_path / "b.json"),
                     "--jcm-variants", "base=;x=JCOMPILEMASK_CUTE_FWD_MASK_R2P=0"])
    assert [r["impl"] for r in recs] == ["jcm-xla", "jcm-xla-x"]
    assert recs[0]["env"] == {"JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY": "1"}
    assert recs[1]["env"] == {"JCOMPILEMASK_CUTE_FWD_MASK_R2P": "0",
                              "JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY": "1"}


def test_bench_total_skip_and_elapsed(tmp_path):
    """--skip IMPL:MASK leaves those records out (so a table fits one device call); each
    record says when it finished (elapsed_s); a malformed pair is refused by name."""
    mod = _bench_module("bench_total")
    recs = mod.main(["--smoke", "--masks", "causal,clear", "--skip", "jcm:causal",
                     "--out", str(tmp_path / "s.json")])
    assert [r["mask"] for r in recs] == ["clear"]
    assert recs[0]["elapsed_s"] >= 0
    with pytest.raises(SystemExit, match="IMPL:MASK"):
        mod.main(["--smoke", "--masks", "causal", "--skip", "flex-fa4",
                  "--out", str(tmp_path / "t.json")])


def test_bench_total_prewarm(tmp_path):
    """--prewarm P: every (N, mask) configuration first runs untimed in a worker process
    (the same arguments less the timing / output ones), then the timed pass; each record
    says whether its configuration's worker finished."""
    mod = _bench_module("bench_total")
    argv = ["--ns", "8", "--masks", "a", "--out", "x.json", "--min-repeat-s=2", "--prewarm",
            "3", "--prewarm-s", "9", "--check", "--impls", "jcm"]
    import prewarm
    assert prewarm.without(argv, ("--ns", "--masks", "--out", "--min-repeat-s", "--prewarm",
                                  "--prewarm-s"), ("--check",)) == ["--impls", "jcm"]
    recs = mod.main(["--smoke", "--masks", "causal", "--prewarm", "1",
                     "--out", str(tmp_path / "p.json")])
    assert len(recs) == 1 and "error" not in recs[0] and recs[0]["prewarmed"] is True


def test_bench_total_variants_and_check(tmp_path, monkeypatch):
    """--jcm-variants: one record per entry, named by its tag, each traced under its own
    environment (restored after); --check records "ok" for the jcm gradients."""
    mod = _bench_module("bench_total")
    var = "JCM_BENCH_TEST_VARIANT"
    monkeypatch.delenv(var, raising=False)
    seen = []
    real = mod.bench_jcm

    def spy(*a, **kw):
        seen.append(os.environ.get(var))
        return real(*a, **kw)
    monkeypatch.setattr(mod, "bench_jcm", spy)
    recs = mod.main(["--smoke", "--masks", "hstu", "--out", str(tmp_path / "v.json"),
                     "--jcm-variants", f"base=;v2={var}=a=b", "--check"])
    backend = recs[0]["impl"]
    assert backend.startswith("jcm-")
    assert [r["impl"] for r in recs] == [backend, backend + "-v2"]
    assert seen == [None, "a=b"] and var not in os.environ
    assert all(r["check"] == "ok" for r in recs), recs
    assert len({r["run"] for r in recs}) == 1
    assert mod.parse_variants("x=A=1 B=2;;y") == [("x", {"A": "1", "B": "2"}), ("y", {})]
    with pytest.raises(ValueError, match="--jcm-variants"):
        mod.parse_variants("a b=X=1")
    with pytest.raises(ValueError, match="twice"):
        mod.parse_variants("a=;a=X=1")


def test_bench_total_check_reports_failure_instead_of_raising():
    mod = _bench_module("bench_total")
    out = mod.check_jcm("hstu", smoke=True, implementation="no-such-backend")
    assert out.startswith("FAIL: ") and "\n" not in out


def test_bench_total_table_has_clock_and_peer_ratio_columns():
    mod = _bench_module("bench_total")
    base = dict(mask="causal", n=8192, pre_ms=0.0, fwd_ms=1.0, total_tflops=1.0,
                run="r", power_w=None)
    recs = [dict(base, impl="jcm-cute", bwd_ms=3.0, sm_clock_mhz=1650.0),
            dict(base, impl="fa4-native", bwd_ms=2.0, sm_clock_mhz=1700.0),
            dict(base, impl="jax-cudnn", bwd_ms=4.0, sm_clock_mhz=None),
            dict(base, mask="hstu", impl="jcm-cute", bwd_ms=5.0, sm_clock_mhz=None),
            {"mask": "hstu", "n": 8192, "impl": "flex-fa4", "error": "x"}]
    assert mod.bwd_ratios(recs) == [1.5, 1.0, 2.0, None, None]
    md = mod.table(recs)
    assert "| sm_clock_mhz | bwd / best peer |" in md
    assert "| causal | 8192 | jcm-cute | 0.0 | 1.0 | 3.0 | 1.0 | 1650.0 | 1.50 |" in md
    assert "| hstu | 8192 | jcm-cute | 0.0 | 1.0 | 5.0 | 1.0 |  |  |" in md
    assert "flex-fa4" not in md


def test_sustained_timing_loop_lasts_the_minimum():
    timing = _bench_module("timing")
    import time
    calls, syncs, windows = [], [], []
    t = timing.sustained(lambda: calls.append(time.sleep(0.002)), syncs.append,
                         min_repeat_s=0.05, repeats=3, windows=windows)
    assert 0.002 <= t < 0.02
    assert len(windows) == 3 and all(t1 - t0 >= 0.04 for t0, t1 in windows)
    # one synchronisation per loop, not per call
    assert len(syncs) < len(calls) / 10


def test_clock_sampler_reads_nvidia_smi(tmp_path, monkeypatch):
    """The nvidia-smi path of the sampler, against a stand-in printing the same CSV."""
    clocks = _bench_module("clocks")
    import time
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nwhile true; do\n"
                    "  echo \"$(date '+%Y/%m/%d %H:%M:%S.%N' | cut -c1-23), 1755, 512.5\"\n"
                    "  sleep 0.1\ndone\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    s = clocks.Sampler(index=0, sources=("nvidia-smi",))
    try:
        assert s.source == "nvidia-smi"
        t0 = time.time()
        time.sleep(0.6)
        assert s.summary([(t0, time.time())]) == {"sm_clock_mhz": 1755.0, "power_w": 512.5}
    finally:
        s.close()
    none = clocks.Sampler(index=0, sources=())
    assert none.source is None
    assert none.summary([(0.0, 1.0)]) == {"sm_clock_mhz": None, "power_w": None}


def test_report_prefers_the_peer_of_the_same_run_id(tmp_path):
    rep = _report()
    _write(tmp_path / "a-forward.json", {"records": [
        {"mask": "causal", "n": 2048, "impl": "jcm-cute", "fwd_ms": 1.0, "fwd_tflops": 400.0,
         "run": "r1"}]})
    _write(tmp_path / "b-peers.json", {"records": [
        {"mask": "causal", "n": 2048, "impl": "fa4-native", "fwd_ms": 1.0, "fwd_tflops": 500.0,
         "run": "r1"}]})
    _write(tmp_path / "c-peers.json", {"records": [
        {"mask": "causal", "n": 2048, "impl": "fa4-native", "fwd_ms": 1.0, "fwd_tflops": 800.0,
         "run": "r2"}]})
    rep.build(str(tmp_path))
    assert "| causal | 2K | 400 | 500 |" in (tmp_path / "REPORT.md").read_text()


def test_report_keeps_the_newest_run_over_an_undated_record_of_the_same_file(tmp_path):
    """A file holding an old record without a run id and a newer one with an id: the newer
    is ours, and the undated one is not taken for its run."""
    rep = _report()
    _write(tmp_path / "a-forward.json", {"records": [
        {"mask": "causal", "n": 2048, "impl": "jcm-cute", "fwd_ms": 1.0, "fwd_tflops": 300.0},
        {"mask": "causal", "n": 2048, "impl": "jcm-cute", "fwd_ms": 1.0, "fwd_tflops": 400.0,
         "run": "2026-01-01T00:00:00Z"}]})
    rep.build(str(tmp_path))
    assert "| causal | 2K | 400 |" in (tmp_path / "REPORT.md").read_text()


def test_bench_head_dims_smoke_records(tmp_path):
    """Issue 15's benchmark at tiny shapes on the CPU (the xla path): one record per
    configuration with the fields the note's tables read."""
    mod = _bench_module("bench_head_dims")
    out = tmp_path / "hd.json"
    recs = mod.main(["--smoke", "--out", str(out)])
    assert [r["config"] for r in recs] == list(mod.CONFIGS)
    for r in recs:
        assert "error" not in r, r
        for f in ("mask", "n", "impl", "head_dim", "head_dim_v", "softcap", "fwd_ms", "bwd_ms",
                  "run", "sm_clock_mhz"):
            assert f in r, f
        assert r["impl"] == "jcm-xla" and r["step_ms"] >= r["fwd_ms"] > 0
    by = {r["config"]: r for r in recs}
    assert by["d192"]["head_dim"] != by["d192"]["head_dim_v"] and by["d128cap"]["softcap"] == 30.0
    assert json.loads(out.read_text())["smoke"] is True
    # --prewarm: the configuration first runs untimed in a worker process
    recs = mod.main(["--smoke", "--configs", "d64", "--prewarm", "1", "--out", str(out)])
    assert len(recs) == 1 and recs[0]["prewarmed"] is True and "error" not in recs[0]


def test_bench_head_dims_fa4_tile_impls():
    """fa4-native-tMxN names FA4 with its SM90 backward tile forced (fa4_tile); other names
    are refused with what is accepted."""
    import pytest
    mod = _bench_module("bench_head_dims")
    assert mod.fa4_tile("fa4-native") is None
    assert mod.fa4_tile("fa4-native-t64x64") == (64, 64)
    assert mod.fa4_tile("fa4-native-t80x128") == (80, 128)
    for bad in ("fa4-native-64x64", "fa4-native-t64", "fa4", "fa4-native-tAxB"):
        with pytest.raises(ValueError, match="fa4-native-tMxN"):
            mod.fa4_tile(bad)
    with mod.fa4_bwd_tile(None):          # no tile: nothing imported, nothing patched
        pass


def test_bench_head_dims_variants_parse_and_scope_the_env(monkeypatch):
    """--jcm-variants: NAME@CONFIG=CFG items; the config env is set only while a variant runs."""
    import pytest
    mod = _bench_module("bench_head_dims")
    assert mod.parse_variants("sdp@d192=split_sdp=1,ds_stages=1; ss@d128cap=static_stage=1") == {
        "sdp": ("d192", "split_sdp=1,ds_stages=1"), "ss": ("d128cap", "static_stage=1")}
    for bad in ("sdp=split_sdp=1", "sdp@d999=split_sdp=1", "sdp@d192", "rse@d256:",
                "rse@d256:PATH=/x", "rse@d999:JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY=1",
                "rse@d256:JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY"):
        with pytest.raises(ValueError, match="NAME@CONFIG"):
            mod.parse_variants(bad)
    assert mod.parse_variants("b@d256:JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY=1 JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY=1") == {
        "b": ("d256", {"JCOMPILEMASK_CUTE_FWD_RESCALE_EARLY": "1", "JCOMPILEMASK_CUTE_FWD_OPERANDS_EARLY": "1"})}
    monkeypatch.delenv(mod.BWD_CONFIG_ENV, raising=False)
    with mod.environment({mod.BWD_CONFIG_ENV: "split_sdp=1"}):
        assert os.environ[mod.BWD_CONFIG_ENV] == "split_sdp=1"
    assert mod.BWD_CONFIG_ENV not in os.environ


def test_quick_summary_reads_each_part(tmp_path, capsys):
    """benchmarks/quick_summary.py: the ratio each of h200.sh quick's decisions rests on."""
    qs = _load("quick_summary")
    _write(tmp_path / "h200-fwd-quick.json", {"records": [
        {"mask": "causal", "n": 8192, "impl": "fa4-native", "fwd_ms": 3.8},
        {"mask": "causal", "n": 8192, "impl": "jcm-cute", "fwd_ms": 4.0},
        {"mask": "causal", "n": 8192, "impl": "jcm-cute-oepd", "fwd_ms": 3.7}]})
    hd = dict(mask="causal", n=8192, head_dim=128, head_dim_v=128)
    _write(tmp_path / "h200-head-dims-cap.json", {"records": [
        dict(hd, impl="jcm-cute", config="d128", bwd_ms=10.0),
        dict(hd, impl="jcm-cute", config="d128cap", bwd_ms=12.0),
        dict(hd, impl="jcm-cute-dvs2rk", config="d128cap", bwd_ms=11.0),
        dict(hd, impl="fa4-native", config="d128cap", bwd_ms=14.3),
        dict(hd, impl="jcm-cute-dkl", config="d128cap", bwd_ms=11.5),
        dict(hd, impl="jcm-cute-dkln", config="d128", bwd_ms=10.4)]})
    _write(tmp_path / "h200-head-dims-d192.json", {"records": [
        dict(hd, impl="jcm-cute", config="d192", bwd_ms=18.0),
        dict(hd, impl="fa4-native", config="d192", bwd_ms=15.0),
        dict(hd, impl="fa4-native-t64x64", config="d192", bwd_ms=18.0, error=None)]})
    lines = qs.summary(str(tmp_path))
    text = "\n".join(lines)
    assert "fwd causal 8192: jcm-cute-oepd 3.7 ms, FA4 / ours 1.027" in text
    assert "fwd causal 8192: jcm-cute 4.0 ms, FA4 / ours 0.950" in text
    assert "cap 8192: jcm-cute 12.0 ms, cost 1.200 (line 1.15)" in text
    assert "cap 8192: jcm-cute-dvs2rk 11.0 ms, cost 1.100 (line 1.15), FA4 capped / ours 1.300" in text
    assert "cap 8192: jcm-cute-dkl 11.5 ms, cost 1.150 (line 1.15), FA4 capped / ours 1.243, " \
        "cost against jcm-cute-dkln 1.106" in text
    assert "cap 8192: uncapped jcm-cute-dkln 10.4 ms, 1.040 of the default" in text
    assert "d192 8192: fa4-native 15.0 ms, fa4-native / ours 0.833" in text
    assert "d192 8192: fa4-native-t64x64 18.0 ms, fa4-native-t64x64 / ours 1.000" in text
    assert lines[-1] == "masks: no records (h200-quick-masks.json missing or empty)"
    _write(tmp_path / "h200-quick-masks.json", {"records": [
        {"mask": "dilated_window", "n": 8192, "impl": "jcm-cute", "bwd_ms": 1.43, "step_ms": 1.95},
        {"mask": "dilated_window", "n": 8192, "impl": "jcm-cute-au", "bwd_ms": 1.50,
         "step_ms": 2.0},
        {"mask": "dilated_window", "n": 8192, "impl": "jcm-cute-pd", "error": "failed"}]})
    text = "\n".join(qs.summary(str(tmp_path)))
    assert "masks dilated_window 8192: jcm-cute-au bwd 1.5 ms (1.049 of the default), step 1.026" in text
    assert "masks dilated_window 8192: jcm-cute-pd bwd None ms (- of the default), step -" in text
    assert qs.main([str(tmp_path / "nowhere")]) == 2
    assert qs.main([str(tmp_path)]) == 0 and "d192 8192" in capsys.readouterr().out


def test_flex_eager_block_mask_choice_names_mask_or_mask_at_n():
    """--flex-eager-block-mask (bench_total and bench_peers): MASK or MASK@N, comma-separated."""
    _bench_module("bench_total")                  # puts benchmarks/ on sys.path
    import workloads as W
    assert W.eager_block_mask("clear@8192", "clear", 8192)
    assert not W.eager_block_mask("clear@8192", "clear", 32768)
    assert W.eager_block_mask(" hstu , clear@8192", "hstu", 2048)
    assert not W.eager_block_mask("", "clear", 8192)



def test_kernel_times_smoke_lists_the_step_kernels_on_cpu(tmp_path):
    """kernel_times.py's jcompilemask path end to end on the CPU: the step traced with
    jax.profiler, read back with ProfileData (the host plane's XLA ops where there is no
    GPU plane), summed per step, merged into --out."""
    kt = _load("kernel_times")
    out = tmp_path / "kernels.json"
    (rec,) = kt.main(["--smoke", "--steps", "2", "--out", str(out)])
    assert "error" not in rec, rec
    assert rec["impl"].startswith("jcm-") and rec["smoke"] is True and rec["n"] == 256
    assert rec["kernels"] and rec["gpu_ms"] > 0 and rec["wall_ms"] > 0
    assert "sm_clock_mhz" in rec and "power_w" in rec      # None here: no GPU to sample
    assert rec["lines"] and all(x.startswith("/host:CPU") for x in rec["lines"])
    us = [r["us"] for r in rec["kernels"]]
    assert us == sorted(us, reverse=True)
    saved = json.loads(out.read_text())["records"]
    assert len(saved) == 1 and saved[0]["kernels"] == rec["kernels"]
    out.write_text(json.dumps({"note": "kept", "records": saved}))
    kt.merge(str(out), [dict(rec, gpu_ms=1.0)])           # same key: replaced, not added
    assert [r["gpu_ms"] for r in json.loads(out.read_text())["records"]] == [1.0]
    assert json.loads(out.read_text())["note"] == "kept"


def test_kernel_times_variants_name_the_variant_and_its_env(tmp_path):
    """--jcm-variants: the jcm record under a JCOMPILEMASK_* variant says which (impl
    suffix, env), as bench_total.py's records do. Several runs go to one child process each
    (one CUPTI profiler per process), under one run id, merged into --out."""
    kt = _load("kernel_times")
    out = tmp_path / "kernels.json"
    base, hi = kt.main(["--smoke", "--steps", "1", "--out", str(out), "--jcm-variants",
                        "base=;hi=JCOMPILEMASK_CUTE_BWD_CONFIG=heads_inner=1"])
    assert "error" not in base and "error" not in hi, (base, hi)
    assert "-" not in base["impl"][len("jcm-"):] and "env" not in base
    assert hi["impl"].endswith("-hi")
    assert hi["env"] == {"JCOMPILEMASK_CUTE_BWD_CONFIG": "heads_inner=1"}
    assert base["run"] == hi["run"]
    saved = json.loads(out.read_text())["records"]
    assert sorted(r["impl"] for r in saved) == sorted([base["impl"], hi["impl"]])
    assert kt.variant_entry("hi", hi["env"]) == "hi=JCOMPILEMASK_CUTE_BWD_CONFIG=heads_inner=1"


def test_kernel_times_summary_and_torch_events():
    """Per-step rows from raw events (the docstring example, names cut), and the device
    events picked out of a torch profiler's event list (stand-ins: no torch on CI)."""
    import doctest
    import types
    kt = _load("kernel_times")
    assert doctest.testmod(kt).failed == 0
    rows = kt.summarize([("x" * 200, 5.0), ("y", 1.0)], steps=1, name_chars=8)
    assert rows == [dict(name="xxxxxxxx", calls=1.0, us=5.0), dict(name="y", calls=1.0, us=1.0)]
    with pytest.raises(ValueError, match="steps"):
        kt.summarize([], steps=0)

    def ev(name, dev, us):
        return types.SimpleNamespace(name=name, device_type=f"DeviceType.{dev}",
                                     time_range=types.SimpleNamespace(elapsed_us=lambda: us))
    prof = types.SimpleNamespace(events=lambda: [ev("aten::mm", "CPU", 9.0),
                                                 ev("bwd_kernel", "CUDA", 40.0),
                                                 ev("Memset (Device)", "CUDA", 2.0)])
    assert kt.torch_events(prof) == [("bwd_kernel", 40.0), ("Memset (Device)", 2.0)]


def test_kernel_times_rejects_bad_arguments(capsys):
    kt = _load("kernel_times")
    for argv, text in ((["--impls", "jcm,cudnn"], "unknown"), (["--mask", "nope"], "unknown"),
                       (["--steps", "0"], "steps")):
        with pytest.raises(SystemExit):
            kt.main(argv)
        assert text in capsys.readouterr().err


def test_ncu_sass_summary_reads_a_committed_profile(capsys):
    """tests/scripts/ncu_sass_summary.py on session 39's ncu page of the dilated window's
    backward (an H100): the stall reasons' shares, and ``--reason barrier`` naming the
    instruction each barrier wait follows (the dQ warp's DQ_FULL, the consumers' last
    DQ_EMPTY before the epilogue)."""
    spec = importlib.util.spec_from_file_location(
        "ncu_sass_summary", os.path.join(ROOT, "tests", "scripts", "ncu_sass_summary.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = os.path.join(ROOT, "benchmarks", "results", "profiles",
                        "ncu-bwd-s39-h100-dilated8k-jcm-sass.csv.gz")
    rows = mod.load(path)
    _, reasons = mod.summarise(rows)
    total = sum(r[2] for r in rows)
    assert total == 125053 and round(100 * reasons["barrier"] / total, 1) == 18.4
    sites = mod.reason_sites(rows, "barrier", 2)
    assert [s[0] for s in sites] == [560, 3002]
    assert all(s[5].startswith("BAR.SYNC") or "BAR.SYNC" in s[5] for s in sites)
    mod.main([path, "--top", "3", "--reason", "barrier"])
    out = capsys.readouterr().out
    assert "sites of stall reason 'barrier'" in out and "after @P0   BAR.SYNC" in out


def test_bench_glue_times_the_xla_passes_on_cpu(tmp_path):
    """benchmarks/bench_glue.py's XLA impls at tiny shapes (the kernels need the GPU: on a
    CPU their records carry the error instead of figures, and the others still come)."""
    mod = _bench_module("bench_glue")
    out = tmp_path / "glue.json"
    recs = mod.main(["--ns", "128", "--tokens", "256", "--min-repeat-s", "0.01", "--impls",
                     "xla-prep,xla-post,cute-post", "--out", str(out)])
    assert [r["impl"] for r in recs] == ["xla-prep", "xla-post", "cute-post"]
    for r in recs[:2]:
        assert "error" not in r, r
        # tb_per_s is rounded: on a loaded CPU at these sizes it can read 0.0
        assert r["us"] > 0 and r["gbytes"] > 0 and r["tb_per_s"] >= 0 and "run" in r
    assert recs[0]["gbytes"] == round(256 * 8 * 128 * 8 / 1e9, 4)
    assert "error" in recs[2]
    assert len(json.loads(out.read_text())["records"]) == 3
    with pytest.raises(SystemExit):
        mod.main(["--impls", "xla-nope"])


def test_bench_total_smoke_runs_a_traced_dense_mask(tmp_path):
    """``documents_traced`` (packed causal documents as a boolean array computed in the
    step) beside ``documents`` (the same mask as a MaskSpec): the same pairs."""
    mod = _bench_module("bench_total")
    import workloads as W
    recs = mod.main(["--smoke", "--masks", ",".join(W.MASKS_RUNTIME),
                     "--out", str(tmp_path / "r.json")])
    assert [r["mask"] for r in recs] == list(W.MASKS_RUNTIME)
    assert all("error" not in r and r["pairs"] > 0 for r in recs), recs
    assert recs[0]["pairs"] == recs[1]["pairs"], recs


def test_bench_runtime_dense_smoke_runs_on_cpu(tmp_path):
    """The run-time dense preprocess's parts at tiny shapes (a word-aligned and a ragged
    length): every part runs."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    mod = _load("bench_runtime_dense")
    out = tmp_path / "rd.json"
    recs = mod.main(["--smoke", "--ns", "64,40", "--out", str(out)])
    names = {r["part"] for r in recs}
    assert {"pack_cols", "row_first_runs_from_words", "plan"} <= names
    assert all(r["ms"] > 0 for r in recs) and len(recs) == 2 * len(names)
    assert json.loads(out.read_text())["smoke"] is True
