"""A tensor record shorter than its tensor is refused on every torch, not read as garbage (torch 2.5 did)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

import gpukit
from gpukit.checkpoint import _record_sizes
from gpukit.errors import CheckpointError


def _save_and_cut(tmp_path: Path, keep: int | None) -> Path:
    """A gpukit checkpoint of two tensors whose larger record keeps only ``keep`` bytes (None: intact)."""
    good = gpukit.save({"w": torch.ones(64, 64), "b": torch.arange(8, dtype=torch.int64)}, tmp_path / "good.pt")
    if keep is None:
        return good
    cut = tmp_path / "cut.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(cut, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info.filename)
            out.writestr(info, data[:keep] if "/data/" in info.filename and len(data) > 1000 else data)
    return cut


@pytest.fixture
def checking_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run gpukit's own comparison whatever this torch does (torch 2.5 does not compare)."""
    monkeypatch.setattr(_record_sizes, "torch_checks_record_sizes", lambda: False)


def test_a_short_record_is_refused_naming_file_and_record(tmp_path: Path, checking_here: None) -> None:
    cut = _save_and_cut(tmp_path, keep=100)
    with pytest.raises(CheckpointError, match=r"cut.pt is corrupted: its tensor record '.*data/\d+' holds 100 bytes "
                                              r"where the tensor needs 16,384"):
        gpukit.load(cut)


def test_intact_files_pass_and_load_equal(tmp_path: Path, checking_here: None) -> None:
    state = gpukit.load(_save_and_cut(tmp_path, keep=None))
    assert torch.equal(state["w"], torch.ones(64, 64)) and torch.equal(state["b"], torch.arange(8))
    _record_sizes.check_record_sizes(tmp_path / "good.pt")  # no error


def test_this_torch_is_asked_once_and_answers_a_bool() -> None:
    _record_sizes.torch_checks_record_sizes.cache_clear()
    answer = _record_sizes.torch_checks_record_sizes()
    assert isinstance(answer, bool) and _record_sizes.torch_checks_record_sizes.cache_info().hits == 0
    assert _record_sizes.torch_checks_record_sizes() is answer


def test_whatever_this_torch_does_the_short_record_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cut.pt is (truncated or )?corrupted"):
        gpukit.load(_save_and_cut(tmp_path, keep=100))
