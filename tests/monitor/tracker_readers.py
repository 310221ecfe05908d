"""Read back what the trackers wrote, through each library's own formats (no server)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any


def wandb_offline_run(directory: Path) -> dict[str, Any]:
    """The records of the newest offline run under ``directory/wandb``: its name, project, config and
    history rows. A ``.wandb`` file is a LevelDB-style log (32 KiB blocks of 7-byte-headed chunks)
    of ``wandb_internal_pb2.Record`` protobufs; wandb 0.31 reads it only from its Go core, so the few
    lines of framing are here, the decoding is wandb's own protobuf classes."""
    deadline = time.monotonic() + 60
    while True:  # wandb's core process writes the file; its last record, "exit", says it is complete
        run = _read_wandb(sorted((directory / "wandb").glob("offline-run-*/run-*.wandb")))
        if run.get("exited") or time.monotonic() > deadline:
            return run
        time.sleep(0.1)


def _read_wandb(paths: list[Path]) -> dict[str, Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    run: dict[str, Any] = {"history": []}
    if not paths:
        return run
    data = paths[-1].read_bytes()
    block, pos, records, partial = 32768, 7, [], b""  # 7: wandb's own file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # a whole record
            records.append(chunk)
        elif kind in (2, 3):  # first / middle part
            partial += chunk
        elif kind == 4:  # last part
            records.append(partial + chunk)
            partial = b""
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        which = record.WhichOneof("record_type")
        if which == "run":
            run.update(name=record.run.display_name, project=record.run.project,
                       config={i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif which == "exit":
            run["exited"] = True
        elif which == "history":
            run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.history.item})
    return run


def mlflow_run(tracking_uri: str) -> dict[str, Any]:
    """The only run of experiment "gpukit" in an MLflow store: name, params, metric histories."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("gpukit")
    (run,) = client.search_runs([experiment.experiment_id])
    metrics = {name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
               for name in run.data.metrics}
    return {"name": run.info.run_name, "params": run.data.params, "metrics": metrics,
            "status": run.info.status}
