"""Files gpukit writes for the user (issue 41 item 7): run names that stay inside the log folder, no
write through a planted symlink, no open that blocks on a FIFO -- the CSV tracker, MLflow's store,
the run record and the HTML report, all through ``gpukit._util.safe_files``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpukit
from gpukit._util.safe_files import UnsafeEntry, open_user_file, walk_folder, write_user_file
from gpukit.errors import ConfigurationError
from gpukit.monitor import CSVTracker

OTHER_UID = 54321
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a symlink to another uid (lchown)")


def _train(session: gpukit.Session, run_name: str = "exp1") -> None:
    model = nn.Linear(3, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = session.setup_dataloader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4)
    session.init_trackers(run_name=run_name, config={"lr": 0.1})
    for x, y in loader:
        session.backward(nn.functional.mse_loss(model(x), y))
        session.step(optimizer)
    session.close()


@pytest.mark.parametrize("name", ["../../x", "/etc/gpukit-x", "a/b", "..", ".hidden", "", "a\x1b[2Jb", "a\\b"])
def test_a_run_name_that_leaves_the_log_folder_is_refused(tmp_path: Path, monkeypatch, name: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    session = gpukit.Session(accelerator="cpu", verbose=False, log_with="csv")
    with pytest.raises(ConfigurationError, match=r"run_name=.* would not name one folder inside the log folder"):
        _train(session, run_name=name)
    session.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"] and not (work / "gpukit_logs").exists()


def test_a_plain_run_name_goes_into_gpukit_logs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _train(gpukit.Session(accelerator="cpu", verbose=False, log_with="csv"), run_name="resnet-lr0.1")
    assert (tmp_path / "gpukit_logs" / "resnet-lr0.1" / "metrics.csv").read_text().startswith("step,")


def test_a_symlinked_metrics_csv_is_refused_and_its_target_kept(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.csv").symlink_to(target)
    session = gpukit.Session(accelerator="cpu", verbose=False, log_with=CSVTracker(logs))
    with pytest.raises(ConfigurationError, match=r"cannot write in .*metrics.csv' is a symlink"):
        _train(session)
    session.close()
    assert target.read_text() == "keep me\n"


def test_a_symlinked_config_json_is_replaced_not_written_through(tmp_path: Path) -> None:
    target = tmp_path / "config-of-another-run.json"
    target.write_text('{"keep": true}')
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "config.json").symlink_to(target)
    _train(gpukit.Session(accelerator="cpu", verbose=False, log_with=CSVTracker(logs)))
    assert target.read_text() == '{"keep": true}'
    assert not (logs / "config.json").is_symlink() and '"run_name": "exp1"' in (logs / "config.json").read_text()


def test_a_fifo_metrics_csv_is_refused_without_blocking(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    os.mkfifo(logs / "metrics.csv")
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            open_user_file(logs / "metrics.csv", "w+").close()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "opening a FIFO blocked"
    assert isinstance(outcome[0], UnsafeEntry) and "a FIFO" in str(outcome[0])
    reader = os.open(logs / "metrics.csv", os.O_RDONLY | os.O_NONBLOCK)  # with a reader it opens: still refused
    try:
        with pytest.raises(UnsafeEntry, match="a FIFO"):
            open_user_file(logs / "metrics.csv", "a")
    finally:
        os.close(reader)


def test_the_run_record_and_the_report_never_write_through_a_symlink(tmp_path: Path) -> None:
    from gpukit.monitor._record import record_path

    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    record = tmp_path / "rec"
    record.mkdir()
    record_path(record, 0).symlink_to(target)
    with pytest.raises(ConfigurationError, match="is a symlink"):
        gpukit.Session(accelerator="cpu", verbose=False, record=record)
    assert target.read_text() == "keep me\n"
    write_user_file(tmp_path / "link", b"new")  # a missing name: made
    (tmp_path / "report.html").symlink_to(target)
    write_user_file(tmp_path / "report.html", b"<html>")
    assert target.read_text() == "keep me\n" and (tmp_path / "report.html").read_bytes() == b"<html>"


@root_only
def test_another_users_symlink_on_the_way_is_never_followed(tmp_path: Path) -> None:
    """A log folder reached through a symlink another user planted as a parent: refused, naming them."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "logs").symlink_to(elsewhere)
    os.lchown(tmp_path / "logs", OTHER_UID, -1)
    with pytest.raises(UnsafeEntry) as caught:
        walk_folder(tmp_path / "logs" / "run1", make_mode=0o755)
    assert caught.value.owner_uid == OTHER_UID and caught.value.kind == "a symlink"
    assert not (elsewhere / "run1").exists()
    session = gpukit.Session(accelerator="cpu", verbose=False, log_with=CSVTracker(tmp_path / "logs" / "run1"))
    with pytest.raises(ConfigurationError, match=r"logs' is a symlink"):
        _train(session)
    session.close()
    os.lchown(tmp_path / "logs", os.geteuid(), -1)  # one's own symlink is followed
    os.close(walk_folder(tmp_path / "logs" / "run1", make_mode=0o755))
    assert (elsewhere / "run1").is_dir()
