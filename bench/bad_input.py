"""Reliability battery, bad input (issue 9, items 7-9): every scenario runs as a real
``python -m gpukit ...`` process, several times, and must end as the README promises:
one line ``gpukit: error: ...`` with exit status 2 (or success where the input is valid),
no traceback, no hang (a 60 s limit per run).

    PYTHONPATH=src python bench/bad_input.py [--trials 3] [--only SUBSTRING]

Prints one Markdown row per scenario: scenario | trials | failures | result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "examples" / "fake-gpus" / "shared-4gpu.json"
UUIDS = ("GPU-5a9b0c3e-1f2d-4e6a-8b7c-0d1e2f3a4b5c", "GPU-6b0c1d4f-2a3e-4f7b-9c8d-1e2f3a4b5c6d",
         "GPU-7c1d2e5a-3b4f-4a8c-8d9e-2f3a4b5c6d7e", "GPU-8d2e3f6b-4c5a-4b9d-9e0f-3a4b5c6d7e8f")
RESUME = textwrap.dedent("""
    import os, sys, torch, gpukit
    session = gpukit.Session(seed=0)
    model = session.setup(torch.nn.Linear(4, 2))
    loader = session.setup_dataloader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)
    step = session.resume(sys.argv[1], model=model, loader=loader) or 0
    for batch in loader:
        step += 1
        if step % 3 == 0:  # stopped mid-epoch, as on SIGTERM
            session.save_checkpoint(sys.argv[1], step, model=model, loader=loader)
            break
