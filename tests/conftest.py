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

# JAX's own test configuration: implicit rank promotion is an error, so a broadcast
# that relies on it fails here rather than in a user's strict program. Override with
# JAX_NUMPY_RANK_PROMOTION=allow (or warn) in the environment.
import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion",
                  os.environ.get("JAX_NUMPY_RANK_PROMOTION", "raise"))


def pytest_collection_finish(session):
    """Print the fuzz stage's seed (tests/test_fuzz.py) before the first test runs."""
    import sys
    fuzz = sys.modules.get("test_fuzz")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if fuzz is not None and reporter is not None:
        reporter.write_line(fuzz.SEED_LINE)
