"""Launching from a notebook: a real notebook executed by nbclient on an ipykernel.

The notebook is built here with nbformat. Its cells define the training function and a model
class, create a Session in the kernel and launch 2 CPU workers, which are forked from the
kernel (a spawned worker could not import what the cells define). Needs nbclient, nbformat
and ipykernel (the ``test`` extra); skipped with the reason when they are missing.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import gpukit
from gpukit.errors import ConfigurationError
from gpukit.launch._notebook import check_fork

SETUP = """
import signal
import torch
from torch import nn
import gpukit
from gpukit.launch import launch_function

class Net(nn.Module):  # defined in the kernel: only a forked worker has it
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)

def train_fn(session, scale):
    torch.manual_seed(0)
    model = Net()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = model(torch.ones(8, 4) * (session.rank + 1)).pow(2).mean()
    session.backward(loss)
    session.step(optimizer)
    mean_rank = session.all_reduce(torch.tensor(float(session.rank))).item()
    return {"rank": session.rank, "world": session.world_size, "mean_rank": mean_rank * scale,
            "weight": gpukit.unwrap_model(model).fc.weight.sum().item()}

def plain(x):
    import os
    return int(os.environ["RANK"]) * x

def broken(session):
    raise ValueError(f"boom on rank {session.rank}")
"""

LAUNCH = """
session = gpukit.Session(accelerator="cpu", devices=2, seed=0, verbose=False)
print("kernel SIGTERM default:", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
results = session.launch(train_fn, 10)
print("RESULTS", json.dumps(results))
print("PLAIN", json.dumps(launch_function(plain, (3,), nproc=2, cpu=True, echo=None)))
"""

FAILURE = """
try:
    session.launch(broken)
except Exception as exc:
    print("FAILED", type(exc).__name__, str(exc).splitlines()[0])
"""


def _outputs(cell) -> str:  # type: ignore[no-untyped-def]
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


@pytest.mark.slow
def test_session_launch_from_a_notebook_forks_and_returns_per_rank_results() -> None:
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install 'gpukit[test]')")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install 'gpukit[test]')")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install 'gpukit[test]')")
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import json\n" + SETUP),
        nbformat.v4.new_code_cell(LAUNCH),
        nbformat.v4.new_code_cell(FAILURE),
    ])
    # the kernel inherits this environment: PYTHONPATH points it at this checkout of gpukit
    env_path = os.pathsep.join(p for p in sys.path if p)
    os.environ.setdefault("PYTHONPATH", env_path)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", allow_errors=False)
    client.execute()
    launch_out, failure_out = _outputs(notebook.cells[1]), _outputs(notebook.cells[2])
    results = json.loads(launch_out.split("RESULTS ", 1)[1].splitlines()[0])
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    assert {r["mean_rank"] for r in results} == {5.0}  # all_reduce over both forked workers
    assert results[0]["weight"] == results[1]["weight"]  # DDP: both ranks stepped on the same gradient
    assert json.loads(launch_out.split("PLAIN ", 1)[1].splitlines()[0]) == [0, 3]
    # a Session in the kernel installs no stop-signal handler (forked workers would inherit it)
    assert "kernel SIGTERM default: True" in launch_out
    assert "SIGTERM received" not in launch_out + failure_out
    assert "FAILED WorkerFailedError" in failure_out and "boom on rank" in failure_out


GPU_LAUNCH = """
import torch, gpukit
def where(session):
    return str(session.device)
print("GPU RESULTS", gpukit.Session(devices=GPUS, verbose=False).launch(where))
torch.cuda.init()  # an earlier cell used the GPU: now forking is refused, with the way out
try:
    gpukit.Session(devices=GPUS, verbose=False).launch(where)
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc)
"""


@pytest.mark.parametrize("gpus", [pytest.param(1, marks=pytest.mark.requires_gpu),
                                  pytest.param(2, marks=pytest.mark.requires_gpus(2))])
def test_notebook_launch_on_gpus_then_refused_after_cuda_init(gpus: int) -> None:
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install 'gpukit[test]')")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install 'gpukit[test]')")
    cell = GPU_LAUNCH.replace("GPUS", str(gpus))
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    os.environ.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    out = _outputs(notebook.cells[0])
    assert f"GPU RESULTS {[f'cuda:{i}' for i in range(gpus)]}" in out
    if gpus == 1:  # one device runs in this process: nothing is forked, so CUDA being initialised is fine
        assert "REFUSED" not in out
    else:
        assert "REFUSED ConfigurationError" in out and "CUDA is already initialised" in out


def test_fork_refused_with_the_way_out_when_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    # no GPU here: stand in for a kernel whose earlier cell initialised CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigurationError, match="CUDA is already initialised here.*Restart the kernel"):
        check_fork("session.launch(train_fn)", uses_gpus=True)
    check_fork("session.launch(train_fn)", uses_gpus=False)  # CPU workers never touch CUDA


def test_scripts_still_spawn_and_check_pickling() -> None:
    from gpukit.launch._notebook import is_interactive, needs_fork

    assert not is_interactive()  # pytest's __main__ has a file
    assert not needs_fork(lambda: None, ())  # a script's lambda is refused by the spawn checks instead
    with pytest.raises(ConfigurationError, match="cannot be pickled"):
        gpukit.launch.launch_function(lambda: None, nproc=2, cpu=True)
