"""The planner's short cuts give the figures of the planner without them: a run of alike blocks
planned from copies of 2 and 3 units (``_repeat.py``), an optimizer step met before counted from
its first run (``_simulate.py``); and ``fit`` the same ranking."""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from gpukit.memory import FitPlanner, _planner, _simulate, estimate_memory, fit
from gpukit.memory._repeat import find_run

sys.path.insert(0, str(Path(__file__).parent))
from planner_models import Transformer, cnn, mlp  # noqa: E402


@pytest.fixture
def whole(monkeypatch: pytest.MonkeyPatch):
    """``whole(fn)``: ``fn()`` with every block and every optimizer step simulated (the planner
    before its short cuts)."""
    def run(fn):  # noqa: ANN001, ANN202
        with monkeypatch.context() as patch:
            patch.setattr(_planner, "_from_short_copies", lambda *args: None)
            patch.setattr(_simulate, "_OPTIMIZER_STEPS", OrderedDict())
            patch.setattr(_simulate, "_OPTIMIZER_STEPS_KEPT", 0)
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


def _case(name: str, checkpointing: object) -> tuple[nn.Module, torch.Tensor]:
    # 8 units, the fewest short copies are used for (every other block checkpointed: units of 2, one left over)
    depth = 13 if checkpointing == "selective" else 6
    torch.manual_seed(0)
    if name == "transformer":
        return Transformer(width=32, depth=depth), torch.randint(0, 1000, (4, 8))
    if name == "big-head":  # a head that outweighs the layers at few of them: the peak moves as layers are added
        return Transformer(vocab=30000, width=32, depth=depth), torch.randint(0, 30000, (1, 8))
    if name == "mlp":
        return mlp(width=32, depth=depth), torch.randn(16, 64)
    return cnn(channels=4, depth=depth), torch.randn(2, 3, 8, 8)


_MATRIX = ([("transformer", p, c) for p in ("32-true", "bf16-mixed", "bf16-true") for c in (None, True, "selective")]
           + [("big-head", "bf16-mixed", c) for c in (None, True, "selective")]
           + [("mlp", "bf16-true", None), ("mlp", "bf16-true", "selective"),
              ("cnn", "32-true", True), ("cnn", "bf16-mixed", "selective")])


@pytest.mark.parametrize("name, precision, checkpointing", _MATRIX)
def test_short_copies_give_the_figures_of_every_block(name: str, precision: str, checkpointing: object,
                                                      whole, short_copies_used: list[int]) -> None:
    model, batch = _case(name, checkpointing)
    device = "cpu" if name == "cnn" else "cuda"  # byte-exact and 512-byte blocks
    got = estimate_memory(model, "adam", batch, precision=precision, device=device,
                          activation_checkpointing=checkpointing)
    expected = whole(lambda: estimate_memory(model, "adam", batch, precision=precision, device=device,
                                             activation_checkpointing=checkpointing))
    assert short_copies_used[0] == 1
    assert got.to_dict() == expected.to_dict()


@pytest.mark.parametrize("optimizer", [None, "sgd", "adamw"])
def test_short_copies_with_other_optimizers(optimizer: object, whole, short_copies_used: list[int]) -> None:
    model, batch = Transformer(width=32, depth=6), torch.randint(0, 1000, (4, 8))
    got = estimate_memory(model, optimizer, batch, precision="bf16-mixed")
    assert got.to_dict() == whole(lambda: estimate_memory(model, optimizer, batch, precision="bf16-mixed")).to_dict()
    assert short_copies_used[0] == 1


def test_a_hugging_face_model_with_layer_indices(whole, short_copies_used: list[int]) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers (in the test extra) is not installed")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=86, num_hidden_layers=13,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      attn_implementation="eager", use_cache=False)
    try:
        model = transformers.LlamaForCausalLM(config)
    except ImportError as exc:  # a transformers newer than this torch (5.x needs torch >= 2.6)
        pytest.skip(f"transformers {transformers.__version__} does not run on torch {torch.__version__}: "
                    f"{str(exc).strip().splitlines()[0]}")
    batch = torch.randint(0, 1000, (2, 8))
    for checkpointing in (None, "selective"):
        got = estimate_memory(model, "adamw", batch, precision="bf16-true", activation_checkpointing=checkpointing)
        expected = whole(lambda: estimate_memory(model, "adamw", batch, precision="bf16-true",
                                                 activation_checkpointing=checkpointing))
        assert got.to_dict() == expected.to_dict()
    assert short_copies_used[0] == 2


def test_fit_ranks_and_figures_as_before(whole, short_copies_used: list[int]) -> None:
    model, batch = Transformer(width=32, depth=6), torch.randint(0, 1000, (4, 16))
    options = dict(memory="12MiB", devices=2, precisions=("32-true", "bf16-mixed"), checkpointing=("none", "full"))
    planner = FitPlanner(model, batch, "adam", "cuda")
    got = fit(model, batch, planner=planner, **options)
    expected = whole(lambda: fit(model, batch, **options))
    assert got.options and got == expected
    assert short_copies_used[0] == planner.plans >= 4  # every plan the search made, both policies


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
    assert find_run(nn.Sequential(*[_Unlike(wide=False) for _ in range(5)]), None) is None  # too short to gain
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
