"""gpukit.Session in one process: parity with a plain loop, bad input, single-process API."""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpukit
from gpukit.accelerators import CUDAAccelerator
from gpukit.errors import ConfigurationError, DeviceError, DistributedError
from gpukit.session import Session
from gpukit.strategies import SingleDeviceStrategy


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 1)
    )


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(48, 1, 8, 8, generator=g), torch.randn(48, 1, generator=g))


def train_plain(model: nn.Module, accumulate: int) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(DataLoader(make_data(), batch_size=8)):
        loss = F.mse_loss(model(x), y)
        if accumulate > 1:
            loss = loss / accumulate
        loss.backward()
        if (i + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model


def train_session(model: nn.Module, accumulate: int) -> nn.Module:
    session = Session(devices="cpu", precision="32-true", accumulate_grad_batches=accumulate,
                      verbose=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = session.setup(model, optimizer)
    for x, y in session.setup_dataloader(make_data(), batch_size=8, shuffle=False):
        with session.accumulate(model):
            with session.autocast():
                loss = F.mse_loss(model(x), y)
            session.backward(loss)
        session.step(optimizer)
    assert session.optimizer_steps == 6 // accumulate
    return model


@pytest.mark.parametrize("accumulate", [1, 3])
def test_bit_identical_to_a_plain_loop(accumulate: int) -> None:
    plain = train_plain(make_model(), accumulate)
    ours = train_session(make_model(), accumulate)
    assert not torch.equal(plain[0].weight, make_model()[0].weight)  # it trained
    for (name, a), b in zip(plain.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"devices": "gpu0"}, '"auto", "cpu", "cuda"'),
        ({"precision": "half"}, "'32-true', 'bf16-mixed'"),
        ({"strategy": "fsdp2"}, "'auto', 'single', 'dp', 'ddp'"),
        ({"accelerator": "tpu"}, "'auto', 'cpu', 'cuda', 'mps'"),
        ({"devices": 0}, "an int N"),
        ({"accumulate_grad_batches": 0}, "int >= 1"),
        ({"devices": "cpu", "strategy": "single", "accelerator": "cpu", "seed": "x"}, "int or None"),
    ],
)
def test_bad_settings_name_the_allowed_values(kwargs: dict, allowed: str) -> None:
    with pytest.raises(ConfigurationError, match=allowed.replace("(", r"\(")):
        Session(verbose=False, **kwargs)


def test_more_devices_than_available(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DeviceError, match="no GPU is visible.*accelerator='cpu', devices=4"):
        Session(devices=4, verbose=False)
    monkeypatch.setattr(CUDAAccelerator, "is_available", lambda self: True)
    monkeypatch.setattr(CUDAAccelerator, "device_count", lambda self: 2)
    with pytest.raises(DeviceError, match=r"needs cuda device\(s\) \[0, 1, 2\], but only 2 are visible"):
        Session(devices=3, accelerator="cuda", verbose=False)


@pytest.mark.parametrize("kwargs", [{"accelerator": "cpu", "devices": 2},
                                    {"accelerator": "cpu", "devices": 2, "strategy": "ddp"}])
def test_several_processes_without_a_launcher_explain_how_to_launch(kwargs: dict) -> None:
    session = Session(verbose=False, **kwargs)  # constructing is fine: launch() may follow
    assert session.world_size == 2 and not session.strategy.launched
    with pytest.raises(DistributedError) as info:
        session.setup(nn.Linear(2, 2))
    message = str(info.value)
    for how in ("session.launch(", "gpukit run --cpu --nproc 2 script.py", "torchrun --nproc-per-node 2"):
        assert how in message
    assert "--gpus" not in message  # on the CPU: no GPUs to ask for
    with pytest.raises(DistributedError):
        _ = session.device


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled")
def test_several_gpu_processes_without_a_launcher_suggest_gpukit_run_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(CUDAAccelerator, "is_available", lambda self: True)
    monkeypatch.setattr(CUDAAccelerator, "device_count", lambda self: 2)
    session = Session(accelerator="cuda", devices=2, strategy="ddp", verbose=False)
    with pytest.raises(DistributedError, match="gpukit run --gpus 2 script.py"):
        session.setup(nn.Linear(2, 2))


