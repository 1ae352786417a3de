"""``compile(spec) -> CompiledMask``: the lowered form of a MaskSpec and its preprocess."""
from __future__ import annotations

import copy
import functools
from typing import Mapping, Optional, Protocol

import jax.numpy as jnp
import numpy as np

from ..spec.evaluate import Env, evaluate
from ..spec.expr import And, BoolConst, Or
from ..spec.maskspec import MaskSpec
from .analyze import LoweredRegion, lower_region
from .classes import RowClasses, classes_enabled, find_row_classes
from .descriptor import ClassDescriptor, ExecutionDescriptor, TileConfig
from .slots import assign_slots, head_support

__all__ = ["CompiledMask", "compile", "resolve_tiles", "DEFAULT_TILES", "Planner",
           "install_planner", "planner"]

# The xla backend's tiles; GPU backends announce their own (see jcompilemask.backends).
DEFAULT_TILES = TileConfig(block_q=128, block_kv=128, bwd_block_q=64, bwd_block_kv=128)


def resolve_tiles(block_q=None, block_kv=None, bwd_block_q=None, bwd_block_kv=None,
                  default: TileConfig | None = None) -> TileConfig:
    d = default or _preferred_default()
    pick = lambda v, dv: dv if v is None else v  # noqa: E731 - 0 must reach validation
    return TileConfig(pick(block_q, d.block_q), pick(block_kv, d.block_kv),
                      pick(bwd_block_q, d.bwd_block_q), pick(bwd_block_kv, d.bwd_block_kv))


def _preferred_default() -> TileConfig:
    return planner().preferred_tiles()


# Which preprocess builds a descriptor and which tiles it is built at are the backend
# registry's choices (jcompilemask.backends), as is which attention backend runs; lower/
# knows only the jnp preprocess. The registry installs itself here when it is imported
# (``import jcompilemask`` does), so lower/ never imports kernels/, ffi/ or the registry.
class Planner(Protocol):
    """What :meth:`CompiledMask.instantiate` asks of the registry."""

    def preferred_tiles(self) -> TileConfig:
        """Tiles of the best available attention backend."""

    def select_preprocess(self, cm: "CompiledMask", name: str | None = None):
        """The preprocess for ``cm`` (``name`` None: automatic): an object with ``name``
        and ``build(cm, metadata, q_len, kv_len, tiles) -> ExecutionDescriptor``."""


class _JnpOnly:
    """The planner of lower/ alone (before the registry is loaded): jnp, default tiles."""

    name = "jnp"

    def preferred_tiles(self, call=None) -> TileConfig:
        return DEFAULT_TILES

    def select_preprocess(self, cm, name=None):
        if name not in (None, "jnp"):
            raise ValueError(f"preprocess {name!r} needs jcompilemask.backends loaded "
                             "(import jcompilemask); lower/ alone has only 'jnp'")
        return self

    @staticmethod
    def build(cm, metadata, q_len, kv_len, tiles):
        from .preprocess import build_descriptor
        return build_descriptor(cm, metadata, q_len, kv_len, tiles)


_PLANNER: Planner = _JnpOnly()


def install_planner(p: Planner) -> None:
    """Route preprocess and tile choices to ``p`` (the backend registry calls this)."""
    global _PLANNER
    _PLANNER = p


def planner() -> Planner:
    """The installed planner (the backend registry once ``jcompilemask`` is imported)."""
    return _PLANNER


def _mask_reason(cm):
    from .residual_program import mask_kernel_reason
    return mask_kernel_reason(cm)


