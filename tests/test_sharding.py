"""mask_attention under a plain jax.jit with batch / head sharded inputs (the
partitioning rules of jcompilemask.attention.partition): a subprocess, since it needs 8
host devices (set before JAX starts). See tests/scripts/sharding_check.py for the cases."""
import os
import subprocess
import sys


def test_batch_and_head_sharding_is_local_and_matches():
    script = os.path.join(os.path.dirname(__file__), "scripts", "sharding_check.py")
    res = subprocess.run([sys.executable, script], capture_output=True, text=True,
                         timeout=1200)
    assert res.returncode == 0 and "OK 23" in res.stdout, (res.stdout[-2000:]
                                                           + res.stderr[-4000:])
