"""Tensor-parallel plans found by structure, user plans, and the errors for what cannot be split --
raised before anything is sharded (no process group needed: plans are checked on the whole model)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from gpukit.errors import ConfigurationError
from gpukit.strategies import TensorParallelStrategy, select_strategy
from gpukit.strategies._fsdp_api import _torch_version
from gpukit.strategies._tp_plan import auto_plan, check_plan
from gpukit.strategies.tensor import REPLICATE_MIN_TORCH

sys.path.insert(0, str(Path(__file__).parent))
import _tp_worker as worker  # noqa: E402


def _kinds(plan) -> dict[str, str]:
    return {name: type(style).__name__[:3] for name, style in plan.styles.items()}


def test_small_transformer_plan_by_structure() -> None:
    plan = auto_plan(worker.make_model("block"), 2)
    assert _kinds(plan) == {
        "block.attn.q": "Col", "block.attn.k": "Col", "block.attn.v": "Col", "block.attn.out": "Row",
        "block.mlp.0": "Col", "block.mlp.2": "Row", "head": "Col", "embed": "Row",
    }
    assert plan.heads == [("block.attn", "n_heads", 2)]  # the attention reshapes by its local heads


def test_hugging_face_llama_and_gpt2() -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    from transformers.utils import is_torch_available

    if not is_torch_available():  # transformers 5 needs torch >= 2.6 for its models (make test-floor: 2.5)
        pytest.skip(f"transformers cannot use torch {torch.__version__} for its models")
    plan = auto_plan(worker.make_model("llama"), 2)
    assert _kinds(plan) == {
        **{f"model.layers.0.self_attn.{p}_proj": "Col" for p in "qkv"}, "model.layers.0.self_attn.o_proj": "Row",
        "model.layers.0.mlp.gate_proj": "Col", "model.layers.0.mlp.up_proj": "Col",
        "model.layers.0.mlp.down_proj": "Row", "lm_head": "Col", "model.embed_tokens": "Row",
    }
    assert plan.heads == []  # Llama reshapes with -1; its shared config is left alone
    with pytest.raises(ConfigurationError, match=r"key/value heads.*num_key_value_heads = 2.*multiple of the degree"):
        auto_plan(worker.make_model("llama"), 4)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=4, n_positions=8,
                                      bos_token_id=0, eos_token_id=0))
    with pytest.raises(ConfigurationError, match=r"found no block to split.*c_attn \(Hugging Face Conv1D"):
        auto_plan(gpt2, 2)


def test_heads_not_divisible_names_the_layer_and_rule() -> None:
    model = worker.make_model("block")
    with pytest.raises(ConfigurationError) as info:
        auto_plan(model, 3)
    assert "'block.attn'" in str(info.value) and "n_heads = 4" in str(info.value)
    assert "multiple of the degree" in str(info.value)
    assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing was sharded


def test_mlp_width_not_divisible() -> None:
    with pytest.raises(ConfigurationError, match=r"MLP '0' -> '2' \(hidden width 6\).*6 is not divisible by 4"):
        auto_plan(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8)), 4)


def test_pairs_only_with_element_wise_layers_between() -> None:
    """A model's input and output projections around blocks are no MLP; a norm over the units is not element-wise."""
    with pytest.raises(ConfigurationError, match="found no block to split"):
        auto_plan(nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 8)), 2)
    with pytest.raises(ConfigurationError, match=r"nn.MultiheadAttention"):
        auto_plan(nn.Sequential(nn.MultiheadAttention(8, 2)), 2)


