"""The collective timeout: Session(timeout_s=), GPUKIT_TIMEOUT_S, validation."""

from __future__ import annotations

import math

import pytest

from gpukit._util.envvars import TIMEOUT_ENV
from gpukit._util.timeouts import DEFAULT_TIMEOUT_S, parse_timeout_s
from gpukit.errors import ConfigurationError
from gpukit.worker import collective_timeout_s


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "soon", True, None])
def test_only_positive_finite_seconds(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="positive, finite number of seconds"):
        parse_timeout_s(bad)


def test_argument_then_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout_s() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv(TIMEOUT_ENV, "90")
    assert collective_timeout_s() == 90.0 and collective_timeout_s(5) == 5.0
    monkeypatch.setenv(TIMEOUT_ENV, "inf")
    with pytest.raises(ConfigurationError, match=TIMEOUT_ENV):
        collective_timeout_s()


def test_session_timeout_reaches_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpukit

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    session = gpukit.Session(accelerator="cpu", strategy="ddp", devices=1, verbose=False, timeout_s=42)
    try:
        assert session.strategy.timeout_s == 42.0
    finally:
        session.close()
    with pytest.raises(ConfigurationError, match="timeout_s=-3"):
        gpukit.Session(accelerator="cpu", verbose=False, timeout_s=-3)
