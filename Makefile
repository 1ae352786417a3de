# make demo         : install (again only when pyproject.toml changed) and run the quickstart
#                     (compile a mask, show intervals + tile map, run mask_attention and
#                     check it; CPU when there is no GPU)
# make test         : the test suite (installs the test extra); no GPU needed
# make test-kernels : compile the CuTe kernels for sm_90a without a GPU (installs the compile
#                     extra: the CuTe DSL compiler, about 485 MB); run tests skip without a GPU;
#                     the configs the registry runs (tests marked `knob`, opt-in benchmark
#                     variants, are left out)
# make test-kernels-all : the same with the knob variants (before timing one on the device)
# make ci           : test + test-kernels, what .ci/run runs on a fresh clone
.PHONY: demo test test-kernels test-kernels-all ci
demo:
	bash -c 'source scripts/env.sh && python examples/quickstart.py'
# Two pytest-xdist workers by default (CI has 2 cores: 15 min instead of 22), whole files per
# worker; JCM_TEST_WORKERS=0 runs in one process.
WORKERS ?= $(or $(JCM_TEST_WORKERS),2)
test:
	bash -c 'source scripts/env.sh test && python -m pytest tests jcompilemask -q --ignore=tests/gpu --durations=15 -n $(WORKERS) --dist loadfile'
test-kernels:
	bash -c 'source scripts/env.sh test,compile && python -m pytest tests/gpu -q -rs -m "not knob" -n $(WORKERS) --dist loadfile --durations=15'
test-kernels-all:
	bash -c 'source scripts/env.sh test,compile && python -m pytest tests/gpu -q -rs -n $(WORKERS) --dist loadfile --durations=15'
ci: test test-kernels