def test_user_plan_is_checked() -> None:
    model = worker.make_model("block")
    plan = check_plan(model, {"block.mlp.0": ColwiseParallel(), "block.mlp.2": RowwiseParallel()}, 2)
    assert list(plan.styles) == ["block.mlp.0", "block.mlp.2"]
    assert check_plan(model, {"block.attn.*": ColwiseParallel()}, 2).styles  # patterns as parallelize_module's
    with pytest.raises(ConfigurationError, match=r"'block.norm1' is a LayerNorm.*nn.Linear and nn.Embedding only"):
        check_plan(model, {"block.norm1": ColwiseParallel()}, 2)
    with pytest.raises(ConfigurationError, match=r"no such module \(did you mean 'block.mlp'\?\)"):
        check_plan(model, {"mlp": ColwiseParallel()}, 2)
    with pytest.raises(ConfigurationError, match="values are torch ParallelStyles"):
        check_plan(model, {"head": "colwise"}, 2)
    with pytest.raises(ConfigurationError, match=r"'head' with ColwiseParallel \(out_features = 16\).*by 3"):
        check_plan(model, {"head": ColwiseParallel()}, 3)


def test_a_user_plan_pattern_matches_what_parallelize_module_splits() -> None:
    """torch matches a plan key one dotted part at a time: ``*.fc1`` names ``a.fc1`` only, so ``a.b.fc1`` (3 outputs,
    which 2 cannot split, and which torch leaves whole) is not checked; ``*`` alone is the children of the root."""
    model = nn.Sequential()
    model.a = nn.Module()
    model.a.fc1 = nn.Linear(8, 8)
    model.a.b = nn.Module()
    model.a.b.fc1 = nn.Linear(8, 3)
    assert list(check_plan(model, {"*.fc1": ColwiseParallel()}, 2).styles) == ["*.fc1"]
    with pytest.raises(ConfigurationError, match=r"'a.b.fc1' with ColwiseParallel \(out_features = 3\)"):
        check_plan(model, {"*.*.fc1": ColwiseParallel()}, 2)
    with pytest.raises(ConfigurationError, match=r"'a' is a Module"):  # "*": the root's children, not every module
        check_plan(model, {"*": ColwiseParallel()}, 2)


def test_selection_and_layouts() -> None:
    tp = select_strategy(2, "auto", "cpu", tensor_parallel=2)
    assert isinstance(tp, TensorParallelStrategy) and not tp.launched
    assert (tp.layout.tensor, tp.data_parallel_size) == (2, 1)
    two_d = select_strategy(4, "fsdp", "cpu", tensor_parallel=2)
    assert (two_d.layout.shards, two_d.layout.tensor, two_d.layout.data_parallel_rank(3)) == (2, 2, 1)
    if _torch_version() >= REPLICATE_MIN_TORCH:  # replicated groups: refused on older torch (tested below)
        assert select_strategy(4, "ddp", "cpu", tensor_parallel=2).layout.replicas == 2
    assert select_strategy(2, "tp", "cpu").layout == tp.layout  # the registry's name: one group of every process
    with pytest.raises(ConfigurationError, match="does not divide the 4 processes"):
        select_strategy(4, "ddp", "cpu", tensor_parallel=3)
    with pytest.raises(ConfigurationError, match="strategy 'single' cannot carry it"):
        select_strategy("cpu", "auto", "cpu", tensor_parallel=2)
    with pytest.raises(ConfigurationError, match="tensor_parallel=0"):
        select_strategy(2, "ddp", "cpu", tensor_parallel=0)
    with pytest.raises(ConfigurationError, match="tensor_plan= was given with tensor_parallel=1"):
        select_strategy(2, "ddp", "cpu", tensor_plan={"head": ColwiseParallel()})


def test_session_batches_count_data_parallel_ranks() -> None:
    """2 x 2 (not launched yet): the global batch is split over the 2 data-parallel ranks, not the 4 processes."""
    import gpukit

    session = gpukit.Session(accelerator="cpu", devices=4, strategy="fsdp", tensor_parallel=2, verbose=False,
                             micro_batch_size=4, global_batch_size=16)
    assert (session.world_size, session.strategy.data_parallel_size) == (4, 2)
    assert session.accumulate_grad_batches == 2 and session.global_batch_size == 16


