"""CheckpointManager: full training state per step, exact resume, rotation.

Layout of ``directory``::

    step_00000120/            one complete checkpoint
        state.pt              shared state, written by rank 0 (models, optimizers, ...)
        rank_00000.pt         per-rank state of rank 0 (RNG states, data loader position)
        rank_00001.pt         ... one per rank
        __0_0.distcp, .metadata   FSDP-sharded models/optimizers: each rank's shards (_sharded.py)
        complete.json         written last: step, world size, file sizes
    .step_00000130.partial/   a save in progress (or killed); never read, removed next save

Every rank writes its files into the ``.partial`` directory; when all succeeded, rank 0 writes
``complete.json`` and renames the directory to ``step_N`` in one atomic step. Only then are
old checkpoints rotated out, so a crash at any moment leaves the last complete checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from gpukit.checkpoint._atomic import atomic_write, clean_temp_files, drop_cached_pages, fsync_directory
from gpukit.checkpoint._background import SaveTimings, background_saves
from gpukit.checkpoint._ddp_buckets import record_ddp_buckets
from gpukit.checkpoint._dist import DistContext, background_dist, current_dist
from gpukit.checkpoint._formats import MARKER_NAME, metadata_entry
from gpukit.checkpoint._gather import gather_sharded
from gpukit.checkpoint._io import _save_here, to_saveable
from gpukit.checkpoint._resume_checks import open_newest, read_marker
from gpukit.checkpoint._reuse import REUSE_DIR, clear, retire, take
from gpukit.checkpoint._rng import capture_rng_state, rederive_rng_state, restore_rng_state, rng_digest
from gpukit.checkpoint._sharded import METADATA_FILE, sharded_state, split_sharded, write_sharded
from gpukit.checkpoint._snapshot import snapshot
from gpukit.checkpoint._step_read import SHARED_FILE, open_step, rank_file_name, restore_objects
from gpukit.errors import CheckpointError, ConfigurationError
from gpukit.monitor import emit
from gpukit.worker import note_checkpoint

__all__ = ["CheckpointManager", "MARKER_NAME", "SHARED_FILE", "rank_file_name"]

_STEP_RE = re.compile(r"^step_(\d+)$")
_DEBRIS_RE = re.compile(r"^\.step_\d+\.(partial|old-[0-9a-f]+)$")


def _debris_for(step_dir: Path) -> Path:
    """A fresh name of _DEBRIS_RE's "old" kind for a step directory on its way out."""
    return step_dir.parent / f".{step_dir.name}.old-{os.urandom(4).hex()}"


def _is_per_rank(obj: Any) -> bool:
    # Data loaders and samplers (iterable, stateful) keep a position that may differ per rank;
    # models, optimizers, schedulers and scalers are the same on every rank under DDP.
    return hasattr(obj, "__iter__") and not isinstance(obj, nn.Module)


def _state_of(name: str, obj: Any) -> Any:
    if isinstance(obj, nn.Module):
        return to_saveable(obj)
    if not callable(getattr(obj, "state_dict", None)):
        raise ConfigurationError(
            f"Cannot checkpoint {name}={type(obj).__name__}: it has no state_dict(). Pass models, "
            "optimizers, schedulers, scalers, loaders or a Session as keywords, and plain values "
            "(counters, metrics) in extra={...}."
        )
    return obj.state_dict()


