"""Write torch's zip checkpoint format with the tensor bytes written outside the GIL, in parallel.

``torch.save`` writes every tensor with the interpreter lock held while it computes the record's
CRC-32 and copies the bytes (measured: a training loop beside a background ``torch.save`` of
512 MiB waited up to 0.16 s for the lock at a time). Here torch's own serializer
(``torch.serialization._save``) still decides what goes in the file -- the pickle, the records,
their names and order -- but hands the records to :class:`_Records` instead of a zip writer;
the archive is then laid out once (every offset known before a byte is written) and the data
written in chunks by a few threads, each computing the chunk's CRC-32 (``zlib.crc32``) and
writing it with ``os.pwrite``, both of which release the lock. Chunk CRCs are combined
(:func:`crc32_combine`, zlib's algorithm) into the record's.

The file is an ordinary zip with the records torch writes (``data.pkl``, ``data/N``, ``version``,
``byteorder``...), each record's data aligned as torch aligns it (64 bytes), ZIP64 fields where
sizes or offsets need them, and gpukit's metadata record: ``torch.load``, ``zipfile`` and
gpukit's in-place reader read it as they read ``torch.save``'s files.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import queue
import secrets
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gpukit.checkpoint._crc32 import crc32_combine

__all__ = ["write_torch_zip", "crc32_combine", "CHUNK_BYTES", "SMALL_BYTES"]

#: bytes one thread checksums and writes at a time (one batch; a larger record is split)
CHUNK_BYTES = 32 * 2**20
#: records below this size are checksummed on the serialising thread and copied into the batch
SMALL_BYTES = 2**20
_IOV_MAX = 512
_ZIP32_MAX = 0xFFFFFFFF
_ROOT = "archive"
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_PAD_ID = b"FB"  # the extra field torch's writer pads with so that record data starts aligned
_trailer: dict[str, bytes] = {}
_trailer_lock = threading.Lock()


def _torch_trailer() -> dict[str, bytes]:
    """Records torch's zip writer adds itself (``version``), learnt once from a tiny save."""
    with _trailer_lock:
        if not _trailer:
            buffer = io.BytesIO()
            torch.save(0, buffer)
            import zipfile

            with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
                for name in archive.namelist():
                    short = name.split("/", 1)[1]
                    if short == "version":
                        _trailer[short] = archive.read(name)
            _trailer.setdefault("version", b"3\n")
        return dict(_trailer)


def _byte_view(storage: torch.UntypedStorage) -> memoryview:
    nbytes = storage.nbytes()
    if nbytes == 0:
        return memoryview(b"")
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
    return memoryview(flat.numpy()).cast("B")


@dataclass
class _Entry:
    name: bytes
    size: int
    header_offset: int = 0
    data_offset: int = 0
    local_extra: bytes = b""
    crc: int = 0

    @property
    def zip64(self) -> bool:
        return self.size >= _ZIP32_MAX or self.header_offset >= _ZIP32_MAX

    @property
    def descriptor_size(self) -> int:
        return 0 if self.size == 0 else 24 if self.zip64 else 16


def _zip64_extra(size: int | None, offset: int | None) -> bytes:
    fields = ([size, size] if size is not None else []) + ([offset] if offset is not None else [])
    return struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""


def _place(entry: _Entry, position: int, alignment: int) -> int:
    """Give ``entry`` its offsets exactly as torch's writer (miniz) lays a record out at
    ``position``; returns where the next record's header starts.

    torch.load computes where a tensor's data lies from this layout instead of reading every
    header (``calculate_storage_offsets``), so it must be the same to the byte: a local header
    without sizes (they follow the data in a descriptor: 16 bytes, 24 with ZIP64; none after an
    empty record), a ZIP64 field when the size or the header's offset needs 64 bits, then the
    "FB" padding field (always present) that aligns the data to ``alignment``.
    """
    entry.header_offset = position
    big_size = entry.size if entry.size >= _ZIP32_MAX else None
    big_offset = position if position >= _ZIP32_MAX else None
    zip64 = _zip64_extra(big_size, big_offset) if entry.zip64 else b""
    start = position + _LOCAL.size + len(entry.name) + len(zip64) + 4
    pad = (-start) % alignment
    entry.local_extra = zip64 + _PAD_ID + struct.pack("<H", pad) + b"Z" * pad
    entry.data_offset = start + pad
    return entry.data_offset + entry.size + entry.descriptor_size


