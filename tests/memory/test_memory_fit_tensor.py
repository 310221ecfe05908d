"""``fit`` with tensor parallelism (memory/_fit_tensor.py, _tp_shard.py): which degrees it plans and why it
refuses the others, the shard model it plans a rank by, and the choice -- tensor groups where the per-rank
activations do not fit under FSDP alone, none where they do not pay."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gpukit.errors import ConfigurationError
from gpukit.layout import Layout, plan_layout, plan_name_of, session_arguments
from gpukit.memory import FitPlanner, TensorSplitError, fit, tensor_split

SEQ, VOCAB = 128, 64


class Attention(nn.Module):
    """Eager attention: its scores (heads x seq x seq per sample) are what tensor groups split."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return self.o((scores @ v).transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, hidden: int = 48, heads: int = 12, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.Sequential(*(Block(hidden, heads) for _ in range(depth)))
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def _ids(batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ))


def test_degrees_are_refused_with_the_rule_they_break() -> None:
    model = LM()  # 12 heads, MLP width 192, vocabulary 64
    result = fit(model, _ids(8), memory="1GiB", devices=8, device="cpu", precisions=["32-true"],
                 checkpointing=["none"], top=1, node_devices=4)
    lines = dict(line.split(": ", 1) for line in result.tensor)
    assert set(lines) == {"tp 2", "tp 4", "tp 8"}
    assert lines["tp 8"].startswith("more than the 4 GPUs of one node")
    assert lines["tp 2"].startswith("heads 12, MLP width 192 divisible by 2, comm ")
    with pytest.raises(TensorSplitError) as refused:
        tensor_split(model, 8)
    assert refused.value.reason == "12 heads ('blocks.0.attn') not divisible by 8"
    result = fit(model, _ids(10), memory="1GiB", devices=10, device="cpu", precisions=["32-true"],
                 checkpointing=["none"], top=1, tensor_parallel=[5])
    assert result.tensor == ("tp 5: 12 heads ('blocks.0.attn') not divisible by 5",)
    # 2 nodes of 6: groups of 4 consecutive ranks (tensor innermost) would put ranks 4-7 on both nodes
    result = fit(model, _ids(12), memory="1GiB", devices=12, device="cpu", precisions=["32-true"],
                 checkpointing=["none"], top=1, node_devices=6, tensor_parallel=[4])
    assert result.tensor == ("tp 4: does not divide the 6 GPUs of one node, so some tensor groups would span two "
                             "nodes (a group's collectives run every layer: they stay inside a node)",)
    assert all(o.layout.tensor == 1 for o in result.options)
    with pytest.raises(ConfigurationError, match="tensor_parallel=5: 12 heads"):  # a layout named: refused loudly
        fit(model, _ids(10), memory="1GiB", devices=10, device="cpu", strategies=["ddp+tp5"])
    with pytest.raises(ConfigurationError, match="tensor_parallel='two'"):
        fit(model, _ids(8), memory="1GiB", devices=8, device="cpu", tensor_parallel="two")


def test_layout_names_and_session_lines_of_tensor_groups() -> None:
    assert plan_layout("fsdp+tp2", 8) == Layout(shards=4, tensor=2)
    assert plan_layout("ddp+tp4", 8) == Layout(replicas=2, tensor=4)
    assert plan_layout("tp2", 8) == Layout(tensor=2)
    assert [plan_name_of(layout) for layout in (Layout(shards=4, tensor=2), Layout(replicas=2, tensor=4),
                                                 Layout(tensor=2))] == ["fsdp+tp2", "ddp+tp4", "tp2"]
    assert session_arguments(Layout(shards=4, tensor=2)) == ["devices=8", "strategy='fsdp'", "tensor_parallel=2"]
    assert session_arguments(Layout(replicas=2, tensor=2)) == ["devices=4", "strategy='ddp'", "tensor_parallel=2"]
    assert session_arguments(Layout(tensor=4)) == ["devices=4", "tensor_parallel=4"]
    with pytest.raises(ConfigurationError, match="the degree must divide the devices"):
        plan_layout("fsdp+tp3", 8)
    with pytest.raises(ConfigurationError, match="tensor groups go with a strategy of one device per process"):
        plan_layout("pipeline+tp2", 8)


