"""The jax.ffi layer: GPU kernels (TileLang, CuTe DSL) as XLA custom calls.

* :func:`register_ffi_kernel` / :func:`ffi_call` -- registration through jax-tvm-ffi and
  calls with an explicit ``vmap_method`` (generic: a name, a compiled function, a
  platform), :func:`match_varying` (custom-call results typed as varying over the
  ``shard_map`` axes their operands vary over);
* :class:`KernelKey` / :class:`CompileCache` -- a typed compile key and a memory + disk
  cache (``~/.cache/jcompilemask``);
* :func:`require_gpu_extras` / :func:`require_sm90` -- clear errors when the GPU extras
  are missing or the GPU is not SM90.

Importing this package needs neither a GPU nor the extras.
"""
from .cache import CompileCache, KernelKey, default_cache, default_cache_dir, versions
from .errors import (GpuExtrasMissing, UnsupportedGpu, gpu_available, require_gpu_extras,
                     require_sm90)
from .registry import ffi_call, is_registered, match_varying, register_ffi_kernel

__all__ = ["register_ffi_kernel", "is_registered", "ffi_call", "match_varying", "KernelKey", "CompileCache",
           "default_cache", "default_cache_dir", "versions", "GpuExtrasMissing",
           "UnsupportedGpu", "gpu_available", "require_gpu_extras", "require_sm90"]
