"""Every ``GPUKIT_*`` environment variable gpukit reads, named once (README.md's table documents them).

This module only names them; each is read by one owner, which parses it into a typed value
and raises a gpukit error naming the variable and its value when it cannot:

* **The launcher -> worker contract** (``gpukit.worker.WorkerEnv``: the only code that writes
  them for the workers and reads them back): ``gpukit run`` and ``launch_function`` set them for
  every worker; the last four may also be set by hand for ``srun python train.py``.
* **Settings a user sets**, each read by the layer it belongs to (named beside each).

Torch-free and import-free: every layer may name a variable from here.
"""

from __future__ import annotations

__all__ = [
    "RUN_ID_ENV", "LAUNCHER_PID_ENV", "GRACE_ENV", "CPU_ENV", "RUN_DIR_ENV",
    "TIMEOUT_ENV", "PREEMPT_SIGNAL_ENV", "MAX_REQUEUES_ENV", "RECORD_DIR_ENV",
    "FAKE_GPUS_ENV", "CLAIM_DIR_ENV", "MAX_NPROC_ENV", "SHM_PATH_ENV", "DATA_TIMEOUT_ENV", "TUNE_BUDGET_ENV",
    "CACHE_DIR_ENV", "RETUNE_ENV", "EXACT_TIMING_ENV", "CKPT_TIMEOUT_ENV", "OOM_DIR_ENV", "STOP_EXIT_ENV",
    "SPAWN_MAIN_ENV",
]

# -- the launcher -> worker contract (gpukit.worker.WorkerEnv) --------------------------------------
#: The run's id (claims are labelled with it; every node of a run shares it).
RUN_ID_ENV = "GPUKIT_RUN_ID"
#: The launcher's pid: a worker dies with it, and a Session knows it runs under ``gpukit run``.
LAUNCHER_PID_ENV = "GPUKIT_LAUNCHER_PID"
#: Seconds from the launcher's SIGTERM to its SIGKILL (``--grace``).
GRACE_ENV = "GPUKIT_GRACE_S"
#: ``"1"`` in the workers of a ``--cpu`` run (GPUs are hidden from them too).
CPU_ENV = "GPUKIT_CPU"
#: The run's directory: workers leave stop markers, heartbeats and stack dumps there.
RUN_DIR_ENV = "GPUKIT_RUN_DIR"
#: The collective timeout of every Session, in seconds (``--timeout``; default 1800).
TIMEOUT_ENV = "GPUKIT_TIMEOUT_S"
#: The scheduler's preemption warning: ``USR2`` (default), ``USR1`` or ``TERM`` (``--signal``).
PREEMPT_SIGNAL_ENV = "GPUKIT_PREEMPT_SIGNAL"
#: Requeue a preempted SLURM job only while ``SLURM_RESTART_COUNT`` is below this (``--max-requeues``).
MAX_REQUEUES_ENV = "GPUKIT_MAX_REQUEUES"
#: Where every Session records its run (``--record``; ``Session(record=)`` wins).
RECORD_DIR_ENV = "GPUKIT_RECORD_DIR"
#: Internal, set only while function workers are spawned: the launcher's real ``__main__``
#: (``path:...`` / ``module:...``), which each worker imports through gpukit (worker/_spawn_import.py).
SPAWN_MAIN_ENV = "GPUKIT_SPAWN_MAIN"

# -- settings a user sets ---------------------------------------------------------------------------
#: A fake NVML's JSON spec, for the library and the CLI (devices/).
FAKE_GPUS_ENV = "GPUKIT_FAKE_GPUS"
#: Where GPU claims live (devices/).
CLAIM_DIR_ENV = "GPUKIT_CLAIM_DIR"
#: The cap on worker processes per node (launch/).
MAX_NPROC_ENV = "GPUKIT_MAX_NPROC"
#: The shared-memory filesystem ``gpukit doctor`` measures (doctor/).
SHM_PATH_ENV = "GPUKIT_SHM_PATH"
#: Longest wait for one batch, in seconds (data/).
DATA_TIMEOUT_ENV = "GPUKIT_DATA_TIMEOUT_S"
#: Measuring time of ``num_workers="tune"``, in seconds (data/).
TUNE_BUDGET_ENV = "GPUKIT_TUNE_BUDGET_S"
#: Where loader tuning results are cached (data/).
CACHE_DIR_ENV = "GPUKIT_CACHE_DIR"
#: ``"1"``: measure the loader again instead of using the cache (data/).
RETUNE_ENV = "GPUKIT_RETUNE"
#: ``"1"``: synchronise the GPU at step boundaries for exact step times (data/).
EXACT_TIMING_ENV = "GPUKIT_EXACT_TIMING"
#: How long a rank waits for the others during a checkpoint, in seconds (checkpoint/).
CKPT_TIMEOUT_ENV = "GPUKIT_CKPT_TIMEOUT_S"
#: Where out-of-memory snapshots are written (memory/).
OOM_DIR_ENV = "GPUKIT_OOM_DIR"
#: How a worker whose stop is finished leaves: ``hooks`` (default), ``python`` or ``now`` (worker/).
STOP_EXIT_ENV = "GPUKIT_STOP_EXIT"
