"""The docstring examples of the kernel packages.

``make test`` collects doctests with ``--doctest-modules`` but leaves out
``jcompilemask/kernels`` (its CuTe modules import the CuTe DSL, which only the ``compile``
extra installs, and ``kernels`` is a namespace package that pytest's doctest collection
cannot import). The host-side policy of ``kernels/cute/api.py`` (the defaults the registry
compiles, the backward's host orders, the dQ fragment order) is documented by runnable
examples; this runs them where the compile extra is installed (``make test-kernels``).
"""
from __future__ import annotations

import doctest
import importlib.util

import pytest

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None

MODULES = ["jcompilemask.kernels.cute.api", "jcompilemask.kernels.cute.common",
           "jcompilemask.kernels.cute.residual_ops", "jcompilemask.kernels.cute.exp2_fma",
           "jcompilemask.kernels.cute.testing", "jcompilemask.kernels.cute.glue"]


@pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")
@pytest.mark.parametrize("name", MODULES)
def test_kernel_module_doctests(name, monkeypatch):
    """Every example in the module's docstrings gives its printed result (read at trace
    time, the environment variables the examples depend on are cleared first)."""
    import os
    for var in [v for v in os.environ if v.startswith("JCOMPILEMASK_CUTE_")]:
        monkeypatch.delenv(var)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