def region_backend(cm, g: int) -> str:
    """Which attention backend serves region ``g`` of ``cm`` as far as the mask decides
    it, and why (the call's dtype, head dims and device decide the rest: see
    ``jcompilemask.backends.explain``). A mask runs on one backend: a region that needs
    ``xla`` takes the whole mask there."""
    lr = cm.regions[g]
    why = _mask_reason(cm) if cm.residual_regions else None
    if lr.has_residual:
        if why:
            return f"xla (residual predicate: {why})"
        return ("cute on an SM90 GPU (hull intervals, the residual predicate emitted into "
                "partial tiles of the forward and backward), else xla")
    others = [i for i in cm.residual_regions if i != g]
    if others and why:
        return (f"xla: the interval tables serve this region, but regions {others} have "
                "residual predicates and a mask runs on one backend")
    return "cute on an SM90 GPU (interval tables only), else xla"


class CompiledMask:
    """A MaskSpec lowered to interval expressions, ready to instantiate descriptors.

    Attributes:
      spec: the source :class:`MaskSpec`.
      regions: one :class:`LoweredRegion` per region: its intervals (hull + residual
        predicate each) and their slot groups (``lr.slots``).
      residual_regions: the regions whose intervals keep a residual predicate (atoms that
        are not intervals in ``k``, e.g. ``k % 2 == 0``); ``fallback_regions`` is the
        same tuple under its former name. Their hulls are in the interval tables, the
        residuals are evaluated per element in partial tiles (the CuTe kernels emit them
        as code; the ``xla`` backend evaluates the same expressions); the TileLang
        preprocess refuses such masks (the jnp preprocess builds their descriptors).
      num_intervals: K, forward intervals (slots) per row (max over regions and mask
        heads, at least 1): the most ranges of keys one query row sees. Intervals whose
        row conditions exclude each other, or that overlap, form one slot group; a group
        takes a table slot only in the heads where some member can hold.
      num_bwd_intervals: Kc, backward intervals per key column (0: no column view): the
        most ranges of query rows that see one key (max over mask heads). The *column
        view* is that table, per key instead of per row; the backward pass, which holds
        a key tile and streams query tiles, reads it. Every lowered interval has its own
        column interval (residuals are applied to it as to rows).
      fwd_slots, bwd_slots: ``{(region, interval): ((slot, heads or None), ...)}``, the
        table slot each lowered interval writes, per head (:mod:`.slots`). In
        ``fwd_slots`` the members of one slot group have their group's assignment (the
        group writes the union of its active members there).
      region_num_slots: per region, the forward slots it uses (max over heads).

    >>> import jcompilemask as jcm
    >>> cm = jcm.compile(jcm.masks.causal())
    >>> cm.num_intervals, cm.num_bwd_intervals
    (1, 1)
    >>> d = cm.instantiate(None, 8, 8, block_q=4, block_kv=4, bwd_block_q=4, bwd_block_kv=4)
    >>> print(d.to_string())
    fwd tiles 4x4 (2x2), batch 0, head 0: # full, + partial, . empty
    +.
    #+
    full 1, partial 2, empty 1
    """

    residual_regions: tuple = ()     # defaults for subclasses (DenseMask) without regions
    shares_slots = False
    row_classes: Optional[RowClasses] = None

    def __init__(self, spec: MaskSpec, regions: tuple[LoweredRegion, ...]):
        self.spec = spec
        self.regions = regions
        self.residual_regions = tuple(i for i, r in enumerate(regions) if r.has_residual)
        # The former name: regions not served by the interval tables alone (the GPU
        # kernels and the TileLang preprocess refuse them; the xla backend serves them).
        self.fallback_regions = self.residual_regions
        self.shares_slots = any(r.shares_slots for r in regions)
        self.has_column_view = bool(regions) and all(r.bwd_ok for r in regions)
        # Two slot systems composed: a region's slot groups (lr.slots: intervals that
        # exclude each other or touch, one run per row) are the units of the per-head
        # assignment (lower/slots.py): a group is live on the union of its members' head
        # supports, so K is the max over regions and heads of the groups live there.
        hm = spec.mask_heads
        support = {(g, i): head_support(iv.cond, hm) for g, r in enumerate(regions)
                   for i, iv in enumerate(r.intervals)}
        self.fwd_slots, k_max, self.region_num_slots = {}, 1, []
        for g, r in enumerate(regions):
            units = [tuple(sorted(set().union(*[support[g, i] for i in members])))
                     for members in r.slots]
            n, slots = assign_slots(units, hm)
            k_max = max(k_max, n)
            self.region_num_slots.append(n)
            for members, sl in zip(r.slots, slots):
                self.fwd_slots.update({(g, i): sl for i in members})
        self.region_num_slots = tuple(self.region_num_slots)
        self.num_intervals = k_max
        # The column view: one column interval per lowered interval (residual or not),
        # per head over all regions: Kc is the max over heads, not the sum.
        keys = sorted(support)
        n, slots = assign_slots([support[x] for x in keys], hm)
        self.bwd_slots = dict(zip(keys, slots))
        self.num_bwd_intervals = n if self.has_column_view else 0
        if self.has_column_view and self.num_bwd_intervals == 0:
            self.has_column_view = False

    # -- residue classes ------------------------------------------------------------------
    @property
    def class_mask(self) -> Optional["CompiledMask"]:
        """The compiled mask of one residue class (:mod:`jcompilemask.lower.classes`), or
        None when the spec does not factor into classes."""
        if self.row_classes is None:
            return None
        return _compile_cached(self.row_classes.spec)

    def classes_for(self, q_len: int, kv_len: int, row_classes: Optional[bool] = None) -> int:
        """How many residue classes a descriptor at these lengths uses: the spec's factor
        when it has one, both lengths are multiples of it and neither ``row_classes=False``
        nor ``$JCOMPILEMASK_ROW_CLASSES=0`` turns them off; else 1. ``row_classes=True``
        raises where they cannot be used, saying why.

        >>> import jcompilemask as jcm
        >>> from jcompilemask.spec import MaskSpec, Region, q, k, q_len
        >>> cm = jcm.compile(MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % 2 == 0))]))
        >>> cm.classes_for(8, 8), cm.classes_for(7, 7), cm.classes_for(8, 8, False)
        (2, 1, 1)
        """
        if row_classes is not None and not isinstance(row_classes, (bool, np.bool_)):
            raise TypeError(f"row_classes must be True, False or None, got {row_classes!r}")
        if row_classes is False:
            return 1
        rc = self.row_classes
        why = None
        if rc is None:
            from .classes import why_no_row_classes
            why = why_no_row_classes(self.spec) or (
                "its rules do not pair each query only with keys of its residue class "
                "(a conjunct (q - k) % c == 0 in every region, every other comparison "
                "a function of q - k, no h, no metadata but segment-id run bounds "
                "at q or k)")
        elif q_len % rc.factor or kv_len % rc.factor:
            why = (f"q_len={q_len} and kv_len={kv_len} must both be multiples of "
                   f"{rc.factor}")
            if row_classes is None and (self.spec.key(), q_len, kv_len) not in _odd_lengths:
                _odd_lengths.add((self.spec.key(), q_len, kv_len))
                import warnings
                from .hints import MaskFallbackWarning
                warnings.warn(
                    f"{'mask ' + repr(self.spec.name) if self.spec.name else 'this mask'}"
                    f" runs as residue classes mod {rc.factor} "
                    f"only where q_len and kv_len are multiples of {rc.factor}; at "
                    f"q_len={q_len}, kv_len={kv_len} it takes its residual lowering "
                    "(slower: pad the sequences to a multiple)", MaskFallbackWarning,
                    stacklevel=3)
        elif row_classes is None and not classes_enabled():
            return 1
        if why is None:
            return rc.factor
        if row_classes:
            raise ValueError(f"row_classes=True: this mask cannot run as residue classes: {why}")
        return 1

    def residual(self, region: int, slot: int):
        """The residual predicate (a :class:`~jcompilemask.spec.expr.Pred` tree over
        ``q``, ``k``, ``h`` and metadata) that the forward-table slot ``slot`` of region
        ``region`` is AND-ed with; ``TRUE`` where the slot is exact. A code generator
        emits it as it is; :meth:`residual_visibility` evaluates it with jnp.

        >>> import jcompilemask as jcm
        >>> from jcompilemask.spec import MaskSpec, Region, q, k, q_len
        >>> cm = jcm.compile(MaskSpec([Region((0, q_len), (k <= q) & ((q - k) % 2 == 0))]),
        ...                  warn=False)
        >>> print(cm.residual(0, 0))
        (q - k) % 2 == 0
        """
        lr = self.regions[region]
        units = []                  # (slot group, heads or None) written to this slot
        for m, members in enumerate(lr.slots):
            for s, heads in self.fwd_slots[region, members[0]]:
                if s == slot:
                    units.append((lr.slot_residual(m), heads))
        return _per_head_residual(units)

    # -- identity (static data of jit / descriptor aux) ---------------------------------
    def key(self):
        return ("compiled", self.spec.key())

    def __eq__(self, other):
        return isinstance(other, CompiledMask) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    def fingerprint(self) -> str:
        return self.spec.fingerprint()

    @property
    def batched(self) -> bool:
        return self.spec.batched

    @property
    def ndim(self):
        from .descriptor import not_an_array
        raise not_an_array("CompiledMask")

    @property
    def mask_heads(self) -> int:
        return self.spec.mask_heads

    @property
    def column_view_exact(self) -> bool:
        """True when every descriptor of this mask has an exact column view (``bwd_exact``
        all True): a column view exists (Kc > 0) and the spec has one region, so no region
        can lie inside another at run time (``lower.preprocess.region_row_ranges``). The
        CuTe backward then compiles its masked tiles without the row path.

        >>> import jcompilemask as jcm
        >>> jcm.compile(jcm.masks.causal()).column_view_exact
        True
        >>> jcm.compile(jcm.masks.hstu()).column_view_exact
        False
        """
        return self.num_bwd_intervals > 0 and len(self.regions) == 1

    # -- reporting ------------------------------------------------------------------------
    def explain(self) -> str:
        """Per region: its forward intervals (hull expressions and slots), the residual
        predicate if any, and which backend runs it and why; then the column view.

        >>> import jcompilemask as jcm
        >>> from jcompilemask.spec import MaskSpec, Region, q, k, q_len
        >>> spec = MaskSpec([Region((0, q_len), (k <= q) & (k % 2 == 0), name="even")])
        >>> print(jcm.compile(spec, warn=False).explain())   # doctest: +ELLIPSIS
        CompiledMask : K = 1 forward interval(s) per row, Kc = 1 backward ...
        ...
          region 0 'even': rows [0, q_len): 1 interval(s) in 1 slot(s)
            interval 0: k in [0, q + 1)  and residual k % 2 == 0
            residual predicate: k % 2 == 0
            backend: cute on an SM90 GPU (hull intervals, the residual predicate emitted ...
        ...
        """
        s = self.spec
        lines = [f"CompiledMask {s.name or ''}: K = {self.num_intervals} forward interval(s) "
                 f"per row, Kc = {self.num_bwd_intervals} backward interval(s) per column",
                 "  (K: at most this many ranges of keys are visible from one query row. "
                 "Kc: at most this many ranges of query rows see one key: the column view, "
                 "which the backward pass walks key by key)"]
        for i, (r, lr) in enumerate(zip(s.regions, self.regions)):
            label = f" {r.name!r}" if r.name else ""
            nk = self.region_num_slots[i]
            lines.append(f"  region {i}{label}: rows [{r.rows[0]}, {r.rows[1]}): "
                         f"{len(lr.intervals)} interval(s) in {nk} slot(s)")
            if not lr.intervals:
                lines.append("    sees nothing")
            per_head = any(hd is not None for m in range(len(lr.intervals))
                           for _, hd in self.fwd_slots[i, m])
            for m, iv in enumerate(lr.intervals):
                where = f"  (slot {_slot_label(self.fwd_slots[i, m])})" if per_head else ""
                lines.append(f"    interval {m}: k in {iv}{where}")
            for m, members in enumerate(lr.slots):
                if len(members) > 1:
                    lines.append(f"    slot {_slot_label(self.fwd_slots[i, members[0]])} "
                                 f"holds intervals {list(members)} (their row "
                                 "conditions exclude each other, or they overlap: one run)")
            for m, members in enumerate(lr.slots):
                res = lr.slot_residual(m)
                if not (isinstance(res, BoolConst) and res.value):
                    where = ("" if nk == 1 and not per_head else
                             f" (slot {_slot_label(self.fwd_slots[i, members[0]])})")
                    lines.append(f"    residual predicate{where}: {res}")
            lines.append(f"    backend: {region_backend(self, i)}")
            if lr.bwd_reason:
                lines.append(f"    no column view: {lr.bwd_reason}")
        if self.has_column_view:
            lines.append("  column view: derived (bounds non-decreasing in q, so the rows "
                         "that see a key form one range per interval; found by counting)")
        else:
            lines.append("  column view: none (the rows that see a key are not known to form "
                         "ranges); the backward pass checks row intervals")
        lines.append("  intervals are clamped to [0, kv_len); empty ones are (0, 0)")
        if self.row_classes is not None:
            rc, inner = self.row_classes, self.class_mask
            lines.append(f"  residue classes: each query sees only keys of its class mod "
                         f"{rc.factor}; where both lengths are multiples of {rc.factor} the "
                         f"descriptor holds one class's mask (K = {inner.num_intervals}, Kc = "
                         f"{inner.num_bwd_intervals}, residual regions "
                         f"{list(inner.residual_regions)}) and the kernels run the {rc.factor} "
                         "classes as heads (row_classes=False: the lowering above)")
            if rc.segments:
                lines.append(f"    each class reads its own segment ids "
                             f"({', '.join(rc.segments)}: runs relabeled, then one token in "
                             f"{rc.factor}) and has its own descriptor")
            for g, r in enumerate(rc.spec.regions):
                lines.append(f"    class region {g}: rows [{r.rows[0]}, {r.rows[1]}): "
                             f"{r.visible}")
        if self.residual_regions:
            lines.append("  residual predicates are evaluated per element in partial tiles; "
                         "a tile that a hull covers but its residual may cut is partial")
        return "\n".join(lines)

    def __str__(self):
        return self.explain()

    def __repr__(self):
        return (f"<CompiledMask {self.spec.name or ''} K={self.num_intervals} "
                f"Kc={self.num_bwd_intervals} residual={list(self.residual_regions)}>")

    # -- instantiation -------------------------------------------------------------------
    def default_preprocess(self) -> str:
        """The preprocess ``instantiate(preprocess=None)`` runs, as the backend registry
        chooses it (``jcm.backends.explain()`` lists the candidates and why each is
        skipped): ``$JCOMPILEMASK_PREPROCESS`` if set, else "tilelang" on an SM90 GPU with
        the ``tilelang`` extra for a mask without residual predicates, else "jnp".

        >>> import jcompilemask as jcm
        >>> jcm.compile(jcm.masks.causal()).default_preprocess() in ("jnp", "tilelang")
        True
        """
        return planner().select_preprocess(self).name

    def instantiate(self, metadata: Mapping | None, q_len: int, kv_len: int | None = None,
                    *, block_q: Optional[int] = None, block_kv: Optional[int] = None,
                    bwd_block_q: Optional[int] = None, bwd_block_kv: Optional[int] = None,
                    preprocess: str | None = None,
                    row_classes: Optional[bool] = None) -> ExecutionDescriptor:
        """Build the :class:`ExecutionDescriptor` for one batch (jit-able).

        Tile sizes left as None take the preferred tiles of the backend that will run.
        ``preprocess``: ``"jnp"`` (every platform; the reference) or ``"tilelang"`` (the
        generated GPU kernel, SM90, bit-identical output, for masks without residual
        predicates, needs the ``tilelang`` extra; compiled once per mask structure and tile
        shape, cached on disk). None asks the backend registry
        (:meth:`default_preprocess`).

        Outside ``jit`` (concrete metadata) the jnp preprocess runs as one jitted program,
        compiled once per (lengths, tiles, metadata shapes) and kept with this mask; the
        metadata's values are checked first (:class:`MetadataError` names the argument).
        Inside ``jit`` it is traced into the caller's program (values outside their declared
        range are clamped; :meth:`MaskSpec.check_metadata` reports them under ``checkify``).

        A mask whose rules pair each query only with keys of its own residue class mod
        ``c`` (``(q - k) % c == 0`` in every region, e.g. a dilated window) gets a
        :class:`ClassDescriptor` when both lengths are multiples of ``c``: the descriptor of
        one class's mask, which :func:`jcompilemask.mask_attention` runs with the classes
        as heads (:mod:`jcompilemask.lower.classes`, :meth:`classes_for`).
        ``row_classes=False`` (or ``$JCOMPILEMASK_ROW_CLASSES=0``) builds the
        sequence-coordinate descriptor instead (hulls and residual predicates);
        ``row_classes=True`` raises if the classes cannot be used.
        """
        kv_len = q_len if kv_len is None else kv_len
        if isinstance(q_len, (int, np.integer)) and isinstance(kv_len, (int, np.integer)):
            q_len, kv_len = int(q_len), int(kv_len)
            c = self.classes_for(q_len, kv_len, row_classes)
            if c > 1:
                segs = self.row_classes.segments
                if segs:
                    metadata = self._class_metadata(metadata, q_len, kv_len, c)
                inner = self.class_mask.instantiate(
                    metadata, q_len // c, kv_len // c, block_q=block_q, block_kv=block_kv,
                    bwd_block_q=bwd_block_q, bwd_block_kv=bwd_block_kv,
                    preprocess=preprocess, row_classes=False)
                if segs:
                    inner = _classes_as_heads(inner, c)
                return ClassDescriptor(inner, classes=c, mask=self, per_class=bool(segs))
        self.check_ranges(q_len, kv_len)
        tiles = resolve_tiles(block_q, block_kv, bwd_block_q, bwd_block_kv)
        impl = planner().select_preprocess(self, preprocess)
        return impl.build(self, metadata, q_len, kv_len, tiles)

    def _class_metadata(self, metadata, q_len: int, kv_len: int, c: int) -> dict:
        """The class mask's metadata: each segment-id array checked as this spec's, then
        relabeled by run and sliced per class, [B, N] -> [B * c, N / c]
        (:func:`~jcompilemask.lower.classes.class_segment_ids`)."""
        from .classes import class_segment_ids
        arrays, _ = self.spec.checked_metadata(metadata, q_len, kv_len)
        return {name: class_segment_ids(jnp.asarray(arrays[name]).astype(jnp.int32), c)
                for name in self.row_classes.segments}

    def check_ranges(self, q_len: int, kv_len: int):
        """The int32 range check of :meth:`MaskSpec.check_ranges`, over the lowered
        interval expressions too (the preprocess evaluates those, not the rules)."""
        if self.spec is None or not (isinstance(q_len, int) and isinstance(kv_len, int)):
            return                      # bad lengths get their error from the spec
        done = self.__dict__.setdefault("_ranges_ok", set())
        if (q_len, kv_len) in done:
            return
        from ..spec.ranges import check_int32
        self.spec.check_ranges(q_len, kv_len)
        items = []
        for g, lr in enumerate(self.regions):
            for m, iv in enumerate(lr.intervals):
                what = f"region {g} lowered interval {m}"
                items += [(what + " lo", iv.lo), (what + " hi", iv.hi), (what, iv.cond),
                          (what, iv.row_flag), (what + " residual", iv.residual)]
                items += [(what + " row bound", b) for b in (iv.q_lo, iv.q_hi)
                          if b is not None]
        check_int32(items, q_len, kv_len, self.spec.mask_heads)
        done.add((q_len, kv_len))

    # -- residual predicates -------------------------------------------------------------
    def fallback_visibility(self, desc: ExecutionDescriptor, rows, cols):
        """Visibility OR-ed over the interval check (False: a lowered MaskSpec has no
        region outside its interval tables; residuals are AND-ed per slot instead, see
        :meth:`slot_residuals`). ``DenseMask`` in bitmap layout overrides it."""
        return jnp.zeros((), bool)

    def residual_visibility(self, pred, desc: ExecutionDescriptor, rows, cols):
        """The jnp evaluator of a residual predicate: bool [B|1, Hm|1, R, C] for the query
        rows ``rows`` [R] and keys ``cols`` [C] (int32), reading the descriptor's
        metadata (kept in ``desc.metadata`` for masks with residuals)."""
        hm = self.spec.mask_heads
        idx = {"q": rows.reshape(1, 1, -1, 1), "k": cols.reshape(1, 1, 1, -1),
               "h": jnp.arange(hm, dtype=jnp.int32).reshape(1, hm, 1, 1)}
        env = Env(4, idx, desc.q_len, desc.kv_len, desc.metadata)
        out = evaluate(pred, env)
        return jnp.broadcast_to(out, out.shape[:2] + (rows.shape[0], cols.shape[0]))

    def column_residual(self, slot: int):
        """The residual predicate of column-view slot ``slot`` (per head, that of the
        interval written there: ``bwd_slots``); ``TRUE`` where it is exact."""
        units = [(self.regions[g].intervals[i].residual, heads)
                 for (g, i), sl in self.bwd_slots.items() for c, heads in sl if c == slot]
        return _per_head_residual(units)

    def slot_residuals(self, desc: ExecutionDescriptor, rows, cols, view: str = "fwd"):
        """None when no slot has a residual; else bool [B|1, Hm|1, R, C, S] to AND with
        the per-slot interval check: S = K forward slots (``view`` "fwd": per row, the
        residual of its region's slot, :meth:`residual`) or Kc column slots ("bwd":
        :meth:`column_residual`)."""
        if not self.residual_regions:
            return None
        r = jnp.clip(rows, 0, desc.q_len - 1)
        region = desc.row_region[:, r][:, None, :, None]             # [B, 1, R, 1]
        one = jnp.ones((1, 1, rows.shape[0], cols.shape[0]), bool)
        out = []
        if view == "fwd":
            for m in range(self.num_intervals):
                acc = one
                for g, lr in enumerate(self.regions):
                    res = self.residual(g, m)
                    if isinstance(res, BoolConst) and res.value:
                        continue
                    acc = acc & ((region != g) | self.residual_visibility(res, desc, rows,
                                                                          cols))
                out.append(acc)
        else:
            for c in range(self.num_bwd_intervals):
                res = self.column_residual(c)
                out.append(one if isinstance(res, BoolConst) and res.value else
                           self.residual_visibility(res, desc, rows, cols))
        shape = jnp.broadcast_shapes(*[x.shape for x in out])
        return jnp.stack([jnp.broadcast_to(x, shape) for x in out], -1)