def test_oom_backoff_is_refused_with_tensor_parallel() -> None:
    import gpukit

    with pytest.raises(ConfigurationError, match="oom='backoff'.*tensor_parallel"):
        gpukit.Session(accelerator="cpu", devices=2, tensor_parallel=2, oom="backoff", verbose=False)


def test_attention_that_is_not_understood_is_left_whole() -> None:
    """A module with a head count whose linears are not q/k/v then an output is not split as an MLP either
    (its ``a``/``b`` pair would be one): its forward reshapes by the head count, which such a split breaks."""

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 4
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 8)

    model = nn.ModuleDict({"attn": Odd(), "mlp": nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))})
    plan = auto_plan(model, 2)
    assert list(plan.styles) == ["mlp.0", "mlp.2"]
    assert plan.left_whole == ["attn (attention-like, but its linears are not q/k/v then an output)"]


def _launched(world: int, per_node: int) -> dict[str, str]:
    """The variables torchrun sets for rank 0 of ``world`` processes, ``per_node`` on each node."""
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("world", "per_node", "degree"), [(8, 4, 8), (12, 6, 4)])
def test_tensor_groups_across_nodes_are_warned_of(world: int, per_node: int, degree: int) -> None:
    """Ranks are tensor-innermost: a degree that does not divide the processes per node puts a group on two nodes."""
    with pytest.warns(RuntimeWarning, match=f"tensor_parallel={degree} puts tensor groups across nodes.*"
                                            f"{per_node} process\\(es\\) per node"):
        strategy = select_strategy("auto", "fsdp", "cpu", tensor_parallel=degree, environ=_launched(world, per_node))
    assert strategy.layout.tensor == degree


def test_tensor_groups_inside_nodes_are_not_warned_of(recwarn: pytest.WarningsRecorder) -> None:
    select_strategy("auto", "fsdp", "cpu", tensor_parallel=4, environ=_launched(8, 4))
    select_strategy("auto", "fsdp", "cpu", tensor_parallel=2, environ=_launched(4, 4))
    assert not [w for w in recwarn if "across nodes" in str(w.message)]


def test_an_auto_degree_across_nodes_is_warned_of() -> None:
    strategy = select_strategy("auto", "fsdp", "cpu", tensor_parallel="auto", environ=_launched(8, 4))
    with pytest.warns(RuntimeWarning, match="tensor_parallel=8 puts tensor groups across nodes"):
        strategy.choose_degree(8)


@pytest.mark.parametrize("old", ["2.5.1+cu124", "2.9.1"])
def test_replicated_groups_need_a_torch_whose_replicate_takes_a_1d_mesh(
        monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """torch 2.5-2.8 have no replicate_with_fsdp and torch 2.9's wants a 2-D mesh: refused when the strategy is
    chosen, not with a traceback from inside torch at setup; sharded groups and one group need no replicate."""
    monkeypatch.setattr(torch, "__version__", old)
    with pytest.raises(ConfigurationError, match=f"needs torch >= 2.10; this is torch {re.escape(old)}.*"
                                                 "strategy='fsdp'"):
        select_strategy(4, "ddp", "cpu", tensor_parallel=2)
    assert select_strategy(4, "fsdp", "cpu", tensor_parallel=2).layout.shards == 2
    assert select_strategy(2, "ddp", "cpu", tensor_parallel=2).layout.tensor == 2


def test_replicated_groups_refused_at_setup_when_replicate_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """tensor_parallel="auto" learns the degree at setup: an old torch is refused there, before the model is split."""
    strategy = select_strategy(2, "ddp", "cpu", tensor_parallel="auto")
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.replicate_with_fsdp", None)  # not importable
    model = worker.make_model("mlp")
    before = {n: type(p) for n, p in model.named_parameters()}
    with pytest.raises(ConfigurationError, match="tensor_parallel='auto' with strategy='ddp'.*replicate_with_fsdp"):
        strategy.setup_module(model)
    assert {n: type(p) for n, p in model.named_parameters()} == before
