"""Quickstart: compile a mask, show its intervals and tile map, run mask_attention, check it.

    python examples/quickstart.py            # CPU (xla backend) or the H200 (cute backend)
"""
import jax
import jax.numpy as jnp
import numpy as np

import jcompilemask as jcm
from jcompilemask.testing import assert_within_policy, reference_attention


def main():
    # 1. A mask written once: HSTU (context / history / grouped targets), from the library.
    spec = jcm.masks.hstu()
    print(spec, "\n")

    # 2. Offline: sympy lowers every region's rule to visible key intervals.
    cm = jcm.compile(spec)
    print(cm.explain(), "\n")

    # 3. Online, once per batch (inside jit): metadata -> Execution Descriptor.
    n, batch, heads, head_dim = 256, 2, 4, 64
    metadata = {"context_len": np.array([64, 96]), "history_end": np.array([232, 226]),
                "group_size": np.array([4, 6])}
    desc = jax.jit(lambda md: cm.instantiate(md, n, n, block_q=32, block_kv=32,
                                             bwd_block_q=32, bwd_block_kv=32))(metadata)
    print(desc)
    print("row 240 of sequence 0, intervals (start, length):",
          np.asarray(desc.fwd_intervals[0, 0, 240]).tolist())
    print(desc.to_string(), "\n")

    # 4. Attention under the mask, forward and backward, inside jit.
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (batch, n, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(ks[1], (batch, n, heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(ks[2], (batch, n, heads, head_dim), jnp.bfloat16)
    print(jcm.backends.explain())
    if desc.tiles != jcm.backends.preferred_tiles():
        # the best backend wants other tiles: let mask_attention build the descriptor
        mask, md = spec, metadata
    else:
        mask, md = desc, None
    attend = jax.jit(lambda q, k, v: jcm.mask_attention(q, k, v, mask, metadata=md,
                                                        return_residual=True))
    out, lse = attend(q, k, v)
    lse = jnp.swapaxes(lse, 1, 2)          # jax's layout [B, N, H] -> the reference's [B, H, N]
    grads = jax.jit(jax.grad(lambda q: jnp.sum(attend(q, k, v)[0].astype(jnp.float32))))(q)

    # 5. Check against dense attention under the MaskSpec's own dense oracle.
    dense = spec.as_dense(metadata, n, n)
    hi = reference_attention(q, k, v, dense, precision="high")
    lo = reference_attention(q, k, v, dense, precision="input")
    assert_within_policy(out, hi[0], lo[0], "out")
    assert_within_policy(lse, hi[1], lo[1], "lse")
    print(f"\nout {out.shape} {out.dtype}: max |out - dense reference| = "
          f"{float(jnp.max(jnp.abs(out.astype(jnp.float32) - hi[0].astype(jnp.float32)))):.4f}"
          f" (within the tolerance policy); dq finite: {bool(jnp.isfinite(grads).all())}")
    print("OK")


if __name__ == "__main__":
    main()
