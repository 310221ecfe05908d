"""Shared test set-up: GPU markers that skip cleanly on CPU-only machines; under ``pytest -n``,
one process per SLURM cluster and per module whose tests share a set-up, and a script-like
``__main__``."""

from __future__ import annotations

import ast
import functools
import os
import sys
from pathlib import Path

import pytest


def _main_is_a_file_under_xdist() -> None:
    # `python -m pytest`'s __main__ is pytest's own __main__.py; a pytest-xdist worker's is execnet's,
    # with no file, which gpukit (rightly) takes for a notebook or `python -c`: launch_function would
    # fork instead of spawn and the tests of the script path would test the notebook path. Give the
    # worker the __main__ a plain `python -m pytest` run has.
    main = sys.modules.get("__main__")
    if os.environ.get("PYTEST_XDIST_WORKER") and main is not None and not getattr(main, "__file__", None):
        main.__file__ = os.path.join(os.path.dirname(pytest.__file__), "__main__.py")


_main_is_a_file_under_xdist()

# The tests that share the session's SLURM cluster (tests/cluster/conftest.py): under `pytest -n`
# (make test) each test process would start a cluster of its own on the same ports, so they all
# go to one process. (xdist's own `--dist loadgroup` marks do not group with pytest >= 9.2.)
_ONE_CLUSTER = ("tests/cluster/test_slurm_cluster.py", "tests/cluster/test_slurm_trials.py",
                "tests/cluster/test_slurm_node_lost.py")
_SHARED_SCOPES = ("module", "class", "package")


@functools.lru_cache(maxsize=None)
def _builds_once(path: Path) -> bool:
    """Whether the test module at ``path`` has something its tests share: a module-, class- or
    package-scoped fixture, or ``pytest.mark.one_worker`` (what it builds once is not a fixture)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "one_worker":
            return True
        if isinstance(node, ast.Call) and any(
                kw.arg == "scope" and isinstance(kw.value, ast.Constant) and kw.value.value in _SHARED_SCOPES
                for kw in node.keywords):
            return True
    return False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended", action="store_true", default=False,
        help="also run the tests marked `extended`: more variants of a multi-process or cluster behaviour that "
             "make test covers with one representative (make test-extended)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "one_worker: (module-level) under pytest -n, every test of the module runs in one process: "
        "they share what the module builds once outside a fixture (module-scoped fixtures need no mark)")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class OneClusterScheduling(LoadScopeScheduling):
        """Every test its own unit of work, except: the SLURM tests, one unit, started first (the
        longest unit: the other process fills the time around it); and a module whose tests share
        a module-scoped fixture (or a module-level cache), one unit, so it is built once, not once
        in each process that happens to run one of its tests."""

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(_ONE_CLUSTER):
                return "slurm"
            module = nodeid.split("::", 1)[0]
            return module if _builds_once(Path(self.config.rootpath, module)) else nodeid

        def _assign_work_unit(self, node: object) -> None:
            if "slurm" in self.workqueue:  # first, whatever the number of tests in other units
                self.workqueue.move_to_end("slurm", last=False)
            super()._assign_work_unit(node)

    return OneClusterScheduling(config, log)


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _skip_cpu_fsdp_on_old_torch(items: list[pytest.Item]) -> None:
    from gpukit.strategies._fsdp_api import CPU_FSDP_MIN_TORCH, _torch_version

    if _torch_version() >= CPU_FSDP_MIN_TORCH:
        return
    import torch

    reason = (f"FSDP on CPU processes needs torch >= {'.'.join(map(str, CPU_FSDP_MIN_TORCH))} "
              f"(this is {torch.__version__}: gpukit refuses it with a clear error, tested)")
    for item in items:
        if item.get_closest_marker("requires_cpu_fsdp") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def _leave_out_extended(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the `extended` variants unless asked for: each behaviour keeps one representative in
    `make test` (issue 41.23: the suite within ~15 minutes on 2 cores); pytest's summary counts the rest
    as deselected, and `make test-extended` runs everything."""
    if config.getoption("--extended"):
        return
    kept = [item for item in items if item.get_closest_marker("extended") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("extended")])
        items[:] = kept


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _leave_out_extended(config, items)
    _skip_cpu_fsdp_on_old_torch(items)
    needs = [(item, m) for item in items for m in item.iter_markers() if m.name in ("requires_gpu", "requires_gpus")]
    if not needs:
        return
    available = _cuda_device_count()
    for item, marker in needs:
        wanted = 1 if marker.name == "requires_gpu" else int(marker.args[0])
        if available < wanted:
            item.add_marker(pytest.mark.skip(reason=f"needs {wanted} CUDA GPU(s), {available} available"))


@pytest.fixture(autouse=True)
def _restore_environ():
    """Undo any environment change a test makes (use_gpus writes CUDA_VISIBLE_DEVICES, ...)."""
    import os

    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


_FAKE_GPU_EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "fake-gpus"


@pytest.fixture
def isolated_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """No GPU env from outside (fake spec, CUDA_VISIBLE_DEVICES/ORDER), an isolated claim dir, a fresh NVML."""
    from gpukit.devices import _nvml

    for var in ("GPUKIT_FAKE_GPUS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    _nvml.shutdown()
    _nvml.set_backend_override(None)
    monkeypatch.setattr(_nvml, "_notice_given", False)
    yield
    _nvml.set_backend_override(None)
    _nvml.shutdown()


@pytest.fixture
def use_spec(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """Point GPUKIT_FAKE_GPUS at a spec: an example name ("shared-4gpu") or a dict written to a file."""
    import json

    def use(spec):
        if isinstance(spec, str):
            path = _FAKE_GPU_EXAMPLES / f"{spec}.json"
        else:
            path = tmp_path / f"spec-{abs(hash(json.dumps(spec, sort_keys=True)))}.json"
            path.write_text(json.dumps(spec))
        monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(path))
        return path

    return use


@pytest.fixture
def ctrl_c_as_from_a_terminal():
    """SIGINT reaches this test and the children it starts as Ctrl-C does from a terminal.

    A shell without job control starts a background job (``make test &`` in a script, a job
    runner) with SIGINT *ignored*, children inherit that, and Python then installs no
    KeyboardInterrupt handler: a test that stops ``gpukit ls --watch`` with SIGINT would wait out
    its timeout. Tests that send SIGINT use this fixture, so the suite passes however it was
    started; the test process's own disposition comes back afterwards.
    """
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # exec resets it to SIG_DFL
    yield
    signal.signal(signal.SIGINT, previous)
