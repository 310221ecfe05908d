"""Recognising checkpoint files and the small metadata record gpukit adds to them.

Formats are told apart by their first bytes, not their names: a torch zip archive starts
with ``PK``, a legacy torch file or raw pickle with the pickle protocol byte ``0x80``, and a
safetensors file with an 8-byte header length followed by ``{``.
"""

from __future__ import annotations

import datetime
import io
import json
import math
import os
import pickletools
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

from gpukit._util.version import __version__
from gpukit.checkpoint._untrusted import regular_file_size
from gpukit.errors import CheckpointError, ConfigurationError

__all__ = [
    "FORMATS",
    "TORCH_ZIP",
    "TORCH_LEGACY",
    "SAFETENSORS",
    "sniff_format",
    "format_for_save",
    "check_format",
    "metadata_entry",
    "safetensors_metadata",
    "append_zip_metadata",
    "read_metadata",
    "check_readable_file",
    "read_safetensors_header",
    "header_metadata",
    "MAX_SAFETENSORS_TENSORS",
    "pickled_globals",
    "SAFETENSORS_DTYPES",
    "MARKER_NAME",
]

FORMATS = ("torch", "safetensors")
TORCH_ZIP = "torch-zip"
TORCH_LEGACY = "torch-legacy"
SAFETENSORS = "safetensors"
_META_RECORD = ".gpukit/meta.json"
#: the safetensors library refuses larger headers too
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
#: tensors gpukit reads from one safetensors file (models with more are saved in shards)
MAX_SAFETENSORS_TENSORS = 200_000
#: file that marks a CheckpointManager step directory as complete; written last
MARKER_NAME = "complete.json"
_ZIP_MAGIC = b"PK\x03\x04"
#: safetensors dtype codes -> (torch dtype name, bytes per element)
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8), "C64": ("complex64", 8),
}


