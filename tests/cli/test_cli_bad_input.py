"""Bad input from the fault battery: each is one line ``gpukit: error: ...`` with exit 2, no traceback, no hang."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from cli_helpers import run_gpukit
from gpukit.devices import _nvml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"
FOUR_GPUS = ("GPU-5a9b0c3e-1f2d-4e6a-8b7c-0d1e2f3a4b5c", "GPU-6b0c1d4f-2a3e-4f7b-9c8d-1e2f3a4b5c6d",
             "GPU-7c1d2e5a-3b4f-4a8c-8d9e-2f3a4b5c6d7e", "GPU-8d2e3f6b-4c5a-4b9d-9e0f-3a4b5c6d7e8f")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("GPUKIT_MAX_NPROC", raising=False)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(EXAMPLES / "shared-4gpu.json"))
    monkeypatch.setattr(_nvml, "_notice_given", False)
    _nvml.shutdown()
    (tmp_path / "x.py").write_text("print('ran')\n")
    monkeypatch.chdir(tmp_path)


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, out, err = run_gpukit(capsys, *args)
    assert code == 2, (code, out, err)
    assert err.startswith("gpukit: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("args,expected", [
    (["run", "--cpu", "--grace", "nan", "x.py"], "'--grace': 'nan' is not a finite number of seconds"),
    (["run", "--cpu", "--grace", "-1", "x.py"], "'--grace'"),
    (["run", "--cpu", "--wait", "nan", "x.py"], "--wait 'nan'"),
    (["run", "--cpu", "--rdzv-timeout", "inf", "x.py"], "'--rdzv-timeout': 'inf' is not a finite number"),
    (["run", "--cpu", "--rdzv-timeout", "0", "x.py"], "'--rdzv-timeout'"),
    (["run", "--max-util", "nan", "x.py"], "'--max-util': 'nan'"),
    (["run", "--cpu", "--nproc", "100000", "x.py"], "CPU core(s) and the cap is"),
    (["ls", "--watch", "inf"], "'--watch': 'inf' is not a finite number"),
    (["ls", "--watch", "nan"], "'--watch': 'nan'"),
    (["ls", "--watch", "0"], "'--watch'"),
    (["select", "--wait", "nan"], "--wait 'nan'"),
    (["select", "--max-util", "inf"], "'--max-util': 'inf'"),
    (["demo", "--seed", "9" * 30], "'--seed'"),
    (["demo", "--batch-size", "9" * 30], "'--batch-size'"),
    (["demo", "--nproc", "100000"], "GPUKIT_MAX_NPROC=100000"),
    (["plan", "m:f", "--batch-shape", "9" * 20 + ",4"], "--batch-shape '99999999999999999999,4'"),
    # issue 16.6: durations are finite, names and paths are not empty, addresses are addresses
    (["select", "--wait", "inf"], "--wait 'inf': a timeout must be a finite number"),
    (["select", "--wait", "1e309"], "--wait '1e309': a timeout must be a finite number"),
    (["select", "--wait", "1e26"], "longer than any run"),
    (["run", "--cpu", "--wait", "-5", "x.py"], "cannot be negative"),
    (["run", "--cpu", "--wait", "inf", "x.py"], "--wait 'inf': a timeout must be a finite number"),
    (["run", "--cpu", "--signal", "", "x.py"], "'--signal': '' is empty"),
    (["run", "--cpu", "--record", "", "x.py"], "'--record': '' is not a path"),
    (["run", "--cpu", "-m", "", "x.py"], "'-m' / '--module': '' is empty"),
    (["run", "--cpu", "-m", "../evil", "x.py"], "is not a valid name"),
    (["run", "--cpu", "--master-addr", "a..b", "x.py"], "'--master-addr': --master-addr='a..b' is not a host name"),
    (["run", "--cpu", "--master-addr", "x" * 300, "x.py"], "300 characters long"),
    (["run", "--cpu", "--local-addr", ".", "x.py"], "'--local-addr'"),
    (["run", "--cpu", "--master-port", "9" * 400, "x.py"], "'--master-port'"),
    (["run", "--cpu", "--master-port", "0", "x.py"], "'--master-port'"),
    (["run", "--cpu", "--nnodes", "0", "x.py"], "'--nnodes'"),
    (["run", "--cpu", "--nnodes", "3:2", "x.py"], "give 1 <= MIN <= MAX"),
    (["run", "--cpu", "--nnodes", "1:b", "x.py"], "a range MIN:MAX (1:2)"),
    (["run", "--cpu", "--node-rank", "-1", "x.py"], "'--node-rank'"),
    (["run", "--cpu", "--max-restarts", "9" * 30, "x.py"], "'--max-restarts'"),
    (["run", "--cpu", "--max-requeues", "-1", "x.py"], "'--max-requeues'"),
    (["doctor", "--shm-path", "/nonexistent-gpukit-test"], "'--shm-path': Directory '/nonexistent-gpukit-test' does not exist"),
    (["doctor", "--shm-path", "/etc/passwd"], "'--shm-path'"),
])
def test_bad_numbers_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str], expected: str) -> None:
    assert expected in one_line_error(capsys, *args)


def test_nproc_cap_says_how_to_raise_it(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    err = one_line_error(capsys, "run", "--cpu", "--nproc", "100000", "x.py")
    assert f"it has {os.cpu_count()} CPU core(s)" in err and "GPUKIT_MAX_NPROC=100000" in err
    monkeypatch.setenv("GPUKIT_MAX_NPROC", "lots")
    assert "GPUKIT_MAX_NPROC='lots'" in one_line_error(capsys, "run", "--cpu", "--nproc", "100000", "x.py")


def test_plan_error_prints_no_torch_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    """FakeTensorMode logs torch's own traceback of a failed op to stderr; only gpukit's line may show."""
    (tmp_path / "i9b_badshape_models.py").write_text("import torch\ndef net():\n    return torch.nn.Linear(4, 2)\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    err = one_line_error(capfd, "plan", "i9b_badshape_models:net", "--batch-shape", "8,5")
    assert "[8, 5] X [4, 2]" in err and "fake_tensor" not in err


# -- the GPU claim directory ---------------------------------------------------------------

def test_claim_dir_that_is_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    for claim_dir, problem in ((tmp_path / "afile", "it is a regular file (made by "),
                               (tmp_path / "afile" / "sub", "afile on the way is a regular file (made by ")):
        monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(claim_dir))
        err = one_line_error(capsys, "run", "--gpus", "1", "x.py")
        assert problem in err and f"GPUKIT_CLAIM_DIR '{claim_dir}'" in err and "unset GPUKIT_CLAIM_DIR" in err


def test_claim_lock_path_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    claims = tmp_path / "claims"
    for uuid in FOUR_GPUS:
        (claims / f"{uuid}.lock").mkdir(parents=True)
    code, _, err = run_gpukit(capsys, "run", "--gpus", "1", "x.py")
    assert code == 2 and err.startswith("gpukit: error: Need 1 GPU") and "Traceback" not in err
    assert f"GPU 2 (NVIDIA TITAN X (Pascal)): blocked: its lock file {FOUR_GPUS[2]}.lock is a directory made by" in err
    assert "gpukit claims clean" in err  # how to remove what blocks them


def test_claim_dir_not_writable(tmp_path: Path) -> None:
    """Read-only and missing-but-uncreatable claim dirs, for a real non-root user (root may write anywhere)."""
    base = Path(tempfile.mkdtemp(prefix="gpukit-ro-claims-"))  # outside tmp_path: a non-root user reaches it
    script = base / "x.py"
    script.write_text("print('ran')\n")
    try:
        os.chmod(base, 0o555)
        as_user: list[str] = []
        if os.geteuid() == 0:  # root writes anywhere: run gpukit as nobody
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: cannot drop to an unprivileged user")
            as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            # a clone in a private folder (mktemp -d: mode 0700) is unreadable to nobody: its Python
            # then imports another gpukit (or none), and cannot read the fake-GPU spec
            import gpukit

            ours = str(Path(gpukit.__file__).resolve())
            check = ("import os, gpukit; open(os.environ['GPUKIT_FAKE_GPUS']).close(); "
                     f"assert os.path.realpath(gpukit.__file__) == {ours!r}, gpukit.__file__")
            probe = subprocess.run([*as_user, sys.executable, "-c", check], cwd=base, capture_output=True,
                                   text=True, timeout=120)
            if probe.returncode != 0:
                last = (probe.stderr.strip().splitlines() or ["?"])[-1]
                pytest.skip(f"the unprivileged user (uid 65534) cannot use this checkout ({last}): a parent "
                            f"folder of {Path(ours).parents[2]} is private to its owner")
        for claim_dir, problem in ((base, "not writable by this user"), (base / "new", "cannot create it")):
            env = {**os.environ, "GPUKIT_CLAIM_DIR": str(claim_dir)}
            result = subprocess.run([*as_user, sys.executable, "-m", "gpukit", "run", "--gpus", "1", str(script)],
                                    env=env, cwd=base, capture_output=True, text=True, timeout=120)
            if "Permission denied" in result.stderr and "gpukit: error" not in result.stderr:
                pytest.skip(f"the unprivileged user cannot run this checkout: {result.stderr[-200:]}")
            assert result.returncode == 2, result.stderr
            assert result.stderr.startswith(f"gpukit: error: GPU claims: GPUKIT_CLAIM_DIR '{claim_dir}'")
            assert problem in result.stderr
            assert result.stderr.count("\n") == 1 and "ran" not in result.stdout
    finally:
        os.chmod(base, 0o755)
        shutil.rmtree(base)


# -- gpukit ckpt inspect on things that are not checkpoints --------------------------------

def _safetensors(path: Path, header: object, body: bytes = b"", declared: int | None = None) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw) if declared is None else declared) + raw + body)
    return path


@pytest.mark.timeout(30)  # opening a FIFO waits for a writer: a regression hangs here, and fails
def test_inspect_fifo_does_not_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    assert "is a FIFO (named pipe), not a regular file" in one_line_error(capsys, "ckpt", "inspect", str(fifo))


@pytest.mark.parametrize("make,expected", [
    (lambda p: (p / "one.bin").write_bytes(b"x") and p / "one.bin", "is not a checkpoint gpukit can read"),
    (lambda p: _safetensors(p / "len.safetensors", {"a": 1}, declared=10**15), "header claims 1000000000000000 bytes"),
    (lambda p: _safetensors(p / "junk.safetensors", b"{garbage!!"), "header is not valid JSON"),
    (lambda p: _safetensors(p / "list.safetensors", b"{}[1]"), "header is not valid JSON"),
    (lambda p: _safetensors(p / "off.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1000]}},
                            b"\0" * 16), "offsets 0..1000, but the file holds 16 bytes"),
    (lambda p: _safetensors(p / "huge.safetensors", {"w": {"dtype": "F32", "shape": [10**6, 10**6],
                                                           "data_offsets": [0, 16]}}, b"\0" * 16),
     "declares 4,000,000,000,000 bytes"),
    (lambda p: _safetensors(p / "dtype.safetensors", {"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}},
                            b"\0"), "unknown dtype 'Q9'"),
    (lambda p: _safetensors(p / "shape.safetensors", {"w": {"dtype": "F32", "shape": "big", "data_offsets": [0, 4]}},
                            b"\0" * 4), "no valid dtype, shape and data_offsets"),
])
def test_inspect_malformed_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], make, expected: str) -> None:  # type: ignore[no-untyped-def]
    path = make(tmp_path)
    assert expected in one_line_error(capsys, "ckpt", "inspect", str(path))


def test_absurd_safetensors_sizes_are_refused_before_allocating(tmp_path: Path) -> None:
    import gpukit
    from gpukit.errors import CheckpointError

    huge = _safetensors(tmp_path / "huge.safetensors", {"w": {"dtype": "F64", "shape": [2**40], "data_offsets": [0, 8]}},
                        b"\0" * 8)
    with pytest.raises(CheckpointError, match="declares 8,796,093,022,208 bytes"):
        gpukit.load(huge)


def test_inspect_step_directory_without_its_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = tmp_path / "ckpt" / "step_00000001"
    step.mkdir(parents=True)
    (step / "complete.json").write_text(json.dumps({"step": 1, "world_size": 1, "files": {}}))
    for target in (step, step.parent):
        err = one_line_error(capsys, "ckpt", "inspect", str(target))
        assert "incomplete checkpoint: state.pt and rank_00000.pt missing" in err
    torch.save({"w": torch.zeros(1)}, step / "state.pt")
    assert "rank_00000.pt missing" in one_line_error(capsys, "ckpt", "inspect", str(step))


# -- gpukit ckpt convert on gpukit's own checkpoints ---------------------------------------

def test_convert_select_model_from_gpukit_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gpukit
    from gpukit.checkpoint import CheckpointManager

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, model=model, optimizer=optimizer)
    with torch.no_grad():
        model[0].weight.add_(1)
    newest = manager.save(2, model=model, optimizer=optimizer)
    expected = model.state_dict()
    for source in (newest / "state.pt", newest, tmp_path / "ckpt"):  # the file, the step, the root (latest)
        for select in ("model", "objects.model"):  # the old spelling keeps working
            out = tmp_path / "weights.safetensors"
            code, stdout, err = run_gpukit(capsys, "ckpt", "convert", str(source), str(out), "--select", select)
            assert code == 0, err
            loaded = gpukit.load(out)
            assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in loaded)
    err = one_line_error(capsys, "ckpt", "convert", str(newest), str(tmp_path / "x.pt"), "--select", "modle")
    assert "no key 'modle' here; available: model, optimizer" in err
    (tmp_path / "empty").mkdir()
    assert "without a complete gpukit checkpoint" in one_line_error(
        capsys, "ckpt", "convert", str(tmp_path / "empty"), str(tmp_path / "x.pt"))


def test_torch_file_declaring_an_absurd_storage_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A torch zip whose pickle declares a 400 GB tensor over a 16-byte record: an error, no allocation."""
    import resource
    import zipfile

    good = tmp_path / "t.pt"
    torch.save({"w": torch.zeros(4)}, good)
    with zipfile.ZipFile(good) as archive:
        entries = {name: archive.read(name) for name in archive.namelist()}
    name = next(n for n in entries if n.endswith("data.pkl"))
    huge = b"\x8a\x05" + (10**11).to_bytes(5, "little")  # LONG1: 100e9 elements, in place of BININT1 4
    pickled = entries[name].replace(b"X\x03\x00\x00\x00cpuq\x06K\x04", b"X\x03\x00\x00\x00cpuq\x06" + huge)
    entries[name] = pickled.replace(b"K\x00K\x04\x85", b"K\x00" + huge + b"\x85")  # and the shape (100e9,)
    assert entries[name].count(huge) == 2
    bad = tmp_path / "absurd.pt"
    with zipfile.ZipFile(bad, "w") as archive:
        for entry, data in entries.items():
            archive.writestr(entry, data)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    err = one_line_error(capsys, "ckpt", "inspect", str(bad))
    assert "record size (16 bytes) does not match expected size (400000000000 bytes" in err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB: nothing was allocated