def _slot_label(sl) -> str:
    """A slot assignment ((slot, heads or None), ...) as text: "0", "1 (heads [2, 3])"."""
    if not sl:
        return "none (no head can see it)"
    return ", ".join(f"{c}" if hd is None else f"{c} (heads {list(hd)})" for c, hd in sl)


def _per_head_residual(units):
    """The residual of one table slot written by ``units`` ((residual, heads or None),
    at most one unit per head): ``TRUE`` when every unit is exact, a unit's residual
    when it holds the slot on every head, else per head ``(h == x) & residual``."""
    from ..spec.expr import TRUE, Index
    if all(isinstance(r, BoolConst) and r.value for r, _ in units):
        return TRUE
    if len(units) == 1 and units[0][1] is None:
        return units[0][0]
    h = Index("h")
    return Or.of(*[And.of(Or.of(*[h == x for x in heads]) if heads is not None else TRUE, r)
                   for r, heads in units])


def _classes_as_heads(inner: ExecutionDescriptor, c: int) -> ExecutionDescriptor:
    """A descriptor of batch ``B * c`` (row ``b c + r``: class ``r`` of sequence ``b``, one
    mask head) as batch ``B`` with the classes as its mask heads (a reshape). Region
    bounds are multiples of ``c`` (or the length), so a class row's region is the same in
    every class; the backward's column table is exact where it is in every class."""
    b = inner.batch // c
    heads = lambda x: x.reshape((b, c) + x.shape[2:])          # noqa: E731
    region = inner.row_region.reshape((b, c) + inner.row_region.shape[1:])[:, 0]
    return ExecutionDescriptor(
        heads(inner.fwd_intervals), heads(inner.bwd_intervals), heads(inner.fwd_tiles),
        heads(inner.bwd_tiles), region, inner.bwd_exact.reshape(b, c).all(axis=1),
        inner.metadata, mask=inner.mask, q_len=inner.q_len, kv_len=inner.kv_len,
        tiles=inner.tiles)


