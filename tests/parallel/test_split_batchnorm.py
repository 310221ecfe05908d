"""BatchNorm under micro-batches: what differs from the unsplit model, and what does not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpukit.parallel import split


def bn_model(momentum: float | None = 0.1) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(), nn.Linear(8, 3))


def _stats(model: nn.Module) -> list[torch.Tensor]:
    bn = model[1] if isinstance(model, nn.Sequential) else model.module[1]
    return [bn.running_mean, bn.running_var, bn.num_batches_tracked]


def test_eval_mode_uses_running_stats_and_equals_unsplit() -> None:
    plain = bn_model()
    plain(torch.randn(16, 6) * 3 + 1)  # non-trivial running statistics
    plain.eval()
    model = split(copy.deepcopy(plain), ["cpu", "cpu"], chunks=4, verbose=False)
    x = torch.randn(8, 6)
    torch.testing.assert_close(model(x), plain(x))


def test_training_normalises_each_micro_batch_and_says_so() -> None:
    plain = bn_model()
    per_micro = copy.deepcopy(plain)
    with pytest.warns(UserWarning, match=r"own statistics.*deferred_batchnorm=True"):
        model = split(copy.deepcopy(plain), ["cpu", "cpu"], chunks=2, verbose=False)
    x = torch.randn(8, 6) * 2 + 0.5
    out = model(x)
    # what it computes: the unsplit model run on each micro-batch in turn
    want = torch.cat([per_micro(x[:4]), per_micro(x[4:])])
    torch.testing.assert_close(out, want)
    for got, expected in zip(_stats(model), _stats(per_micro)):
        torch.testing.assert_close(got, expected)
    assert int(_stats(model)[2]) == 2  # one running-statistics update per micro-batch
    # ... which is not the whole batch's normalisation
    assert not torch.allclose(out, plain(x), atol=1e-3)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_batchnorm_keeps_whole_batch_running_stats(momentum: float | None) -> None:
    plain = bn_model(momentum)
    model = split(copy.deepcopy(plain), ["cpu", "cpu"], chunks=4, deferred_batchnorm=True, verbose=False)
    for _ in range(2):  # the second step starts from the first one's statistics
        x = torch.randn(12, 6) * 2 + 0.5
        model(x)
        plain(x)
        for got, expected in zip(_stats(model), _stats(plain)):
            torch.testing.assert_close(got, expected)
    assert int(_stats(model)[2]) == 2
    # eval mode leaves BatchNorm to its running statistics
    model.eval()
    plain.eval()
    x = torch.randn(4, 6)
    torch.testing.assert_close(model(x), plain(x))
