"""End-to-end training throughput: a Qwen3-style decoder in Flax NNX whose attention is
jcompilemask, against cuDNN and dense-mask XLA attention, on packed real-length batches.

The model (:class:`Qwen3`): token embedding tied to the output head, pre-norm blocks of
RMSNorm -> GQA attention with per-head RMSNorm on queries and keys (QK-norm) and RoPE ->
RMSNorm -> SwiGLU MLP, a final RMSNorm. Parameters and activations are bfloat16; AdamW
(optax) keeps its moments and the update in float32 (:func:`make_train_step`). Each block
is rematerialised (``jax.checkpoint``); the blocks are stacked and run by ``lax.scan`` (one
block is compiled, not 28), or unrolled with ``scan=False``.

The mask is built once per step, inside the jitted step, from that batch's metadata, and
the same object is handed to every layer and to every recomputation:

    desc = compiled.instantiate(metadata, n, n)        # once per step
    logits = model(tokens, positions, desc, attend)    # every block reads desc

Workloads (:func:`make_batch`; metadata sampled with a fixed seed, the same batch for every
implementation): ``document`` (packed documents, log-normal lengths, document-causal
mask); ``hstu`` (users with KuaiRand-like log-normal lengths packed into sequences of N
tokens, each user's tokens an HSTU context / history / grouped-targets pattern,
:func:`hstu_packed`); ``shared_prompt`` (reward-model batches: one prompt, six responses,
docs/workloads.md); ``causal``.

Implementations (``--impls``):

* ``jcm``: :func:`jcompilemask.flax.attention_fn` with the registry's default backend
  (``cute`` on an H100/H200, ``xla`` elsewhere; the record's ``backend`` says which);
* ``cudnn-causal``: ``jax.nn.dot_product_attention(..., is_causal=True,
  implementation="cudnn")``. It is the right mask only for ``causal``; on the other
  workloads it is a speed-of-light reference on the same batch (``mask_exact: false``);
* ``xla-dense``: ``jax.nn.dot_product_attention(..., mask=<bool [B, 1, N, N]>,
  implementation="xla")``, the dense mask built once per step from the MaskSpec's oracle.
  When the compiled step needs more memory than the device has, the record says
  ``status: "oom"`` (read from XLA's memory analysis before running, or from the
  allocator's RESOURCE_EXHAUSTED error);
* ``no-attention``: attention replaced by a copy of V, measured once per (model, N): the
  rest of the step. Every other record gets ``rest_ms`` and ``attention_ms`` = step_ms -
  rest_ms from it (the step split into attention / rest without a profiler).

One record per (model, workload, n, impl): ``tokens_per_s`` (all B*N positions per second,
``real_tokens_per_s`` without padding), ``step_ms`` (median over the measured steps after
warm-up; each step synchronised, host clock, ``benchmarks/timing.py``), ``peak_gib`` (the
compiled step's arguments + outputs + temporaries - aliased, from XLA's memory analysis;
``peak_gib_allocator`` is the allocator's process-wide peak so far, where it reports one),
``run`` / ``sm_clock_mhz`` / ``power_w`` (``benchmarks/clocks.py``), ``loss_first`` /
``loss_last``. Output: ``--out`` JSON, the markdown table beside it (``.md``) and a PNG
plot (``.png`` when matplotlib imports, else the same bars as ``.svg``).

On the H200 (one device call, ``bash scripts/h200.sh train``)::

    python benchmarks/train_e2e.py --models qwen3-0.6b --ns 8192,32768 \\
        --out benchmarks/results/h200-train-e2e.json

On CPU, a tiny model for two steps (checks that the loss decreases)::

    python benchmarks/train_e2e.py --smoke --out /tmp/train-smoke.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clocks  # noqa: E402
import timing  # noqa: E402
import workloads  # noqa: E402

import jcompilemask as jcm  # noqa: E402
from jcompilemask.flax import attention_fn  # noqa: E402
from jcompilemask.spec import MaskSpec, Region, SegmentIds, k, q  # noqa: E402
from jcompilemask.spec.expr import q_len  # noqa: E402

WORKLOADS = ("document", "hstu", "shared_prompt", "causal")
HSTU_MEDIAN = 512        # tokens per user (median of the log-normal length trace)
IMPLS = ("jcm", "cudnn-causal", "no-attention", "xla-dense")
COMPARED = ("jcm", "cudnn-causal", "xla-dense")    # the table's columns


# ---------------------------------------------------------------------------- model ----
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float = 1e6
    eps: float = 1e-6


# Qwen3-0.6B / 1.7B shapes (tied embeddings, QK-norm, head dim 128, 8 KV heads).
CONFIGS = {
    "tiny": ModelConfig(vocab=128, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128),
    "qwen3-0.6b": ModelConfig(vocab=151936, dim=1024, layers=28, heads=16, kv_heads=8,
                              head_dim=128, ffn=3072),
    "qwen3-1.7b": ModelConfig(vocab=151936, dim=2048, layers=28, heads=16, kv_heads=8,
                              head_dim=128, ffn=6144),
}


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        # Statistics in float32: bf16 sums of squares lose the small components.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + self.eps)
        w = self.weight[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (x32 * w).astype(x.dtype)


def rope(x, positions, theta: float):
    """Rotary embedding of x [B, N, H, D] at integer ``positions`` [B, N] (rotate-half
    convention, as Qwen3's reference implementation)."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[..., None, None] * freq.reshape(1, 1, 1, half)  # [B, N, 1, half]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _linear(i, o, dtype, rngs):
    return nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.q_proj = _linear(cfg.dim, cfg.heads * cfg.head_dim, dtype, rngs)
        self.k_proj = _linear(cfg.dim, cfg.kv_heads * cfg.head_dim, dtype, rngs)
        self.v_proj = _linear(cfg.dim, cfg.kv_heads * cfg.head_dim, dtype, rngs)
        self.o_proj = _linear(cfg.heads * cfg.head_dim, cfg.dim, dtype, rngs)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.eps, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.eps, dtype)

    def __call__(self, x, positions, mask, attend):
        c = self.cfg
        b, n, _ = x.shape
        qh = self.q_norm(self.q_proj(x).reshape(b, n, c.heads, c.head_dim))
        kh = self.k_norm(self.k_proj(x).reshape(b, n, c.kv_heads, c.head_dim))
        vh = self.v_proj(x).reshape(b, n, c.kv_heads, c.head_dim)
        qh, kh = rope(qh, positions, c.rope_theta), rope(kh, positions, c.rope_theta)
        out = attend(qh, kh, vh, mask)
        return self.o_proj(out.reshape(b, n, c.heads * c.head_dim))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.gate = _linear(cfg.dim, cfg.ffn, dtype, rngs)
        self.up = _linear(cfg.dim, cfg.ffn, dtype, rngs)
        self.down = _linear(cfg.ffn, cfg.dim, dtype, rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.dim, cfg.eps, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.post_norm = RMSNorm(cfg.dim, cfg.eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, mask, attend):
        x = x + self.attn(self.input_norm(x), positions, mask, attend)
        return x + self.mlp(self.post_norm(x))


class Qwen3(nnx.Module):
    """Qwen3-style decoder; ``model(tokens, positions, mask, attend)`` -> logits.

    ``mask`` is whatever ``attend(q, k, v, mask)`` reads (an ExecutionDescriptor for
    jcompilemask), built once per step by the caller and passed to every block.
    ``remat``: ``jax.checkpoint`` around each block; ``scan``: ``lax.scan`` over the
    stacked blocks (else a Python loop over them).

    >>> m = Qwen3(CONFIGS["tiny"], rngs=nnx.Rngs(0))
    >>> tok = jnp.zeros((1, 8), jnp.int32); pos = jnp.arange(8)[None]
    >>> m(tok, pos, jcm.masks.causal(), jcm_attend()).shape
    (1, 8, 128)
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, remat: bool = True,
                 scan: bool = True, rngs: nnx.Rngs):
        self.cfg, self.remat, self.scan = cfg, remat, scan
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, dtype=dtype, param_dtype=dtype, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.02))

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, dtype, rngs)

        self.blocks = make_blocks(rngs)               # every parameter has a leading [L]
        self.norm = RMSNorm(cfg.dim, cfg.eps, dtype)

    def __call__(self, tokens, positions, mask, attend):
        x = self.embed(tokens)
        graphdef, state = nnx.split(self.blocks)

        def block(x, st):
            return nnx.merge(graphdef, st)(x, positions, mask, attend), None

        if self.remat:
            block = jax.checkpoint(block)
        if self.scan:
            x, _ = jax.lax.scan(block, x, state)
        else:
            for i in range(self.cfg.layers):
                x, _ = block(x, jax.tree.map(lambda a: a[i], state))
        return self.embed.attend(self.norm(x))


def num_params(model) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ----------------------------------------------------------------- attention impls ----
def jcm_attend(implementation: Optional[str] = None) -> Callable:
    """attend(q, k, v, desc) through jcompilemask's Flax ``attention_fn``."""
    def attend(qh, kh, vh, desc):
        return attention_fn(qh, kh, vh, mask=desc, deterministic=True,
                            implementation=implementation)
    return attend


def cudnn_causal_attend(implementation: Optional[str] = "cudnn") -> Callable:
    def attend(qh, kh, vh, _mask):
        return jax.nn.dot_product_attention(qh, kh, vh, is_causal=True,
                                            implementation=implementation)
    return attend


def no_attend(qh, kh, vh, _mask):
    """Attention replaced by a copy of V (per query head): the rest of the step, whose
    time subtracted from a step's gives that step's attention time."""
    return jnp.repeat(vh, qh.shape[2] // vh.shape[2], axis=2)


def dense_attend(qh, kh, vh, dense):
    return jax.nn.dot_product_attention(qh, kh, vh, mask=dense, implementation="xla")


# ---------------------------------------------------------------------- workloads ----
def hstu_packed() -> MaskSpec:
    """HSTU over users packed back to back in one sequence.

    Four per-token segment arrays (int [B, N], -1 = not part of such a run):
    ``user_ids`` (one run per user; -1 on padding), ``context_ids`` (a user's context),
    ``target_ids`` (one run per target group) and ``tail_ids`` (a user's whole target
    part). For a user spanning [s, e) with context end a and history end b: context rows
    see [s, a); history rows see [s, q]; target rows see [s, b) and their group up to q;
    padding rows see themselves. Three intervals per row: [s, tail.start(q)) is [s, b)
    on target rows and [s, q) elsewhere; [ctx.start(q), ctx.end(q)) is the context on
    context rows and empty elsewhere; [tgt.start(q), q + 1) is the causal group on
    target rows and {q} elsewhere.
    """
    users, ctx, tgt, tail = (SegmentIds(name) for name in
                             ("user_ids", "context_ids", "target_ids", "tail_ids"))
    rule = (((k >= users.start(q)) & (k < tail.start(q)))
            | ((k >= ctx.start(q)) & (k < ctx.end(q)))
            | ((k >= tgt.start(q)) & (k <= q)))
    return MaskSpec([Region((0, q_len), rule)], name="hstu_packed")


def spec_for(workload: str) -> Optional[MaskSpec]:
    return {"document": jcm.masks.document(), "hstu": hstu_packed(),
            "shared_prompt": jcm.masks.shared_prompt(workloads.NUM_RESPONSES),
            "causal": jcm.masks.causal()}[workload]


def _lognormal(rng, median, sigma, lo, hi, size=None):
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, size)), lo, hi).astype(int)


