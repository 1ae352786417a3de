"""benchmarks/multi_gpu.py (the multi-GPU run's script) in its CPU smoke mode: 8 virtual
devices, tiny sizes, the xla backend. The batch-sharded step has no collective at all
(the descriptor is built per device inside the jit), device 0's gradients equal the
one-device ones, and context parallelism matches the one-device call while its plan sends
fewer bytes than a full ring."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_multi_gpu_smoke(tmp_path):
    out = tmp_path / "multi.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "multi_gpu.py"), "--smoke", "--gpus", "2",
         "--masks", "causal,hstu", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = json.loads(out.read_text())["records"]
    assert {(r["mode"], r["mask"]) for r in recs} == {
        ("shard", "causal"), ("shard", "hstu"), ("cp", "causal"), ("cp", "hstu")}
    for r in recs:
        assert "error" not in r, r
        assert r["match"], r
        assert r["run"] and "sm_clock_mhz" in r
        if r["mode"] == "shard":
            assert r["collectives"] == {}, r       # no all-gather of q, k, v; nothing at all
        else:
            assert 0 < r["bytes_sent"] <= r["bytes_full_ring"], r
            assert r["bytes_hlo"] > 0 and r["collectives"].get("all-gather", 0) == 0, r
            assert r["work_max_min"] <= 1.25, r
    causal = next(r for r in recs if r["mode"] == "cp" and r["mask"] == "causal")
    assert causal["bytes_sent"] < causal["bytes_full_ring"]  # the last step's sends are cut
    assert "| mode | mask |" in proc.stdout


def test_permute_bytes_parses_hlo():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import multi_gpu as M
    hlo = ("  %cp.1 = bf16[1,128,8,128]{3,2,1,0} collective-permute(bf16[1,128,8,128]{3,2,1,0} %x), "
           "channel_id=1, source_target_pairs={{0,1},{1,2},{2,3}}, metadata={}\n"
           "  %ag = f32[8]{0} all-gather(f32[2]{0} %y), dimensions={0}\n")
    assert M.permute_bytes(hlo) == 3 * 128 * 8 * 128 * 2
    assert M.collectives(hlo) == {"collective-permute": 1, "all-gather": 1}
