"""Run in a subprocess by tests/test_attention.py (it needs 4 host devices, which must be
set before JAX starts): mask_attention inside jax.shard_map over a data axis equals the
unsharded call, forward and gradients, with metadata sharded along the batch."""
import os

# N host devices; XLA's CPU backend at optimization level 0: these checks compile many
# small programs and run each once, so compile time is what they spend (about half of it
# goes with -O0; the results are compared under the same tolerance policy).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jcompilemask as jcm  # noqa: E402

B, N, H, D = 4, 48, 2, 16
cm = jcm.compile(jcm.masks.document())
ids = np.sort(np.random.default_rng(0).integers(0, 4, (B, N)), axis=1).astype(np.int32)
q, k, v, do = (jax.random.normal(kk, (B, N, H, D), jnp.float32)
               for kk in jax.random.split(jax.random.key(0), 4))


def attend(q, k, v, ids):
    desc = cm.instantiate({"segment_ids": ids}, N, N, block_q=16, block_kv=16,
                          bwd_block_q=16, bwd_block_kv=16)
    return jcm.mask_attention(q, k, v, desc)


mesh = Mesh(np.array(jax.devices()), ("data",))
sharded = jax.shard_map(attend, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P("data"))
loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, ids) * do)  # noqa: E731
out, ref = jax.jit(sharded)(q, k, v, ids), jax.jit(attend)(q, k, v, ids)
g = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
g_ref = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(q, k, v)
np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
print("OK", len(jax.devices()))
