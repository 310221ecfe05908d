"""A tensor record shorter than its tensor: refused before torch.load fills the gap with garbage.

torch 2.5's ``torch.load`` reads a storage whose zip record holds fewer bytes than the pickle says
without a word: the tensor comes back with uninitialised memory (a 64x64 tensor of ones, its record
cut to 100 bytes, summed to ``nan``). Newer torch refuses it ("record size ... does not match
expected size"). Where the installed torch does not (asked once per process, on a file made in
memory), the sizes are compared here first: the pickle is read by torch's own weights-only
unpickler with storages placed on the meta device (nothing is allocated, no code can run), and each
storage's byte count is set against the size of its zip record.
"""

from __future__ import annotations

import functools
import io
import zipfile
from pathlib import Path
from typing import Any

import torch

from gpukit.errors import CheckpointError

__all__ = ["check_record_sizes", "torch_checks_record_sizes"]


@functools.lru_cache(maxsize=1)
def torch_checks_record_sizes() -> bool:
    """Whether this torch's ``torch.load`` refuses a tensor record shorter than its tensor."""
    saved = io.BytesIO()
    torch.save(torch.ones(16), saved)
    short = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(saved.getvalue())) as src, zipfile.ZipFile(short, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info.filename)
            out.writestr(info, data[:4] if "/data/" in info.filename else data)
    try:
        torch.load(io.BytesIO(short.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal will do
        return True
    return False


def _needed_bytes(data_pkl: bytes) -> dict[str, int]:
    """Storage key -> bytes, as the pickle describes each storage (nothing is allocated)."""
    from torch import _weights_only_unpickler

    needed: dict[str, int] = {}

    def persistent_load(saved_id: Any) -> Any:
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] == "storage"):
            raise CheckpointError(f"an unexpected persistent id {str(saved_id)[:80]!r}")
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = int(numel) * dtype.itemsize
        needed[str(key)] = max(needed.get(str(key), 0), nbytes)
        return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(nbytes, device="meta"), dtype=dtype,
                                          _internal=True)

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data_pkl), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[attr-defined]
    unpickler.load()
    return needed


def check_record_sizes(path: Path) -> None:
    """Refuse a torch zip file whose tensor records hold fewer bytes than its tensors need.

    Does nothing where the installed torch checks this itself, or when the pickle cannot be read
    this way (torch.load then reports what is wrong with it, as before).

    Raises:
        CheckpointError: a record is shorter than its tensor; the message names the file and record.
    """
    if torch_checks_record_sizes():
        return
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            return
        prefix = pickles[0][: -len("data.pkl")]
        try:
            needed = _needed_bytes(archive.read(pickles[0]))
        except Exception:  # noqa: BLE001 - torch.load will say what is wrong with this pickle
            return
        sizes = {info.filename: info.file_size for info in archive.infolist()}
    for key, nbytes in needed.items():
        record = f"{prefix}data/{key}"
        if sizes.get(record, -1) < nbytes:
            held = sizes.get(record)
            raise CheckpointError(
                f"{path} is corrupted: its tensor record {record!r} holds "
                f"{'nothing' if held is None else f'{held:,} bytes'} where the tensor needs {nbytes:,}. "
                "Use an older checkpoint or copy the file again."
            )
