"""``gpukit ckpt inspect`` and ``gpukit ckpt convert``."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit
from gpukit.checkpoint import CheckpointManager
from cli_helpers import run_gpukit as _gpukit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint"))
from ckpt_helpers import SmallNet, save_with_cuda_location  # noqa: E402


def test_inspect_foreign_ddp_state_dict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ddp.pt"
    torch.save({"module." + k: v for k, v in SmallNet().state_dict().items()}, path)  # plain torch
    code, out, _ = _gpukit(capsys, "ckpt", "inspect", str(path))
    assert code == 0
    assert "format:         torch-zip" in out and "saved by torch: unknown" in out
    assert "'module.' (DataParallel/DistributedDataParallel) on 9 of 9 keys" in out
    assert "module.fc1.weight  [8, 4]  float32  cpu" in out
    code, out, _ = _gpukit(capsys, "ckpt", "inspect", str(path), "--json")
    info = json.loads(out)
    assert code == 0 and info["tensors"]["count"] == 9 and info["torch_version"] == "unknown"
    assert info["size_bytes"] == path.stat().st_size


def test_inspect_training_state_and_large_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(50)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    gpukit.save({"model": model, "optimizer": opt, "epoch": 3}, tmp_path / "train.pt")
    code, out, _ = _gpukit(capsys, "ckpt", "inspect", str(tmp_path / "train.pt"))
    assert code == 0 and f"saved by torch: {torch.__version__} (gpukit" in out
    assert "model: state dict: 100 tensors" in out
    assert "optimizer: 1 param group(s), state for 100 param(s) (exp_avg, exp_avg_sq, step)" in out
    assert "epoch: 3" in out
    assert "model.{0..49}.weight x50  [8, 8]  float32  cpu" in out  # summarised, not 300 lines
    assert len(out.splitlines()) < 40


def test_inspect_gpu_checkpoint_reports_saved_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_with_cuda_location({"w": torch.ones(3)}, tmp_path / "gpu.pt")
    code, out, _ = _gpukit(capsys, "ckpt", "inspect", str(tmp_path / "gpu.pt"), "--json")
    assert code == 0 and json.loads(out)["tensors"]["devices"] == {"cuda:0": 1}


def test_inspect_checkpoint_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    class Loader:
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(())

        def state_dict(self) -> dict[str, int]:
            return {"epoch": 2, "batches_consumed": 5}

    model = SmallNet()
    CheckpointManager(tmp_path).save(40, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1),
                                     loader=Loader(), extra={"best": 0.5})
    code, out, _ = _gpukit(capsys, "ckpt", "inspect", str(tmp_path))  # the run dir: shows latest
    assert code == 0 and "gpukit-checkpoint-directory" in out
    assert "step:           40 (world size 1)" in out and "'best': 0.5" in out
    assert "loader (per rank): data position: epoch 2, 5 batch(es) consumed" in out
    assert "rng (per rank): RNG states: python, torch, numpy" in out


def test_inspect_malicious_pickle_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (exec, (f"open({str(marker)!r}, 'w')",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(Evil(), protocol=2))
    for name in ("evil.pt", "evil.pkl"):
        code, out, _ = _gpukit(capsys, "ckpt", "inspect", str(tmp_path / name))
        assert code == 0 and "NOT LOADED" in out and "pickled globals: builtins.exec" in out, out
    assert not marker.exists()


@pytest.mark.parametrize(("content", "message"), [
    (b"", "is empty"), (b"\x00junk" * 50, "not a checkpoint gpukit can read"), (None, "does not exist"),
])
def test_inspect_bad_input_exits_nonzero(tmp_path: Path, capsys, content: bytes | None, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.pt"
    if content is not None:
        path.write_bytes(content)
    code, _, err = _gpukit(capsys, "ckpt", "inspect", str(path))
    assert code == 2 and err.startswith("gpukit: error:") and message in err


def test_convert_strip_prefix_dtype_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    net = SmallNet()
    torch.save({"model": {"module._orig_mod." + k: v for k, v in net.state_dict().items()}, "step": 1},
               tmp_path / "in.pt")
    code, _, err = _gpukit(capsys, "ckpt", "convert", str(tmp_path / "in.pt"), str(tmp_path / "w.safetensors"))
    assert code == 2 and "--select KEY" in err and not (tmp_path / "w.safetensors").exists()
    code, out, _ = _gpukit(capsys, "ckpt", "convert", str(tmp_path / "in.pt"), str(tmp_path / "w.safetensors"),
                           "--select", "model", "--strip-prefix", "--dtype", "bf16")
    assert code == 0 and "safetensors, 9 tensors" in out
    weights = gpukit.load(tmp_path / "w.safetensors")
    assert set(weights) == set(net.state_dict())
    assert weights["fc1.weight"].dtype == torch.bfloat16 and weights["bn.num_batches_tracked"].dtype == torch.int64
    gpukit.load_state_dict(SmallNet(), {k: v.float() if v.is_floating_point() else v for k, v in weights.items()})


def test_convert_gpu_checkpoint_to_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_with_cuda_location({"w": torch.arange(4.0)}, tmp_path / "gpu.pt")
    code, _, _ = _gpukit(capsys, "ckpt", "convert", str(tmp_path / "gpu.pt"), str(tmp_path / "cpu.pt"), "--to-cpu")
    assert code == 0
    assert torch.equal(torch.load(tmp_path / "cpu.pt", weights_only=True)["w"], torch.arange(4.0))  # plain torch


def test_convert_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpukit.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    code, _, err = _gpukit(capsys, "ckpt", "convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--dtype", "int3")
    assert code == 2 and "int3" in err
    code, _, err = _gpukit(capsys, "ckpt", "convert", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--select", "x")
    assert code == 2 and "no key 'x'" in err and "available: w" in err


def test_convert_never_replaces_a_device_or_fifo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import stat

    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    fifo = tmp_path / "out.pt"
    os.mkfifo(fifo)
    targets = [fifo] + ([Path("/dev/null")] if os.geteuid() == 0 else [])  # as root the rename would succeed
    for target in targets:
        before = os.stat(target)
        code, out, err = _gpukit(capsys, "ckpt", "convert", str(good), str(target))
        assert code == 2 and f"Refused to write {target}" in err and out == ""
        after = os.stat(target)
        assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))


def test_inspect_escapes_tensor_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "names.pt"
    torch.save({"evil\x1b]0;owned\x07\x1b[2J": torch.ones(1)}, path)
    code, out, _ = _gpukit(capsys, "ckpt", "inspect", str(path))
    assert code == 0 and "\x1b" not in out and "evil\\x1b]0;owned\\x07\\x1b[2J" in out