def metadata_entry() -> dict[str, str]:
    """What gpukit records about a save: its own and torch's version, and when."""
    return {
        "gpukit_version": __version__,
        "torch_version": torch.__version__,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def safetensors_metadata(**extra: str) -> dict[str, str]:
    """The ``__metadata__`` of every safetensors file gpukit writes.

    ``{"format": "pt"}`` is what transformers 4.x requires before it loads a file ("File
    metadata is not ['pt', 'tf', 'flax', 'mlx'] but None"); gpukit's own record follows it.
    """
    return {"format": "pt", **extra, **metadata_entry()}


def check_format(format: str | None) -> None:
    """Refuse a ``format=`` that is none of :data:`FORMATS` (``None``: decided later, by suffix or bytes).

    Raises:
        ConfigurationError: an unknown format.
    """
    if format is not None and format not in FORMATS:
        raise ConfigurationError(f"Unknown checkpoint format {format!r}; use one of {', '.join(map(repr, FORMATS))}.")


def format_for_save(path: Path, format: str | None) -> str:
    """``"torch"`` or ``"safetensors"``, from ``format`` or else the file extension (the one suffix rule)."""
    check_format(format)
    if format is None:
        return "safetensors" if path.suffix == ".safetensors" else "torch"
    return format


def check_readable_file(path: Path) -> int:
    """Size of ``path``, or a CheckpointError saying why it cannot be a checkpoint file.

    Only regular files pass (see ``_untrusted``): a FIFO, a device, a symlink loop or a dangling
    symlink is refused before anything opens it for reading.
    """
    if path.is_dir():
        if (path / MARKER_NAME).exists():
            raise CheckpointError(
                f"{path} is a gpukit checkpoint directory, not a file. Resume it with "
                f"CheckpointManager({str(path.parent)!r}).resume(...), or load {path / 'state.pt'}."
            )
        raise CheckpointError(f"{path} is a directory, not a checkpoint file. Give the path of the file.")
    if path.suffix == ".distcp" or path.name == ".metadata":
        raise CheckpointError(
            f"{path} is one file of a sharded checkpoint (torch.distributed.checkpoint), not a checkpoint by "
            f"itself. Give its step directory instead: gpukit ckpt inspect {path.parent} (or convert it, or "
            "resume it with CheckpointManager)."
        )
    if not os.path.lexists(path):
        raise CheckpointError(f"No checkpoint at {path}: the file does not exist.")
    size = regular_file_size(path)
    try:
        with open(path, "rb"):
            pass
    except PermissionError as exc:
        raise CheckpointError(
            f"Permission denied reading {path} ({exc.strerror}). Check the file's owner and mode."
        ) from None
    except OSError as exc:
        raise CheckpointError(f"Cannot read {path}: {exc.strerror or exc}.") from None
    if size == 0:
        raise CheckpointError(
            f"{path} is empty (0 bytes): not a checkpoint. A write was probably interrupted by a tool "
            "that does not write atomically; use an older checkpoint."
        )
    return size


def sniff_format(path: Path, size: int) -> str:
    """The format of a readable, non-empty file, or CheckpointError if it is none we read."""
    with open(path, "rb") as handle:
        head = handle.read(16)
    if head.startswith(_ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path) as archive:
                if not any(name.endswith("data.pkl") for name in archive.namelist()):
                    raise CheckpointError(f"{path} is a zip archive but not a PyTorch checkpoint (no data.pkl).")
        except (zipfile.BadZipFile, OSError, EOFError):
            raise CheckpointError(
                f"{path} is truncated or corrupted: it starts like a PyTorch checkpoint but its zip "
                f"directory is missing or damaged ({size} bytes). The write was probably interrupted "
                "or the copy is incomplete; use an older checkpoint or copy it again."
            ) from None
        return TORCH_ZIP
    # safetensors before pickle: its 8-byte header length may well start with byte 0x80,
    # pickle's PROTO opcode, while a pickle never has "{" at offset 8.
    if len(head) > 8 and head[8:9] == b"{":
        header_bytes = int.from_bytes(head[:8], "little")
        if header_bytes + 8 <= size:
            return SAFETENSORS
        raise CheckpointError(
            f"{path} is a truncated safetensors file: its header claims {header_bytes} bytes but the "
            f"file has {size}."
        )
    if head[:1] == b"\x80":
        return TORCH_LEGACY
    raise CheckpointError(
        f"{path} is not a checkpoint gpukit can read: it is neither a torch.save file (zip or legacy "
        f"pickle) nor safetensors (first bytes: {head[:8].hex(' ')}). Check the path."
    )


def append_zip_metadata(handle: BinaryIO, metadata: dict[str, Any]) -> None:
    """Add gpukit's metadata record to the torch zip archive written into ``handle``.

    torch.load ignores records it does not know, so files stay loadable by plain torch.
    """
    handle.flush()
    handle.seek(0)
    with zipfile.ZipFile(handle, "a") as archive:  # type: ignore[arg-type]
        root = archive.namelist()[0].split("/", 1)[0]
        archive.writestr(f"{root}/{_META_RECORD}", json.dumps(metadata, sort_keys=True))


def header_metadata(header: dict[str, Any]) -> dict[str, str] | None:
    """gpukit's metadata from a parsed safetensors header (``None``: not saved by gpukit)."""
    meta = header.get("__metadata__") or {}
    if isinstance(meta, dict) and "gpukit_version" in meta:
        return {k: v for k, v in meta.items() if k in ("gpukit_version", "torch_version", "saved_at")}
    return None


def read_metadata(path: Path, format: str) -> dict[str, str] | None:
    """gpukit's metadata of a file it saved; ``None`` for files saved by something else."""
    try:
        if format == TORCH_ZIP:
            with zipfile.ZipFile(path) as archive:
                for name in archive.namelist():
                    if name.endswith("/" + _META_RECORD):
                        return dict(json.loads(archive.read(name)))
        elif format == SAFETENSORS:
            return header_metadata(read_safetensors_header(path, os.stat(path).st_size))
    except (OSError, ValueError, zipfile.BadZipFile, CheckpointError):
        return None
    return None


def read_safetensors_header(path: Path, size: int) -> dict[str, Any]:
    """The header of a safetensors file, checked against the file before any tensor is read.

    Every tensor's dtype, shape and byte range must agree with each other and lie inside the
    file, so a damaged or hostile header (absurd shapes, offsets past the end) is refused here
    instead of making a reader allocate what the header claims.

    Returns:
        ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`` as stored.

    Raises:
        CheckpointError: the header is truncated, not JSON, or describes data the file lacks.
    """
    def damaged(why: str) -> CheckpointError:
        return CheckpointError(f"{path} is a damaged safetensors file: {why}. Use an older copy or "
                               "export it again.")

    with open(path, "rb") as handle:
        header_bytes = int.from_bytes(handle.read(8), "little")
        if size < 8 or header_bytes + 8 > size:
            raise damaged(f"its header claims {header_bytes} bytes but the file has {size}")
        if header_bytes > MAX_SAFETENSORS_HEADER_BYTES:  # the safetensors library's own limit
            raise damaged(f"its header claims {header_bytes:,} bytes, more than the "
                          f"{MAX_SAFETENSORS_HEADER_BYTES:,} safetensors allows")
        raw = handle.read(header_bytes)
    # Counted before parsing, so a header of a million tiny tensors costs a scan, not minutes.
    entries = raw.count(b'"data_offsets"')
    if entries > MAX_SAFETENSORS_TENSORS:
        raise damaged(f"its header lists {entries:,} tensors, more than the {MAX_SAFETENSORS_TENSORS:,} gpukit "
                      "reads from one file (split it into shards)")
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise damaged("its header is nested too deeply to be a safetensors header") from None
    except _Duplicate as exc:
        raise damaged(f"its header names {str(exc)!r} twice (which one is meant cannot be told)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise damaged(f"its header is not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(header, dict):
        raise damaged(f"its header is a JSON {type(header).__name__}, not an object")
    data_bytes = size - 8 - header_bytes
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (*shape, begin, end)):
                raise TypeError
        except (TypeError, KeyError, ValueError):
            raise damaged(f"tensor {name!r} has no valid dtype, shape and data_offsets ({str(entry)[:80]})") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise damaged(f"tensor {name!r} has unknown dtype {dtype!r}")
        declared = math.prod(shape) * SAFETENSORS_DTYPES[dtype][1]
        if not begin <= end <= data_bytes or end - begin != declared:
            raise damaged(f"tensor {name!r} ({dtype} {shape}) declares {declared:,} bytes at offsets "
                          f"{begin}..{end}, but the file holds {data_bytes:,} bytes of tensor data")
        ranges.append((begin, end, name))
    _check_tiling(sorted(ranges), data_bytes, damaged)
    return header


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (``json`` would silently keep the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key[:200])
            seen.add(key)
    return out


def _check_tiling(ranges: list[tuple[int, int, str]], data_bytes: int, damaged: Any) -> None:
    """Tensor byte ranges must follow each other without overlap or gap, as safetensors requires."""
    position, previous = 0, None
    for begin, end, name in ranges:
        if begin < position:
            raise damaged(f"tensors {previous!r} and {name!r} overlap (bytes {begin}..{position} belong to both)")
        if begin > position:
            raise damaged(f"bytes {position}..{begin} of the tensor data belong to no tensor (before {name!r})")
        position, previous = end, name
    if position != data_bytes:
        raise damaged(f"the tensors cover {position:,} of the {data_bytes:,} bytes of tensor data")


def pickled_globals(path: Path, fmt: str) -> list[str]:
    """Python globals a pickle would import beyond what ``weights_only`` admits, found by reading
    opcodes (nothing is executed); ``fmt`` is TORCH_ZIP or TORCH_LEGACY."""
    if fmt == TORCH_ZIP:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            streams = [io.BytesIO(archive.read(name))]
    else:
        with open(path, "rb") as handle:  # a regular file (checked before): bounded read
            streams = [io.BytesIO(handle.read(64 * 1024 * 1024))]
    found: list[str] = []
    strings: list[str] = []
    for stream in streams:
        for _ in range(5):  # legacy torch files are several pickles in a row
            try:
                for opcode, arg, _pos in pickletools.genops(stream):
                    if isinstance(arg, str):
                        strings.append(arg)
                    if opcode.name == "GLOBAL":
                        found.append(str(arg).replace(" ", "."))
                    elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                        found.append(f"{strings[-2]}.{strings[-1]}")
            except Exception:  # end of data or not a pickle: stop scanning this stream
                break
    names = {g.replace("__builtin__.", "builtins.", 1) for g in found}
    return sorted(names - _weights_only_allowed())


def _weights_only_allowed() -> set[str]:
    """Globals torch's weights-only loader accepts (to list only the others)."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        return set(_get_allowed_globals())
    except (ImportError, AttributeError):  # private torch API: without it, list everything
        return set()
