"""Checkpoints that survive crashes, resume exactly, load anywhere, and cannot run code.

- :func:`save` / :func:`load`: atomic writes, ``weights_only`` reads, GPU checkpoints that load
  on CPU-only machines, safetensors for weights export.
- :func:`load_state_dict`: state dicts with or without ``module.`` / ``_orig_mod.`` prefixes
  into models wrapped or not, with readable errors on a real mismatch.
- :class:`CheckpointManager`: the full training state per step (models, optimizers,
  schedulers, scalers, data position, RNG states per rank), exact resume, rotation.
- ``background=True`` (``save``, ``CheckpointManager.save``, ``session.save_checkpoint``): the
  call returns once the state is copied to host memory; :func:`wait_for_saves` waits for the
  write, :func:`last_save_timings` says how long training waited.
- :func:`export_pretrained`: a folder Hugging Face ``from_pretrained`` loads (sharded
  safetensors with an index above a size, plus the model's config).
- :func:`open_tensor_files`: a model's tensors by name in a file, a folder of shards or a sharded
  step directory, each read straight into place when asked for (big-model inference reads through it).
"""

from __future__ import annotations

from gpukit.checkpoint._background import SaveTimings, last_save_timings, wait_for_saves
from gpukit.checkpoint._atomic import atomic_write
from gpukit.checkpoint._hf_export import export_pretrained
from gpukit.checkpoint._inspect import convert_checkpoint, inspect_checkpoint
from gpukit.checkpoint._direct import load_state_dict
from gpukit.checkpoint._io import load, save
from gpukit.checkpoint._manager import CheckpointManager
from gpukit.checkpoint._prefixes import detect_prefixes, strip_wrapper_prefixes
from gpukit.checkpoint._read import auto_map_location
from gpukit.checkpoint._rng import capture_rng_state, restore_rng_state
from gpukit.checkpoint._tensor_files import TensorFiles, open_tensor_files

__all__ = [
    "save",
    "load",
    "load_state_dict",
    "CheckpointManager",
    "export_pretrained",
    "strip_wrapper_prefixes",
    "detect_prefixes",
    "capture_rng_state",
    "restore_rng_state",
    "auto_map_location",
    "wait_for_saves",
    "last_save_timings",
    "SaveTimings",
    "inspect_checkpoint",
    "convert_checkpoint",
    "atomic_write",
    "open_tensor_files",
    "TensorFiles",
]