@functools.lru_cache(maxsize=256)
def _compile_cached(spec: MaskSpec) -> CompiledMask:
    from .._progress import slow_step
    what = (f"jcompilemask: lowering mask {spec.name or spec.fingerprint()} "
            f"({len(spec.regions)} region(s), sympy)")
    with slow_step(what):
        regions = tuple(lower_region(r, spec) for r in spec.regions)
    cm = CompiledMask(spec, regions)
    cm.row_classes = find_row_classes(spec)
    return cm


_warned: set = set()      # spec keys whose fallback regions were reported
_odd_lengths: set = set()  # (spec key, q_len, kv_len) told they miss the residue classes
_quiet: set = set()       # spec keys a caller compiled with warn=False


def compile(spec, *, warn: bool = True) -> CompiledMask:  # noqa: A001 - the public name
    """Lower a :class:`MaskSpec` to interval expressions (cached per spec structure).

    Atoms that are not intervals in ``k`` (``k % 2 == 0``, ``k * k <= q``) stay as a
    residual predicate of their interval's hull (evaluated per element in partial tiles:
    correct, slower, and not run by the GPU kernels yet); the first compile of such a spec
    issues a :class:`~jcompilemask.lower.hints.MaskFallbackWarning` naming the region, the
    atom, and a rewrite that lowers where one is known. ``warn=False`` is for code that
    checks ``residual_regions`` itself: no warning for that spec, now or later. A lowering
    that takes more than a second says so through ``logging`` while it runs.

    >>> import jcompilemask as jcm
    >>> print(jcm.compile(jcm.masks.hstu()).explain().splitlines()[0])
    CompiledMask hstu: K = 2 forward interval(s) per row, Kc = 4 backward interval(s) per column
    """
    if isinstance(spec, CompiledMask):
        return spec
    if not isinstance(spec, MaskSpec):
        raise TypeError(f"compile() takes a MaskSpec, got {type(spec).__name__}")
    cm = _compile_cached(spec)
    names = lambda x: (x.name, tuple(r.name for r in x.regions))  # noqa: E731
    if cm.spec is not spec and names(cm.spec) != names(spec):
        # The cache is keyed by structure; names (the spec's, its regions') are the
        # caller's: explain() and the warnings must name this spec's regions.
        cm = copy.copy(cm)
        cm.spec = spec
    key = spec.key()
    if not warn:
        _quiet.add(key)
    elif (cm.fallback_regions and cm.row_classes is None and key not in _quiet
          and key not in _warned):
        _warned.add(key)
        from .hints import warn_fallbacks
        warn_fallbacks(cm, stacklevel=3)
    return cm
