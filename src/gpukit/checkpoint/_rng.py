"""Capture and restore every random generator a training step may draw from.

Python's ``random``, NumPy's global generator, torch's CPU generator, and the generators of
every accelerator device whose runtime is initialised. States are stored as tensors and plain
values so the checkpoint stays loadable with ``weights_only=True``.

Under another number of processes a rank's saved stream is not its own any more. Where every rank
had the same stream when it was saved (``Session(seed=...)`` without ``seed_per_rank``: the models
build identically everywhere), every rank gets that stream back, exactly. Where they differed, rank
``r`` of ``M`` seeds every generator from a hash of the stream it read and ``(r, M)``
(:func:`rederive_rng_state`): distinct per rank, and the same on every rerun of that resume.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from typing import Any

import torch

from gpukit.accelerators import DEVICE_TYPES, get_accelerator

__all__ = ["capture_rng_state", "rederive_rng_state", "restore_rng_state", "rng_digest"]


def _numpy_random() -> Any | None:
    try:
        import numpy.random as np_random
    except ImportError:  # numpy is optional for torch; nothing to capture without it
        return None
    return np_random


def capture_rng_state() -> dict[str, Any]:
    """The states of all random generators of this process.

    Returns:
        ``{"python": ..., "numpy": ... (when numpy is installed), "torch": ByteTensor}`` plus one
        list of per-device states for each accelerator type whose runtime is initialised
        (e.g. ``"cuda": [state of cuda:0, state of cuda:1, ...]``).
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    np_random = _numpy_random()
    if np_random is not None:
        kind, keys, pos, has_gauss, cached = np_random.get_state(legacy=True)
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    for device_type in DEVICE_TYPES:
        # Only initialised runtimes: asking for the states would otherwise initialise CUDA.
        if get_accelerator(device_type).is_initialized():
            module = torch.get_device_module(device_type)
            state[device_type] = [s.clone() for s in module.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put the generators back where :func:`capture_rng_state` found them.

    Device states are restored for the devices present; if the checkpoint has states for more
    devices (or a device type not available here) a warning says which were skipped.
    """
    if "python" in state:
        py = state["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"]))
    np_random = _numpy_random()
    if "numpy" in state and np_random is not None:
        npy = state["numpy"]
        import numpy as np

        np_random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                             npy["has_gauss"], npy["cached_gaussian"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    for device_type in DEVICE_TYPES:
        saved = state.get(device_type)
        if not saved:
            continue
        accelerator = get_accelerator(device_type)
        available = accelerator.device_count() if accelerator.is_available() else 0
        if available < len(saved):
            warnings.warn(
                f"The checkpoint holds random states for {len(saved)} {device_type} device(s) but "
                f"{available} are available here; restoring {min(available, len(saved))}. Random "
                "streams on the other devices will differ from the uninterrupted run.",
                stacklevel=3,
            )
        if available:
            torch.get_device_module(device_type).set_rng_state_all(saved[:available])


def rng_digest(state: dict[str, Any]) -> str:
    """A short hash of the host generators' states in ``state`` (python, numpy, torch): equal digests,
    equal streams."""
    digest = hashlib.blake2b(digest_size=16)
    if "python" in state:
        digest.update(state["python"]["internal"].numpy().tobytes())
    if "numpy" in state:
        digest.update(state["numpy"]["keys"].numpy().tobytes())
        digest.update(str(state["numpy"]["pos"]).encode())
    if "torch" in state:
        digest.update(state["torch"].numpy().tobytes())
    return digest.hexdigest()


def rederive_rng_state(state: dict[str, Any], rank: int, world_size: int) -> int:
    """Seed every generator (python, numpy, torch and every device) for rank ``rank`` of ``world_size``
    from ``state`` (a stream saved under another number of processes) -- a pure function of the three.

    Returns:
        The seed used.
    """
    material = f"{rng_digest(state)}/{rank}/{world_size}".encode()
    seed = int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little") >> 1
    random.seed(seed)
    np_random = _numpy_random()
    if np_random is not None:
        np_random.seed(seed % 2**32)
    torch.manual_seed(seed)  # the CPU generator and every device's
    return seed
