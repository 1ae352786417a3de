"""jcompilemask: attention masks written once as region-based MaskSpecs, compiled to
per-row visible intervals and tile-state bitmaps, run by flash-attention kernels.

>>> import jcompilemask as jcm
>>> print(jcm.masks.causal())
MaskSpec 'causal'  (metadata: none; mask heads: 1)
  region 0: rows [0, q_len)
      visible: k <= q
"""
__version__ = "0.1.0"   # the one version source (pyproject.toml reads it; CHANGELOG.md)

from . import backends, masks, spec
from .attention import mask_attention
from .lower import (ClassDescriptor, CompiledMask, ExecutionDescriptor, MaskFallbackWarning,
                    RuntimeDense, TileConfig, compile, from_dense, runtime_dense)
from .spec import MaskSpec, Region


def __getattr__(name):
    # jcm.flax, jcm.splash and jcm.parallel load on first use (flax is heavier to import).
    if name in ("flax", "splash", "parallel"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'jcompilemask' has no attribute {name!r}")
__all__ = ["masks", "spec", "backends", "mask_attention", "MaskSpec", "Region", "compile", "CompiledMask",
           "ExecutionDescriptor", "ClassDescriptor", "TileConfig", "from_dense",
           "runtime_dense", "RuntimeDense", "MaskFallbackWarning"]
