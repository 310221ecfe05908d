"""Hostile run records for ``gpukit report`` (and its TensorBoard replay).

Each builder plants one record directory under ``tmp`` and returns how to report it. A safe
outcome is a one-line ``gpukit: error:`` or a report that was written, stays small (a few MB)
and, where the record had bad lines, says how many were skipped. The big records (hundreds of
MB, a million lines, 100,000 rank files) are generated here at test time, streamed to disk.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from _probe import Run

T0 = 1_800_000_000.0
MAX_REPORT_BYTES = 8 * 2**20  # "a report stays a few MB"
BIG = {"event_kind_200mb", "scalar_key_200mb", "steps_1m_lines", "rank_files_100k", "line_300mb_no_newline"}


def _meta(rank: int = 0, **overrides: object) -> dict:
    line = {"type": "meta", "t": T0, "format": "gpukit-record", "version": 1, "rank": rank, "world_size": 1,
            "local_rank": 0, "host": "node0", "pid": 100, "restart_count": 0, "sample_interval_s": 1.0,
            "full_steps": 2000, "device": "cpu", "strategy": "single", "precision": "32-true"}
    line.update(overrides)
    return line


def _step(i: int, **overrides: object) -> dict:
    line = {"type": "step", "t": T0 + 0.1 * (i + 1), "step": i, "n": 1, "epoch": 0, "samples": 32,
            "step_s": 0.01, "data_s": 0.002, "compute_s": 0.008, "max_step_s": 0.01, "exact": True,
            "scalars": {"loss": 1.0 / (i + 1)}}
    line.update(overrides)
    return line


def _write(directory: Path, lines: list[object], name: str = "rank0.jsonl", raw: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    (directory / name).write_text(text + raw)
    return directory


def _good(directory: Path) -> Path:
    return _write(directory, [_meta()] + [_step(i) for i in range(20)] + [{"type": "end", "t": T0 + 3, "steps": 20}])


def _report_ok(*needles: str) -> Callable[[subprocess.CompletedProcess[str]], None]:
    def check(proc: subprocess.CompletedProcess[str]) -> None:
        path = Path(proc.stdout.split("report: ", 1)[1].split()[0])
        size = path.stat().st_size
        assert size < MAX_REPORT_BYTES, f"report is {size} bytes"
        text = path.read_text(encoding="utf-8")
        for needle in needles:
            assert needle in text, f"{needle!r} not in the report"
    return check


def _report(directory: Path, *needles: str, timeout_s: float = 60.0, tensorboard: bool = False) -> Run:
    argv = ["report", str(directory)]
    if tensorboard:
        argv += ["--tensorboard", str(directory.parent / "tb")]
    return Run(reader="report --tensorboard" if tensorboard else "report", argv=argv,
               timeout_s=timeout_s, check=_report_ok(*needles))


# -- what the rank files are -------------------------------------------------------------------
def fifo_rank_file(tmp: Path) -> Run:
    _good(tmp / "rec")
    os.mkfifo(tmp / "rec" / "rank1.jsonl")
    return _report(tmp / "rec", "rank1.jsonl", timeout_s=30)


def symlink_to_dev_zero(tmp: Path) -> Run:
    _good(tmp / "rec")
    os.symlink("/dev/zero", tmp / "rec" / "rank1.jsonl")
    return _report(tmp / "rec", "rank1.jsonl", timeout_s=30)


def rank_file_is_a_directory(tmp: Path) -> Run:
    _good(tmp / "rec")
    (tmp / "rec" / "rank1.jsonl").mkdir()
    return _report(tmp / "rec", "rank1.jsonl")


def dangling_symlink(tmp: Path) -> Run:
    _good(tmp / "rec")
    os.symlink(tmp / "nowhere", tmp / "rec" / "rank1.jsonl")
    return _report(tmp / "rec", "rank1.jsonl")


def symlink_loop(tmp: Path) -> Run:
    _good(tmp / "rec")
    os.symlink(tmp / "rec" / "rank2.jsonl", tmp / "rec" / "rank1.jsonl")
    os.symlink(tmp / "rec" / "rank1.jsonl", tmp / "rec" / "rank2.jsonl")
    return _report(tmp / "rec", "rank1.jsonl")


def only_rank_file_is_a_fifo(tmp: Path) -> Run:
    (tmp / "rec").mkdir()
    os.mkfifo(tmp / "rec" / "rank0.jsonl")
    return Run(reader="report", argv=["report", str(tmp / "rec")], timeout_s=30)


def binary_garbage(tmp: Path) -> Run:
    _good(tmp / "rec")
    (tmp / "rec" / "rank1.jsonl").write_bytes(bytes(range(256)) * 64 + b"\xff\xfe\n\x80{\n")
    return _report(tmp / "rec", "skipped")


# -- header values ---------------------------------------------------------------------------------
def _bad_meta(**fields: object) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        lines = [_meta(**fields)] + [_step(i) for i in range(5)]
        return _report(_write(tmp / "rec", lines))
    return build


# -- line values ----------------------------------------------------------------------------------
def _bad_lines(*lines: object, raw: str = "", tensorboard: bool = False) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        body = [_meta()] + [_step(i) for i in range(5)] + list(lines)
        return _report(_write(tmp / "rec", body, raw=raw), tensorboard=tensorboard)
    return build


_HUGE_INT = "1" + "0" * 400
_NON_NUMERIC = [_step(5, step_s="x", samples="many", n="two", data_s=[1], epoch={}, scalars={"loss": "low"}),
                {"type": "sys", "t": T0 + 1, "cpu_pct": "hot", "gpu_util_pct": None, "process_rss_bytes": {}},
                {"type": "event", "t": T0 + 1, "kind": 7, "step": "x", "detail": {"a": [1, 2]}}]


def deep_nesting(tmp: Path) -> Run:
    lines = [_meta()] + [_step(i) for i in range(5)]
    raw = '{"type":"event","t":1800000001,"kind":"x","d":' + "[" * 200_000 + "]" * 200_000 + "}\n"
    return _report(_write(tmp / "rec", lines, raw=raw), "skipped")


# -- sizes ------------------------------------------------------------------------------------------
def _stream(path: Path, head: str, filler: bytes, size_bytes: int, tail: str) -> None:
    with open(path, "wb") as handle:
        handle.write(head.encode())
        chunk = filler * (2**20 // len(filler))
        for _ in range(size_bytes // len(chunk)):
            handle.write(chunk)
        handle.write(tail.encode())


def event_kind_200mb(tmp: Path) -> Run:
    directory = _good(tmp / "rec")
    _stream(directory / "rank1.jsonl", json.dumps(_meta(rank=1)) + '\n{"type":"event","t":1800000001,"kind":"',
            b"k", 200 * 2**20, '","step":1}\n' + json.dumps(_step(0)) + "\n")
    return _report(directory, "skipped", timeout_s=90)


def scalar_key_200mb(tmp: Path) -> Run:
    directory = _good(tmp / "rec")
    _stream(directory / "rank1.jsonl", json.dumps(_meta(rank=1)) + '\n{"type":"step","t":1800000001,"step":0,'
            '"samples":1,"step_s":0.1,"scalars":{"', b"s", 200 * 2**20, '":1.0}}\n' + json.dumps(_step(1)) + "\n")
    return _report(directory, "skipped", timeout_s=90)


def line_300mb_no_newline(tmp: Path) -> Run:
    directory = _good(tmp / "rec")
    _stream(directory / "rank1.jsonl", json.dumps(_meta(rank=1)) + "\n", b"x", 300 * 2**20, "")
    return _report(directory, timeout_s=90)


def steps_1m_lines(tmp: Path) -> Run:
    directory = tmp / "rec"
    directory.mkdir()
    template = ('{"type":"step","t":%.3f,"step":%d,"n":1,"epoch":0,"samples":32,"step_s":0.01,'
                '"data_s":0.002,"compute_s":0.008,"max_step_s":0.01,"exact":true,"scalars":{"loss":%.5f}}\n')
    with open(directory / "rank0.jsonl", "w") as handle:
        handle.write(json.dumps(_meta()) + "\n")
        for block in range(0, 1_000_000, 10_000):
            handle.write("".join(template % (T0 + 0.01 * i, i, 1.0 / (i + 1)) for i in range(block, block + 10_000)))
        handle.write('{"type":"end","t":%.3f,"steps":1000000}\n' % (T0 + 10_001))
    return _report(directory, "1,000,000", timeout_s=90)


def rank_files_100k(tmp: Path) -> Run:
    directory = tmp / "rec"
    directory.mkdir()
    for rank in range(100_000):
        with open(directory / f"rank{rank}.jsonl", "w") as handle:
            handle.write('{"type":"meta","t":1800000000,"format":"gpukit-record","version":1,"rank":%d,'
                         '"world_size":100000}\n{"type":"step","t":1800000001,"step":0,"samples":1,"step_s":0.1}\n'
                         % rank)
    return _report(directory, "100,000", timeout_s=120)


# -- runs appended ------------------------------------------------------------------------------------
def second_run_appended(tmp: Path) -> Run:
    first = [_meta()] + [_step(i) for i in range(20)] + [{"type": "end", "t": T0 + 3, "steps": 20}]
    later = T0 + 3600
    second = [_meta(t=later)] + [_step(i, t=later + 0.1 * (i + 1)) for i in range(20)] + [
        {"type": "end", "t": later + 3, "steps": 20}]
    return _report(_write(tmp / "rec", first + second), "run 2")


PROBES: dict[str, Callable[[Path], Run]] = {
    "fifo_rank_file": fifo_rank_file,
    "symlink_to_dev_zero": symlink_to_dev_zero,
    "rank_file_is_a_directory": rank_file_is_a_directory,
    "dangling_symlink": dangling_symlink,
    "symlink_loop": symlink_loop,
    "only_rank_file_is_a_fifo": only_rank_file_is_a_fifo,
    "binary_garbage": binary_garbage,
    "meta_version_abc": _bad_meta(version="abc"),
    "meta_version_null": _bad_meta(version=None),
    "meta_version_nan": _bad_meta(version=float("nan")),
    "meta_version_list": _bad_meta(version=[1]),
    "meta_fields_wrong_types": _bad_meta(world_size="x", restart_count="x", rank=None, device=["a"], host=1e308),
    "t_nan": _bad_lines(_step(5, t=float("nan")), {"type": "sys", "t": float("nan"), "cpu_pct": 1.0}),
    "t_negative": _bad_lines(_step(5, t=-5.0), {"type": "event", "t": -1e300, "kind": "checkpoint"}),
    "samples_nan": _bad_lines(_step(5, samples=float("nan")), _step(6, samples=float("inf"))),
    "non_numeric_fields": _bad_lines(*_NON_NUMERIC),
    "non_numeric_fields_tensorboard": _bad_lines(*_NON_NUMERIC, tensorboard=True),
    "integers_beyond_float_range": _bad_lines(raw=(
        '{"type":"step","t":1800000002,"step":%s,"samples":%s,"step_s":%s,"n":%s}\n'
        '{"type":"sys","t":%s,"process_rss_bytes":%s}\n'
        '{"type":"end","t":1800000009,"steps":%s}\n') % ((_HUGE_INT,) * 7)),
    "integers_beyond_float_range_tensorboard": _bad_lines(raw=(
        '{"type":"step","t":1800000002,"step":5,"samples":%s,"step_s":0.1,"scalars":{"loss":%s}}\n'
        '{"type":"sys","t":1800000003,"process_rss_bytes":%s}\n') % ((_HUGE_INT,) * 3), tensorboard=True),
    "deep_nesting": deep_nesting,
    "event_kind_200mb": event_kind_200mb,
    "scalar_key_200mb": scalar_key_200mb,
    "line_300mb_no_newline": line_300mb_no_newline,
    "steps_1m_lines": steps_1m_lines,
    "rank_files_100k": rank_files_100k,
    "second_run_appended": second_run_appended,
}
