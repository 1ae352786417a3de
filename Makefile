# make demo : install and run the quickstart (compile a mask, show intervals + tile map,
#             run mask_attention and check it; CPU when there is no GPU)
# make test : install and run the test suite (what .ci/run does)
.PHONY: demo test
demo:
	bash -c 'source scripts/env.sh && python examples/quickstart.py'
test:
	bash -c 'source scripts/env.sh test,compile && python -m pytest tests jcompilemask -q'
