"""What to install for each optional part: every install hint the package prints comes
from here, so each one names an extra that ``pyproject.toml`` defines (a test checks).

The extras:

* ``cuda``: JAX's CUDA 13 plugin and the CuTe DSL attention kernels for SM90 GPUs
  (nvidia-cutlass-dsl, apache-tvm-ffi, jax-tvm-ffi); no torch.
* ``tilelang``: the TileLang descriptor preprocess (generated GPU kernels). TileLang
  depends on torch, so it is an extra of its own; without it the jnp preprocess builds the
  same descriptor bit for bit.
* ``compile``: the CuTe DSL compiler alone, to compile the kernels for ``sm_90a`` on a
  machine without a GPU (the compile-only kernel tests).
* ``test``: pytest and hypothesis.

>>> from jcompilemask import _install
>>> _install.pip_hint("cuda", "tilelang")
"pip install 'jcompilemask[cuda,tilelang]'"
>>> _install.missing_hint("cutlass")
"nvidia-cutlass-dsl is not installed (pip install 'jcompilemask[cuda]')"
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Optional

__all__ = ["EXTRAS", "MODULES", "pip_hint", "missing_hint", "missing", "jax_cuda_plugin",
           "no_gpu_hint"]

# extra -> what it adds (the text of the hints and of the README's install section).
EXTRAS = {
    "cuda": "JAX's CUDA plugin and the CuTe DSL attention kernels (SM90)",
    "tilelang": "the TileLang preprocess (pulls torch)",
    "compile": "the CuTe DSL compiler alone (compile the kernels without a GPU)",
    "test": "pytest and hypothesis",
}

# importable module -> (distribution that provides it, extra that installs it).
MODULES = {
    "cutlass": ("nvidia-cutlass-dsl", "cuda"),
    "tvm_ffi": ("apache-tvm-ffi", "cuda"),
    "jax_tvm_ffi": ("jax-tvm-ffi", "cuda"),
    "tilelang": ("tilelang", "tilelang"),
}

# Distributions of JAX's CUDA backend; any one of them lets JAX see an NVIDIA GPU.
_JAX_CUDA_DISTS = ("jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt",
                   "jax-cuda12-pjrt")


def pip_hint(*extras: str) -> str:
    """The pip command that installs ``extras`` of jcompilemask."""
    for e in extras:
        if e not in EXTRAS:
            raise ValueError(f"unknown extra {e!r}; jcompilemask defines {sorted(EXTRAS)}")
    return f"pip install 'jcompilemask[{','.join(extras)}]'"


def missing(*modules: str) -> list[str]:
    """The modules among ``modules`` that are not importable."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def missing_hint(*modules: str) -> str:
    """``"<dists> is/are not installed (<pip command>)"`` for the absent ``modules``."""
    dists = [MODULES.get(m, (m, None))[0] for m in modules]
    extras = sorted({MODULES[m][1] for m in modules if m in MODULES})
    others = [m for m in modules if m not in MODULES]   # not part of any extra
    cmds = ([pip_hint(*extras)] if extras else []) + [f"pip install {m}" for m in others]
    verb = "is" if len(dists) == 1 else "are"
    return f"{', '.join(dists)} {verb} not installed ({'; '.join(cmds)})"


def jax_cuda_plugin() -> Optional[str]:
    """The installed JAX CUDA plugin distribution (name==version), or None."""
    for d in _JAX_CUDA_DISTS:
        try:
            return f"{d}=={importlib.metadata.version(d)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def no_gpu_hint() -> str:
    """Why JAX sees no GPU, as far as the installed packages tell, and what to install."""
    if jax_cuda_plugin() is None:
        return f"no GPU visible to JAX (JAX's CUDA plugin is not installed: {pip_hint('cuda')})"
    return "no GPU visible to JAX (its CUDA plugin is installed: check the driver and CUDA_VISIBLE_DEVICES)"
