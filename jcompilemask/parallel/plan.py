"""Sequence layouts and ring schedules for context parallelism, read from a descriptor.

The sequence (length N, the descriptor's ``q_len == kv_len``) is cut into C equal,
contiguous *chunks*; a layout is the order of chunk ids along the sharded axis, so with
P devices device d holds chunks ``chunks[d * C/P : (d + 1) * C/P]`` (its query rows and
its key/value columns alike). The descriptor always stays in the original order: the
layout tells the ring which original rows and columns each shard holds.

Everything here works on a *concrete* descriptor (numpy reads of its tile states and
interval tables, no dense mask): it decides static things -- where rows go, which
transfers a ring makes -- so it runs once, outside ``jit``.

>>> import jcompilemask as jcm
>>> from jcompilemask.parallel import balance_permutation, ring_plan, zigzag_permutation
>>> desc = jcm.compile(jcm.masks.causal()).instantiate(None, 64, block_q=8, block_kv=8,
...                                                   bwd_block_q=8, bwd_block_kv=8)
>>> zigzag_permutation(2)
(0, 3, 1, 2)
>>> balance_permutation(desc, 2)          # the visible counts of causal give the zigzag
(0, 3, 1, 2)
>>> plan = ring_plan(desc, 2, (0, 3, 1, 2))
>>> plan.num_steps, plan.forward_sends(), plan.full_ring_forward_sends()
(2, 3, 4)
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from ..lower.descriptor import COMPUTE, TILES_PER_WORD, ClassDescriptor, ExecutionDescriptor

__all__ = ["RingPlan", "ring_plan", "full_ring_plan", "zigzag_permutation",
           "balance_permutation", "permute_sequence", "unpermute_sequence",
           "chunk_visibility", "row_work", "cost_report", "check_layout"]


def _concrete(x, what):
    try:
        return np.asarray(x)
    except Exception as e:   # a tracer: jax raises one of several concretization errors
        raise TypeError(f"{what} needs a concrete descriptor (built outside jax.jit / "
                        "shard_map, or closed over rather than passed in): it decides the "
                        "static data layout and transfer schedule") from e


def check_layout(chunks: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Validate a chunk order for ``num_devices`` devices; returns it as a tuple."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    c = tuple(int(x) for x in chunks)
    if sorted(c) != list(range(len(c))):
        raise ValueError(f"the layout must be a permutation of range(num_chunks), got {c}")
    if len(c) % num_devices:
        raise ValueError(f"the layout has {len(c)} chunks, not a multiple of the "
                         f"{num_devices} devices (each device holds as many chunks)")
    return c


def zigzag_permutation(num_devices: int) -> tuple[int, ...]:
    """2P chunks, device d holding chunk d and chunk 2P-1-d (the causal balance: one early
    and one late chunk each, so every device has the same number of visible pairs)."""
    check_layout(range(2 * num_devices), num_devices)
    out = []
    for d in range(num_devices):
        out += [d, 2 * num_devices - 1 - d]
    return tuple(out)


def permute_sequence(x, chunks: Sequence[int], axis: int = 1):
    """Reorder ``x`` along ``axis`` (length divisible by ``len(chunks)``) into the layout:
    chunk ``chunks[i]`` of the original order goes to position i. Apply it to q, k, v
    (and ``do``, segment data the caller shards) before sharding the axis.

    >>> import numpy as np
    >>> x = np.arange(8)[None]
    >>> permute_sequence(x, (0, 3, 1, 2)).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    >>> unpermute_sequence(permute_sequence(x, (0, 3, 1, 2)), (0, 3, 1, 2)).tolist()
    [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    import jax.numpy as jnp
    c = len(chunks)
    n = x.shape[axis]
    if n % c:
        raise ValueError(f"axis {axis} has length {n}, not divisible by {c} chunks")
    xs = jnp.split(x, c, axis=axis) if not isinstance(x, np.ndarray) else np.split(x, c, axis=axis)
    cat = np.concatenate if isinstance(x, np.ndarray) else jnp.concatenate
    return cat([xs[i] for i in chunks], axis=axis)


def unpermute_sequence(x, chunks: Sequence[int], axis: int = 1):
    """The inverse of :func:`permute_sequence` (back to the original order)."""
    inv = np.argsort(np.asarray(chunks))
    return permute_sequence(x, tuple(int(i) for i in inv), axis)


def _unpack(words, num_tiles):
    # numpy twin of descriptor.unpack_tiles: usable while tracing (the plan is static)
    shifts = 2 * np.arange(TILES_PER_WORD, dtype=np.uint32)
    s = (words[..., None] >> shifts) & np.uint32(3)
    return s.reshape(words.shape[:-1] + (-1,))[..., :num_tiles].astype(np.uint8)


def _tile_states(desc, view):
    """uint8 [B, Hm, Tq, Tk] decoded states of ``view`` (row-major), as numpy."""
    tq, tk = desc.num_tiles(view)
    if view == "fwd":
        return _unpack(_concrete(desc.fwd_tiles, "a ring plan"), tk)
    return np.swapaxes(_unpack(_concrete(desc.bwd_tiles, "a ring plan"), tq), -1, -2)


def _classes(desc):
    """(the descriptor the ring runs, its residue classes): a :class:`ClassDescriptor`'s
    chunk ``i`` is chunk ``i`` of its class sequence (every class alike), so layouts and
    plans read its inner descriptor."""
    if isinstance(desc, ClassDescriptor):
        return desc.inner, desc.classes
    return desc, 1


def chunk_size(desc: ExecutionDescriptor, num_chunks: int) -> int:
    """Rows per chunk; raises unless the chunks are whole tiles of both passes (of a
    :class:`ClassDescriptor`: whole class rows, and whole tiles of the class sequence)."""
    inner, f = _classes(desc)
    if f > 1:
        if desc.q_len != desc.kv_len or desc.q_len % (num_chunks * f):
            raise ValueError(f"a chunk of this descriptor must start at a multiple of its "
                             f"{f} residue classes: the sequence length {desc.q_len} is not "
                             f"a multiple of {num_chunks} chunks x {f}")
        try:
            return chunk_size(inner, num_chunks) * f
        except ValueError as e:
            raise ValueError(f"{e} (this descriptor runs as {f} residue classes: a chunk "
                             f"of {desc.q_len // num_chunks} rows holds "
                             f"{desc.q_len // num_chunks // f} rows of each class, and the "
                             "tiles are the class sequence's)") from None
    if desc.q_len != desc.kv_len:
        raise ValueError(f"context parallelism needs q_len == kv_len (self-attention); the "
                         f"descriptor has {desc.q_len} / {desc.kv_len}")
    if desc.q_len % num_chunks:
        raise ValueError(f"the sequence length {desc.q_len} is not divisible by the "
                         f"{num_chunks} chunks of the layout")
    cs = desc.q_len // num_chunks
    t = desc.tiles
    for name in ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv"):
        if cs % getattr(t, name):
            raise ValueError(f"a chunk has {cs} rows, not a multiple of the descriptor's "
                             f"{name}={getattr(t, name)}: build the descriptor with tiles "
                             f"that divide N / num_chunks, or use fewer chunks")
    return cs


def chunk_visibility(desc: ExecutionDescriptor, num_chunks: int) -> np.ndarray:
    """bool [C, C]: query chunk a sees some key of key chunk b (for some batch and head),
    from the tile states of both passes (no dense mask)."""
    cs = chunk_size(desc, num_chunks)
    desc, f = _classes(desc)              # a class descriptor: its class sequence's chunks
    cs //= f
    out = np.zeros((num_chunks, num_chunks), bool)
    for view in ("fwd", "bwd"):
        st = (_tile_states(desc, view) & COMPUTE) != 0            # [B, Hm, Tq, Tk]
        bq, bk = desc._blocks(view)
        tq, tk = cs // bq, cs // bk
        st = st.any(axis=(0, 1)).reshape(num_chunks, tq, num_chunks, tk)
        out |= st.any(axis=(1, 3))
    return out


def row_work(desc: ExecutionDescriptor) -> np.ndarray:
    """int64 [Nq]: visible keys per row summed over the batch and mask heads (the union
    of the row's intervals), from the forward interval table. A :class:`ClassDescriptor`'s
    row ``f i + r`` has the work of its class row ``i``."""
    inner, f = _classes(desc)
    if f > 1:
        w = _head_row_work(inner)                                     # [1 or f, Nq / f]
        # row f i + r: class r's row i (the same class mask in every class, or its own)
        return np.repeat(w[0], f) if w.shape[0] == 1 else w.T.reshape(-1)
    return _head_row_work(desc).sum(0)


def _head_row_work(desc) -> np.ndarray:
    """int64 [Hm, Nq]: :func:`row_work` per mask head."""
    iv = _concrete(desc.fwd_intervals, "row_work").astype(np.int64)   # [B, Hm, Nq, K, 2]
    big = np.iinfo(np.int64).max // 4
    lo = np.where(iv[..., 1] > 0, iv[..., 0], big)
    hi = np.where(iv[..., 1] > 0, iv[..., 0] + iv[..., 1], big)
    order = np.argsort(lo, axis=-1)
    lo = np.take_along_axis(lo, order, -1)
    hi = np.take_along_axis(hi, order, -1)
    # Sorted by start, the union is sum(max(0, hi_m - max(lo_m, running max of hi)))
    prev = np.maximum.accumulate(np.concatenate(
        [np.full(hi.shape[:-1] + (1,), -1, np.int64), hi[..., :-1]], -1), axis=-1)
    add = np.where(lo < big, np.maximum(0, hi - np.maximum(lo, prev)), 0)
    work = add.sum(-1).sum(0)
    if desc.mask.fallback_regions:
        raise ValueError("row_work reads the interval tables; this mask has fallback "
                         f"regions {list(desc.mask.fallback_regions)} that are not in them")
    return work


def balance_permutation(desc: ExecutionDescriptor, num_devices: int,
                        chunks_per_device: int = 2) -> tuple[int, ...]:
    """A layout of ``num_devices * chunks_per_device`` chunks that balances the visible
    (query, key) pairs per device, from the descriptor's per-row visible counts.

    Greedy, largest chunk first, to the least-loaded device that still has room (for
    causal this is the zigzag layout), then pairwise swaps between the most and least
    loaded devices while they narrow the spread. One layout serves the whole batch (the
    counts are summed over it); results are correct for any layout, only the balance
    depends on it, so a layout computed from one batch's metadata can serve others.
    Apply it with :func:`permute_sequence`.
    """
    check_layout(range(num_devices * chunks_per_device), num_devices)
    c = num_devices * chunks_per_device
    cs = chunk_size(desc, c)
    w = row_work(desc).reshape(c, cs).sum(1)
    owner = -np.ones(c, np.int64)
    load = np.zeros(num_devices, np.int64)
    room = np.full(num_devices, chunks_per_device)
    for ch in sorted(range(c), key=lambda i: (-w[i], i)):
        cand = [d for d in range(num_devices) if room[d] > 0]
        d = min(cand, key=lambda d: (load[d], d))
        owner[ch] = d
        load[d] += w[ch]
        room[d] -= 1
    for _ in range(4 * c * c):
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        spread = load[hi] - load[lo]
        best = None
        for a in np.flatnonzero(owner == hi):
            for b in np.flatnonzero(owner == lo):
                delta = w[a] - w[b]
                new = max(abs(spread - 2 * delta), 0)
                if 0 < delta and new < spread and (best is None or new < best[0]):
                    best = (new, a, b, delta)
        if best is None:
            break
        _, a, b, delta = best
        owner[a], owner[b] = lo, hi
        load[hi] -= delta
        load[lo] += delta
    out = []
    for d in range(num_devices):
        out += sorted(int(i) for i in np.flatnonzero(owner == d))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """A static ring schedule: the layout and, per key/value chunk, how far it travels.

    ``last_step[t][j]`` is the last ring step at which slot j (chunk ``chunks[t*cpd+j]``)
    of device t is read by some device (-1: by none); at step s device d holds the slots
    of device ``(d - s) % P``. A slot moves from step s to s+1 only if
    ``last_step >= s + 1`` -- blocks no later device can see are not sent -- and the ring
    stops after ``num_steps`` steps. A plan without a descriptor (:func:`full_ring_plan`)
    sends every block around the whole ring.
    """

    num_devices: int
    chunks: tuple[int, ...]
    last_step: tuple[tuple[int, ...], ...]

    @property
    def chunks_per_device(self) -> int:
        return len(self.chunks) // self.num_devices

    @property
    def num_steps(self) -> int:
        return max(1, 1 + max(max(r) for r in self.last_step))

    def sends(self, step: int, slot: int) -> list[tuple[int, int]]:
        """(source, destination) device pairs of slot ``slot`` moving after ``step``."""
        p = self.num_devices
        return [((t + step) % p, (t + step + 1) % p) for t in range(p)
                if self.last_step[t][slot] >= step + 1]

    def returns(self, step: int, slot: int) -> list[tuple[int, int]]:
        """Pairs sending a finished dK/dV accumulator home after ``step`` (step >= 1)."""
        p = self.num_devices
        return [((t + step) % p, t) for t in range(p) if self.last_step[t][slot] == step]

    def forward_sends(self) -> int:
        """Chunk transfers of one forward pass (each carries K and V of one chunk)."""
        return sum(len(self.sends(s, j)) for s in range(self.num_steps)
                   for j in range(self.chunks_per_device))

    def backward_sends(self) -> tuple[int, int]:
        """(K/V chunk transfers, dK/dV chunk transfers) of one backward pass."""
        kv = self.forward_sends()
        back = sum(len(self.returns(s, j)) for s in range(1, self.num_steps)
                   for j in range(self.chunks_per_device))
        return kv, kv + back

    def full_ring_forward_sends(self) -> int:
        """Transfers of a ring that sends every block (P - 1 hops per chunk)."""
        return (self.num_devices - 1) * len(self.chunks)

    def full_ring_backward_sends(self) -> tuple[int, int]:
        """(K/V, dK/dV) transfers of a ring that sends every block: K/V P - 1 hops, their
        gradient accumulators P hops (P - 1 with them and one home)."""
        n = len(self.chunks)
        p = self.num_devices
        return (p - 1) * n, (p if p > 1 else 0) * n


def full_ring_plan(num_devices: int, chunks: Optional[Sequence[int]] = None) -> RingPlan:
    """Every block around the whole ring (the schedule when the descriptor is traced)."""
    chunks = check_layout(range(num_devices) if chunks is None else chunks, num_devices)
    cpd = len(chunks) // num_devices
    last = tuple(tuple([num_devices - 1] * cpd) for _ in range(num_devices))
    return RingPlan(num_devices, chunks, last)


def ring_plan(desc: ExecutionDescriptor, num_devices: int,
              chunks: Optional[Sequence[int]] = None) -> RingPlan:
    """The static ring schedule of a concrete descriptor under a layout (default: one
    chunk per device, in order): only blocks that a device's rows can see travel."""
    chunks = check_layout(range(num_devices) if chunks is None else chunks, num_devices)
    p, cpd = num_devices, len(chunks) // num_devices
    vis = chunk_visibility(desc, len(chunks))
    last = []
    for t in range(p):
        row = []
        for j in range(cpd):
            kc = chunks[t * cpd + j]
            s_max = -1
            for s in range(p):
                d = (t + s) % p
                if any(vis[chunks[d * cpd + i], kc] for i in range(cpd)):
                    s_max = s
            row.append(s_max)
        last.append(tuple(row))
    return RingPlan(p, chunks, tuple(last))


def cost_report(desc: ExecutionDescriptor, plan: RingPlan, *, kv_bytes_per_token: int,
                acc_bytes_per_token: Optional[int] = None) -> dict:
    """Work per device and bytes sent by ``plan`` vs a ring that sends every block.

    ``kv_bytes_per_token``: bytes of K and V of one sequence position over the batch
    (batch * kv_heads * (head_dim + head_dim_v) * itemsize); ``acc_bytes_per_token`` the
    same for the float32 dK/dV accumulators (default 2x for 16-bit inputs: 4-byte floats).
    Work is the visible (query, key) pairs of each device's rows (``work_max_min``) and
    the computed (non-empty) forward tiles of its rows (``tiles_max_min``).
    """
    c = len(plan.chunks)
    cs = chunk_size(desc, c)
    cpd, p = plan.chunks_per_device, plan.num_devices
    w = row_work(desc).reshape(c, cs).sum(1)
    inner, f = _classes(desc)          # a class descriptor: f class sequences alike
    st = (_tile_states(inner, "fwd") & COMPUTE) != 0
    tq = cs // f // inner.tiles.block_q
    # f classes alike (one mask head), or each its own (the inner mask heads)
    tiles = (f if inner.mask_heads == 1 else 1) * st.sum(axis=(0, 1, 3)).reshape(c, tq).sum(1)
    dev = [list(plan.chunks[d * cpd:(d + 1) * cpd]) for d in range(p)]
    work = np.array([w[ch].sum() for ch in dev], np.float64)
    tw = np.array([tiles[ch].sum() for ch in dev], np.float64)
    acc = 2 * kv_bytes_per_token if acc_bytes_per_token is None else acc_bytes_per_token
    chunk_kv, chunk_acc = cs * kv_bytes_per_token, cs * acc
    bkv, bacc = plan.backward_sends()
    fkv, facc = plan.full_ring_backward_sends()
    ratio = lambda x: float(x.max() / x.min()) if x.min() > 0 else float("inf")  # noqa: E731
    return {
        "devices": p, "chunks": c, "chunk_rows": cs, "steps": plan.num_steps,
        "work_per_device": work.tolist(), "work_max_min": ratio(work),
        "tiles_per_device": tw.tolist(), "tiles_max_min": ratio(tw),
        "fwd_bytes": plan.forward_sends() * chunk_kv,
        "fwd_bytes_full_ring": plan.full_ring_forward_sends() * chunk_kv,
        "bwd_bytes": bkv * chunk_kv + bacc * chunk_acc,
        "bwd_bytes_full_ring": fkv * chunk_kv + facc * chunk_acc,
    }
