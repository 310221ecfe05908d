"""Hostile inputs for the Hugging Face interop: ``gpukit ckpt export`` (configs, folders, sizes)
and ``gpukit plan --input``. Checkpoint sources themselves are the checkpoint corpus's."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from _probe import Run

def _weights(tmp: Path) -> Path:
    import torch

    import gpukit

    path = tmp / "w.safetensors"
    gpukit.save({"w": torch.ones(2)}, path)
    return path


def _export(tmp: Path, *args: str) -> Run:
    return Run(reader="ckpt export", argv=["ckpt", "export", str(_weights(tmp)), str(tmp / "out"), *args])


def config_fifo(tmp: Path) -> Run:
    os.mkfifo(tmp / "config.json")  # opening it would block until a writer comes
    return _export(tmp, "--config", str(tmp / "config.json"))


def config_deeply_nested(tmp: Path) -> Run:
    (tmp / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    return _export(tmp, "--config", str(tmp / "config.json"))


def config_huge(tmp: Path) -> Run:
    with open(tmp / "config.json", "wb") as handle:
        handle.truncate(64 * 2**20)  # sparse: 64 MiB of zeros, no disk used
    return _export(tmp, "--config", str(tmp / "config.json"))


def config_not_utf8(tmp: Path) -> Run:
    (tmp / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    return _export(tmp, "--config", str(tmp / "config.json"))


def shard_size_absurd(tmp: Path) -> Run:
    return _export(tmp, "--max-shard-size", "-5GB")


def shard_size_overflowing(tmp: Path) -> Run:
    # a number with 400 digits: one shard, never an overflow traceback
    return _export(tmp, "--max-shard-size", "9" * 400)


def plan_input_absurd_shape(tmp: Path) -> Run:
    return Run(reader="plan --input", argv=["plan", "torch.nn:Identity", "--input", "x=99999999999,99999999"])


PROBES: dict[str, Callable[[Path], Run]] = {
    "export: config is a FIFO": config_fifo,
    "export: config nested 200k deep": config_deeply_nested,
    "export: config of 64 MiB": config_huge,
    "export: config not UTF-8": config_not_utf8,
    "export: --max-shard-size -5GB": shard_size_absurd,
    "export: --max-shard-size 400 digits": shard_size_overflowing,
    "plan: --input with an absurd shape": plan_input_absurd_shape,
}
