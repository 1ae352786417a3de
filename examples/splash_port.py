"""A model written against TPU SplashAttention, moved to jcompilemask by one import.

The model code below uses only SplashAttention's API: mask objects, ``BlockSizes``,
``make_splash_mha_single_device``, ``SegmentIds``, a per-example kernel that is vmapped
over the batch, no 1/sqrt(d) inside the kernel (the model scales q itself), and a logits
soft cap. To port it, swap the import:

    # from jax.experimental.pallas.ops.tpu import splash_attention as splash   # TPU only
    from jcompilemask import splash                                            # any backend

jcompilemask converts the splash masks to MaskSpecs (causal and local windows lower to
intervals) and runs them with its own kernels (CuTe on H100/H200, the xla backend
elsewhere). Run:  python examples/splash_port.py
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

# from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jcompilemask import splash

HEADS, SEQ, HEAD_DIM, MODEL_DIM, BATCH, VOCAB = 4, 128, 16, 64, 4, 32


def make_attention():
    """Half the heads causal, half a causal 32-token sliding window (Gemma-style)."""
    shape = (SEQ, SEQ)
    heads = [splash.CausalMask(shape) for _ in range(HEADS // 2)]
    heads += [splash.LocalMask(shape, (32, 0), 0) for _ in range(HEADS // 2)]
    kernel = splash.make_splash_mha_single_device(
        splash.MultiHeadMask(heads),
        block_sizes=splash.BlockSizes(block_q=128, block_kv=128),
        attn_logits_soft_cap=20.0)
    # One example per call: [heads, seq, head_dim]; vmap over the batch.
    return jax.vmap(kernel, in_axes=(0, 0, 0, 0))


ATTENTION = make_attention()


def init(key):
    ks = jax.random.split(key, 4)
    n = lambda k, shape: jax.random.normal(k, shape) / np.sqrt(shape[0])  # noqa: E731
    return {"embed": n(ks[0], (VOCAB, MODEL_DIM)), "qkv": n(ks[1], (MODEL_DIM, 3 * MODEL_DIM)),
            "out": n(ks[2], (MODEL_DIM, MODEL_DIM)), "pos": n(ks[3], (SEQ, MODEL_DIM))}


def forward(params, tokens, segment_ids):
    x = params["embed"][tokens] + params["pos"][None]
    qkv = (x @ params["qkv"]).reshape(BATCH, SEQ, 3, HEADS, HEAD_DIM)
    q, k, v = (jnp.swapaxes(qkv[:, :, i], 1, 2) for i in range(3))   # [B, H, N, D]
    q = q / np.sqrt(HEAD_DIM)                 # splash applies no scaling itself
    seg = splash.SegmentIds(q=segment_ids, kv=segment_ids)
    o = ATTENTION(q, k, v, seg)               # [B, H, N, D]
    x = x + jnp.swapaxes(o, 1, 2).reshape(BATCH, SEQ, MODEL_DIM) @ params["out"]
    return x @ params["embed"].T


def batch(rng):
    """Packed rows of 'repeat the previous token plus one' documents."""
    tokens = np.zeros((BATCH, SEQ), np.int32)
    seg = np.zeros((BATCH, SEQ), np.int32)
    for b in range(BATCH):
        i, doc = 0, 1
        while i < SEQ:
            n = min(int(rng.integers(16, 48)), SEQ - i)
            tokens[b, i:i + n] = (rng.integers(VOCAB) + np.arange(n)) % VOCAB
            seg[b, i:i + n] = doc
            i, doc = i + n, doc + 1
    return tokens, seg


@jax.jit
def train_step(params, tokens, seg):
    def loss_fn(p):
        logits = forward(p, tokens, seg)[:, :-1]
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        w = (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
        return jnp.sum(nll * w) / jnp.sum(w)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss


def main(steps: int = 20):
    params, rng, t0 = init(jax.random.key(0)), np.random.default_rng(0), time.time()
    losses = []
    for step in range(steps):
        params, loss = train_step(params, *batch(rng))
        losses.append(float(loss))
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.3f}  ({time.time() - t0:.1f}s)")
    return losses


if __name__ == "__main__":
    print("attention:", splash.__name__)
    main()
