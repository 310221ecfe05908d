"""SessionConfig: Session(...)'s arguments as one checked value, sent to workers and trackers."""

from __future__ import annotations

import inspect
import pickle
from dataclasses import FrozenInstanceError, fields

import pytest

from gpukit import Session
from gpukit.errors import ConfigurationError
from gpukit.session._config import SessionConfig
from gpukit.worker import WorkerEnv


def test_the_config_has_exactly_the_sessions_arguments_with_their_defaults() -> None:
    # a Session argument the config lacks would not reach launch()'s workers
    params = {name: p.default for name, p in inspect.signature(Session.__init__).parameters.items() if name != "self"}
    argument_fields = {f.name: f.default for f in fields(SessionConfig) if f.init}
    assert argument_fields == params


def test_arguments_rebuild_an_equal_config_and_it_pickles_for_the_workers() -> None:
    config = SessionConfig(devices=1, precision="32-true", seed=7, accumulate_grad_batches=2, oom="backoff",
                           watch_memory=5, timeout_s="30", compile={"mode": "max-autotune"}, refuse=["compile"])
    copy = pickle.loads(pickle.dumps(config))
    assert copy.arguments() == config.arguments()
    rebuilt = SessionConfig(**copy.arguments())
    assert rebuilt.arguments() == config.arguments()
    # the checked forms are worked out once, from the arguments
    assert (rebuilt.watch_every_n_steps, rebuilt.collective_timeout_s) == (5, 30.0)
    assert rebuilt.compile_options == {"mode": "max-autotune"} and rebuilt.refused == frozenset({"compile"})
    assert "watch_every_n_steps" not in config.arguments()
    with pytest.raises(FrozenInstanceError):
        config.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize("bad, named", [
    ({"accumulate_grad_batches": 0}, "accumulate_grad_batches=0"),
    ({"seed": -1}, "seed=-1"),
    ({"oom": "retry"}, "oom='retry'"),
    ({"watch_memory": 0}, "watch_memory=0"),
    ({"compile": {"nonsense": 1}}, "nonsense"),
    ({"auto": "yes"}, "auto='yes'"),
    ({"refuse": ("bogus",)}, "bogus"),
    ({"timeout_s": -5}, "timeout_s=-5"),
])
def test_a_bad_setting_is_refused_when_the_config_is_made_naming_it(bad: dict, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named.replace("(", r"\(").replace(")", r"\)")):
        SessionConfig(**bad)


def test_gpukit_run_cpu_makes_an_automatic_accelerator_the_cpu() -> None:
    on_cpu = WorkerEnv(cpu=True)
    assert SessionConfig().for_worker(on_cpu).accelerator == "cpu"
    assert SessionConfig(accelerator="cuda").for_worker(on_cpu).accelerator == "cuda"
    config = SessionConfig()
    assert config.for_worker(WorkerEnv()) is config


def test_what_the_trackers_log_is_every_argument_as_a_plain_value_then_what_was_chosen() -> None:
    class Custom:
        pass

    logged = SessionConfig(devices=[0, 1], strategy=Custom(), refuse=("compile",)).tracked(world_size=2)
    assert set(logged) == {f.name for f in fields(SessionConfig) if f.init} | {"world_size"}
    assert logged["devices"] == [0, 1] and logged["strategy"] == "Custom" and logged["refuse"] == ["compile"]
    assert logged["world_size"] == 2