""")


def _safetensors(path: Path, header: object, body: bytes = b"", declared: int | None = None) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw) if declared is None else declared) + raw + body)
    return path


def _scenarios(work: Path) -> list[tuple[str, Callable[[], tuple[list[str], dict[str, str]]], int, str]]:
    """(name, prepare() -> (argv, env), expected exit status, expected text)."""
    gpukit = [sys.executable, "-m", "gpukit"]
    script = work / "x.py"
    script.write_text("print('ran')\n")
    env = {"GPUKIT_FAKE_GPUS": str(FAKE)}

    def claims(kind: str) -> tuple[list[str], dict[str, str]]:
        target = work / f"claims-{kind}-{time.monotonic_ns()}"
        as_user: list[str] = []
        if kind == "file":
            target.write_text("")
        elif kind == "lockdir":
            for uuid in UUIDS:
                (target / f"{uuid}.lock").mkdir(parents=True)
        elif kind in ("readonly", "missing"):
            target.mkdir()
            os.chmod(target, 0o555)
            if kind == "missing":
                target = target / "new"
            if os.geteuid() == 0:  # root writes anywhere: run as nobody
                as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        return [*as_user, *gpukit, "run", "--gpus", "1", str(script)], {**env, "GPUKIT_CLAIM_DIR": str(target)}

    def inspect(make: Callable[[], Path]) -> Callable[[], tuple[list[str], dict[str, str]]]:
        return lambda: ([*gpukit, "ckpt", "inspect", str(make())], env)

    def fifo() -> Path:
        path = work / f"pipe-{time.monotonic_ns()}"
        os.mkfifo(path)
        return path

    def torch_absurd() -> Path:  # a torch zip whose pickle declares a 400 GB tensor over a 16-byte record
        import torch

        good, bad = work / "t.pt", work / "absurd.pt"
        torch.save({"w": torch.zeros(4)}, good)
        with zipfile.ZipFile(good) as archive:
            entries = {name: archive.read(name) for name in archive.namelist()}
        name = next(n for n in entries if n.endswith("data.pkl"))
        huge = b"\x8a\x05" + (10**11).to_bytes(5, "little")
        pickled = entries[name].replace(b"X\x03\x00\x00\x00cpuq\x06K\x04", b"X\x03\x00\x00\x00cpuq\x06" + huge)
        entries[name] = pickled.replace(b"K\x00K\x04\x85", b"K\x00" + huge + b"\x85")
        with zipfile.ZipFile(bad, "w") as archive:
            for entry, data in entries.items():
                archive.writestr(entry, data)
        return bad

    def step_without_parts() -> Path:
        step = work / "ckpt-empty" / "step_00000001"
        step.mkdir(parents=True, exist_ok=True)
        (step / "complete.json").write_text(json.dumps({"step": 1, "world_size": 1, "files": {}}))
        return step

    def cli(*args: str) -> Callable[[], tuple[list[str], dict[str, str]]]:
        return lambda: ([*gpukit, *args], env)

    (work / "bad_models.py").write_text("import torch\ndef net():\n    return torch.nn.Linear(4, 2)\n")
    (work / "resume.py").write_text(RESUME)

    def other_world_size() -> tuple[list[str], dict[str, str]]:
        ckpt = work / f"ckpt-ws-{time.monotonic_ns()}"
        subprocess.run([*gpukit, "run", "--cpu", "--nproc", "2", str(work / "resume.py"), str(ckpt)],
                       env={**os.environ, **env}, capture_output=True, timeout=120, check=True)
        return [sys.executable, str(work / "resume.py"), str(ckpt)], env

    def convert_root() -> tuple[list[str], dict[str, str]]:
        ckpt = work / f"ckpt-conv-{time.monotonic_ns()}"
        subprocess.run([sys.executable, str(work / "resume.py"), str(ckpt)], env={**os.environ, **env},
                       capture_output=True, timeout=120, check=True)
        return [*gpukit, "ckpt", "convert", str(ckpt), str(ckpt) + ".safetensors", "--select", "model"], env

    def truncated_latest() -> tuple[list[str], dict[str, str]]:
        ckpt = work / f"ckpt-trunc-{time.monotonic_ns()}"
        for _ in range(2):
            subprocess.run([sys.executable, str(work / "resume.py"), str(ckpt)], env={**os.environ, **env},
                           capture_output=True, timeout=120, check=True)
        newest = sorted(ckpt.glob("step_*"))[-1] / "state.pt"
        newest.write_bytes(newest.read_bytes()[:100])
        return [sys.executable, str(work / "resume.py"), str(ckpt)], env

    ram_bound = textwrap.dedent("""
        import torch
        from gpukit.memory import _host_ram, find_batch_size
        class Memory: available = 200 * 2**20   # pretend 200 MiB are free
        _host_ram.psutil.virtual_memory = lambda: Memory()
        def step(n):
            assert n * 2 <= 400, f"ran {n}: {n * 2} MiB"   # the OS would kill us long before on a real box
            torch.ones(n * 2**19).sum()
        r = find_batch_size(step, start=1, margin=0, device="cpu")
        print(f"stopped at {r.max_fitting_batch_size} (2 MiB each), {sum(t.ram_limited for t in r.trials)} sizes not run")
    """)
    st = work / "st"
    st.mkdir()
    return [
        ("claim dir is a file", lambda: claims("file"), 2, "exists but is not a directory"),
        ("claim dir missing, parent read-only", lambda: claims("missing"), 2, "cannot create it"),
        ("claim dir read-only", lambda: claims("readonly"), 2, "not writable by this user"),
        ("claim lock path is a directory", lambda: claims("lockdir"), 2, "Is a directory"),
        ("ckpt inspect FIFO", inspect(fifo), 2, "is a FIFO"),
        ("ckpt inspect one-byte file", inspect(lambda: (work / "one.bin").write_bytes(b"x") and work / "one.bin"),
         2, "not a checkpoint gpukit can read"),
        ("ckpt inspect step dir without its parts", inspect(step_without_parts), 2, "state.pt and rank_00000.pt missing"),
        ("ckpt inspect safetensors: header length past the end",
         inspect(lambda: _safetensors(st / "a.safetensors", {"a": 1}, declared=10**15)), 2, "header claims"),
        ("ckpt inspect safetensors: header JSON garbage",
         inspect(lambda: _safetensors(st / "b.safetensors", b"{garbage!!")), 2, "not valid JSON"),
        ("ckpt inspect safetensors: offsets past the end",
         inspect(lambda: _safetensors(st / "c.safetensors", {"w": {"dtype": "F32", "shape": [4],
                                                                   "data_offsets": [0, 1000]}}, b"\0" * 16)),
         2, "offsets 0..1000"),
        ("ckpt inspect safetensors: 4 TB tensor in a 16-byte file",
         inspect(lambda: _safetensors(st / "d.safetensors", {"w": {"dtype": "F32", "shape": [10**6, 10**6],
                                                                   "data_offsets": [0, 16]}}, b"\0" * 16)),
         2, "declares 4,000,000,000,000 bytes"),
        ("ckpt inspect torch file: 400 GB tensor in a 16-byte record", inspect(torch_absurd), 2,
         "record size (16 bytes) does not match"),
        ("run --grace nan", cli("run", "--cpu", "--grace", "nan", str(script)), 2, "not a finite number"),
        ("run --wait nan", cli("run", "--cpu", "--wait", "nan", str(script)), 2, "--wait 'nan'"),
        ("run --rdzv-timeout inf", cli("run", "--cpu", "--rdzv-timeout", "inf", str(script)), 2, "not a finite number"),
        ("run --nproc 100000", cli("run", "--cpu", "--nproc", "100000", str(script)), 2, "GPUKIT_MAX_NPROC"),
        ("ls --watch inf", cli("ls", "--watch", "inf"), 2, "not a finite number"),
        ("demo --seed 10^30", cli("demo", "--seed", "1" + "0" * 30), 2, "'--seed'"),
        ("demo --batch-size 10^20", cli("demo", "--batch-size", "1" + "0" * 20), 2, "'--batch-size'"),
        ("plan --batch-shape 10^20,4", cli("plan", "bad_models:net", "--batch-shape", "1" + "0" * 20 + ",4"),
         2, "beyond any device"),
        ("plan with a wrong input shape (no torch traceback)",
         cli("plan", "bad_models:net", "--batch-shape", "8,5"), 2, "[8, 5] X [4, 2]"),
        ("resume mid-epoch ckpt of 2 processes with 1", other_world_size, 1, "Resume with 2 process(es)"),
        ("resume with a truncated newest ckpt (warns, falls back)", truncated_latest, 0,
         "is damaged: state.pt has 100 bytes"),
        ("ckpt convert --select model on a ckpt root", convert_root, 0, ""),
        ("find_batch_size on the CPU (200 MiB free)", lambda: ([sys.executable, "-c", ram_bound], env), 0,
         "sizes not run"),
    ]


def _judge(result: subprocess.CompletedProcess[str], status: int, text: str) -> str | None:
    """Why this run broke the promise, or None."""
    err = result.stderr
    if result.returncode != status:
        return f"exit {result.returncode}, expected {status}: {err.strip()[-160:]}"
    if text and text not in err + result.stdout:
        return f"message lacks {text!r}: {err.strip()[-160:]}"
    if status == 2 and not (err.startswith("gpukit: error: ") and err.count("\n") == 1):
        return f"not one 'gpukit: error:' line: {err[:160]!r}"
    if status == 2 and "Traceback" in err:
        return "traceback printed"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--only", default="", help="run only scenarios whose name contains this")
    options = parser.parse_args()
    trials = options.trials
    work = Path(tempfile.mkdtemp(prefix="gpukit-bad-input-"))
    os.chmod(work, 0o755)  # the read-only claim scenarios run as nobody
    try:
        print("| scenario | trials | failures | result |\n|---|---|---|---|")
        for name, prepare, status, text in _scenarios(work):
            if options.only not in name:
                continue
            failures: list[str] = []
            shown = ""
            for _ in range(trials):
                argv, env = prepare()
                try:
                    result = subprocess.run(argv, env={**os.environ, **env}, cwd=work, capture_output=True,
                                            text=True, timeout=60)
                except subprocess.TimeoutExpired:
                    failures.append("hung (60 s)")
                    continue
                why = _judge(result, status, text)
                if why is not None:
                    failures.append(why)
                last = (result.stdout.strip().splitlines() or [""])[-1]
                shown = f"exit {result.returncode}" + (f', "…{text}…"' if text else f", {last[:60]}")
                if status == 2:
                    shown += " (one line, no traceback)"
            summary = "ok: " + shown if not failures else "FAILED: " + failures[0]
            summary = summary.replace("|", "/").replace(str(work), "TMP")
            print(f"| {name} | {trials} | {len(failures)} | {summary} |", flush=True)
    finally:
        for path in work.rglob("*"):
            if path.is_dir():
                os.chmod(path, 0o755)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
