"""FSDP wrapping policy and strategy selection, in one process (no process group needed)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpukit.errors import ConfigurationError
from gpukit.strategies import FSDPStrategy, select_strategy
from gpukit.memory import units_to_shard


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)


class GPTish(nn.Module):
    def __init__(self, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)  # 8000 own parameters
        self.h = nn.ModuleList(Block() for _ in range(3))
        self.enc = nn.TransformerEncoderLayer(4, 1, 8)
        self.out = nn.Linear(4, 2)


def names(model: nn.Module, **kwargs: object) -> list[str]:
    return [n for n, _ in units_to_shard(model, **kwargs)]  # type: ignore[arg-type]


def test_default_policy_blocks_stacks_and_large_layers_innermost_first() -> None:
    model = GPTish()
    assert names(model, min_unit_params=5000) == ["enc", "h.2", "h.1", "h.0", "embed"]
    assert names(model) == ["enc", "h.2", "h.1", "h.0"]  # the embedding is below 1M parameters


def test_policy_overrides_and_fp32_norm_units() -> None:
    model = GPTish()
    assert names(model, auto_wrap={nn.Linear}) == ["out", "enc.linear2", "enc.linear1",
                                                    "enc.self_attn.out_proj", "h.2.fc", "h.1.fc", "h.0.fc"]
    assert names(model, auto_wrap=lambda m, n: n == "out") == ["out"]
    # a "-true" precision keeps norm layers fp32: they become units inside their block's unit
    with_norms = names(model, always=(nn.LayerNorm,))
    assert with_norms.index("h.0.norm") < with_norms.index("h.0")
    with pytest.raises(ConfigurationError, match="auto_wrap=3"):
        units_to_shard(model, auto_wrap=3)  # type: ignore[arg-type]


def test_selection_by_name_and_by_configured_object() -> None:
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    by_name = select_strategy(strategy="fsdp", accelerator="cpu", environ=env)
    assert isinstance(by_name, FSDPStrategy) and (by_name.rank, by_name.world_size) == (1, 2)
    configured = FSDPStrategy(auto_wrap={Block}, cpu_offload=True)
    placed = select_strategy(strategy=configured, accelerator="cpu", environ=env)
    assert placed.bound and placed.auto_wrap == {Block} and placed.cpu_offload
    assert placed.root_device == torch.device("cpu") and placed.rank == 1
    with pytest.raises(ConfigurationError, match="min_unit_params=0"):
        FSDPStrategy(min_unit_params=0)


def test_fp16_mixed_is_refused_with_a_way_out() -> None:
    from gpukit.precision import MixedPrecision

    strategy = select_strategy(strategy="fsdp", accelerator="cpu", environ={})
    strategy.precision = MixedPrecision("16-mixed", torch.device("cpu"))
    with pytest.raises(ConfigurationError, match="bf16-mixed"):
        strategy.setup_module(nn.Linear(2, 2))


@pytest.mark.requires_cpu_fsdp
def test_a_meta_device_model_is_materialised_shard_by_shard() -> None:
    import gpukit

    session = gpukit.Session(strategy="fsdp", accelerator="cpu", seed=0, verbose=False)  # world of 1
    try:
        with torch.device("meta"):
            model = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2,
                                          enable_nested_tensor=False)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = session.setup(model, optimizer)
        params = list(model.parameters())
        assert all(p.device.type == "cpu" and p.to_local().abs().sum() > 0 for p in params if p.dim() == 2)
        assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in params}
        session.backward(model(torch.randn(2, 3, 8)).pow(2).mean())
        assert session.step(optimizer)

        class NoInit(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(2))

        with torch.device("meta"), pytest.raises(ConfigurationError, match="no reset_parameters"):
            session.setup(NoInit())
    finally:
        session.close()


@pytest.mark.requires_cpu_fsdp
def test_cpu_offload_and_bf16_mixed_gather_in_bf16_keep_fp32_shards() -> None:
    import gpukit

    strategy = FSDPStrategy(cpu_offload=True, auto_wrap={nn.Linear})
    session = gpukit.Session(strategy=strategy, accelerator="cpu", precision="bf16-mixed",
                             accumulate_grad_batches=2, verbose=False)
    try:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model, optimizer = session.setup(model, torch.optim.Adam(model.parameters()))
        assert session.strategy.units == ["2", "0"] and session.strategy.cpu_offload
        seen: list[torch.dtype] = []
        model[0].register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        stepped = []
        for _ in range(2):
            with session.accumulate(model), session.autocast():
                session.backward(model(torch.ones(3, 4)).float().pow(2).sum())
            stepped.append(session.step(optimizer, clip_grad_norm=0.1))
        assert stepped == [False, True] and set(seen) == {torch.bfloat16}  # gathered for compute in bf16
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the shards the optimizer steps
    finally:
        session.close()


@pytest.mark.requires_cpu_fsdp
def test_banner_names_the_real_unit_count(capsys: pytest.CaptureFixture[str]) -> None:
    import gpukit

    session = gpukit.Session(strategy=FSDPStrategy(auto_wrap={nn.Linear}), accelerator="cpu", verbose=True)
    try:
        assert "units chosen at setup" in capsys.readouterr().err  # before setup: no count yet
        session.setup(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
        err = capsys.readouterr().err
        assert session.strategy.units == ["2", "0"] and "3 unit(s)" in err and "1 unit(s)" not in err
    finally:
        session.close()


@pytest.mark.requires_cpu_fsdp
def test_bf16_mixed_batchnorm_is_a_unit_gathered_in_fp32() -> None:
    """batch_norm refuses bf16 weights beside its fp32 running statistics (which FSDP does not
    cast): under bf16-mixed a BatchNorm is a unit of its own, gathered in fp32 as autocast runs it."""
    import gpukit

    session = gpukit.Session(strategy="fsdp", accelerator="cpu", precision="bf16-mixed", verbose=False)
    try:
        block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), block, copy.deepcopy(block), nn.Flatten(), nn.Linear(4 * 36, 2))
        model, optimizer = session.setup(model, torch.optim.Adam(model.parameters()))
        assert {"1.1", "2.1"} <= set(session.strategy.units)  # the BatchNorms, inside the block units
        seen: dict[str, torch.dtype] = {}
        model[1][1].register_forward_pre_hook(lambda m, args: seen.update(bn=m.weight.dtype, x=args[0].dtype))
        model[1][0].register_forward_pre_hook(lambda m, args: seen.update(conv=m.weight.dtype))
        for _ in range(2):
            with session.autocast():
                out = model(torch.randn(2, 3, 6, 6))
            session.backward(out.float().pow(2).mean())
            session.step(optimizer)
        assert seen == {"conv": torch.bfloat16, "bn": torch.float32, "x": torch.bfloat16}
        assert model[1][1].running_mean.dtype == torch.float32 and model[1][1].num_batches_tracked.item() == 2
    finally:
        session.close()


@pytest.mark.requires_cpu_fsdp
def test_bf16_mixed_output_is_fp32_so_a_loss_outside_autocast_works() -> None:
    """FSDP computes in bf16 under bf16-mixed; the root's output comes back in fp32, as a loss under
    autocast is computed: ``mse_loss(model(x), y)`` with an fp32 target must backward (on an H100
    with nccl it raised "Found dtype Float but expected BFloat16")."""
    import gpukit

    session = gpukit.Session(strategy="fsdp", accelerator="cpu", precision="bf16-mixed", verbose=False)
    try:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        inner: list[torch.dtype] = []
        model[0].register_forward_hook(lambda m, args, out: inner.append(out.dtype))
        out = model(torch.randn(5, 8))
        assert out.dtype == torch.float32 and inner == [torch.bfloat16]  # computed in bf16, returned in fp32
        session.backward(nn.functional.mse_loss(out, torch.randn(5, 4)))
        assert session.step(optimizer)
    finally:
        session.close()


def test_fsdp_on_the_cpu_with_an_older_torch_is_refused_with_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.5's FSDP2 raised "FSDP requires CUDA for streams" at the first forward on CPU processes:
    gpukit says so at setup, with what to do (seen with torch 2.5.1; the suite's floor run)."""
    import gpukit
    from gpukit.strategies import _fsdp_api

    monkeypatch.setattr(_fsdp_api, "_torch_version", lambda: (2, 5))
    session = gpukit.Session(strategy="fsdp", accelerator="cpu", verbose=False)
    try:
        model = nn.Linear(4, 4)
        with pytest.raises(ConfigurationError, match=r"strategy='fsdp' on CPU processes needs torch >= 2\.7.*"
                                                     r"Use strategy='ddp' on the CPU, run FSDP on GPUs"):
            session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        session.close()


@pytest.mark.requires_cpu_fsdp
@pytest.mark.parametrize("torch_2_5", [False, True], ids=["get_total_norm", "torch-2.5-clip_grad_norm_"])
def test_clipping_uses_the_whole_gradient_norm(monkeypatch: pytest.MonkeyPatch, torch_2_5: bool) -> None:
    """session.step(clip_grad_norm=) under FSDP returns the norm of the whole gradient and scales the shards; torch
    2.5 has no torch.nn.utils.get_total_norm / clip_grads_with_norm_ (torch 2.6 split clip_grad_norm_ into them)."""
    import gpukit

    if torch_2_5:
        monkeypatch.delattr(torch.nn.utils, "get_total_norm")
        monkeypatch.delattr(torch.nn.utils, "clip_grads_with_norm_")
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    reference(x).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    session = gpukit.Session(strategy="fsdp", accelerator="cpu", verbose=False)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
        model(x).pow(2).sum().backward()
        total = session.strategy.clip_gradients(optimizer, 0.1)
        assert type(total) is torch.Tensor
        torch.testing.assert_close(total, expected)
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(ours.grad.full_tensor(), theirs.grad)
    finally:
        session.close()
