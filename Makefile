# The README's two commands. Each makes its own virtual environment from a bare Python 3.10+.
PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0

DEMO_VENV := .venv-demo
TEST_VENV := .venv-test

.PHONY: demo test clean

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

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) build src/*.egg-info
