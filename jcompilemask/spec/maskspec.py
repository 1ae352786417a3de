"""Regions and MaskSpecs, with metadata validation and the dense oracle.

Run-time semantics (every backend follows them):

* Region bounds are evaluated per sequence and clamped to ``[0, q_len]``; bounds that are
  provably empty for every value (``(10, 5)``) are an error at construction.
* Every value is int32; metadata that does not fit is an error (a ``check_metadata``
  report inside ``jit``), and so is an expression that can overflow for the lengths in
  use (:mod:`jcompilemask.spec.ranges`).
* A query row belongs to the **first listed** region whose ``[lo, hi)`` contains it; rows
  in no region see nothing (their output is 0 and their lse is -inf).
* A row ``q`` of region ``g`` sees key ``k`` (``0 <= k < kv_len``) iff ``g.visible(q, k)``.

Overlapping regions are an error only when the overlap is provable at construction;
overlaps that appear only for some metadata values follow the first-match rule and are
reported by :meth:`MaskSpec.check_metadata` (for ``checkify``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from .evaluate import Env, evaluate, segment_tables
from .expr import Expr, Index, as_expr, as_pred, walk
from .metadata import MetaDecl, Scalar, SegRead, VectorElem, VectorRead

__all__ = ["Region", "MaskSpec", "MetadataError"]


class MetadataError(ValueError):
    """Metadata that does not fit the MaskSpec (missing key, shape, dtype, value range)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """A contiguous range of query rows ``[lo, hi)`` and their visibility rule.

    Args:
      rows: ``(lo, hi)``: integer expressions of constants, ``q_len``, ``kv_len`` and
        metadata (not of ``q``, ``k`` or ``h``). Bounds that are provably empty for every
        value (``(10, 5)``, ``(a, a)``, ``(q_len, q_len + 4)``) raise; bounds empty only
        for some values are clamped at run time (see the module doc).
      visible: a predicate over ``q``, ``k``, ``h``, lengths and metadata, or True/False.
      name: optional label used when printing.

    >>> from jcompilemask.spec import Region, q, k, q_len
    >>> print(Region(rows=(0, q_len), visible=k <= q))
    rows [0, q_len): k <= q
    """

    rows: tuple
    visible: Any
    name: str | None = None

    def __post_init__(self):
        if not isinstance(self.rows, (tuple, list)) or len(self.rows) != 2:
            raise TypeError(f"Region rows must be a (lo, hi) pair, got {self.rows!r}")
        lo = as_expr(self.rows[0], "Region rows lo")
        hi = as_expr(self.rows[1], "Region rows hi")
        for bound, what in ((lo, "lo"), (hi, "hi")):
            used = {n.name for n in walk(bound) if isinstance(n, Index)}
            if used:
                raise ValueError(f"Region rows {what} = {bound} uses {sorted(used)}: bounds "
                                 "may depend on constants, lengths and metadata only")
        object.__setattr__(self, "rows", (lo, hi))
        object.__setattr__(self, "visible", as_pred(self.visible, "Region visible"))
        self._check_provably_empty()

    def _check_provably_empty(self):
        """A region whose rows are empty for every admissible length and metadata value
        (after the run-time clamp to [0, q_len]) is a bug in the spec: every row it names
        would silently see nothing. Bounds that are empty only for some values keep the
        clamp semantics."""
        from ..lower.symbolic import provably_le  # sympy lives in lower/
        from .expr import q_len
        lo, hi = self.rows
        zero = as_expr(0)
        fix = f"write rows as (lo, hi) with lo < hi, e.g. ({hi}, {lo}), or drop the region"
        outside = "rows are clamped to [0, q_len): the range must reach into it"
        for ok, why, hint in ((provably_le(hi, lo), "hi <= lo", fix),
                              (provably_le(hi, zero), "hi <= 0", outside),
                              (provably_le(q_len, lo), "lo >= q_len", outside)):
            if ok:
                raise ValueError(
                    f"Region rows [{lo}, {hi}) are empty for every q_len and metadata "
                    f"value ({why}), so the region would silently see nothing: {hint}")

    def key(self):
        return ("region", self.rows[0].key(), self.rows[1].key(), self.visible.key())

    def __str__(self):
        label = f"{self.name}: " if self.name else ""
        return f"{label}rows [{self.rows[0]}, {self.rows[1]}): {self.visible}"