def test_stop_signal_while_reaching_the_master_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM while node 1 still tries to reach node 0 (no worker started): a clean stop (75, the job
    may be requeued: nothing could be lost) in one line, no traceback.

    The signal handler raises StopSignal wherever the main thread is; here that is inside
    torch's rendezvous set-up, which is where it is injected.
    """
    import signal

    from torch.distributed.elastic.rendezvous import registry

    from gpukit.launch._signals import StopSignal

    def stopped(*_args: object) -> None:
        raise StopSignal(signal.SIGTERM)

    monkeypatch.setattr(registry, "get_rendezvous_handler", stopped)
    code, _out, err = run_gpukit(capsys, "run", "--cpu", "--nnodes", "2", "--node-rank", "1",
                                 "--master-addr", "127.0.0.1", "x.py")
    from gpukit.launch import PREEMPTED_EXIT_CODE

    assert code == PREEMPTED_EXIT_CODE and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("gpukit: ") and "SIGTERM" in err, err


@pytest.mark.parametrize("seed", [10**30, -1, 2**63])
def test_session_seed_outside_torch_range_is_one_clear_error(seed: int) -> None:
    import gpukit
    from gpukit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"ints from 0 to 2\*\*63 - 1"):
        gpukit.Session(seed=seed)


def test_a_master_address_that_does_not_resolve_is_an_error_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    import time

    from gpukit.cli.run import RESOLVE_TIMEOUT_S

    started = time.monotonic()
    # .invalid never resolves (RFC 2606); the hostile corpus tries the "nan" as well
    err = one_line_error(capsys, "run", "--cpu", "--master-addr", "gpukit-test.invalid", "--rdzv-timeout", "20",
                         "x.py")
    assert "--master-addr 'gpukit-test.invalid' does not resolve" in err and "port" not in err.split("resolve")[1]
    assert time.monotonic() - started < RESOLVE_TIMEOUT_S + 3


def test_launcher_settings_and_scripts_that_are_not_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26.6: a negative GPUKIT_MAX_NPROC is no cap, a FIFO is no script, a relative claim folder is refused."""
    script = tmp_path / "x.py"
    script.write_text("print('ran')\n")
    monkeypatch.setenv("GPUKIT_MAX_NPROC", "-1")
    err = one_line_error(capsys, "run", "--cpu", "--nproc", "2", str(script))
    assert "GPUKIT_MAX_NPROC='-1': give the most worker processes per node, a whole number >= 1" in err
    monkeypatch.delenv("GPUKIT_MAX_NPROC")
    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    err = one_line_error(capsys, "run", "--cpu", str(fifo))
    assert "is not a regular file (a FIFO, socket or device)" in err and "not found" not in err
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", "-1")
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, "run", "--gpus", "1", str(script))
    assert "GPUKIT_CLAIM_DIR '-1' is a relative path" in err and not (tmp_path / "-1").exists()
