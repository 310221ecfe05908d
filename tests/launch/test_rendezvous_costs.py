"""gpukit's launches skip two costs of torch's dynamic rendezvous, and leave torch as it was."""

from __future__ import annotations

import inspect
import time

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from gpukit.launch._rendezvous import _method_name, cheaper_rendezvous


def _recorder() -> tuple[str, str]:
    return _method_name(), dynamic_rendezvous.get_method_name()


def test_the_recorded_method_name_is_the_one_torch_would_name() -> None:
    def _record_event() -> tuple[str, str]:  # like DynamicRendezvousHandler._record
        return _recorder()

    ours, torch_s = _record_event()
    assert ours == torch_s == "_record_event"  # two frames up, as torch counts
    assert inspect.stack()[0].function == _method_name(1)


def test_one_machine_skips_the_join_skew_only_and_torch_is_restored() -> None:
    original_name, original_delay = dynamic_rendezvous.get_method_name, dynamic_rendezvous._delay
    with cheaper_rendezvous(single_machine=True):
        assert dynamic_rendezvous.get_method_name is _method_name
        start = time.monotonic()
        for _ in range(20):
            dynamic_rendezvous._delay(seconds=(0.2, 0.3))  # the skew: skipped
        assert time.monotonic() - start < 0.2
        start = time.monotonic()
        dynamic_rendezvous._delay(seconds=0.05)  # a real wait (e.g. polling): kept
        assert time.monotonic() - start >= 0.04
    assert dynamic_rendezvous.get_method_name is original_name
    assert dynamic_rendezvous._delay is original_delay
    with cheaper_rendezvous(single_machine=False):  # several nodes: the skew stays
        assert dynamic_rendezvous._delay is original_delay
