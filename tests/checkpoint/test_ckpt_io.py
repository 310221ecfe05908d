"""gpukit.save / gpukit.load: round trips, unwrapped models, devices, safetensors, bad files."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gpukit
from gpukit.checkpoint._formats import read_metadata
from gpukit.errors import CheckpointError, ConfigurationError, UnsafeCheckpointError


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_nested_state_with_metadata(tmp_path: Path, small_net: nn.Module) -> None:
    opt = torch.optim.Adam(small_net.parameters())
    small_net(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"model": small_net, "optimizer": opt.state_dict(), "step": 7, "tags": ["a", 1.5]}
    path = gpukit.save(state, tmp_path / "ckpt.pt")
    loaded = gpukit.load(path)
    assert _same(loaded["model"], small_net.state_dict())
    assert loaded["step"] == 7 and loaded["tags"] == ["a", 1.5]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    meta = read_metadata(path, "torch-zip")
    assert meta is not None and meta["torch_version"] == torch.__version__
    # still a plain torch file: torch.load reads it and ignores gpukit's metadata record
    assert _same(torch.load(path, weights_only=True)["model"], small_net.state_dict())
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temp file left behind


def test_wrapped_models_are_saved_without_prefixes(tmp_path: Path, small_net: nn.Module) -> None:
    plain = small_net.state_dict()
    for name, wrapped in {
        "dp": nn.DataParallel(small_net),
        "compiled": torch.compile(small_net),  # OptimizedModule; compiles only when called
        "compiled_dp": torch.compile(nn.DataParallel(small_net)),
    }.items():
        assert any(k.startswith(("module.", "_orig_mod.")) for k in wrapped.state_dict())
        gpukit.save(wrapped, tmp_path / f"{name}.pt")
        assert _same(gpukit.load(tmp_path / f"{name}.pt"), plain), name


def test_ddp_model_saved_unwrapped_with_one_process_gloo_group(tmp_path: Path, small_net: nn.Module) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(small_net)
        assert all(k.startswith("module.") for k in ddp.state_dict())
        gpukit.save({"model": ddp}, tmp_path / "ddp.pt")  # rank 0 of 1 writes
        loaded = gpukit.load(tmp_path / "ddp.pt")["model"]
        assert _same(loaded, small_net.state_dict())
        fresh = nn.parallel.DistributedDataParallel(type(small_net)())
        gpukit.load_state_dict(fresh, loaded)
        assert _same(fresh.module.state_dict(), small_net.state_dict())
    finally:
        dist.destroy_process_group()


def test_gpu_checkpoint_loads_on_cpu_only_machine(tmp_path: Path, save_as_cuda) -> None:
    path = tmp_path / "gpu.pt"
    save_as_cuda({"w": torch.arange(6.0)}, path)
    assert b"cuda:0" in zipfile.ZipFile(path).read("gpu/data.pkl")
    if not torch.cuda.is_available():  # the trap itself: plain torch.load fails here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)
    loaded = gpukit.load(path)  # map_location="auto"
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert loaded["w"].device.type == expected_device
    assert torch.equal(loaded["w"].cpu(), torch.arange(6.0))


def test_explicit_map_location_to_missing_device_is_clear(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    gpukit.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match="map_location"):
        gpukit.load(tmp_path / "a.pt", map_location="cuda:0")


def test_safetensors_round_trip_and_tied_weights(tmp_path: Path, small_net: nn.Module) -> None:
    path = gpukit.save(nn.DataParallel(small_net), tmp_path / "w.safetensors")
    with open(path, "rb") as handle:
        assert handle.read(1) != b"P"  # not a zip: really safetensors
    assert _same(dict(sorted(gpukit.load(path).items())), dict(sorted(small_net.state_dict().items())))
    assert read_metadata(path, "safetensors")["torch_version"] == torch.__version__
    shared = torch.randn(3, 3)
    gpukit.save({"emb": shared, "head": shared, "view": shared[1]}, tmp_path / "tied.st", format="safetensors")
    loaded = gpukit.load(tmp_path / "tied.st")  # detected by content, not extension
    assert torch.equal(loaded["emb"], shared) and torch.equal(loaded["head"], shared)
    assert torch.equal(loaded["view"], shared[1])


def test_safetensors_refuses_training_state_clearly(tmp_path: Path, small_net: nn.Module) -> None:
    with pytest.raises(ConfigurationError, match="flat mapping.*step"):
        gpukit.save({"model": small_net.state_dict(), "step": 3}, tmp_path / "x.safetensors")
    with pytest.raises(ConfigurationError, match="format"):
        gpukit.save({}, tmp_path / "x.pt", format="onnx")
    assert not list(tmp_path.iterdir())


def test_save_replaces_atomically_and_keeps_old_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    gpukit.save({"v": torch.tensor(1)}, path)
    with pytest.raises(CheckpointError, match="Could not write"):
        gpukit.save({"v": (x for x in range(3))}, path)  # a generator cannot be pickled
    assert gpukit.load(path)["v"].item() == 1
    gpukit.save({"v": torch.tensor(2)}, path)
    assert gpukit.load(path)["v"].item() == 2
    assert sorted(os.listdir(tmp_path)) == ["c.pt"]


# -- bad input: each a clear gpukit error, nothing executed, nothing overwritten -----------------


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.pt"
    gpukit.save({"w": torch.arange(1000.0)}, path)
    return path


def test_truncated_file(tmp_path: Path, good_file: Path) -> None:
    bad = tmp_path / "trunc.pt"
    bad.write_bytes(good_file.read_bytes()[: good_file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        gpukit.load(bad)


def test_random_bytes(tmp_path: Path) -> None:
    bad = tmp_path / "random.pt"
    bad.write_bytes(bytes(range(7, 256)) * 20)
    with pytest.raises(CheckpointError, match="not a checkpoint gpukit can read"):
        gpukit.load(bad)


def test_random_bytes_after_pickle_marker(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.pt"
    bad.write_bytes(b"\x80\x02" + bytes(range(256)) * 3)
    with pytest.raises(CheckpointError, match="corrupted: its pickled data cannot be read") as info:
        gpukit.load(bad)
    assert type(info.value) is CheckpointError
    assert "weights_only` set to `False`" not in str(info.value)  # no advice to disable safety


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty.pt").touch()
    with pytest.raises(CheckpointError, match="empty"):
        gpukit.load(tmp_path / "empty.pt")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        gpukit.load(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        gpukit.load(tmp_path)
    with pytest.raises(CheckpointError, match="is a directory"):
        gpukit.save({}, tmp_path)


def test_no_permission_to_read(tmp_path: Path, good_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        good_file.chmod(0)
    else:
        # root ignores file modes, so chmod cannot deny it: simulate EACCES at open() instead
        real_open = open

        def denying_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
            if Path(file) == good_file:
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr("builtins.open", denying_open)
    try:
        with pytest.raises(CheckpointError, match="Permission denied"):
            gpukit.load(good_file)
    finally:
        good_file.chmod(0o644)


class _CreatesFile:
    """Unpickling this runs ``open(target, 'w')``: a stand-in for any malicious payload."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, (f"open({str(self.target)!r}, 'w').write('pwned')",))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-pickle"])