class CheckpointManager:
    """Saves and resumes the full training state, keeping the last ``keep_last`` checkpoints.

    Example::

        ckpt = CheckpointManager("runs/exp1/checkpoints", keep_last=3)
        start = ckpt.resume(model=model, optimizer=opt, scheduler=sched, loader=loader) or 0
        for step in range(start + 1, total + 1):
            ...
            if step % 500 == 0:
                ckpt.save(step, model=model, optimizer=opt, scheduler=sched, loader=loader)

    Args:
        directory: where the step directories live (created on first save).
        keep_last: complete checkpoints to keep; ``None`` keeps all.
        reuse_files: keep the large files of a rotated-out checkpoint in ``directory/.reuse``
            and overwrite them with the next save instead of deleting them and writing new
            ones (deleting a large file can cost more than writing it: see ``_reuse.py``).
            Costs the disk space of one checkpoint between saves; ``False`` deletes them.

    Raises:
        ConfigurationError: ``keep_last`` below 1.
    """

    def __init__(self, directory: str | os.PathLike[str], keep_last: int | None = 3, *,
                 reuse_files: bool = True) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or int(keep_last) < 1):
            raise ConfigurationError(f"keep_last={keep_last!r}: keep at least 1 checkpoint, or None for all.")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.reuse_files = bool(reuse_files)
        #: the ``extra`` values of the checkpoint last resumed (empty before a resume)
        self.extra: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, keep_last={self.keep_last})"

    # -- finding checkpoints -------------------------------------------------------------

    def step_directory(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives (whether or not it exists)."""
        return self.directory / f"step_{step:08d}"

    @staticmethod
    def _read_marker(path: Path) -> dict[str, Any] | None:
        return read_marker(path)[0]

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest step first. Incomplete ones are never listed."""
        found: list[tuple[int, Path]] = []
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return []
        for entry in entries:
            match = _STEP_RE.match(entry.name)
            if match:  # read_marker refuses what is no directory (a file, a symlink loop)
                marker = self._read_marker(Path(entry.path))
                if marker is not None and marker.get("step") == int(match.group(1)):
                    found.append((int(match.group(1)), Path(entry.path)))
        return [path for _, path in sorted(found)]

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, or ``None``."""
        complete = self.checkpoints()
        return complete[-1] if complete else None

    # -- saving ---------------------------------------------------------------------------

    def _clean_debris(self) -> None:
        clean_temp_files(self.directory)
        for entry in os.scandir(self.directory):
            if _DEBRIS_RE.match(entry.name) and entry.is_dir():
                shutil.rmtree(entry.path, ignore_errors=True)

    def save(
        self,
        step: int,
        *,
        extra: Mapping[str, Any] | None = None,
        per_rank: Iterable[str] = (),
        background: bool = False,
        **objects: Any,
    ) -> Path:
        """Save a complete checkpoint of ``step``; then delete checkpoints beyond ``keep_last``.

        Call it on every rank under DDP (it synchronises them).

        Args:
            step: the step just completed (resume returns it).
            extra: plain values to keep (counters, best metric...), read back as ``.extra``.
            per_rank: names of ``objects`` to keep per rank; iterable objects (data loaders,
                samplers) are per rank anyway, everything else is taken from rank 0.
            background: return once the state is copied to host memory; the files are written,
                committed and rotated in a background thread (see ``_background.py``): one save
                in flight at a time (the next one waits for it), its error raised by the next
                call, :func:`~gpukit.checkpoint.wait_for_saves` or ``resume``.
            **objects: things with ``state_dict()``: models (saved unwrapped), optimizers, LR
                schedulers, GradScaler, data loaders, a Session.

        Returns:
            The step directory written (with ``background``: where it will be once complete).

        Raises:
            CheckpointError: a rank failed to write; no checkpoint of ``step`` is left behind and
                older checkpoints are untouched. Also the failure of the previous background save.
            ConfigurationError: an object without ``state_dict()``.
        """
        started = time.perf_counter()
        dist = current_dist()
        dist.check_all_arrived("save_checkpoint / CheckpointManager.save")  # before any collective
        saves = background_saves()
        waited = saves.wait()  # one save in flight at a time; its failure surfaces here
        state = self._capture(dist, set(per_rank), objects, step, dict(extra or {}))
        timings = SaveTimings(f"step {step} in {self.directory}", background, waited_s=waited)
        final = self.step_directory(step)
        if not background:
            saves.last = timings
            self._write(dist, final, step, state)
            timings.blocked_s = timings.total_s = time.perf_counter() - started
            timings.write_s = timings.blocked_s - waited
            return final
        copied = time.perf_counter()
        state, timings.host_bytes = snapshot(state, saves.buffers)
        timings.snapshot_s = time.perf_counter() - copied
        writer = background_dist(dist)  # its group is made here, on the training thread
        timings.blocked_s = time.perf_counter() - started
        saves.submit(timings, lambda: self._write(writer, final, step, state))
        return final

    def _capture(self, dist: DistContext, local: set[str], objects: dict[str, Any], step: int,
                 extra: dict[str, Any]) -> dict[str, Any]:
        """What this rank writes: the shared file's content (rank 0), its own file's, its shards."""
        sharded = split_sharded(objects)  # FSDP models + their optimizers: DCP shards, every rank
        buckets = record_ddp_buckets(objects, is_main=dist.is_main)  # collective: before any file
        objects = {n: o for n, o in objects.items() if n not in sharded}
        shared_names = [n for n, o in objects.items() if n not in local and not _is_per_rank(o)]
        shared = {n: _state_of(n, objects[n]) for n in shared_names}  # every rank: the same errors
        rank_state = {
            "rank": dist.rank,
            "rng": capture_rng_state(),
            "objects": {n: _state_of(n, o) for n, o in objects.items() if n not in shared},
        }
        # whether every rank draws from one stream: a resume under another world size then gives it to all
        same_rng = len(set(dist.gather_all(rng_digest(rank_state["rng"])))) == 1
        meta = {"step": step, "world_size": dist.world_size, "extra": extra, "ddp_buckets": buckets,
                "rng_same_on_all_ranks": same_rng}
        return {
            "shared": {"objects": shared, "gpukit": meta} if dist.is_main else None,
            "rank": rank_state,
            "sharded": sharded_state(sharded),
        }

    def _write(self, dist: DistContext, final: Path, step: int, state: dict[str, Any]) -> None:
        """Write ``state`` into a staging directory, commit it as ``final``, rotate (every rank)."""
        staging = self.directory / f".{final.name}.partial"
        error: str | None = None
        if dist.is_main:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._clean_debris()
                self._drop_doomed_pages(step)
                staging.mkdir()
            except OSError as exc:
                error = f"cannot create {staging}: {exc.strerror or exc}"
        error = dist.broadcast_from_main(error)
        if error is None:
            error = write_sharded(staging, state["sharded"], dist)
        if error is None:
            error = self._write_files(dist, staging, state["shared"], state["rank"])
        if error is None and dist.is_main:
            error = self._finalise(dist, staging, final, step)
        error = dist.broadcast_from_main(error)
        if error is not None:
            if dist.is_main:
                shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"Checkpoint of step {step} in {self.directory} was not saved: {error}")
        if dist.is_main:
            self._rotate()
        note_checkpoint(step, dist.rank)  # an elastic launcher grows the group at a complete checkpoint
        emit("checkpoint", saved_step=step, path=str(final))

    def _write_files(
        self, dist: DistContext, staging: Path, shared: dict[str, Any] | None, rank_state: dict[str, Any],
    ) -> str | None:
        error: str | None = None
        try:
            if shared is not None:
                self._save_file(shared, staging / SHARED_FILE)
            self._save_file(rank_state, staging / rank_file_name(dist.rank))
        except Exception as exc:  # reported to every rank, so none waits forever
            error = f"rank {dist.rank}: {exc}"
        errors = [e for e in dist.gather_all(error) if e is not None]
        return "; ".join(errors) if errors else None

    def _save_file(self, state: Any, path: Path) -> None:
        """``gpukit.save(state, path, rank_zero_only=False)``, overwriting a kept file of the same name."""
        reuse = take(self.directory / REUSE_DIR, path.name) if self.reuse_files else None
        _save_here(gather_sharded(state, everywhere=True), path, "torch", reuse=reuse)

    def _finalise(self, dist: DistContext, staging: Path, final: Path, step: int) -> str | None:
        try:
            files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if not p.name.startswith(".") or p.name == METADATA_FILE}
            marker = {"step": step, "world_size": dist.world_size, "files": files, **metadata_entry()}
            atomic_write(staging / MARKER_NAME, lambda f: f.write(json.dumps(marker, indent=1).encode()))
            fsync_directory(staging)
            aside: Path | None = None
            if final.exists():  # saving the same step again: move the old one aside first
                aside = _debris_for(final)
                os.replace(final, aside)
            os.replace(staging, final)
            fsync_directory(self.directory)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
        except (OSError, CheckpointError) as exc:
            return f"finalising {final}: {exc}"
        return None

    def _drop_doomed_pages(self, step: int) -> None:
        """Drop the page cache of checkpoints this save replaces or rotates out (see drop_cached_pages).

        They stay on disk, complete, until the new checkpoint is; only their cached copy goes,
        so the new files reuse that memory. Nothing reads them again unless this save fails.
        """
        existing = self.checkpoints()
        keep = None if self.keep_last is None else self.keep_last - 1
        doomed = [p for p in existing if p == self.step_directory(step)]
        if keep is not None:
            doomed += existing[: max(0, len(existing) - keep)]
        for directory in doomed:
            for entry in os.scandir(directory):
                if entry.is_file(follow_symlinks=False):
                    drop_cached_pages(Path(entry.path))

    def _rotate(self) -> None:
        bin_dir = self.directory / REUSE_DIR
        if not self.reuse_files:
            clear(bin_dir)
        if self.keep_last is None:
            return
        for old in self.checkpoints()[: -self.keep_last]:
            retire(old, _debris_for(old), bin_dir if self.reuse_files else None)

    # -- resuming -------------------------------------------------------------------------

    def resume(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        restore_rng: bool = True,
        strict: bool = True,
        trust: bool = False,
        **objects: Any,
    ) -> int | None:
        """Restore ``objects`` (and the RNG states) from the latest complete checkpoint.

        Every file is read as untrusted: regular files only, sizes bounded, ``weights_only``
        unpickling, and the shard index of a sharded (FSDP) step through a restricted
        unpickler. A newest step that fails any of that is passed over, with a warning naming
        it, for the step before it (on every rank alike).

        Args:
            path: a specific step directory (no fallback); by default the newest usable step.
            restore_rng: put python, numpy, torch and device generators back (per rank; under another
                number of processes, re-derived per rank where the ranks' streams differed: see ``_rng``).
            strict: models must match the saved keys exactly (see ``gpukit.load_state_dict``).
            trust: unpickle every file of the step freely, which can run code hidden in it: only
                for checkpoints from a source you trust.
            **objects: the same names as given to :meth:`save`.

        Returns:
            The step of the checkpoint resumed from, or ``None`` when there is none (start fresh).

        Raises:
            CheckpointError: ``path`` is incomplete or unreadable, or every complete step is, or
                the checkpoint lacks one of ``objects``, or holds per-process state saved by another
                number of processes that does not carry over (nothing is restored then; a gpukit
                loader's position does carry over, with a warning).
            UnsafeCheckpointError: ``path`` needs full unpickling and ``trust`` is False.
            StateDictMismatchError: a model does not fit its saved state.
            CheckpointError: also when a background save of this process failed (said once).
        """
        background_saves().wait()  # a save still being written finishes first (its failure is raised)
        dist = current_dist()
        if path is not None:
            directory = Path(path)
            marker, shared_file, rank_file = open_step(directory, dist, trust)
        else:
            newest = open_newest(self.directory, self.checkpoints(), dist,
                                 lambda step: open_step(step, dist, trust))
            if newest is None:
                return None
            directory, (marker, shared_file, rank_file) = newest
        saved_world = int(marker["world_size"])
        with shared_file:
            self.extra = restore_objects(directory, dist, saved_world, shared_file, rank_file, objects, strict, trust)
            same_rng = shared_file.tree["gpukit"].get("rng_same_on_all_ranks") is True
        if restore_rng:
            restore_rng_state(rank_file["rng"])
            if saved_world != dist.world_size and not same_rng:  # per-rank streams: one of its own for each rank
                rederive_rng_state(rank_file["rng"], dist.rank, dist.world_size)
        # the run record shows a change of size: when, from how many processes to how many
        emit("checkpoint", resumed_step=int(marker["step"]), path=str(directory), saved_world_size=saved_world,
             world_size=dist.world_size)
        return int(marker["step"])
