"""Shared test configuration: a deterministic hypothesis profile.

``ci`` (the default) is derandomized -- every run draws the same examples, so a failure
on CI reproduces locally -- with a modest example count that keeps the whole suite well
under five minutes on two cores. ``dev`` explores more (random seeds); select it with
``HYPOTHESIS_PROFILE=dev``.
"""
import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])

settings.register_profile("ci", derandomize=True, max_examples=25, **_COMMON)
settings.register_profile("dev", max_examples=200, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# XLA's CPU backend at optimization level 0 on CPU-only machines: the suite compiles many
# small programs and runs each a few times, so compiling is most of its time (suite
# ~1650 s -> ~870 s of two workers). A JAX CUDA plugin keeps XLA's defaults (and the GPU
# tests with them); JCM_TEST_XLA_OPT=1 keeps them here too. (Withdrawn once after CI
# workers aborted inside XLA's CPU compiler, with and without these flags: most likely
# the process's memory-map count, see the fixture below and tests/compiled_programs.py.)
import importlib.util  # noqa: E402

if (os.environ.get("JCM_TEST_XLA_OPT", "") in ("", "0")
        and not any(importlib.util.find_spec(p) for p in ("jax_cuda13_plugin", "jax_cuda12_plugin"))):
    _fast = "--xla_backend_optimization_level=0"
    if _fast not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _fast).strip()

# JAX's own test configuration: implicit rank promotion is an error, so a broadcast
# that relies on it fails here rather than in a user's strict program. Override with
# JAX_NUMPY_RANK_PROMOTION=allow (or warn) in the environment.
import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion",
                  os.environ.get("JAX_NUMPY_RANK_PROMOTION", "raise"))


import pytest  # noqa: E402

import compiled_programs  # noqa: E402  (tests/ is on sys.path: rootdir conftest)


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """After each test, drop JAX's compiled programs once the process's memory maps near
    the kernel's limit (tests/compiled_programs.py: XLA:CPU aborted in a CI worker there)."""
    yield
    compiled_programs.release_if_needed()


def pytest_configure(config):
    """Draw the fuzz stage's seed (tests/test_fuzz.py) once, in the main process, into
    $JCM_FUZZ_SEED: pytest-xdist workers (``make test`` runs two) inherit it, so every
    worker fuzzes with the one seed the header prints."""
    if not hasattr(config, "workerinput") and not os.environ.get("JCM_FUZZ_SEED"):
        import secrets
        os.environ["JCM_FUZZ_SEED"] = str(secrets.randbits(32))


def pytest_sessionstart(session):
    """Print the fuzz seed before the first test runs (also under -q and xdist)."""
    seed = os.environ.get("JCM_FUZZ_SEED")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if seed and reporter is not None and not hasattr(session.config, "workerinput"):
        reporter.write_line(f"fuzz seed {seed} (replay: JCM_FUZZ_SEED={seed} pytest "
                            "tests/test_fuzz.py; one group: add JCM_FUZZ_CASE=<group>)")