def test_16_mixed_with_a_plain_loss_backward_says_to_call_session_backward() -> None:
    session = Session(devices="cpu", precision="16-mixed", verbose=False)
    model = nn.Linear(3, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with session.autocast():
        loss = model(torch.ones(2, 3)).float().mean()
    loss.backward()  # the mistake: not session.backward(loss)
    with pytest.raises(ConfigurationError, match=r"Call session.backward\(loss\) instead of loss.backward\(\)"):
        session.step(optimizer)


def test_optimizer_of_another_model_is_refused() -> None:
    session = Session(devices="cpu", verbose=False)
    model, other = nn.Linear(3, 2), nn.Linear(3, 2)
    with pytest.raises(ConfigurationError, match=r"2 parameter tensor\(s\) that are not parameters"):
        session.setup(model, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ConfigurationError, match="torch.optim.Optimizer"):
        session.setup(model, "adam")  # type: ignore[arg-type]


def test_single_process_collectives_are_identity() -> None:
    session = Session(devices="cpu", verbose=False)
    x = torch.arange(3.0)
    assert torch.equal(session.all_reduce(x, op="sum"), x)
    assert session.all_reduce(2.5).item() == 2.5
    assert session.all_gather(x).shape == (1, 3)
    assert session.broadcast({"k": 1}) == {"k": 1}
    session.barrier()
    with pytest.raises(ConfigurationError, match="'mean', 'sum', 'max', 'min'"):
        session.all_reduce(x, op="avg")
    assert session.launch(lambda s, a: (s.rank, a), 7) == [(0, 7)]
    assert (session.rank, session.local_rank, session.world_size, session.is_main) == (0, 0, 1, True)


def test_state_dict_round_trip_restores_accumulation_position() -> None:
    session = Session(devices="cpu", accumulate_grad_batches=2, verbose=False)
    model = nn.Linear(2, 1)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    session.backward(model(torch.ones(1, 2)).sum())
    assert session.step(optimizer) is False  # first micro-batch of two
    restored = Session(devices="cpu", accumulate_grad_batches=2, verbose=False)
    restored.load_state_dict(session.state_dict())
    restored.backward(model(torch.ones(1, 2)).sum())
    assert restored.step(optimizer) is True and restored.optimizer_steps == 1


def test_print_and_progress_only_on_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    session = Session(devices="cpu", verbose=False)
    session.print("hello")
    assert list(session.progress(range(3))) == [0, 1, 2]

    class RankOne(SingleDeviceStrategy):
        rank = 1  # type: ignore[assignment]

    session.strategy = RankOne(session.accelerator, torch.device("cpu"))
    session.print("from rank 1")
    assert list(session.progress(range(2))) == [0, 1]
    out = capsys.readouterr().out
    assert "hello" in out and "from rank 1" not in out


def test_auto_choice_is_announced(capsys: pytest.CaptureFixture[str]) -> None:
    Session(devices="cpu")
    err = capsys.readouterr().err
    assert "strategy single on cpu, chosen automatically; precision 32-true, chosen automatically" in err
    assert "((" not in err and "))" not in err


def test_ddp_in_one_process_wraps_and_skips_sync_between_boundaries() -> None:
    session = Session(accelerator="cpu", strategy="ddp", accumulate_grad_batches=2,
                      sync_batchnorm=True, verbose=False)
    try:
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped, optimizer = session.setup(model, optimizer)
        assert isinstance(wrapped, nn.parallel.DistributedDataParallel)
        assert type(gpukit.unwrap_model(wrapped)[1]).__name__ == "HostSyncBatchNorm"
        owned = {id(p) for p in wrapped.parameters()}
        assert all(id(p) in owned for g in optimizer.param_groups for p in g["params"])
        with session.accumulate(wrapped):
            assert wrapped.require_backward_grad_sync is False
            session.backward(wrapped(torch.randn(4, 3)).sum())
        session.step(optimizer)
        with session.accumulate(wrapped):
            assert wrapped.require_backward_grad_sync is True
    finally:
        session.close()
    assert not torch.distributed.is_initialized()


def test_setup_moves_existing_optimizer_state() -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    session = Session(devices="cpu", verbose=False)
    model, optimizer = session.setup(model, optimizer)
    state = optimizer.state[model.weight]
    assert state["exp_avg"].device == model.weight.device
    optimizer.step()  # still a working optimizer


@pytest.mark.requires_gpus(2)
def test_dataparallel_on_a_main_gpu_other_than_zero() -> None:
    session = Session(devices=[1, 0], strategy="dp", precision="32-true", verbose=False)
    model = nn.Linear(4, 2)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert session.device == torch.device("cuda", 1)
    assert next(gpukit.unwrap_model(model).parameters()).device == torch.device("cuda", 1)
    out = model(session.to_device(torch.randn(8, 4)))  # no "device_ids[0]" error
    assert out.device == torch.device("cuda", 1)


@pytest.mark.requires_gpu
def test_dataparallel_keeps_bf16_autocast_in_replicas() -> None:
    if not CUDAAccelerator().supports_bf16():
        pytest.skip("GPU without native bf16")
    session = Session(devices=-1, strategy="dp", precision="bf16-mixed", verbose=False)
    model = nn.Linear(4, 2)
    seen: list[torch.dtype] = []  # read inside each replica (its hooks are copied with it)
    model.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    model = session.setup(model)
    with session.autocast():
        assert model(session.to_device(torch.randn(8, 4))).dtype == torch.float32  # outputs back in fp32
    assert model(session.to_device(torch.randn(8, 4))).dtype == torch.float32  # without session.autocast too
    assert seen and set(seen) == {torch.bfloat16}  # every replica computed in bf16, not fp16, both times


@pytest.mark.requires_gpu
def test_gpu_loader_pins_memory_and_delivers_on_device() -> None:
    session = Session(devices=1, verbose=False)
    loader = session.setup_dataloader(make_data(), batch_size=8)
    assert loader.pin_memory is True
    x, y = next(iter(loader))
    assert x.device == session.device and y.device == session.device