def test_malicious_pickle_is_refused_and_not_executed(tmp_path: Path, legacy: bool) -> None:
    marker = tmp_path / "payload_ran"
    evil = tmp_path / "evil.pt"
    if legacy:
        evil.write_bytes(pickle.dumps({"weights": _CreatesFile(marker)}, protocol=2))
    else:
        torch.save({"weights": _CreatesFile(marker)}, evil)
    before = evil.read_bytes()
    with pytest.raises(UnsafeCheckpointError, match=r"(?s)exec.*trust=True") as info:
        gpukit.load(evil)
    assert "Nothing was executed" in str(info.value)
    assert not marker.exists()
    assert evil.read_bytes() == before
    # the payload is real: opting in runs it (this is what the default protects against)
    if legacy:  # a raw pickle is not a torch file: torch runs it while reading the "magic number"
        with pytest.raises(CheckpointError, match="corrupted"):
            gpukit.load(evil, trust=True)
    else:
        gpukit.load(evil, trust=True)
    assert marker.read_text() == "pwned"


def test_unsafe_message_names_the_global(tmp_path: Path) -> None:
    path = tmp_path / "obj.pt"
    torch.save({"fn": os.getcwd}, path)
    with pytest.raises(UnsafeCheckpointError, match="getcwd"):
        gpukit.load(path)


def test_auto_map_location_sends_gpu_tensors_to_this_ranks_gpu_under_ddp(monkeypatch) -> None:
    """Every rank loading a cuda:0 checkpoint must not land on cuda:0 (extra contexts, OOM)."""
    from gpukit.checkpoint import _read as _io  # auto_map_location lives with the readers
    from gpukit.checkpoint._dist import DistContext

    class TwoGpus(_io.get_accelerator("cuda").__class__):
        def is_available(self) -> bool:
            return True

        def device_count(self) -> int:
            return 2

        def current_device(self) -> torch.device:
            return torch.device("cpu")  # stands in for this rank's cuda:1 on a CPU-only machine

    monkeypatch.setattr(_io, "get_accelerator", lambda device: TwoGpus())
    storage = torch.UntypedStorage(8)
    monkeypatch.setattr(_io, "current_dist", lambda: DistContext(rank=0, world_size=1))
    assert _io.auto_map_location(storage, "cuda:0") is None  # one process: keep cuda:0
    assert _io.auto_map_location(storage, "cuda:5") is storage  # not here: CPU
    monkeypatch.setattr(_io, "current_dist", lambda: DistContext(rank=1, world_size=2))
    moved = _io.auto_map_location(storage, "cuda:0")
    assert moved is not None and moved.device == torch.device("cpu")  # the rank's current device


def test_safetensors_whose_header_length_starts_like_a_pickle_loads(tmp_path) -> None:
    """A safetensors header length with low byte 0x80 (pickle's PROTO opcode) is still safetensors."""
    path = tmp_path / "weights.safetensors"
    for width in range(1, 400):
        gpukit.save({"w" * width: torch.ones(2)}, path)
        if path.read_bytes()[0] == 0x80:
            break
    else:
        raise AssertionError("no key width gave a header length with low byte 0x80")
    loaded = gpukit.load(path)
    assert torch.equal(loaded["w" * width], torch.ones(2))