def _metadata_of(node) -> list[MetaDecl]:
    out = []
    for n in walk(node):
        if isinstance(n, Scalar):
            out.append(n)
        elif isinstance(n, (VectorElem, VectorRead)):
            out.append(n.decl)
        elif isinstance(n, SegRead):
            out.append(n.decl)
    return out


class MaskSpec:
    """An attention mask written once as regions of query rows with visibility rules.

    Args:
      regions: the :class:`Region` list; order matters (first match wins).
      num_heads: required when a rule uses ``h``; the dense view then has that many
        mask heads (``Hm``), otherwise ``Hm = 1``.
      metadata: optional declaration list; when given, every metadata the rules read must
        be in it (catches typos such as two spellings of one name).
      name: a label for printing.

    >>> import jcompilemask as jcm
    >>> from jcompilemask.spec import MaskSpec, Region, Scalar, q, k, q_len
    >>> p = Scalar("prefix_len", max=q_len)
    >>> spec = MaskSpec([Region((0, q_len), (k < p) | (k <= q))], name="prefix")
    >>> spec.as_dense({"prefix_len": [2]}, 4, 4)[0, 0].astype(int).tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """

    def __init__(self, regions: Sequence[Region], *, num_heads: int | None = None,
                 metadata: Sequence[MetaDecl] | None = None, name: str | None = None):
        if isinstance(regions, Region):
            regions = [regions]
        regions = list(regions)
        if not regions:
            raise ValueError("MaskSpec needs at least one Region")
        for i, r in enumerate(regions):
            if not isinstance(r, Region):
                raise TypeError(f"regions[{i}] must be a Region, got {type(r).__name__}")
        self.regions: tuple[Region, ...] = tuple(regions)
        self.name = name

        decls: dict[str, MetaDecl] = {}
        nodes = [b for r in regions for b in r.rows] + [r.visible for r in regions]
        for node in nodes:
            for d in _metadata_of(node):
                prev = decls.get(d.name)
                if prev is not None and prev.decl_key() != d.decl_key():
                    raise ValueError(f"metadata name {d.name!r} is declared twice with "
                                     f"different kinds or ranges: {prev.describe()} vs "
                                     f"{d.describe()}")
                decls[d.name] = d
        if metadata is not None:
            declared = {}
            for d in metadata:
                if not isinstance(d, MetaDecl):
                    raise TypeError(f"metadata declarations must be Scalar/Vector/SegmentIds,"
                                    f" got {d!r}")
                declared[d.name] = d
            unknown = sorted(set(decls) - set(declared))
            if unknown:
                raise ValueError(f"rules read unknown metadata {unknown}; declared: "
                                 f"{sorted(declared)}. Add them to metadata=[...] or fix "
                                 "the spelling")
            for n, d in declared.items():
                if n in decls and decls[n].decl_key() != d.decl_key():
                    raise ValueError(f"metadata {n!r} declared as {d.describe()} but used "
                                     f"as {decls[n].describe()}")
            decls = {**declared, **decls}
        self.metadata: dict[str, MetaDecl] = dict(sorted(decls.items()))

        uses_h = any(isinstance(n, Index) and n.name == "h" for r in regions
                     for n in walk(r.visible))
        if uses_h:
            if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
                raise ValueError("this MaskSpec's rules use the head index h: pass "
                                 "num_heads=<number of query heads>")
        elif num_heads is not None and (not isinstance(num_heads, int) or num_heads < 1):
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.uses_heads = uses_h
        self.num_heads = num_heads
        self.mask_heads = num_heads if uses_h else 1
        self._check_provable_overlaps()

    # -- identity ---------------------------------------------------------------------
    def key(self) -> tuple:
        return ("maskspec", tuple(r.key() for r in self.regions), self.mask_heads,
                tuple(d.decl_key() for d in self.metadata.values()))

    def fingerprint(self) -> str:
        """A stable hash of the spec's structure (not of its name)."""
        return hashlib.sha256(repr(self.key()).encode()).hexdigest()[:16]

    def __eq__(self, other):
        return isinstance(other, MaskSpec) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    @property
    def batched(self) -> bool:
        """True when the spec reads per-sequence metadata (its dense view has B > 1)."""
        return bool(self.metadata)

    @property
    def ndim(self):
        from ..lower.descriptor import not_an_array
        raise not_an_array("MaskSpec")

    def __str__(self):
        head = f"MaskSpec {self.name!r}" if self.name else "MaskSpec"
        meta = "; ".join(d.describe() for d in self.metadata.values()) or "none"
        lines = [f"{head}  (metadata: {meta}; mask heads: {self.mask_heads})"]
        for i, r in enumerate(self.regions):
            label = f" {r.name!r}" if r.name else ""
            lines.append(f"  region {i}{label}: rows [{r.rows[0]}, {r.rows[1]})")
            lines.append(f"      visible: {r.visible}")
        return "\n".join(lines)

    def __repr__(self):
        return f"<MaskSpec {self.name or ''} {len(self.regions)} regions {self.fingerprint()}>"

    # -- construction checks ------------------------------------------------------------
    def _check_provable_overlaps(self):
        from ..lower.symbolic import provably  # sympy lives in lower/
        for i, a in enumerate(self.regions):
            for j in range(i + 1, len(self.regions)):
                b = self.regions[j]
                lo = (a.rows[0], b.rows[0])
                hi = (a.rows[1], b.rows[1])
                # Both non-empty and intersecting, for every admissible metadata value.
                if provably(lambda S: S.Min(S.E(hi[0]), S.E(hi[1]))
                            - S.Max(S.E(lo[0]), S.E(lo[1])) > 0, self):
                    raise ValueError(f"regions {i} and {j} provably overlap: rows "
                                     f"[{a.rows[0]}, {a.rows[1]}) and [{b.rows[0]}, "
                                     f"{b.rows[1]}); make their row ranges disjoint")

    def check_ranges(self, q_len: int, kv_len: int):
        """Raise :class:`~jcompilemask.spec.ranges.Int32RangeError` if some expression
        of the spec can leave int32 for these lengths and the declared metadata ranges
        (checked once per pair of lengths; see :mod:`jcompilemask.spec.ranges`)."""
        done = self.__dict__.setdefault("_ranges_ok", set())
        if (q_len, kv_len) in done:
            return
        from .ranges import check_int32
        items = []
        for g, r in enumerate(self.regions):
            items += [(f"region {g} rows lo", r.rows[0]), (f"region {g} rows hi", r.rows[1]),
                      (f"region {g} rule", r.visible)]
        check_int32(items, q_len, kv_len, self.mask_heads)
        done.add((q_len, kv_len))

    # -- metadata -------------------------------------------------------------------------
    def normalize_metadata(self, metadata: Mapping | None, q_len: int, kv_len: int,
                           *, validate: bool = True):
        """Check and convert run-time metadata; returns ``(meta, B)``.

        ``meta`` maps scalars to int32 [B], vectors to int32 [B, R] and segment ids to
        their run tables (:func:`segment_tables`). Structural problems (missing or extra
        keys, shapes, dtypes) always raise :class:`MetadataError`; value ranges are
        checked when the values are concrete (outside ``jit``) and ``validate`` is True.
        Traced values outside their declared range are clamped into it.
        """
        q_len, kv_len = _static_len(q_len, "q_len"), _static_len(kv_len, "kv_len")
        arrays, batch = self.checked_metadata(metadata, q_len, kv_len, validate=validate)
        meta = {}
        lens = {"q_len": q_len, "kv_len": kv_len}
        for name, x in arrays.items():
            decl = self.metadata[name]
            x = _to_int32(x)
            if decl.kind == "tokens":
                meta[name] = segment_tables(x)
                continue
            # Values outside the declared range (possible only inside jit, where they are
            # not validated) are clamped into it: the lowering's proofs (merges, monotone
            # bounds) hold for declared ranges only, and clamping here keeps the oracle
            # and every preprocess on one definition. check_metadata reports them.
            lo = None if decl.min is None else _eval_static(decl.min, lens)
            hi = None if decl.max is None else _eval_static(decl.max, lens)
            if lo is not None or hi is not None:
                x = jnp.clip(x, lo, hi)
            meta[name] = x
        return meta, (batch or 1)

    def checked_metadata(self, metadata: Mapping | None, q_len: int, kv_len: int,
                         *, validate: bool = True):
        """The checks of :meth:`normalize_metadata` without its conversion: ``(arrays,
        B)``, the metadata arrays by name as given (lists made numpy arrays). Raises
        :class:`MetadataError` as it does."""
        q_len, kv_len = _static_len(q_len, "q_len"), _static_len(kv_len, "kv_len")
        self.check_ranges(q_len, kv_len)
        if metadata is not None and not isinstance(metadata, Mapping):
            names = ", ".join(f"{n!r}: ..." for n in self.metadata) or "none"
            raise MetadataError(f"metadata must be a dict mapping names to arrays "
                                f"({{{names}}}), got a {type(metadata).__name__}")
        metadata = {} if metadata is None else dict(metadata)
        missing = [n for n in self.metadata if n not in metadata]
        if missing:
            need = "; ".join(self.metadata[n].describe() for n in missing)
            raise MetadataError(f"metadata is missing {missing} (this spec reads {need})")
        extra = sorted(set(metadata) - set(self.metadata))
        if extra:
            raise MetadataError(f"unexpected metadata keys {extra}; this spec reads "
                                f"{sorted(self.metadata) or 'no metadata'}")
        n_tok = max(q_len, kv_len)
        arrays, batch = {}, None
        for name, decl in self.metadata.items():
            x = metadata[name]
            if not hasattr(x, "dtype"):
                x = np.asarray(x)
            if x.dtype == bool or not jnp.issubdtype(x.dtype, jnp.integer):
                raise MetadataError(f"metadata {name!r} must have an integer dtype, got "
                                    f"{x.dtype}")
            want = {"scalar": 1, "vector": 2, "tokens": 2}[decl.kind]
            if x.ndim != want:
                shape = {"scalar": "[B]", "vector": f"[B, {getattr(decl, 'size', '')}]",
                         "tokens": f"[B, {n_tok}]"}[decl.kind]
                raise MetadataError(f"metadata {name!r} must have shape {shape}, got "
                                    f"{tuple(x.shape)}")
            if decl.kind == "vector" and x.shape[1] != decl.size:
                raise MetadataError(f"metadata {name!r} must have shape [B, {decl.size}], "
                                    f"got {tuple(x.shape)}")
            if decl.kind == "tokens" and x.shape[1] != n_tok:
                raise MetadataError(f"metadata {name!r} must have shape [B, {n_tok}] "
                                    f"(max(q_len, kv_len) tokens), got {tuple(x.shape)}")
            if batch is None:
                batch = x.shape[0]
            elif x.shape[0] != batch:
                raise MetadataError(f"metadata {name!r} has batch {x.shape[0]}, others "
                                    f"have {batch}")
            if x.shape[0] < 1:
                raise MetadataError(f"metadata {name!r} has an empty batch axis")
            arrays[name] = x
        if validate:
            concrete = {n: a for n, a in arrays.items() if not isinstance(a, jax.core.Tracer)}
            for msg, bad in self._range_errors(concrete, q_len, kv_len, np):
                if np.any(bad):
                    where = np.argwhere(np.asarray(bad))[0].tolist()
                    raise MetadataError(f"{msg} (first at index {where})")
        return arrays, batch

    def _range_errors(self, arrays, q_len, kv_len, xp):
        """(message, bool array of violations) for each declared value range."""
        out = []
        lens = {"q_len": q_len, "kv_len": kv_len}
        for name, x in arrays.items():
            decl = self.metadata[name]
            info = np.iinfo(x.dtype)
            if info.min < _I32.min or info.max > _I32.max:
                bad = x > _I32.max
                if info.min < 0:
                    bad = bad | (x < _I32.min)
                out.append((f"metadata {name!r} ({x.dtype}) has values outside int32 "
                            f"[{_I32.min}, {_I32.max}], the type every mask computation "
                            "uses (inside jit they saturate): pass values that fit int32"
                            + ("" if decl.kind == "tokens" or decl.max is not None else
                               f", and declare the range, e.g. {type(decl).__name__}"
                               f"({name!r}, max=q_len)"), bad))
            if decl.kind == "tokens":
                if decl.contiguous:
                    out.append((f"metadata {name!r} is declared contiguous (each id one run "
                                "of tokens) but an id occurs in more than one run, which "
                                "the lowering of seg.id(k) == seg.id(q) assumes: sort the "
                                "ids, give each run its own id, or drop contiguous=True",
                                _repeated_runs(x, xp)))
                continue
            for bound, cmp, word in ((decl.min, "lt", "below its minimum"),
                                     (decl.max, "gt", "above its maximum")):
                if bound is None:
                    continue
                v = _eval_static(bound, lens)
                bad = (x < v) if cmp == "lt" else (x > v)
                out.append((f"metadata {name!r} has values {word} {bound} = {v}", bad))
        return out

    def check_metadata(self, metadata: Mapping | None, q_len: int, kv_len: int):
        """Report bad metadata values with ``checkify`` (works inside ``jit``).

        Reports values that do not fit int32 (they saturate), values outside their
        declared ranges (clamped), region bounds that fall outside
        ``[0, q_len]`` (clamped at run time), and run-time region overlaps (resolved by
        first match). Use it inside a function wrapped by ``checkify.checkify``:

        >>> import jax
        >>> from jax.experimental import checkify
        >>> import jcompilemask as jcm
        >>> spec = jcm.masks.prefix_lm()
        >>> f = checkify.checkify(lambda m: spec.check_metadata(m, 8, 8))
        >>> err, _ = jax.jit(f)({"prefix_len": jax.numpy.array([9])})
        >>> err.get() is not None
        True
        """
        arrays = self._structural(metadata, q_len, kv_len)
        for msg, bad in self._range_errors(arrays, q_len, kv_len, jnp):
            checkify.check(jnp.logical_not(jnp.any(bad)), msg)
        meta = {n: (segment_tables(_to_int32(a)) if self.metadata[n].kind == "tokens"
                    else _to_int32(a)) for n, a in arrays.items()}
        lo, hi = self._raw_bounds(meta, q_len, kv_len)
        for g in range(len(self.regions)):
            checkify.check(jnp.all((lo[g] >= 0) & (hi[g] <= q_len)),
                           f"region {g} bounds fall outside [0, q_len={q_len}] for some "
                           "sequence (they are clamped)")
            for g2 in range(g):
                ov = (jnp.maximum(jnp.clip(lo[g], 0, q_len), jnp.clip(lo[g2], 0, q_len))
                      < jnp.minimum(jnp.clip(hi[g], 0, q_len), jnp.clip(hi[g2], 0, q_len)))
                checkify.check(jnp.logical_not(jnp.any(ov)),
                               f"regions {g2} and {g} overlap for some sequence (rows go to "
                               f"region {g2}, the first listed)")

    def _structural(self, metadata, q_len, kv_len):
        self.normalize_metadata(metadata, q_len, kv_len, validate=False)
        # Raw dtypes (not jnp.asarray, which wraps int64 when x64 is off): the range
        # checks must see the values the caller passed.
        return {n: (metadata[n] if hasattr(metadata[n], "dtype") else np.asarray(metadata[n]))
                for n in self.metadata}

    def _raw_bounds(self, meta, q_len, kv_len):
        """Unclamped region bounds, int32 [B] each (B = 1 without metadata)."""
        b = _batch_of(meta)
        env = Env(1, {}, q_len, kv_len, meta)
        los, his = [], []
        for r in self.regions:
            los.append(jnp.broadcast_to(evaluate(r.rows[0], env), (b,)).astype(jnp.int32))
            his.append(jnp.broadcast_to(evaluate(r.rows[1], env), (b,)).astype(jnp.int32))
        return los, his

    def row_regions(self, meta, q_len: int, kv_len: int):
        """int32 [B, q_len]: each row's region (first match), or -1 for none."""
        lo, hi = self._raw_bounds(meta, q_len, kv_len)
        rows = jnp.arange(q_len, dtype=jnp.int32)[None, :]
        out = jnp.full((lo[0].shape[0], q_len), -1, jnp.int32)
        for g in reversed(range(len(self.regions))):
            inside = (rows >= jnp.clip(lo[g], 0, q_len)[:, None]) & (
                rows < jnp.clip(hi[g], 0, q_len)[:, None])
            out = jnp.where(inside, g, out)
        return out

    # -- the dense oracle ---------------------------------------------------------------
    def as_dense(self, metadata: Mapping | None = None, q_len: int = None,
                 kv_len: int | None = None):
        """The mask as bool [B, Hm, q_len, kv_len] (jit-able): the reference of every stage.

        ``B`` is the metadata batch (1 without metadata), ``Hm`` the mask heads.
        ``kv_len`` defaults to ``q_len``.
        """
        if q_len is None:
            raise TypeError("as_dense needs q_len (and kv_len, default q_len)")
        kv_len = q_len if kv_len is None else kv_len
        arrays, _ = self.checked_metadata(metadata, q_len, kv_len)     # raises on bad input
        if any(isinstance(x, jax.core.Tracer) for x in arrays.values()):   # in the caller's jit
            meta, _ = self.normalize_metadata(metadata, q_len, kv_len)
            return self._dense_from_meta(meta, q_len, kv_len)
        # Concrete metadata: one compiled program per (spec, lengths) instead of each op
        # compiled and run on its own (~5x faster on a CPU; the same result). numpy
        # arrays are made int32 here, saturating (at the jit boundary they would wrap).
        arrays = {n: _to_int32(a, np) if isinstance(a, np.ndarray) else a for n, a in arrays.items()}
        return _dense_program(self, _static_len(q_len, "q_len"),
                              _static_len(kv_len, "kv_len"))(arrays or None)

    def _dense_from_meta(self, meta, q_len, kv_len):
        b = _batch_of(meta)
        hm = self.mask_heads
        idx = {"q": jnp.arange(q_len, dtype=jnp.int32).reshape(1, 1, q_len, 1),
               "k": jnp.arange(kv_len, dtype=jnp.int32).reshape(1, 1, 1, kv_len),
               "h": jnp.arange(hm, dtype=jnp.int32).reshape(1, hm, 1, 1)}
        env = Env(4, idx, q_len, kv_len, meta)
        region = self.row_regions(meta, q_len, kv_len)[:, None, :, None]
        out = jnp.zeros((b, hm, q_len, kv_len), bool)
        for g, r in enumerate(self.regions):
            vis = evaluate(r.visible, env)
            out = out | ((region == g) & vis)
        return out


