"""LaunchSpec: a launch's settings, checked once where they are made (no process is started here)."""

from __future__ import annotations

import os
import signal

import pytest

from gpukit.errors import ConfigurationError
from gpukit.launch import GpuRequest, LaunchSpec, Topology, launch_function, launch_script


def test_the_forms_a_caller_gives_become_one_typed_value(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = LaunchSpec(nproc=2, gpus="1,3", timeout_s="90", preempt_signal="usr1", max_requeues="4",  # type: ignore[arg-type]
                      record_dir="rec")
    assert spec.gpus == GpuRequest(ids=(1, 3))
    assert spec.timeout_s == 90.0 and spec.preempt_signal == signal.SIGUSR1 and spec.max_requeues == 4
    assert spec.record_dir == os.path.join(str(tmp_path), "rec")  # the workers may run elsewhere
    assert LaunchSpec().gpus.automatic and LaunchSpec(gpus=2).gpus == GpuRequest(count=2)


@pytest.mark.parametrize(("settings", "message"), [
    ({"nproc": 0}, "nproc (--nproc) must be an integer >= 1, got 0"),
    ({"nproc": True}, "nproc (--nproc) must be an integer >= 1, got True"),
    ({"max_restarts": -1}, "max_restarts (--max-restarts) must be an integer >= 0"),
    ({"grace_s": float("nan")}, "grace_s (--grace) must be a finite number of seconds >= 0"),
    ({"cpu": True, "gpus": 2}, "--cpu and --gpus 2 contradict each other"),
    ({"gpus": 0}, "a run needs at least 1 GPU"),
    ({"timeout_s": -3}, "timeout_s (--timeout)=-3"),
    ({"preempt_signal": "KILL"}, "'KILL' is not a preemption signal"),
    ({"max_requeues": -1}, "-1 is not a number of requeues"),
])
def test_a_bad_setting_is_refused_when_the_spec_is_made(settings, message) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LaunchSpec(**settings)


def test_the_worker_cap_names_its_variable(monkeypatch) -> None:
    monkeypatch.setenv("GPUKIT_MAX_NPROC", "3")
    with pytest.raises(ConfigurationError, match="GPUKIT_MAX_NPROC=4"):
        LaunchSpec(nproc=4)
    monkeypatch.setenv("GPUKIT_MAX_NPROC", "many")
    with pytest.raises(ConfigurationError, match="GPUKIT_MAX_NPROC='many'"):
        LaunchSpec(nproc=1)


def test_a_launch_takes_a_spec_or_its_fields_not_both() -> None:
    with pytest.raises(ConfigurationError, match="not both"):
        launch_function(print, (), LaunchSpec(nproc=1), cpu=True, echo=None)
    with pytest.raises(ConfigurationError, match="unknown setting.*nprocs.*a launch takes nproc, cpu"):
        launch_script("train.py", nprocs=2, echo=None)


def test_a_function_launch_needs_nproc_and_stays_on_this_machine() -> None:
    with pytest.raises(ConfigurationError, match="give nproc"):
        launch_function(print, cpu=True, echo=None)
    with pytest.raises(ConfigurationError, match="topology are for scripts"):
        launch_function(print, nproc=1, cpu=True, topology=Topology(nnodes=2, master_addr="h"), echo=None)


def test_an_elastic_range_is_checked_and_sets_torchs_rendezvous_bounds() -> None:
    from gpukit.launch._rendezvous import ELASTIC_LAST_CALL_S, rendezvous_parameters
    from gpukit.launch._spec import ELASTIC_MAX_RESTARTS

    two = Topology(nnodes=2, master_addr="127.0.0.1")
    with pytest.raises(ConfigurationError, match="--nnodes 3:2: the fewest nodes"):
        LaunchSpec(min_nodes=3, topology=two)
    with pytest.raises(ConfigurationError, match=r"min_nodes \(--nnodes MIN:MAX\) must be an integer >= 1"):
        LaunchSpec(min_nodes=0, topology=two)
    spec = LaunchSpec(min_nodes=1, topology=two)
    assert spec.max_restarts == ELASTIC_MAX_RESTARTS  # re-forming after a lost node is a restart
    assert LaunchSpec(min_nodes=1, topology=two, max_restarts=3).max_restarts == 3
    elastic = rendezvous_parameters(two, "run", spec.min_nodes)
    assert (elastic.min_nodes, elastic.max_nodes) == (1, 2)
    assert elastic.get_as_int("last_call_timeout") == ELASTIC_LAST_CALL_S
    fixed = rendezvous_parameters(two, "run")
    assert (fixed.min_nodes, fixed.max_nodes, fixed.get("last_call_timeout")) == (2, 2, None)


def test_a_returning_node_is_let_in_at_the_workers_next_checkpoint(tmp_path) -> None:
    from gpukit.launch._rendezvous import grow_at_checkpoints
    from gpukit.worker import note_checkpoint

    class Handler:  # torch's answers: a node waiting, seen only now and then
        answers = iter([0, 1, 0, 1, 1, 0, 1])

        def num_nodes_waiting(self) -> int:
            return next(self.answers)

        def next_rendezvous(self) -> None:  # what every torch rendezvous handler has; no round here
            raise AssertionError("no round starts in this test")

    handler = grow_at_checkpoints(Handler(), str(tmp_path), patience_s=60)
    assert [handler.num_nodes_waiting() for _ in range(4)] == [0, 0, 0, 0]  # waiting, no checkpoint yet
    note_checkpoint(10, 0, tmp_path)
    assert handler.num_nodes_waiting() == 1  # the workers saved: the group restarts for the node now
    assert handler.num_nodes_waiting() == 0  # (torch's own answer again once it restarted)
    impatient = grow_at_checkpoints(type("H", (Handler,), {"num_nodes_waiting": lambda self: 1})(), str(tmp_path), 0.0)
    assert impatient.num_nodes_waiting() == 0 and impatient.num_nodes_waiting() == 1  # no checkpoint: after patience_s
