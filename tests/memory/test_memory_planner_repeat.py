"""The planner's short copies (``_repeat.py``): a run of alike blocks planned from 3 and 4 units
gives the same figures as simulating every block, and ``fit`` the same ranking."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gpukit.memory import _planner, estimate_memory, fit
from gpukit.memory._repeat import find_run

sys.path.insert(0, str(Path(__file__).parent))
from planner_models import Transformer, cnn, mlp  # noqa: E402


@pytest.fixture
def whole(monkeypatch: pytest.MonkeyPatch):
    """``whole(fn)``: ``fn()`` with every block simulated (the planner before short copies)."""
    def run(fn):  # noqa: ANN001, ANN202
        with monkeypatch.context() as patch:
            patch.setattr(_planner, "_from_short_copies", lambda *args: None)
            return fn()
    return run


@pytest.fixture
def short_copies_used(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many plans came from short copies (so a test cannot pass by never using them)."""
    used = [0]
    real = _planner._from_short_copies

    def counted(*args):  # noqa: ANN002, ANN202
        figures = real(*args)
        used[0] += figures is not None
        return figures

    monkeypatch.setattr(_planner, "_from_short_copies", counted)
    return used


_CASES = {
    "transformer": (lambda: Transformer(width=64, depth=17), lambda: torch.randint(0, 1000, (4, 16))),
    # a vocabulary whose head outweighs the layers at few of them: the peak moves as layers are added
    "big-head": (lambda: Transformer(vocab=30000, width=64, depth=12), lambda: torch.randint(0, 30000, (1, 8))),
    "mlp": (lambda: mlp(width=64, depth=18), lambda: torch.randn(32, 64)),
    "cnn": (lambda: cnn(channels=8, depth=17), lambda: torch.randn(4, 3, 16, 16)),
}


@pytest.mark.parametrize("name", list(_CASES))
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("checkpointing", [None, True, "selective"])
def test_short_copies_give_the_figures_of_every_block(name: str, precision: str, checkpointing: object,
                                                      whole, short_copies_used: list[int]) -> None:
    torch.manual_seed(0)
    model, batch = _CASES[name][0](), _CASES[name][1]()
    device = "cpu" if name == "cnn" else "cuda"  # byte-exact and 512-byte blocks
    got = estimate_memory(model, "adam", batch, precision=precision, device=device,
                          activation_checkpointing=checkpointing)
    expected = whole(lambda: estimate_memory(model, "adam", batch, precision=precision, device=device,
                                             activation_checkpointing=checkpointing))
    assert short_copies_used[0] == 1
    assert got.to_dict() == expected.to_dict()


@pytest.mark.parametrize("optimizer", [None, "sgd", "adamw"])
def test_short_copies_with_other_optimizers(optimizer: object, whole, short_copies_used: list[int]) -> None:
    model, batch = Transformer(width=64, depth=12), torch.randint(0, 1000, (4, 16))
    got = estimate_memory(model, optimizer, batch, precision="bf16-mixed")
    assert got.to_dict() == whole(lambda: estimate_memory(model, optimizer, batch, precision="bf16-mixed")).to_dict()
    assert short_copies_used[0] == 1


def test_a_hugging_face_model_with_layer_indices(whole, short_copies_used: list[int]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=17,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      attn_implementation="eager", use_cache=False)
    model, batch = transformers.LlamaForCausalLM(config), torch.randint(0, 1000, (2, 16))
    for checkpointing in (None, "selective"):
        got = estimate_memory(model, "adamw", batch, precision="bf16-true", activation_checkpointing=checkpointing)
        expected = whole(lambda: estimate_memory(model, "adamw", batch, precision="bf16-true",
                                                 activation_checkpointing=checkpointing))
        assert got.to_dict() == expected.to_dict()
    assert short_copies_used[0] == 2


def test_fit_ranks_and_figures_as_before(whole, short_copies_used: list[int]) -> None:
    model, batch = Transformer(width=64, depth=12), torch.randint(0, 1000, (16, 32))
    budget = "40MiB"
    got = fit(model, batch, memory=budget, devices=2)
    expected = whole(lambda: fit(model, batch, memory=budget, devices=2))
    assert got.options and got == expected
    assert short_copies_used[0] >= 9  # every precision x checkpointing plan


class _Unlike(nn.Module):
    """Blocks of one class whose work depends on a setting that is no position: not alike."""

    def __init__(self, wide: bool) -> None:
        super().__init__()
        self.linear, self.wide = nn.Linear(32, 32), wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([x, x], 0))[: len(x)] if self.wide else self.linear(x)


def test_blocks_that_differ_are_simulated_whole(short_copies_used: list[int]) -> None:
    unlike = nn.Sequential(*[_Unlike(wide=i % 3 == 0) for i in range(12)])
    assert find_run(unlike, None) is None
    alike = nn.Sequential(*[_Unlike(wide=False) for _ in range(12)])
    assert find_run(alike, None) is not None and len(find_run(alike, None).blocks) == 12
    assert find_run(nn.Sequential(*[_Unlike(wide=False) for _ in range(6)]), None) is None  # too short to gain
    estimate_memory(unlike, "adam", torch.randn(8, 32), device="cpu")
    assert short_copies_used[0] == 0


class _IndexedLoop(nn.Module):
    """A model that indexes its layers by a count of its own: it cannot run cut short."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 12
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(self.count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.count):
            x = torch.relu(self.layers[i](x))
        return x


def test_a_model_that_fails_cut_short_is_simulated_whole(whole, short_copies_used: list[int]) -> None:
    model = _IndexedLoop()
    got = estimate_memory(model, "adam", torch.randn(8, 16), device="cpu")
    assert short_copies_used[0] == 0 and len(model.layers) == 12  # put back as it was
    assert got.to_dict() == whole(lambda: estimate_memory(model, "adam", torch.randn(8, 16), device="cpu")).to_dict()