@functools.lru_cache(maxsize=128)
def _dense_program(spec, q_len, kv_len):
    """``spec``'s dense oracle for these lengths as one jitted function of the checked
    metadata arrays (``MaskSpec.as_dense`` with concrete metadata)."""
    def dense(arrays):
        meta, _ = spec.normalize_metadata(arrays, q_len, kv_len, validate=False)
        return spec._dense_from_meta(meta, q_len, kv_len)
    return jax.jit(dense)


_I32 = np.iinfo(np.int32)


def _to_int32(x, xp=jnp):
    """int32 copy of an integer array that saturates values outside int32 instead of
    wrapping them (``2**32 + 4`` would otherwise read as 4), as an ``xp`` array (numpy:
    ``as_dense`` converts numpy metadata before a jit boundary, where int64 would wrap)."""
    info = np.iinfo(x.dtype)
    if info.min < _I32.min or info.max > _I32.max:
        lo, hi = max(info.min, _I32.min), min(info.max, _I32.max)
        x = np.clip(x, lo, hi) if isinstance(x, (np.ndarray, np.generic)) else jnp.clip(x, lo, hi)
    return xp.asarray(x).astype(xp.int32)


def _repeated_runs(ids, xp):
    """bool [B, N]: True at the first token of a run whose id already had a run before
    (the breach of ``SegmentIds(contiguous=True)``); ``xp`` is numpy or jax.numpy."""
    ids = xp.asarray(ids)
    n = ids.shape[-1]
    first = xp.ones(ids.shape[:-1] + (1,), bool)
    new_run = xp.concatenate([first, ids[..., 1:] != ids[..., :-1]], axis=-1)
    pos = xp.broadcast_to(xp.arange(n), ids.shape)
    # run starts first, by id, then by position: a repeated id is a run start that
    # follows a run start with the same id
    order = xp.lexsort((pos, ids, ~new_run), axis=-1)
    s_ids = xp.take_along_axis(ids, order, axis=-1)
    s_new = xp.take_along_axis(new_run, order, axis=-1)
    dup = s_new[..., 1:] & s_new[..., :-1] & (s_ids[..., 1:] == s_ids[..., :-1])
    dup = xp.concatenate([xp.zeros_like(first), dup], axis=-1)
    return xp.take_along_axis(dup, xp.argsort(order, axis=-1), axis=-1)


def _batch_of(meta) -> int:
    for v in meta.values():
        return (v["id"] if isinstance(v, dict) else v).shape[0]
    return 1


def _static_len(n, what):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{what} must be a positive Python int (a static length), got {n!r}")
    return int(n)


def _eval_static(e: Expr, lens) -> int:
    from .expr import BinOp, Const, Length
    from .expr import _FOLD
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Length):
        return lens[e.name]
    if isinstance(e, BinOp):
        return _FOLD[e.op](_eval_static(e.a, lens), _eval_static(e.b, lens))
    raise ValueError(f"cannot evaluate bound {e} statically")