def make_batch(workload: str, n: int, batch: int, vocab: int, seed: int = 0) -> dict:
    """numpy arrays of one batch: ``tokens``, ``positions`` (within the document / user /
    prompt+response), ``weights`` (float [B, N-1], 1 where token t+1 is predicted from the
    same sequence), ``real`` (non-padding tokens) and ``metadata`` (the mask's arrays)."""
    rng = np.random.default_rng(seed + n)
    tokens = rng.integers(0, vocab, (batch, n)).astype(np.int32)
    pos = np.zeros((batch, n), np.int32)
    seg = np.zeros((batch, n), np.int32)             # sequence id for the loss weights
    md = None
    if workload == "causal":
        pos[:] = np.arange(n)
    elif workload == "document":
        for b in range(batch):
            i, d = 0, 0
            while i < n:
                ln = min(_lognormal(rng, max(16, n // 16), 1.0, 16, n), n - i)
                seg[b, i:i + ln], pos[b, i:i + ln] = d, np.arange(ln)
                i, d = i + ln, d + 1
        md = {"segment_ids": seg.copy()}
    elif workload == "hstu":
        md = {name: np.full((batch, n), -1, np.int32)
              for name in ("user_ids", "context_ids", "target_ids", "tail_ids")}
        seg[:] = -1
        # KuaiRand user-day traces are heavy-tailed: log-normal lengths (median
        # HSTU_MEDIAN tokens, sigma 1), the same distribution at every N.
        median = min(HSTU_MEDIAN, n // 4)
        for b in range(batch):
            i, u, grp = 0, 0, 0
            while n - i >= 12:               # a shorter tail stays padding
                # A user longer than the room left is cut to it (the sequence stays full).
                ln = min(_lognormal(rng, max(12, median), 1.0, 12, n), n - i)
                g = int(rng.integers(3, 9))
                groups = min(int(rng.integers(3, 9)), max(1, (ln // 2) // g))
                a = int(rng.integers(ln // 4, ln // 2 + 1))
                hb = max(a, ln - g * groups)
                s = i
                md["user_ids"][b, s:s + ln] = u
                md["context_ids"][b, s:s + a] = u
                md["tail_ids"][b, s + hb:s + ln] = u
                for j in range(s + hb, s + ln, g):
                    md["target_ids"][b, j:min(j + g, s + ln)] = grp
                    grp += 1
                seg[b, s:s + ln], pos[b, s:s + ln] = u, np.arange(ln)
                i, u = i + ln, u + 1
    elif workload == "shared_prompt":
        md = workloads.metadata_for("shared_prompt", n, batch, seed)
        for b in range(batch):
            p = int(md["prompt_len"][b])
            pos[b, :p], seg[b, :p] = np.arange(p), 0
            starts = list(md["response_starts"][b]) + [n]
            for r in range(workloads.NUM_RESPONSES):
                s, e = int(starts[r]), int(starts[r + 1])
                pos[b, s:e], seg[b, s:e] = p + np.arange(e - s), r + 1
    else:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    weights = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)).astype(np.float32)
    return {"tokens": tokens, "positions": pos, "weights": weights,
            "real": int(np.sum(seg >= 0)), "metadata": md}


# ----------------------------------------------------------------------- training ----
def make_optimizer(lr: float = 3e-4, weight_decay: float = 0.1):
    return optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=weight_decay)


def init_state(model, tx):
    """(graphdef, bf16 params, float32 AdamW state)."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params, tx.init(jax.tree.map(lambda a: a.astype(jnp.float32), params))


def loss_from_logits(logits, tokens, weights):
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:])
    return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_train_step(graphdef, tx, build_mask: Callable, attend: Callable, *, jit: bool = True,
                    donate: bool = True):
    """``step(params, opt_state, tokens, positions, weights, metadata)`` ->
    ``(params, opt_state, loss)``.

    ``build_mask(metadata, n)`` runs once per step (outside the differentiated function,
    so neither the backward pass nor the rematerialised blocks rebuild it); its result is
    what every block's ``attend`` receives. The update runs in float32 (the AdamW moments
    are float32) and is cast back to the parameters' bfloat16."""

    def step(params, opt_state, tokens, positions, weights, metadata):
        mask = build_mask(metadata, tokens.shape[1])        # once per step

        def loss_fn(p):
            model = nnx.merge(graphdef, p)
            return loss_from_logits(model(tokens, positions, mask, attend), tokens, weights)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        p32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
        g32 = jax.tree.map(lambda a: a.astype(jnp.float32), grads)
        updates, opt_state = tx.update(g32, opt_state, p32)
        new = jax.tree.map(lambda w32, u, w: (w32 + u).astype(w.dtype), p32, updates, params)
        return new, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ()) if jit else step


def mask_builder(workload: str, impl: str) -> Callable:
    """``build_mask(metadata, n)`` of an implementation (None where it reads no mask)."""
    if impl in ("cudnn-causal", "no-attention"):
        return lambda md, n: None
    spec = spec_for(workload)
    if impl == "xla-dense":
        return lambda md, n: spec.as_dense(md, n, n)         # bool [B, 1, N, N]
    cm = jcm.compile(spec)                                    # lowered once, cached
    return lambda md, n: cm.instantiate(md, n, n)


def attend_for(impl: str, on_gpu: bool) -> Callable:
    if impl == "jcm":
        return jcm_attend()
    if impl == "cudnn-causal":
        # cuDNN needs a GPU; on CPU (smoke) the same call through XLA keeps the code path.
        return cudnn_causal_attend("cudnn" if on_gpu else None)
    if impl == "xla-dense":
        return dense_attend
    if impl == "no-attention":
        return no_attend
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def jcm_backend(cfg: ModelConfig, workload: str) -> dict:
    """The registry's choice for this model's attention calls, and where its gradients
    come from (a backward that falls back to ``xla`` explains a slow step)."""
    try:
        from jcompilemask import backends
        cm = jcm.compile(spec_for(workload))
        call = backends.Call(dtype="bfloat16", head_dim=cfg.head_dim, head_dim_v=cfg.head_dim,
                             num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, softcap=False,
                             has_fallback=False, num_intervals=cm.num_intervals)
        b = backends.select(None, call)
        note = b.backward_note() if callable(b.backward_note) else b.backward_note
        return {"backend": b.name, "backward_note": note}
    except Exception as e:  # noqa: BLE001 - only a label for the record
        return {"backend": f"unknown ({type(e).__name__}: {e})"}


def _is_oom(e: BaseException) -> bool:
    s = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower() or "OOM" in s


def _device_limit_bytes() -> Optional[int]:
    try:
        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("bytes_limit")
    except Exception:  # noqa: BLE001
        return None


def _allocator_peak_gib() -> Optional[float]:
    try:
        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        return None if peak is None else round(peak / 2**30, 2)
    except Exception:  # noqa: BLE001
        return None


def run_config(model_name: str, cfg: ModelConfig, workload: str, n: int, batch: int,
               impl: str, *, steps: int, warmup: int, seed: int = 0, lr: float = 3e-4,
               step_cache: dict | None = None) -> dict:
    """Train ``warmup + steps`` steps of one configuration and return its record."""
    on_gpu = jax.default_backend() == "gpu"
    rec = {"model": model_name, "workload": workload, "n": n, "batch": batch, "impl": impl,
           "mask_exact": impl in ("jcm", "xla-dense") or (impl == "cudnn-causal"
                                                           and workload == "causal"),
           "device": str(jax.devices()[0].device_kind), "run": clocks.run_id()}
    if impl == "jcm":
        rec.update(jcm_backend(cfg, workload))
    data = make_batch(workload, n, batch, cfg.vocab, seed)
    rec["real_tokens"] = data["real"]
    model = Qwen3(cfg, rngs=nnx.Rngs(seed))
    rec["params"] = num_params(model)
    tx = make_optimizer(lr)
    graphdef, params, opt_state = init_state(model, tx)
    del model
    # cuDNN (and no attention) read no metadata: one compiled step serves every workload.
    maskless = impl in ("cudnn-causal", "no-attention")
    key = (model_name, n, batch, impl) if maskless else None
    md = None if maskless else data["metadata"]
    args = (jnp.asarray(data["tokens"]), jnp.asarray(data["positions"]),
            jnp.asarray(data["weights"]), jax.tree.map(jnp.asarray, md))
    state = {"params": params, "opt": opt_state}
    try:
        t0 = time.perf_counter()
        if step_cache is not None and key in step_cache:
            compiled = step_cache[key]
        else:
            step = make_train_step(graphdef, tx, mask_builder(workload, impl),
                                   attend_for(impl, on_gpu))
            compiled = step.lower(state["params"], state["opt"], *args).compile()
            if step_cache is not None and key is not None:
                step_cache[key] = compiled
        rec["compile_s"] = round(time.perf_counter() - t0, 1)
        mem = _memory_gib(compiled)
        rec["peak_gib"] = mem
        limit = _device_limit_bytes()
        if on_gpu and mem is not None and limit and mem * 2**30 > limit:
            rec.update(status="oom", error=f"compiled step needs {mem:.1f} GiB, device "
                       f"limit {limit / 2**30:.1f} GiB (XLA memory analysis)")
            return rec
        losses = []

        def one():
            state["params"], state["opt"], loss = compiled(state["params"], state["opt"], *args)
            losses.append(loss)
            return loss

        windows: list = []
        # One step per timed loop (iters=1): step_ms is the median of single steps.
        sec = timing.sustained(one, timing.jax_sync, warmup=warmup, repeats=steps, iters=1,
                               windows=windows)
        losses = [float(x) for x in losses]
        rec.update(status="ok", step_ms=round(sec * 1e3, 3),
                   step_ms_all=[round((t1 - t0_) * 1e3, 3) for t0_, t1 in windows],
                   tokens_per_s=round(batch * n / sec, 1),
                   real_tokens_per_s=round(data["real"] / sec, 1),
                   loss_first=losses[0], loss_last=losses[-1],
                   peak_gib_allocator=_allocator_peak_gib(), **clocks.fields(windows))
    except Exception as e:  # noqa: BLE001 - recorded, the other configurations go on
        rec.update(status="oom" if _is_oom(e) else "error",
                   error=f"{type(e).__name__}: {str(e)[:400]}")
    return rec


def _memory_gib(compiled) -> Optional[float]:
    try:
        m = compiled.memory_analysis()
        total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes)
        return round(total / 2**30, 2)
    except Exception:  # noqa: BLE001 - not every platform reports it
        return None


# ------------------------------------------------------------------------- report ----
def attach_split(records: list[dict]) -> None:
    """``rest_ms`` (the step with attention replaced by a copy of V, same model, N and
    run) and ``attention_ms`` = step_ms - rest_ms on every measured record."""
    rest = {(r["model"], r["n"], r.get("run")): r["step_ms"] for r in records
            if r["impl"] == "no-attention" and r.get("status") == "ok"}
    for r in records:
        key = (r["model"], r["n"], r.get("run"))
        if r["impl"] != "no-attention" and r.get("status") == "ok" and key in rest:
            r["rest_ms"] = rest[key]
            r["attention_ms"] = round(r["step_ms"] - rest[key], 3)


def table(records: list[dict]) -> str:
    """Markdown: per (model, n) a row per workload, a column per implementation with
    tokens/s, step time (its attention part where measured) and jcm's ratio to it."""
    impls = [i for i in COMPARED if any(r["impl"] == i for r in records)]
    lines = []
    for model, n in sorted({(r["model"], r["n"]) for r in records}, key=lambda t: (t[0], t[1])):
        lines += [f"### {model}, N = {n}", "",
                  "| workload | " + " | ".join(impls) + " |",
                  "|---|" + "---|" * len(impls)]
        for w in WORKLOADS:
            rs = {r["impl"]: r for r in records
                  if r["model"] == model and r["n"] == n and r["workload"] == w}
            if not rs:
                continue
            ours = rs.get("jcm", {}).get("tokens_per_s") if rs.get("jcm", {}).get(
                "status") == "ok" else None
            cells = []
            for i in impls:
                r = rs.get(i)
                if r is None:
                    cells.append("-")
                elif r.get("status") != "ok":
                    cells.append(r.get("status", "?"))
                else:
                    attn = (f", attention {r['attention_ms']:.0f} ms" if "attention_ms" in r
                            else "")
                    c = (f"{r['tokens_per_s']:,.0f} tok/s (step {r['step_ms']:.0f} ms{attn}, "
                         f"{r['peak_gib']} GiB)")
                    if not r.get("mask_exact", True):
                        c += " [wrong mask]"
                    if i != "jcm" and ours:
                        c += f"; jcm {ours / r['tokens_per_s']:.2f}x"
                    cells.append(c)
            lines.append(f"| {w} | " + " | ".join(cells) + " |")
        rest = [r for r in records if (r["model"], r["n"], r["impl"]) == (model, n,
                                                                         "no-attention")]
        if rest and rest[0].get("status") == "ok":
            lines += ["", f"Rest of the step (attention replaced by a copy of V): "
                          f"{rest[0]['step_ms']:.0f} ms; attention = step - rest."]
        lines.append("")
    run = sorted({r.get("run") for r in records if r.get("run")})
    lines.append(f"run: {', '.join(run)}; tokens/s = B*N / median step time; "
                 "[wrong mask] = cuDNN causal on a batch whose mask is not causal "
                 "(speed-of-light reference).")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: str) -> Optional[str]:
    """Grouped bars of tokens/s; returns a message instead when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not importable: no plot written"
    panels = sorted({(r["model"], r["n"]) for r in records})
    impls = [i for i in COMPARED if any(r["impl"] == i for r in records)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, n) in zip(axes[0], panels):
        ws = [w for w in WORKLOADS if any(r["workload"] == w and r["n"] == n
                                          and r["model"] == model for r in records)]
        width = 0.8 / max(1, len(impls))
        for j, i in enumerate(impls):
            ys = []
            for w in ws:
                r = next((r for r in records if (r["model"], r["n"], r["workload"], r["impl"])
                          == (model, n, w, i)), None)
                ys.append(r["tokens_per_s"] / 1e3 if r and r.get("status") == "ok" else 0)
            ax.bar(np.arange(len(ws)) + j * width, ys, width, label=i)
        ax.set_xticks(np.arange(len(ws)) + width * (len(impls) - 1) / 2, ws, rotation=15)
        ax.set_title(f"{model}, N = {n}")
        ax.set_ylabel("kTok/s")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


_COLORS = ("#d62728", "#1f77b4", "#7f7f7f", "#2ca02c", "#9467bd")


def svg_bars(records: list[dict]) -> str:
    """The plot of :func:`plot` as SVG, for machines without matplotlib: a panel per
    (model, N), a group of bars per workload, a bar per implementation (kTok/s)."""
    panels = sorted({(r["model"], r["n"]) for r in records})
    impls = [i for i in COMPARED if any(r["impl"] == i for r in records)]
    ok = [r for r in records if r.get("status") == "ok"]
    top = max([r["tokens_per_s"] / 1e3 for r in ok] + [1e-9]) * 1.15
    pw, ph, ml, mt, mb = 360, 220, 60, 40, 50
    width, height = ml + len(panels) * (pw + 30) + 130, mt + ph + mb

    def esc(x):
        return str(x).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="14" y="{mt + ph / 2}" transform="rotate(-90 14 {mt + ph / 2})" '
           f'text-anchor="middle">kTok/s</text>']
    for p, (model, n) in enumerate(panels):
        x0 = ml + p * (pw + 30)
        out += [f'<rect x="{x0}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>',
                f'<text x="{x0 + pw / 2}" y="{mt - 8}" text-anchor="middle">'
                f'{esc(model)}, N = {n}</text>']
        for j in range(5):
            v = top * j / 4
            y = mt + ph - v / top * ph
            out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
        ws = [w for w in WORKLOADS if any((r["model"], r["n"], r["workload"]) == (model, n, w)
                                          for r in records)]
        gw = pw / max(1, len(ws))
        bw = 0.8 * gw / max(1, len(impls))
        for g, w in enumerate(ws):
            out.append(f'<text x="{x0 + (g + 0.5) * gw:.1f}" y="{mt + ph + 14}" '
                       f'text-anchor="middle">{esc(w)}</text>')
            for j, i in enumerate(impls):
                r = next((r for r in ok if (r["model"], r["n"], r["workload"], r["impl"])
                          == (model, n, w, i)), None)
                if r is None:
                    continue
                v = r["tokens_per_s"] / 1e3
                x = x0 + g * gw + 0.1 * gw + j * bw
                y = mt + ph - v / top * ph
                out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" '
                           f'height="{mt + ph - y:.1f}" fill="{_COLORS[j % len(_COLORS)]}">'
                           f'<title>{esc(i)} {esc(w)}: {v:.4g} kTok/s</title></rect>')
    lx = ml + len(panels) * (pw + 30)
    for j, i in enumerate(impls):
        y = mt + 10 + 16 * j
        out += [f'<rect x="{lx}" y="{y - 8}" width="12" height="10" '
                f'fill="{_COLORS[j % len(_COLORS)]}"/>',
                f'<text x="{lx + 18}" y="{y + 1}">{esc(i)}</text>']
    return "\n".join(out + ["</svg>"]) + "\n"


def write_outputs(records: list[dict], out: str, meta: dict, with_plot: bool = True) -> list[str]:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({**meta, "records": records}, f, indent=1)
    stem = os.path.splitext(out)[0]
    with open(stem + ".md", "w") as f:
        f.write(table(records))
    written = [out, stem + ".md"]
    if not with_plot:
        return written
    msg = plot(records, stem + ".png")
    if msg:
        with open(stem + ".svg", "w") as f:
            f.write(svg_bars(records))
        print(msg + f"; the same bars as SVG: {stem}.svg")
        written.append(stem + ".svg")
    else:
        written.append(stem + ".png")
    return written


# --------------------------------------------------------------------------- main ----
def dense_in_child(a, models: list[str], ns: list[int], wls: list[str], run: str,
                   budget_s: Optional[float]) -> list[dict]:
    """The xla-dense records of ``models`` x ``ns`` x ``wls``, measured by this script in a
    fresh process (``--impls xla-dense``, the same run id), so the dense step meets an
    empty allocator. A child that fails leaves one ``error`` record per configuration
    with the end of its output."""
    import subprocess
    import tempfile
    out = os.path.join(tempfile.mkdtemp(prefix="train-dense-"), "dense.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--models", ",".join(models),
           "--ns", ",".join(map(str, ns)), "--workloads", ",".join(wls), "--impls", "xla-dense",
           "--tokens", str(a.tokens), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--lr", str(a.lr), "--dense-process", "off", "--out", out]
    if budget_s is not None:
        cmd += ["--budget-s", f"{max(budget_s, 0.0):.0f}"]
    if a.smoke:
        cmd.append("--smoke")
    # The child is alone on the device: let its allocator take 95% of it, not JAX's default
    # 75%. The 8K dense step needed 58.4 GiB held + one 52.9 GiB buffer, over the default
    # 75% of the H200's 139.8 GiB (run 2026-12-04T12:52:25Z).
    env = dict(os.environ, JCM_RUN_ID=run)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    proc = subprocess.run(cmd, env=env, capture_output=True,
                          text=True)
    sys.stdout.write(proc.stdout)
    try:
        with open(out) as f:
            got = json.load(f)["records"]
    except (OSError, ValueError, KeyError):
        got = []
    if got:
        return got
    tail = (proc.stderr or proc.stdout)[-400:]
    return [{"model": m, "workload": w, "n": n, "batch": max(1, a.tokens // n),
             "impl": "xla-dense", "status": "error", "run": run,
             "error": f"dense child exited {proc.returncode}: {tail}"}
            for m in models for n in ns for w in wls]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b")
    ap.add_argument("--ns", default="8192,32768")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per step (batch = tokens // n)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no configuration past this many seconds (recorded as skipped)")
    ap.add_argument("--out", default="benchmarks/results/train-e2e.json")
    ap.add_argument("--dense-process", choices=("auto", "on", "off"), default="auto",
                    help="run the xla-dense baseline in a child process before this one uses "
                         "the device (auto: on a GPU, when other implementations run too). "
                         "After a dozen other steps in one process the allocator could not "
                         "place the dense step's 53 GiB buffer (H200, run "
                         "2026-12-04T03:23:21Z); a child run after them still met their "
                         "memory, held by this process (16 GiB autotuning buffers failed, run "
                         "2026-12-04T09:42:55Z), so the child now runs first")
    ap.add_argument("--dense-share", type=float, default=0.4,
                    help="with --budget-s and a dense child: the share of the budget in which "
                         "the child may start configurations (the rest is this process's)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: tiny model, N = 128, two steps, every workload and impl; "
                         "fails unless the loss decreases")
    a = ap.parse_args(argv)
    if a.smoke:
        a.models, a.ns, a.tokens, a.steps, a.warmup, a.lr = "tiny", "128", 256, 2, 0, 1e-2
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in CONFIGS:
            ap.error(f"--models: unknown {m!r}, choose from {sorted(CONFIGS)}")
    ns = [int(x) for x in a.ns.split(",") if x]
    wls = [w for w in a.workloads.split(",") if w]
    impls = [i for i in a.impls.split(",") if i]
    for w in wls:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown {w!r}, choose from {WORKLOADS}")
    for i in impls:
        if i not in IMPLS:
            ap.error(f"--impls: unknown {i!r}, choose from {IMPLS}")
    # Device memory is taken as needed, not 75% up front, so that a dense child started by
    # this process finds the device's memory free (read when the backend starts, below).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    clocks.start()
    meta = {"run": clocks.run_id(), "jax": jax.__version__, "backend": jax.default_backend(),
            "tokens_per_step": a.tokens, "steps": a.steps, "warmup": a.warmup,
            "smoke": a.smoke}   # report.py skips smoke files
    t_start = time.perf_counter()
    records, cache = [], {}
    # jcm, cuDNN and the rest-of-step at every N first, the dense baseline (slow to
    # compile, out of memory at long N) last: under a budget the comparisons that matter
    # most are measured before it runs out.
    phases = [[i for i in IMPLS if i in impls and i != "xla-dense"],
              [i for i in IMPLS if i in impls and i == "xla-dense"]]
    dense_child = ("xla-dense" in impls and bool(phases[0]) and
                   (a.dense_process == "on" or
                    (a.dense_process == "auto" and jax.default_backend() == "gpu")))
    plan = [(model, n, impl) for model in models for phase in phases for n in ns
            for impl in phase if not (dense_child and impl == "xla-dense")]
    dense = []
    if dense_child:
        # First, while this process holds (almost) no device memory; merged after the rest.
        share = None if a.budget_s is None else a.budget_s * min(max(a.dense_share, 0.0), 1.0)
        dense = dense_in_child(a, models, ns, wls, meta["run"], share)
        write_outputs(dense, a.out, meta, with_plot=False)
    for model, n, impl in plan:
        batch = max(1, a.tokens // n)
        for w in wls:
            if impl == "no-attention" and w != wls[0]:
                continue                  # mask-independent: measured once per N
            if a.budget_s is not None and time.perf_counter() - t_start > a.budget_s:
                rec = {"model": model, "workload": w, "n": n, "batch": batch,
                       "impl": impl, "status": "skipped",
                       "error": f"time budget {a.budget_s} s spent",
                       "run": clocks.run_id()}
            else:
                rec = run_config(model, CONFIGS[model], w, n, batch, impl,
                                 steps=a.steps, warmup=a.warmup, lr=a.lr,
                                 step_cache=cache)
            records.append(rec)
            attach_split(records)
            print(json.dumps({k_: v for k_, v in rec.items() if k_ != "step_ms_all"}),
                  flush=True)
            # After every record: a call cut short by its time limit keeps them.
            write_outputs(records + dense, a.out, meta, with_plot=False)
    if dense:
        records += dense
        attach_split(records)
    written = write_outputs(records, a.out, meta)
    print(table(records))
    print("wrote", ", ".join(written))
    if a.smoke:
        bad = [r for r in records if r.get("status") != "ok" or not r["loss_last"] < r["loss_first"]]
        if bad:
            raise SystemExit(f"smoke: {len(bad)} configuration(s) failed or did not reduce "
                             f"the loss: {[(r['workload'], r['impl'], r.get('error')) for r in bad]}")
        print(f"smoke: {len(records)} configurations trained; loss decreased in each")
    return records


if __name__ == "__main__":
    main()