def _local_header(entry: _Entry) -> bytes:
    flags = 0x0808 if entry.size else 0x0800  # UTF-8 names; sizes and CRC in the descriptor
    return _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(entry.name), len(entry.local_extra)) \
        + entry.name + entry.local_extra


def _descriptor(entry: _Entry) -> bytes:
    if entry.descriptor_size == 24:
        return struct.pack("<IIQQ", 0x08074B50, entry.crc, entry.size, entry.size)
    return struct.pack("<IIII", 0x08074B50, entry.crc, entry.size, entry.size) if entry.size else b""


def _central_header(entry: _Entry) -> bytes:
    big_size = entry.size >= _ZIP32_MAX
    big_offset = entry.header_offset >= _ZIP32_MAX
    extra = _zip64_extra(entry.size if big_size else None, entry.header_offset if big_offset else None)
    flags = 0x0808 if entry.size else 0x0800
    size32 = min(entry.size, _ZIP32_MAX)
    return _CENTRAL.pack(0x02014B50, 0, 45 if extra else 0, flags, 0, 0, 0, entry.crc, size32, size32,
                         len(entry.name), len(extra), 0, 0, 0, 0, min(entry.header_offset, _ZIP32_MAX)) \
        + entry.name + extra


def _end_records(count: int, directory_offset: int, directory_size: int) -> bytes:
    end = directory_offset + directory_size
    big = count >= 0xFFFF or end >= _ZIP32_MAX
    out = b""
    if big:
        out += _EOCD64.pack(0x06064B50, _EOCD64.size - 12, 45, 45, 0, 0, count, count, directory_size,
                            directory_offset)
        out += _LOCATOR64.pack(0x07064B50, 0, end, 1)
    return out + _EOCD.pack(0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                            min(directory_size, _ZIP32_MAX), min(directory_offset, _ZIP32_MAX), 0)


PWrite = Callable[[memoryview, int], int]
PWriteV = Callable[[list[memoryview], int], int]


def _pwrite_all(pwrite: PWrite, data: memoryview, offset: int) -> None:
    while len(data):
        written = pwrite(data, offset)
        data, offset = data[written:], offset + written


def _pwritev_all(pwritev: PWriteV, buffers: list[memoryview], offset: int) -> None:
    buffers = [b for b in buffers if len(b)]
    while buffers:
        written = pwritev(buffers[:_IOV_MAX], offset)
        offset += written
        while buffers and written >= len(buffers[0]):
            written -= len(buffers[0])
            buffers.pop(0)
        if written:
            buffers[0] = buffers[0][written:]


def _crc32_holding_lock(data: memoryview) -> int:
    """CRC-32 of a small buffer in pieces short enough that zlib keeps the interpreter lock
    (it lets go of it above 5 KiB, and getting it back can take a switch interval)."""
    crc = 0
    for start in range(0, len(data), 4096):
        crc = zlib.crc32(data[start:start + 4096], crc)
    return crc