def test_a_rank_is_planned_by_its_shard_of_the_model() -> None:
    model = LM(hidden=48, heads=12, depth=2)
    planner = FitPlanner(model, _ids(2), "adam", "cpu")
    whole = planner.exact("32-true", "none", 2)
    half = planner.exact("32-true", "none", 2, tensor=2)
    split, local = planner.split(2)
    assert next(local.parameters()).device.type == "meta" and next(model.parameters()).device.type == "cpu"
    assert local.blocks[0].attn.num_heads == 6 and model.blocks[0].attn.num_heads == 12  # the model is not changed
    # each split layer keeps 1/2 of its weight (row-wise biases whole); norms and the rest whole
    split_params = sum(model.get_submodule(n).weight.numel() // 2 + (model.get_submodule(n).bias.numel() // 2
                       if n in (*split.column, *split.gathered) and model.get_submodule(n).bias is not None else 0)
                       for n in split.names)
    kept = sum(p.numel() for n, p in model.named_parameters()
               if not (n.rsplit(".", 1)[0] in split.names and (n.endswith("weight") or n.rsplit(".", 1)[0]
                                                               not in split.row)))
    assert half.parameters_bytes == 4 * (split_params + kept)
    assert half.peak_bytes < whole.peak_bytes and half.flops < whole.flops
    # what the group exchanges per sample: 2 blocks x (attention out + MLP down forward, q/k/v + MLP up
    # backward), the embedding forward, the head's input backward -- each of SEQ x 48 -- and the logits gathered
    traffic = planner.traffic(2)
    assert traffic.reduced == (2 * (2 + 4) + 1 + 1) * SEQ * 48
    assert traffic.gathered == SEQ * VOCAB and traffic.collectives == 2 * 6 + 1 + 2


def test_tensor_groups_are_chosen_where_fsdp_alone_does_not_fit() -> None:
    """Per-rank activations (the attention scores of 12 heads) too large for FSDP at one sample per device:
    a tensor group splits the heads, and is chosen; with memory to spare it does not pay, and is not."""
    model = LM(hidden=48, heads=12, depth=2)
    kwargs = dict(devices=4, device="cpu", precisions=["32-true"], checkpointing=["none", "full"], top=2)
    ids = _ids(4)
    planner = FitPlanner(model, ids, "adam", "cpu")
    alone = fit(model, ids, memory=1, tensor_parallel=(), planner=planner, **kwargs)
    least = alone.closest.peak_bytes  # the least any layout without tensor groups needs per device
    tight = fit(model, ids, memory=least - 1, planner=planner, **kwargs)
    assert tight.best is not None and tight.best.layout.tensor > 1, str(tight)
    assert f"tensor_parallel={tight.best.layout.tensor}" in tight.best.session_line()
    chosen = [line for line in tight.tensor if f"tp {tight.best.layout.tensor}:" in line]
    assert chosen and "; chosen (" in chosen[0] and "nothing without tensor parallelism fits" in chosen[0]
    roomy = fit(model, ids, memory="4GiB", planner=planner, **kwargs)
    assert roomy.best.layout.tensor == 1, str(roomy)
    assert all("not chosen: its fastest" in line for line in roomy.tensor), roomy.tensor
    assert "tensor parallel (collectives priced over an assumed 200 GB/s intra-node link):" in str(roomy)


def test_node_gpus_goes_with_fit() -> None:
    from click.testing import CliRunner

    from gpukit.cli.plan import plan

    result = CliRunner().invoke(plan, ["nosuchmodule:factory", "--batch-shape", "2,8", "--node-gpus", "2"])
    assert isinstance(result.exception, ConfigurationError)
    assert "--node-gpus 2 goes with --fit SIZE" in str(result.exception)


def test_session_fit_plans_its_tensor_group_and_names_a_degree_that_would_fit() -> None:
    """``Session(fit=...)`` on 2 processes (not launched: rank 0's choice, made here): with
    ``tensor_parallel=2`` it plans the group's shard model; without, where nothing fits, the error names
    the degree that would."""
    import gpukit
    from gpukit.errors import MemoryPlanError

    torch.manual_seed(0)
    model, ids = LM(hidden=48, heads=12, depth=2), _ids(2)
    kwargs = dict(devices=2, device="cpu", precisions=["32-true"], checkpointing=["none", "full"], top=1)
    least = fit(model, _ids(4), memory=1, strategies=["ddp"], **kwargs).closest.peak_bytes
    budget = least - 1  # under DDP's least peak (2 per batch, 1 per micro-batch); tensor x2 fits
    optimizer = torch.optim.Adam(model.parameters())
    grouped = gpukit.Session(accelerator="cpu", devices=2, tensor_parallel=2, precision="32-true", fit=budget,
                             verbose=False)
    choice = grouped._fit._choose(model, optimizer, ids, budget, "given")
    assert choice.option.layout == Layout(tensor=2) and choice.peak_bytes <= budget
    assert "tensor_parallel=2" in choice.option.session_line()
    plain = gpukit.Session(accelerator="cpu", devices=2, strategy="ddp", precision="32-true", fit=budget,
                           verbose=False)
    with pytest.raises(MemoryPlanError, match=r"fix: tensor_parallel=2 would fit \(.*or tensor_parallel='auto'"):
        plain._fit._choose(model, optimizer, ids, budget, "given")
    auto = gpukit.Session(accelerator="cpu", devices=2, tensor_parallel="auto", precision="32-true", fit=budget,
                          verbose=False)  # the degree left to fit: the one that fits
    assert auto.strategy.layout == Layout(replicas=2)
    assert auto._fit._choose(model, optimizer, ids, budget, "given").option.layout == Layout(tensor=2)
