# The README's two commands. Each makes its own virtual environment from a bare Python 3.10+.
PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0
# The oldest torch pyproject.toml admits: `make test-floor` runs the version-sensitive tests on it
# (a CUDA build from PyPI, ~2.8 GB: no CPU-only wheel of it is on PyPI).
FLOOR_TORCH_PIN ?= torch==2.5.1
FLOOR_TESTS ?= tests/strategies tests/checkpoint tests/memory tests/parallel tests/test_precision.py \
	tests/test_session.py -m "not slow"

DEMO_VENV := .venv-demo
TEST_VENV := .venv-test
FLOOR_VENV := .venv-floor

.PHONY: demo test test-extended test-floor gpu-check clean

# $(1): the environment's folder, $(2): the extras to install with gpukit, $(3): the torch pin.
# torch is installed pinned first so pip takes the local CPU build instead of
# resolving `torch>=2.4` to the newest release with several GB of CUDA wheels.
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q "$(3)"
	$(1)/bin/pip install -q -e ".[$(2)]"
	touch $(1)/.installed
endef

$(DEMO_VENV)/.installed: pyproject.toml
	$(call make_venv,$(DEMO_VENV),demo,$(TORCH_PIN))

$(TEST_VENV)/.installed: pyproject.toml
	$(call make_venv,$(TEST_VENV),test,$(TORCH_PIN))

$(FLOOR_VENV)/.installed: pyproject.toml
	$(call make_venv,$(FLOOR_VENV),test,$(FLOOR_TORCH_PIN))

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/gpukit demo

# Two test processes (pytest-xdist): most tests wait on the processes they start, and one
# process left a 2-core machine half idle. TEST_JOBS=0 runs the suite in one process.
TEST_JOBS ?= 2

test: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS)) $(PYTEST_ARGS)

# make test plus the `extended` variants (more world sizes and ways in of the multi-process and
# cluster trials that make test covers with one representative each): ~10 more minutes.
test-extended: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS)) --extended $(PYTEST_ARGS)

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest $(FLOOR_TESTS)

# On a machine with a CUDA GPU (the lent one: torch preinstalled, no network): every GPU path,
# in order of value, within 7 minutes; results in $$GPUKIT_CHECK_OUT (default gpu-check-results/).
# Without a GPU it lists its plan and exits 0. Nothing is installed: gpukit runs from src/.
gpu-check:
	$(PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) $(FLOOR_VENV) build src/*.egg-info
