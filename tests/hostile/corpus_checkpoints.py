"""Hostile checkpoints: planted pickles, special files, damaged and oversized metadata.

Readers: ``gpukit ckpt inspect``, ``gpukit ckpt convert``, ``gpukit.load`` and ``session.resume``.
Each probe copies a real checkpoint directory (written once per process by
``ckpt_template_worker.py`` under one process, DDP or FSDP with 2 gloo processes), damages
one thing in it and runs one reader. Probes that plant a pickle adjust ``complete.json`` so
the size check passes: the reader must refuse the content, not the size.

A resume probe whose check has ``falls_back`` set damages only the newest step: resuming must
fall back to step 1 with a warning naming the damaged step (outcome "correct", not an error).
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from _probe import Run, canary_pickle_payload

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ckpt_template_worker.py"
STEP1, STEP2 = "step_00000001", "step_00000002"
_templates: dict[str, Path] = {}
_template_root: list[Path] = []


def _template(kind: str) -> Path:
    """A checkpoint directory with steps 1 and 2 written by ``kind`` ("single", "ddp", "fsdp")."""
    if kind not in _templates:
        if not _template_root:
            _template_root.append(Path(tempfile.mkdtemp(prefix="gpukit-hostile-ckpt-")))
            atexit.register(shutil.rmtree, _template_root[0], True)
        target = _template_root[0] / kind
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        launcher = [] if kind == "single" else ["-m", "gpukit", "run", "--cpu", "--nproc", "2"]
        for _attempt in range(2):
            shutil.rmtree(target, ignore_errors=True)
            proc = subprocess.run([sys.executable, *launcher, str(WORKER), kind, str(target)], env=env,
                                  capture_output=True, text=True, timeout=300)
            # Judged by the checkpoint, not the exit code: gloo's teardown after the last save
            # sometimes aborts a worker under load (issue #17), which leaves the steps complete.
            if (target / STEP2 / "complete.json").is_file():
                break
        else:
            raise RuntimeError(f"building the {kind} template failed:\n{proc.stderr[-3000:]}")
        _templates[kind] = target
    return _templates[kind]


def _copy(kind: str, tmp: Path) -> Path:
    root = tmp / "ckpt"
    shutil.copytree(_template(kind), root, symlinks=True)
    return root


def _refresh_marker(step: Path) -> None:
    """Make ``complete.json`` list every file in ``step`` with its current size."""
    marker_path = step / "complete.json"
    marker = json.loads(marker_path.read_text())
    files = {}
    for entry in sorted(os.scandir(step), key=lambda e: e.name):
        if entry.name != "complete.json":
            files[entry.name] = os.lstat(entry.path).st_size if entry.is_symlink() else os.stat(entry.path).st_size
    marker["files"] = files
    marker_path.write_text(json.dumps(marker))


# -- readers -------------------------------------------------------------------------------

def _inspect(path: Path, **kw: object) -> Run:
    return Run("ckpt inspect", argv=["ckpt", "inspect", str(path)], **kw)  # type: ignore[arg-type]


def _convert(path: Path, tmp: Path, **kw: object) -> Run:
    return Run("ckpt convert", argv=["ckpt", "convert", str(path), str(tmp / "out.pt")], **kw)  # type: ignore[arg-type]


def _load(path: Path, **kw: object) -> Run:
    return Run("gpukit.load", code=f"import gpukit\ngpukit.load({str(path)!r})", **kw)  # type: ignore[arg-type]


def _resume(root: Path, **kw: object) -> Run:
    from ckpt_template_worker import RESUME_SNIPPET

    return Run("session.resume", code=RESUME_SNIPPET.format(here=str(HERE), directory=str(root)), **kw)  # type: ignore[arg-type]


def _resumed_from_step1(damaged: str, step: int = 1) -> Callable[[subprocess.CompletedProcess[str]], None]:
    def check(proc: subprocess.CompletedProcess[str]) -> None:
        assert f"RESUMED {step}" in proc.stdout, proc.stdout
        assert damaged in proc.stderr, proc.stderr  # the warning names the damaged step

    check.falls_back = True  # type: ignore[attr-defined]
    return check


READERS: dict[str, Callable[[Path, Path, Path], Run]] = {
    # (checkpoint root, the damaged step directory, tmp) -> Run
    "inspect": lambda root, step, tmp: _inspect(step),
    "convert": lambda root, step, tmp: _convert(step, tmp),
    "resume": lambda root, step, tmp: _resume(root),
}


def _damaged_step2(root: Path, reader: str, tmp: Path, *, canary: Path | None = None,
                   timeout_s: float | None = None) -> Run:
    """``reader`` run on ``root`` whose newest step was just damaged (complete.json made to list
    its files as they are now); a resume must fall back to step 1 and name the damaged step."""
    step = root / STEP2
    _refresh_marker(step)
    run = _load(step / "state.pt") if reader == "load" else READERS[reader](root, step, tmp)
    if canary is not None:
        run.canary = canary
    if timeout_s is not None:
        run.timeout_s = timeout_s
    if reader == "resume":
        run.check = _resumed_from_step1(STEP2)
    return run

# -- code execution: planted pickles ------------------------------------------------------


def _planted_metadata(kind: str, reader: str) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        root = _copy(kind, tmp)
        step = root / STEP2
        canary = tmp / "canary"
        (step / ".metadata").write_bytes(canary_pickle_payload(canary))
        return _damaged_step2(root, reader, tmp, canary=canary)

    return build


def _planted_shard_bytes(tmp: Path) -> Run:
    """A non-tensor entry (an optimizer hyperparameter) of an FSDP shard replaced by a pickle."""
    root = _copy("fsdp", tmp)
    step = root / STEP2
    canary = tmp / "canary"
    metadata = pickle.loads((step / ".metadata").read_bytes())  # our own template: trusted
    index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
    info = metadata.storage_data[index]
    shard = step / info.relative_path
    payload = canary_pickle_payload(canary)
    info.offset, info.length = shard.stat().st_size, len(payload)
    with open(shard, "ab") as f:
        f.write(payload)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    _refresh_marker(step)
    return _resume(root, canary=canary)


def _planted_state(reader: str) -> Callable[[Path], Run]:
    """state.pt replaced by a plain pickle whose loading would run code."""
    def build(tmp: Path) -> Run:
        root = _copy("single", tmp)
        step = root / STEP2
        canary = tmp / "canary"
        (step / "state.pt").write_bytes(canary_pickle_payload(canary))
        return _damaged_step2(root, reader, tmp, canary=canary)

    return build


# -- special files and damaged files ---------------------------------------------------------


def _one_byte(reader: str) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        path = tmp / "one.pt"
        path.write_bytes(b"\x80")
        if reader == "convert":
            return _convert(path, tmp)
        return _inspect(path) if reader == "inspect" else _load(path)

    return build


def _one_byte_state_resume(tmp: Path) -> Run:
    root = _copy("single", tmp)
    (root / STEP2 / "state.pt").write_bytes(b"\x80")
    _refresh_marker(root / STEP2)
    return _resume(root, check=_resumed_from_step1(STEP2))


def _symlink_loop(reader: str) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        root = _copy("single", tmp)
        loop = root / "step_00000003"
        os.symlink(loop, loop)  # a link to itself: ELOOP on every access
        return READERS[reader](root, loop, tmp) if reader != "resume" else _resume(
            root, check=_resumed_from_step1("step_00000003", step=2))

    return build


def _marker_fifo(reader: str) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        root = _copy("single", tmp)
        marker = root / STEP2 / "complete.json"
        marker.unlink()
        os.mkfifo(marker)  # nobody ever writes it: opening it for reading blocks
        run = READERS[reader](root, root / STEP2, tmp)  # the marker stays a FIFO: not refreshed
        run.timeout_s = 40
        if reader == "resume":
            run.check = _resumed_from_step1(STEP2)
        return run

    return build


def _marker_text(reader: str, text: str, must_resume: bool = True) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        root = _copy("single", tmp)
        (root / STEP2 / "complete.json").write_text(text)
        run = READERS[reader](root, root / STEP2, tmp)
        if reader == "resume" and must_resume:
            run.check = _resumed_from_step1(STEP2)
        return run

    return build


def _marker_edit(edit: Callable[[dict], None]) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        root = _copy("single", tmp)
        path = root / STEP2 / "complete.json"
        marker = json.loads(path.read_text())
        edit(marker)
        path.write_text(json.dumps(marker))
        return _resume(root, check=_resumed_from_step1(STEP2))

    return build


def _state_replaced(make: Callable[[Path], None], reader: str = "resume") -> Callable[[Path], Run]:
    """state.pt of the newest step replaced by ``make(path)``; complete.json adjusted."""
    def build(tmp: Path) -> Run:
        root = _copy("single", tmp)
        state = root / STEP2 / "state.pt"
        state.unlink()
        make(state)
        return _damaged_step2(root, reader, tmp, timeout_s=40)

    return build


def _truncate_half(path: Path) -> None:
    data = (path.parent.parent / STEP1 / "state.pt").read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _ddp_buckets(value: object) -> Callable[[Path], None]:
    """step 1's state.pt (our own template) whose recorded DDP gradient buckets are ``value``."""
    def make(path: Path) -> None:
        import torch

        state = torch.load(path.parent.parent / STEP1 / "state.pt", weights_only=False)
        state["gpukit"]["ddp_buckets"] = value
        torch.save(state, path)

    return make