class _ZipStream:
    """Stands in for torch's zip writer inside ``torch.serialization._save``.

    Records are laid out as they arrive, and the file is one stream of adjacent bytes: headers,
    data, descriptors. Small pieces (headers, descriptors, records under ``SMALL_BYTES``) are
    copied into runs and checksummed on this thread; large records are referenced, not copied.
    Every ``CHUNK_BYTES`` or so the stream so far goes to a thread as one batch: the thread
    checksums its large pieces (``zlib.crc32``) and writes the whole batch with one
    ``pwritev``, both outside the interpreter lock. A large record's descriptor (its CRC) is
    written by :meth:`finish` once its pieces are done.

    Few, large calls on purpose: every call that lets go of the interpreter lock costs the
    writer up to ``sys.getswitchinterval()`` (5 ms) to get it back while the training thread
    runs Python. Measured: a background save of 504 MiB written with one ``pwrite`` per header
    and record took 1.3-1.9 s with a Python loop running in the training thread, 0.7-1.0 s
    with that thread waiting, and 0.6-0.8 s with the same loop in another process (so: the
    lock, not the CPU). At most ``2 x threads`` batches wait, so the copies torch makes of
    device tensors are held a few at a time.

    Plain threads, not a ``concurrent.futures`` pool: a background save still writing when the
    interpreter exits is waited for by an exit hook, and such pools refuse work by then.
    """

    def __init__(self, pwrite: PWrite, pwritev: PWriteV | None, alignment: int, threads: int) -> None:
        self.pwrite, self.alignment = pwrite, alignment
        self.pwritev = pwritev or self._one_by_one
        self.entries: list[_Entry] = []
        self.position = 0
        self._crcs: dict[tuple[int, int], tuple[int, int]] = {}  # (entry, piece) -> (crc, length)
        self._chunked: list[int] = []  # entries checksummed by the threads, piece by piece
        self._run = bytearray()  # small bytes copied, continuing the batch
        self._batch: list[memoryview] = []  # adjacent buffers from _batch_at on
        self._batch_at = 0
        self._batch_bytes = 0
        self._pieces: list[tuple[int, int, memoryview]] = []  # (entry, piece, data) of the batch
        self._errors: list[BaseException] = []
        self._queue: queue.Queue[tuple[int, list[memoryview], list[tuple[int, int, memoryview]]] | None] = \
            queue.Queue(maxsize=2 * threads)
        self._threads = [threading.Thread(target=self._serve, name="gpukit-ckpt-write", daemon=True)
                         for _ in range(threads if threads > 1 else 0)]
        for thread in self._threads:
            thread.start()

    def _one_by_one(self, buffers: list[memoryview], offset: int) -> int:
        for buffer in buffers:
            _pwrite_all(self.pwrite, buffer, offset)
            offset += len(buffer)
        return sum(len(b) for b in buffers)

    # torch.serialization._save calls these two
    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, torch.UntypedStorage):
            view = _byte_view(data)
        elif isinstance(data, (bytes, bytearray)):
            view = memoryview(bytes(data[:nbytes]))
        else:
            raise TypeError(f"unexpected record {name!r} of type {type(data).__name__}")
        self.add(name, view)

    def write_record_metadata(self, name: str, nbytes: int) -> None:  # torch.serialization.skip_data
        raise RuntimeError("gpukit's checkpoint writer does not support torch.serialization.skip_data()")

    def add(self, name: str, view: memoryview) -> None:
        entry = _Entry(f"{_ROOT}/{name}".encode(), len(view))
        index = len(self.entries)
        self.entries.append(entry)
        self.position = _place(entry, self.position, self.alignment)
        self._run += _local_header(entry)
        if entry.size < SMALL_BYTES:
            entry.crc = _crc32_holding_lock(view)
            self._run += view
            self._run += _descriptor(entry)
        else:
            self._chunked.append(index)
            for number, start in enumerate(range(0, entry.size, CHUNK_BYTES)):
                piece = view[start:start + CHUNK_BYTES]
                self._close_run()
                self._batch.append(piece)
                self._batch_bytes += len(piece)
                self._pieces.append((index, number, piece))
                if self._batch_bytes >= CHUNK_BYTES:
                    self._submit_batch()
            self._run += bytes(entry.descriptor_size)  # its place; finish() writes it
        if self._batch_bytes + len(self._run) >= CHUNK_BYTES:
            self._submit_batch()

    def _close_run(self) -> None:
        if self._run:
            run, self._run = self._run, bytearray()
            self._batch.append(memoryview(run))
            self._batch_bytes += len(run)

    def _submit_batch(self) -> None:
        self._close_run()
        if not self._batch:
            return
        item = (self._batch_at, self._batch, self._pieces)
        self._batch_at += self._batch_bytes
        self._batch, self._batch_bytes, self._pieces = [], 0, []
        if self._errors:
            raise self._errors[0]
        if not self._threads:
            self._work(*item)
        else:
            self._queue.put(item)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            if not self._errors:  # after a failure the rest is drained unwritten
                try:
                    self._work(*item)
                except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                    self._errors.append(exc)

    def _work(self, offset: int, buffers: list[memoryview], pieces: list[tuple[int, int, memoryview]]) -> None:
        for index, number, piece in pieces:
            self._crcs[(index, number)] = (zlib.crc32(piece), len(piece))  # outside the lock
        _pwritev_all(self.pwritev, buffers, offset)  # one call, outside the lock

    def finish(self) -> int:
        """Wait for the data, write the descriptors and the central directory; returns the size."""
        self._submit_batch()
        self.close()
        for index in self._chunked:
            entry = self.entries[index]
            crc, number = 0, 0
            while (index, number) in self._crcs:
                part, length = self._crcs[(index, number)]
                crc = crc32_combine(crc, part, length) if number else part
                number += 1
            entry.crc = crc
            _pwrite_all(self.pwrite, memoryview(_descriptor(entry)), entry.data_offset + entry.size)
        directory = b"".join(_central_header(entry) for entry in self.entries)
        tail = directory + _end_records(len(self.entries), self.position, len(directory))
        _pwrite_all(self.pwrite, memoryview(tail), self.position)
        return self.position + len(tail)

    def close(self) -> None:
        """Wait for every batch; raise the first failure (disk full...)."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        if self._errors:
            raise self._errors[0]


def write_torch_zip(pwrite: PWrite | int, obj: Any, metadata: dict[str, Any] | None = None, *,
                    threads: int = 2, pwritev: PWriteV | None = None) -> int:
    """Write ``obj`` as ``torch.save`` would, into an empty file; returns its size.

    Args:
        pwrite: ``pwrite(bytes, offset) -> bytes written`` of the file (called from several
            threads), or a file descriptor open for writing (``os.pwrite`` on it).
        obj: what to save (tensors on any device: others than the CPU's are copied one storage
            at a time, as ``torch.save`` copies them).
        metadata: gpukit's metadata record (``.gpukit/meta.json`` inside the archive).
        threads: threads checksumming and writing chunks at once (1: all in this thread).
        pwritev: ``pwritev(buffers, offset) -> bytes written`` of the same file (several
            adjacent buffers in one call); ``os.pwritev`` when ``pwrite`` is a descriptor,
            else one ``pwrite`` per buffer.

    Raises:
        OSError: a write failed (disk full, ...).
        TypeError, RuntimeError, pickle.PicklingError: ``obj`` cannot be saved (as torch.save).
    """
    alignment = int(getattr(torch.serialization, "_get_storage_alignment", lambda: 64)())
    if isinstance(pwrite, int):
        fd = pwrite
        pwrite = lambda data, offset: os.pwrite(fd, data, offset)  # noqa: E731
        if pwritev is None and hasattr(os, "pwritev"):
            pwritev = lambda buffers, offset: os.pwritev(fd, buffers, offset)  # noqa: E731
    from gpukit.checkpoint._formats import _META_RECORD

    stream = _ZipStream(pwrite, pwritev, alignment, threads)
    try:
        torch.serialization._save(obj, stream, pickle, 2, False)
        if metadata is not None:
            stream.add(_META_RECORD, memoryview(json.dumps(metadata, sort_keys=True).encode()))
        stream.add("version", memoryview(_torch_trailer()["version"]))
        stream.add(".data/serialization_id", memoryview(str(secrets.randbits(128)).zfill(40).encode()))
    except BaseException:
        try:
            stream.close()
        except Exception:  # noqa: BLE001 - the first failure is the one to report
            pass
        raise
    return stream.finish()
