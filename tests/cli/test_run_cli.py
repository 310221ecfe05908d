"""`gpukit run` argument parsing: the script and its arguments are never taken as ours."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpukit.cli.run import run


def _params(*args: str) -> dict:
    with run.make_context("run", list(args)) as ctx:
        return dict(ctx.params)


def test_bare_wait_does_not_swallow_the_script():
    params = _params("--wait", "train.py", "--lr", "3")
    from gpukit.cli._common import WAIT_NO_LIMIT

    assert params["wait"] == WAIT_NO_LIMIT
    assert params["command"] == ("train.py", "--lr", "3")


def test_wait_with_timeout_and_script_options_that_look_like_ours():
    params = _params("--wait", "30", "--cpu", "--nproc", "2", "train.py", "--nproc", "9", "--wait")
    assert params["wait"] == "30" and params["cpu"] is True and params["nproc"] == 2
    assert params["command"] == ("train.py", "--nproc", "9", "--wait")


def test_module_mode_keeps_module_arguments():
    params = _params("-m", "pkg.train", "--epochs", "1")
    assert params["module"] == "pkg.train"
    assert params["command"] == ("--epochs", "1")


def test_help_documents_exit_codes_and_flags():
    result = CliRunner().invoke(run, ["--help"])
    assert result.exit_code == 0
    for flag in ("--gpus", "--nproc", "--cpu", "--max-restarts", "--grace", "--nnodes", "--node-rank",
                 "--master-addr", "--master-port", "--wait", "--min-free", "--max-util", "75"):
        assert flag in result.output


@pytest.mark.parametrize(("args", "message"), [
    ((), "Give the script to run"),
    (("--wait", "-5", "x.py"), "cannot be negative"),
])
def test_usage_errors(args, message):
    result = CliRunner().invoke(run, list(args))
    assert result.exit_code == 2
    assert message in result.output