def _safetensors_overlap(reader: str) -> Callable[[Path], Run]:
    """Two tensors whose byte ranges overlap (each range inside the file and of the right size)."""
    def build(tmp: Path) -> Run:
        header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path = tmp / "overlap.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(24))
        return _inspect(path, check=_must_fail) if reader == "inspect" else _load(path, check=_must_fail)

    return build


def _sharded_metadata(make: Callable[[Path, Path], None], reader: str) -> Callable[[Path], Run]:
    """The FSDP template's newest .metadata replaced by ``make(path, tmp)``; complete.json adjusted."""
    def build(tmp: Path) -> Run:
        root = _copy("fsdp", tmp)
        step = root / STEP2
        (step / ".metadata").unlink()
        make(step / ".metadata", tmp)
        return _damaged_step2(root, reader, tmp, timeout_s=40)

    return build


def _shard_points_at_fifo(tmp: Path) -> Run:
    """.metadata (a valid one) names a shard file that is a FIFO."""
    root = _copy("fsdp", tmp)
    step = root / STEP2
    metadata = pickle.loads((step / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        if info.relative_path == "__1_0.distcp":
            info.relative_path = "pipe.distcp"
    os.mkfifo(step / "pipe.distcp")
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    _refresh_marker(step)
    return _resume(root, timeout_s=40, check=_resumed_from_step1(STEP2))


def _shard_outside(tmp: Path) -> Run:
    """.metadata (a valid one) names a shard outside the step directory."""
    root = _copy("fsdp", tmp)
    step = root / STEP2
    metadata = pickle.loads((step / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        if info.relative_path == "__1_0.distcp":
            info.relative_path = "../../elsewhere.distcp"
    shutil.copy(step / "__1_0.distcp", tmp / "elsewhere.distcp")
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    _refresh_marker(step)
    return _convert(step, tmp)


def _huge_tensor_claim(tmp: Path) -> Run:
    """.metadata claims a model tensor of 2**40 elements (merging would allocate it)."""
    root = _copy("fsdp", tmp)
    step = root / STEP2
    import torch

    metadata = pickle.loads((step / ".metadata").read_bytes())
    entry = metadata.state_dict_metadata["model.0.weight"]
    entry.size = torch.Size([2**20, 2**20])
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    _refresh_marker(step)
    return _convert(step, tmp)


def _must_fail(proc: subprocess.CompletedProcess[str]) -> None:
    raise AssertionError("this input must be refused")


def _distcp_file(reader: str) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        root = _copy("fsdp", tmp)
        shard = root / STEP2 / "__0_0.distcp"
        return _inspect(shard, check=_must_fail) if reader == "inspect" else _load(shard, check=_must_fail)

    return build


def _safetensors_raw(header: bytes, data_bytes: int, name: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        raw = header + b" " * (-len(header) % 8)
        path = tmp / name
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + data_bytes)
        return path

    return make


def _million_tensors(tmp: Path) -> Path:
    """An 81 MB safetensors file of 10**6 one-byte tensors (issue 26: 315 s, 1.6 GB in inspect)."""
    n = 1_000_000
    body = b",".join(b'"t%d":{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}' % (i, i, i + 1) for i in range(n))
    return _safetensors_raw(b"{" + body + b"}", n, "million.safetensors")(tmp)


_NESTED = _safetensors_raw(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 0, "nested.safetensors")
_DUPLICATE = _safetensors_raw(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                              b'"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', 8, "duplicate.safetensors")


def _st_reader(make: Callable[[Path], Path], reader: str, timeout_s: float = 60) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        path = make(tmp)
        run = {"inspect": _inspect, "load": _load}[reader](path, check=_must_fail) if reader != "convert" else \
            _convert(path, tmp, check=_must_fail)
        run.timeout_s = timeout_s
        return run

    return build


def _shard_replaced(make: Callable[[Path, Path], None]) -> Callable[[Path], Run]:
    """A shard file of the FSDP template's newest step replaced by ``make(shard, tmp)``; convert it."""
    def build(tmp: Path) -> Run:
        root = _copy("fsdp", tmp)
        step = root / STEP2
        shard = step / "__0_0.distcp"
        make(shard, tmp)
        _refresh_marker(step)
        return _convert(step, tmp, check=_must_fail, timeout_s=60)

    return build


def _garbage_shard(shard: Path, tmp: Path) -> None:
    shard.write_bytes(b"not a torch file " * (shard.stat().st_size // 17 + 1))


def _shard_link_outside(shard: Path, tmp: Path) -> None:
    outside = tmp / "outside.distcp"
    outside.write_bytes(b"\x80\x02not a torch file" * 4096)
    shard.unlink()
    shard.symlink_to(outside)


def _index_edit(edit: Callable[[object], None]) -> Callable[[Path], Run]:
    """The FSDP template's newest .metadata (a real one) edited by ``edit``; convert it."""
    def build(tmp: Path) -> Run:
        root = _copy("fsdp", tmp)
        step = root / STEP2
        metadata = pickle.loads((step / ".metadata").read_bytes())  # our own template: trusted
        edit(metadata)
        (step / ".metadata").write_bytes(pickle.dumps(metadata))
        _refresh_marker(step)
        return _convert(step, tmp, check=_must_fail, timeout_s=60)

    return build


def _five_million_chunks(metadata: object) -> None:
    """One tensor's chunk list made 5e6 references to one chunk: a ~10 MB pickle (issue 26: 200 s, 4.65 GB)."""
    entry = metadata.state_dict_metadata["model.0.weight"]  # type: ignore[attr-defined]
    entry.chunks = [entry.chunks[0]] * 5_000_000


def _numel_overflow(metadata: object) -> None:
    """A tensor of 2**80 elements: torch.Size.numel() wraps around to 0."""
    import torch

    entry = metadata.state_dict_metadata["model.0.weight"]  # type: ignore[attr-defined]
    entry.size = torch.Size([2**40, 2**40])
    entry.chunks[0].sizes = torch.Size([2**40, 2**40])


def _convert_to_special(make: Callable[[Path], Path]) -> Callable[[Path], Run]:
    """``ckpt convert good.pt OUT`` where OUT is a device or a FIFO: refused, OUT left as it is."""
    def build(tmp: Path) -> Run:
        import torch

        good = tmp / "good.pt"
        torch.save({"w": torch.ones(2)}, good)
        return Run("ckpt convert", argv=["ckpt", "convert", str(good), str(make(tmp))], check=_must_fail)

    return build


PROBES: dict[str, Callable[[Path], Run]] = {
    "safetensors-nested-header-inspect": _st_reader(_NESTED, "inspect"),
    "safetensors-nested-header-convert": _st_reader(_NESTED, "convert"),
    "safetensors-duplicate-names-inspect": _st_reader(_DUPLICATE, "inspect"),
    "safetensors-duplicate-names-load": _st_reader(_DUPLICATE, "load"),
    "safetensors-million-tensors-inspect": _st_reader(_million_tensors, "inspect", timeout_s=30),
    "shard-not-torch-convert": _shard_replaced(_garbage_shard),
    "shard-symlink-outside-convert": _shard_replaced(_shard_link_outside),
    "metadata-5e6-chunks-convert": _index_edit(_five_million_chunks),
    "metadata-numel-overflow-convert": _index_edit(_numel_overflow),
    "convert-to-fifo": _convert_to_special(lambda tmp: (os.mkfifo(tmp / "out.pt"), tmp / "out.pt")[1]),
    "convert-to-dev-null": _convert_to_special(lambda tmp: Path("/dev/null")),
    **{f"metadata-pickle-{kind}-{reader}": _planted_metadata(kind, reader)
       for kind in ("single", "ddp", "fsdp") for reader in READERS},
    "shard-bytes-pickle-fsdp-resume": _planted_shard_bytes,
    **{f"state-pickle-{reader}": _planted_state(reader) for reader in ("inspect", "convert", "load", "resume")},
    **{f"one-byte-{reader}": _one_byte(reader) for reader in ("inspect", "convert", "load")},
    "one-byte-state-resume": _one_byte_state_resume,
    **{f"step-symlink-loop-{reader}": _symlink_loop(reader) for reader in READERS},
    **{f"marker-fifo-{reader}": _marker_fifo(reader) for reader in READERS},
    "marker-deeply-nested-resume": _marker_text("resume", "[" * 100_000 + "]" * 100_000),
    "marker-deeply-nested-inspect": _marker_text("inspect", "[" * 100_000 + "]" * 100_000),
    "marker-huge-resume": _marker_text("resume", '{"files": {}, "pad": "' + "x" * (64 * 2**20) + '"}'),
    "marker-not-object-inspect": _marker_text("inspect", "[1, 2]"),
    "marker-world-size-text-resume": _marker_edit(lambda m: m.update(world_size="abc")),
    "marker-files-list-resume": _marker_edit(lambda m: m.update(files=["state.pt"])),
    "marker-size-text-resume": _marker_edit(lambda m: m["files"].update({"state.pt": "big"})),
    "marker-names-outside-resume": _marker_edit(lambda m: m["files"].update({"../../../etc/hostname": 1})),
    "state-truncated-zip-resume": _state_replaced(_truncate_half),
    "state-directory-resume": _state_replaced(lambda p: p.mkdir()),
    "state-directory-inspect": _state_replaced(lambda p: p.mkdir(), "inspect"),
    "state-dangling-symlink-resume": _state_replaced(lambda p: os.symlink(p.parent / "nowhere", p)),
    "state-fifo-resume": _state_replaced(os.mkfifo),
    "state-dev-zero-resume": _state_replaced(lambda p: os.symlink("/dev/zero", p)),
    "state-ddp-buckets-not-names-resume": _state_replaced(_ddp_buckets({"model": [["0.weight", {"a": 1}]]})),
    "state-ddp-buckets-not-mapping-resume": _state_replaced(_ddp_buckets([["0.weight"]] * 1000)),
    "safetensors-overlap-inspect": _safetensors_overlap("inspect"),
    "safetensors-overlap-load": _safetensors_overlap("load"),
    "metadata-fifo-inspect": _sharded_metadata(lambda p, t: os.mkfifo(p), "inspect"),
    "metadata-fifo-resume": _sharded_metadata(lambda p, t: os.mkfifo(p), "resume"),
    "metadata-dev-zero-convert": _sharded_metadata(lambda p, t: os.symlink("/dev/zero", p), "convert"),
    "metadata-garbage-inspect": _sharded_metadata(lambda p, t: p.write_bytes(b"\x80\x04garbage"), "inspect"),
    "metadata-wrong-object-resume": _sharded_metadata(lambda p, t: p.write_bytes(pickle.dumps({"a": [1]})), "resume"),
    "metadata-shard-fifo-resume": _shard_points_at_fifo,
    "metadata-shard-outside-convert": _shard_outside,
    "metadata-huge-tensor-convert": _huge_tensor_claim,
    "distcp-file-inspect": _distcp_file("inspect"),
    "distcp-file-load": _distcp_file("load"),
}
