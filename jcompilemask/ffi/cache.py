"""A compile cache for GPU kernels, keyed by a typed frozen key, in memory and on disk.

Layout on disk (``$JCOMPILEMASK_CACHE_DIR`` or ``~/.cache/jcompilemask``)::

    <kind>/<digest>/key.json     the key, readable
    <kind>/<digest>/kernel.so    the exported library (CuTe kernels: kernel.o, an object file)
    <kind>/<digest>/source.py    the generated source (for debugging)

The digest hashes every key field, so a new source text, tile config or library version
never reuses a stale artifact. Writes go through a temporary file and ``os.replace``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import warnings
import threading
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["KernelKey", "CompileCache", "default_cache", "default_cache_dir", "versions"]


def versions(*dists: str) -> tuple:
    """``(("jcompilemask", v), (dist, v) ...)`` for the key's ``versions`` field."""
    from .. import __version__
    out = [("jcompilemask", __version__)]
    for d in dists:
        try:
            out.append((d, importlib.metadata.version(d)))
        except importlib.metadata.PackageNotFoundError:
            out.append((d, "absent"))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Everything a compiled kernel depends on (never lengths or metadata values).

    kind: which generator made it (``"tilelang-preprocess"``, ``"cute-forward"`` ...).
    mask_fingerprint: the MaskSpec's structural hash.
    shape_class: the static parts of the shapes (dynamic dimensions stay symbolic).
    dtypes: operand / result dtypes.
    tile_config: tile sizes and launch config, as ints.
    source_fingerprint: hash of the generated source.
    versions: ``(name, version)`` pairs of the toolchain, and the target arch.
    """

    kind: str
    mask_fingerprint: str
    shape_class: tuple
    dtypes: tuple
    tile_config: tuple
    source_fingerprint: str
    versions: tuple

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("tuple",) and not isinstance(v, tuple):
                raise TypeError(f"KernelKey.{f.name} must be a tuple, got {type(v).__name__}")
            if f.type == "str" and not isinstance(v, str):
                raise TypeError(f"KernelKey.{f.name} must be a str, got {type(v).__name__}")

    def as_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=list)

    def digest(self) -> str:
        return hashlib.sha256(self.as_json().encode()).hexdigest()[:24]

    def target_name(self) -> str:
        """A valid, unique FFI target name for this key."""
        return f"jcm_{self.kind.replace('-', '_')}_{self.digest()}"


def default_cache_dir() -> Path:
    env = os.environ.get("JCOMPILEMASK_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jcompilemask"


class CompileCache:
    """Memory + disk cache of compiled kernels.

    :meth:`get_or_build` returns the cached object for a key, else loads it from disk
    (``load(path)``), else builds it (``build()``), saves it (``save(obj, path)``) and
    loads what was saved, so a fresh build and a later process run the same artifact.
    """

    def __init__(self, directory: Optional[os.PathLike] = None, *, disk: bool = True):
        self.directory = Path(directory) if directory else default_cache_dir()
        self.disk = disk
        self._mem: dict[KernelKey, Any] = {}
        self._lock = threading.Lock()

    def path_for(self, key: KernelKey, filename: str = "kernel.so") -> Path:
        return self.directory / key.kind / key.digest() / filename

    def __contains__(self, key: KernelKey) -> bool:
        return key in self._mem

    def get_or_build(self, key: KernelKey, build: Callable[[], Any], *,
                     load: Optional[Callable[[str], Any]] = None,
                     save: Optional[Callable[[Any, str], None]] = None,
                     source: Optional[str] = None, reload: bool = True,
                     announce: bool = True, filename: str = "kernel.so"):
        """The object of ``key``: from memory, else ``load``-ed from disk, else ``build()``.

        A fresh build is saved (``save(obj, path)``); with ``reload`` (the default) the
        saved artifact is loaded back and returned, so this process runs what later ones
        will; without it the built object is returned as it is. An artifact that fails to
        load is rebuilt (with a ``RuntimeWarning``), never returned. ``announce`` logs a
        one-line notice when the build is slow (callers that announce it themselves pass
        False). ``filename``: the artifact's name in the key's directory.
        """
        if not isinstance(key, KernelKey):
            raise TypeError(f"cache keys are KernelKey, got {type(key).__name__}")
        with self._lock:
            hit = self._mem.get(key)
            if hit is not None:
                return hit
            path = self.path_for(key, filename)
            obj = None
            if self.disk and load is not None and path.exists():
                try:
                    obj = load(str(path))
                except Exception as err:   # a corrupt or foreign artifact: rebuild it
                    warnings.warn(f"jcompilemask: the cached kernel {path} did not load "
                                  f"({type(err).__name__}: {err}); rebuilding it",
                                  RuntimeWarning, stacklevel=2)
                    obj = None
            if obj is None:
                from .._progress import slow_step
                with (slow_step(f"jcompilemask: building the {key.kind} kernel "
                                f"(mask {key.mask_fingerprint})") if announce
                      else contextlib.nullcontext()):
                    built = build()
                obj = built
                if self.disk and save is not None:
                    try:
                        self._save(key, built, save, source, filename)
                        if load is not None and reload:
                            obj = load(str(path))
                    except Exception as err:   # noqa: BLE001 - the build itself is good
                        warnings.warn(f"jcompilemask: the {key.kind} kernel built but its "
                                      f"disk copy {path} failed ({type(err).__name__}: "
                                      f"{err}); this process uses the fresh build",
                                      RuntimeWarning, stacklevel=2)
                        obj = built
            self._mem[key] = obj
            return obj

    def _save(self, key, built, save, source, filename="kernel.so"):
        path = self.path_for(key, filename)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.so")
        try:
            save(built, str(tmp))
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        (path.parent / "key.json").write_text(key.as_json() + "\n")
        if source is not None:
            (path.parent / "source.py").write_text(source)

    def clear_memory(self):
        with self._lock:
            self._mem.clear()


_DEFAULT: Optional[CompileCache] = None


def default_cache() -> CompileCache:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = CompileCache()
    return _DEFAULT
