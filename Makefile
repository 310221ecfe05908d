# The README's two commands. Each makes its own virtual environment from a bare Python 3.10+.
PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0

DEMO_VENV := .venv-demo
TEST_VENV := .venv-test

.PHONY: demo test clean

# torch is installed pinned first so pip takes the local CPU build instead of
# resolving `torch>=2.4` to the newest release with several GB of CUDA wheels.
$(DEMO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --upgrade pip
	$(DEMO_VENV)/bin/pip install -q "$(TORCH_PIN)"
	$(DEMO_VENV)/bin/pip install -q -e ".[demo]"
	touch $@

$(TEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install -q --upgrade pip
	$(TEST_VENV)/bin/pip install -q "$(TORCH_PIN)"
	$(TEST_VENV)/bin/pip install -q -e ".[test]"
	touch $@

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/gpukit demo

test: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) build src/*.egg-info
