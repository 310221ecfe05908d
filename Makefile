# The README's two commands. Each makes its own virtual environment from a bare Python 3.10+.
PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0

DEMO_VENV := .venv-demo
TEST_VENV := .venv-test

.PHONY: demo test gpu-check clean

# $(1): the environment's folder, $(2): the extras to install with gpukit.
# torch is installed pinned first so pip takes the local CPU build instead of
# resolving `torch>=2.4` to the newest release with several GB of CUDA wheels.
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	$(1)/bin/pip install -q "$(TORCH_PIN)"
	$(1)/bin/pip install -q -e ".[$(2)]"
	touch $(1)/.installed
endef

$(DEMO_VENV)/.installed: pyproject.toml
	$(call make_venv,$(DEMO_VENV),demo)

$(TEST_VENV)/.installed: pyproject.toml
	$(call make_venv,$(TEST_VENV),test)

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/gpukit demo

test: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

# On a machine with a CUDA GPU (the lent one: torch preinstalled, no network): every GPU path,
# in order of value, within 7 minutes; results in $$GPUKIT_CHECK_OUT (default gpu-check-results/).
# Without a GPU it lists its plan and exits 0. Nothing is installed: gpukit runs from src/.
gpu-check:
	$(PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) build src/*.egg-info
