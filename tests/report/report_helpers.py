"""A synthetic 3-rank run record with a straggler (rank 2 waits twice as long for data)."""

from __future__ import annotations

import json
from pathlib import Path

T0 = 1_800_000_000.0


def write_record(directory: Path, *, ranks: int = 3, steps: int = 60, straggler: int | None = 2,
                 finished: bool = True, gpu: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        lines: list[dict] = [{"type": "meta", "t": T0, "format": "gpukit-record", "version": 1, "rank": rank,
                              "world_size": ranks, "local_rank": rank, "host": "node0", "pid": 100 + rank,
                              "restart_count": 0, "sample_interval_s": 1.0, "full_steps": 2000,
                              "device": f"cuda:{rank}" if gpu else "cpu", "strategy": "ddp on 3 GPUs",
                              "precision": "bf16-mixed", **({"gpu_name": "NVIDIA H100", "gpu_index": rank} if gpu else {})}]
        data_s = 0.004 if rank == straggler else 0.002
        for i in range(steps):
            lines.append({"type": "step", "t": T0 + 0.1 * (i + 1), "step": i, "n": 1, "epoch": 0, "samples": 32,
                          "step_s": data_s + 0.011, "data_s": data_s, "h2d_s": 0.001, "compute_s": 0.010,
                          "max_step_s": data_s + 0.011, "exact": True, "scalars": {"loss": 2.0 / (i + 1)}})
            if i % 10 == 0:
                sample = {"type": "sys", "t": T0 + 0.1 * i, "cpu_pct": 95.0, "process_rss_bytes": 2**30}
                if gpu:
                    sample.update(gpu_util_pct=60 + rank, gpu_mem_used_bytes=(3 + i / 60) * 2**30,
                                  torch_allocated_bytes=(1 + i / 60) * 2**30, torch_reserved_bytes=2 * 2**30)
                lines.append(sample)
        lines.append({"type": "event", "t": T0 + 3.0, "kind": "checkpoint", "step": 29, "saved_step": 30})
        if finished:
            lines.append({"type": "end", "t": T0 + 0.1 * steps + 0.05, "steps": steps})
        (directory / f"rank{rank}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return directory
