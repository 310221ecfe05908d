"""``Session(log_with=...)`` (issue 28, item 8): CSV, MLflow's local file store and W&B offline,
written through the real libraries and read back through their own formats; rank 0 only (the
2-process check is in tests/session/test_session_two_ranks.py); a missing library names its extra.
The loss given to ``session.backward`` is logged without a ``session.log`` call."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpukit
from gpukit.errors import ConfigurationError
from gpukit.monitor import CSVTracker, MLflowTracker, WandbTracker

sys.path.insert(0, str(Path(__file__).parent))
from tracker_readers import mlflow_run, wandb_offline_run  # noqa: E402


def _train(session: gpukit.Session, *, log_acc: bool = True) -> list[float]:
    """6 steps; returns the losses (as the trackers should have them)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = session.setup_dataloader(TensorDataset(torch.randn(24, 3), torch.randn(24, 1)), batch_size=4)
    session.init_trackers(run_name="exp1", config={"lr": 0.1, "model": {"width": 3}})
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        session.backward(loss)  # logged as "loss" by itself
        if log_acc:
            session.log(acc=0.5)
        session.step(optimizer, clip_grad_norm=10.0)
        losses.append(loss.item())
    session.close()
    return losses


def test_csv_tracker_writes_every_step_and_the_config(tmp_path: Path) -> None:
    session = gpukit.Session(accelerator="cpu", verbose=False, log_with=CSVTracker(tmp_path))
    losses = _train(session)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(6))
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses)
    assert {r["acc"] for r in rows} == {"0.5"}
    assert all(float(r["grad_norm"]) > 0 for r in rows)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["run_name"] == "exp1" and config["lr"] == 0.1 and config["model"] == {"width": 3}
    assert config["gpukit"]["precision"] == "32-true" and config["gpukit"]["world_size"] == 1


def test_csv_by_name_goes_into_the_record_directory(tmp_path: Path) -> None:
    session = gpukit.Session(accelerator="cpu", verbose=False, log_with="csv", record=tmp_path / "rec")
    losses = _train(session, log_acc=False)
    rows = list(csv.DictReader((tmp_path / "rec" / "metrics.csv").open()))
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses)
    # the run record got the loss too, without a session.log(loss=...) call
    lines = [json.loads(line) for line in (tmp_path / "rec" / "rank0.jsonl").read_text().splitlines()]
    recorded = [line["scalars"]["loss"] for line in lines if line["type"] == "step"]
    assert recorded == pytest.approx(losses)


def test_users_own_loss_replaces_the_one_logged_by_backward(tmp_path: Path) -> None:
    session = gpukit.Session(accelerator="cpu", verbose=False, log_with=CSVTracker(tmp_path))
    model = nn.Linear(3, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    session.backward(model(torch.ones(2, 3)).sum())
    session.log(loss=42.0)
    session.step(optimizer)
    session.close()
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["loss"] for r in rows] == ["42.0"]


def test_mlflow_file_store_gets_params_once_and_metrics_per_step(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="mlflow (gpukit[mlflow], in the test extra) is not installed")
    session = gpukit.Session(accelerator="cpu", verbose=False, log_with=MLflowTracker(tmp_path))
    losses = _train(session)
    run = mlflow_run((tmp_path / "mlruns").resolve().as_uri())
    assert run["name"] == "exp1" and run["status"] == "FINISHED"
    assert run["params"]["lr"] == "0.1" and run["params"]["model.width"] == "3"
    assert run["params"]["gpukit.strategy"] == "single on cpu"
    assert [s for s, _ in run["metrics"]["loss"]] == list(range(6))
    assert [v for _, v in run["metrics"]["loss"]] == pytest.approx(losses)
    assert [v for _, v in run["metrics"]["acc"]] == [0.5] * 6


def test_wandb_offline_run_has_the_config_and_every_step(tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="wandb (gpukit[wandb], in the test extra) is not installed")
    session = gpukit.Session(accelerator="cpu", verbose=False, log_with=WandbTracker(tmp_path, project="p28"))
    losses = _train(session)
    run = wandb_offline_run(tmp_path)
    assert run["name"] == "exp1" and run["project"] == "p28"
    assert run["config"]["lr"] == 0.1 and run["config"]["gpukit"]["world_size"] == 1
    steps = [row for row in run["history"] if "loss" in row]
    assert [row["_step"] for row in steps] == list(range(6))
    assert [row["loss"] for row in steps] == pytest.approx(losses)


@pytest.mark.parametrize(("name", "module", "extra"), [("mlflow", "mlflow", "mlflow"), ("wandb", "wandb", "wandb")])
def test_a_missing_library_names_its_extra(monkeypatch: pytest.MonkeyPatch, name: str, module: str, extra: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when the package is absent
    with pytest.raises(ConfigurationError, match=rf"pip install 'gpukit\[{extra}\]'"):
        gpukit.Session(accelerator="cpu", verbose=False, log_with=name)


def test_unknown_tracker_lists_the_choices() -> None:
    with pytest.raises(ConfigurationError, match="'csv', 'mlflow', 'wandb'"):
        gpukit.Session(accelerator="cpu", verbose=False, log_with="neptune")


def test_init_trackers_after_the_first_log_is_refused(tmp_path: Path) -> None:
    session = gpukit.Session(accelerator="cpu", verbose=False, log_with=CSVTracker(tmp_path))
    session.log(acc=1.0)
    with pytest.raises(ConfigurationError, match="before the training loop"):
        session.init_trackers(run_name="late")
    session.close()
