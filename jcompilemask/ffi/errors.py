"""Clear errors for a missing GPU stack: the extras are not installed, or the GPU is not
SM90 (the kernels use Hopper instructions and are compiled for ``sm_90a``)."""
from __future__ import annotations

from typing import Sequence

from .._install import missing, missing_hint, pip_hint

__all__ = ["GpuExtrasMissing", "UnsupportedGpu", "require_gpu_extras", "require_sm90",
           "gpu_available"]


class GpuExtrasMissing(ImportError):
    """A package of the GPU extras is not importable."""


class UnsupportedGpu(RuntimeError):
    """No GPU, or one that is not compute capability 9.0 (H100 / H200)."""


def require_gpu_extras(modules: Sequence[str] = ("tilelang", "tvm_ffi", "jax_tvm_ffi")):
    """Raise :class:`GpuExtrasMissing` naming what to install when a module is absent."""
    absent = missing(*modules)
    if absent:
        raise GpuExtrasMissing(
            f"the GPU path needs {', '.join(absent)}: {missing_hint(*absent)}; without "
            "them use the jnp preprocess (preprocess='jnp') and the xla backend")


def _gpu_devices():
    import jax
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def gpu_available(major: int = 9, minor: int = 0) -> bool:
    """True when JAX sees a GPU of the given compute capability."""
    for d in _gpu_devices():
        if str(getattr(d, "compute_capability", "")) == f"{major}.{minor}":
            return True
    return False


def require_sm90():
    """Raise :class:`UnsupportedGpu` unless JAX's default backend has an SM90 GPU."""
    devs = _gpu_devices()
    if not devs:
        import jax
        raise UnsupportedGpu(
            f"no GPU visible to JAX (default backend: {jax.default_backend()}); the "
            f"TileLang / CuTe kernels need an NVIDIA H100/H200 (SM90) and JAX's CUDA plugin "
            f"({pip_hint('cuda')}). "
            "Use preprocess='jnp' / implementation='xla' on this machine")
    caps = sorted({str(getattr(d, "compute_capability", "?")) for d in devs})
    if "9.0" not in caps:
        raise UnsupportedGpu(
            f"the kernels are built for SM90 (H100/H200, compute capability 9.0); this "
            f"machine has {devs[0].device_kind} (compute capability {', '.join(caps)}). "
            "Use preprocess='jnp' / implementation='xla' here")
