"""A small Flax (NNX) decoder trained on document-packed batches with jcompilemask.

Each training row packs several short documents back to back; a token may attend only
to earlier tokens of its own document (``jcm.masks.document()``). The mask descriptor is
built once per step, inside the jitted step, from that batch's ``segment_ids`` and shared
by every layer -- the pattern to copy:

    desc = DOC_MASK.instantiate({"segment_ids": segment_ids}, n, n)   # once per step
    logits = model(tokens, positions, desc)                           # all layers use it

Documents are arithmetic progressions modulo the vocabulary (random start and step), so
the next token is predictable from the two before it *in the same document*; the loss
drops from ~ln(vocab) within a few dozen steps. Runs on CPU in a few seconds:

    python examples/flax_decoder.py
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jcompilemask as jcm
from jcompilemask.flax import MultiHeadAttention

VOCAB, SEQ, BATCH = 32, 128, 8
DOC_MASK = jcm.compile(jcm.masks.document())        # lowered once, reused every step


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = MultiHeadAttention(heads, dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, desc):
        x = x + self.attn(self.norm1(x), desc)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Decoder(nnx.Module):
    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.pos = nnx.Embed(SEQ, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, rngs=rngs) for _ in range(layers)]) \
            if hasattr(nnx, "List") else [Block(dim, heads, rngs=rngs) for _ in range(layers)]
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, tokens, positions, desc):
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, desc)                       # the same descriptor in every layer
        return self.embed.attend(self.norm(x))


def packed_batch(rng: np.random.Generator):
    """tokens, segment_ids, positions-in-document, loss weights: int/float [BATCH, SEQ]."""
    tokens = np.zeros((BATCH, SEQ), np.int32)
    seg = np.zeros((BATCH, SEQ), np.int32)
    pos = np.zeros((BATCH, SEQ), np.int32)
    for b in range(BATCH):
        i, doc = 0, 0
        while i < SEQ:
            n = min(int(rng.integers(8, 40)), SEQ - i)
            start, step = rng.integers(0, VOCAB), rng.integers(1, 5)
            tokens[b, i:i + n] = (start + step * np.arange(n)) % VOCAB
            seg[b, i:i + n], pos[b, i:i + n] = doc, np.arange(n)
            i, doc = i + n, doc + 1
    # Predict token t+1 from t only inside a document.
    weights = (seg[:, 1:] == seg[:, :-1]).astype(np.float32)
    return tokens, seg, pos, weights


def main(steps: int = 40, lr: float = 3e-3, seed: int = 0, verbose: bool = True):
    """Train; returns the list of per-step losses."""
    model = Decoder(rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(lr)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, tokens, seg, pos, weights):
        n = tokens.shape[1]
        desc = DOC_MASK.instantiate({"segment_ids": seg}, n, n)     # once per step

        def loss_fn(params):
            m = nnx.merge(graphdef, params, rest)
            logits = m(tokens, pos, desc)[:, :-1]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
            return jnp.sum(ce * weights) / jnp.sum(weights)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses, t0 = [], time.time()
    for step in range(steps):
        params, opt_state, loss = train_step(params, opt_state, *packed_batch(rng))
        losses.append(float(loss))
        if verbose and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.3f}  ({time.time() - t0:.1f}s)")
    return losses


if __name__ == "__main__":
    main()
