"""Hostile environments and options: SLURM and launcher variables, fake-GPU specs, paths, CLI values.

Readers:

* ``doctor`` -- ``gpukit doctor --json`` run in-process by a snippet that accepts exit 0 or 1 (a
  failed check is what doctor is for): the probe is "correct" when the named finding has the
  expected status and names the variable, and no check crashed ("the check itself failed");
* ``doctor (CLI)`` -- ``gpukit doctor`` where the right answer is a usage error (exit 2);
* ``run``, ``select``, ``ls``, ``plan`` -- the CLI; the right answer is one ``gpukit: error:`` line;
* ``cluster.environment`` -- the detector the Session and ``gpukit run`` use (library call);
* ``Session`` -- ``gpukit.Session(devices="cpu")`` in a hostile job environment (library call).

Node lists and task counts that would expand to billions of entries must be refused before
anything is expanded; a FIFO must never be opened for reading (that waits for a writer forever).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from _probe import Run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"
FAKE = {"GPUKIT_FAKE_GPUS": str(EXAMPLES / "shared-4gpu.json")}
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
        "SLURM_JOB_NODELIST": "n1"}
HUGE_RANGE = "n[1-999999999]"
DIGITS_25 = "n[1-" + "9" * 25 + "]"
PRODUCT = "a[1-65536]b[1-65536]"
TASKS = "2(x99999999999),1"

_DOCTOR = """
from gpukit.cli._main import main
try:
    main(["doctor", "--json"])
except SystemExit as exc:
    if exc.code not in (0, 1):  # 1: a check failed, which is the answer here
        raise
"""


def _finding(name: str, status: str, *said: str) -> Callable[[subprocess.CompletedProcess[str]], None]:
    def check(proc: subprocess.CompletedProcess[str]) -> None:
        report = json.loads(proc.stdout)
        crashed = [f["message"] for f in report["findings"] if "the check itself failed" in f["message"]]
        assert not crashed, crashed
        found = [f for f in report["findings"] if f["name"] == name]
        assert found and found[0]["status"] == status, found
        assert all(s in found[0]["message"] for s in said), (said, found[0]["message"])
        assert "MASTER_PORT=None" not in proc.stdout

    return check


def _doctor(env: dict[str, str], name: str, status: str, *said: str) -> Callable[[Path], Run]:
    return lambda tmp: Run("doctor", code=_DOCTOR, env={**FAKE, **env}, timeout_s=30,
                           check=_finding(name, status, *said))


def _doctor_path(var: str, make: Callable[[Path], Path], name: str, *said: str) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        return Run("doctor", code=_DOCTOR, env={**FAKE, var: str(make(tmp))}, timeout_s=30,
                   check=_finding(name, "fail", var, *said))

    return build


def _fifo(tmp: Path) -> Path:
    path = tmp / "fifo"
    os.mkfifo(path)
    return path


def _file(tmp: Path) -> Path:
    path = tmp / "regular-file"
    path.write_text("not a directory\n")
    return path


def _refused(proc: subprocess.CompletedProcess[str]) -> None:
    """Exit 0 on a hostile value means it was accepted silently: never the right answer here."""
    raise AssertionError(f"accepted (exit 0): {proc.stdout[-300:]}")


def _says(*parts: str) -> Callable[[subprocess.CompletedProcess[str]], None]:
    def check(proc: subprocess.CompletedProcess[str]) -> None:
        text = " ".join(proc.stdout.split())
        assert all(part in text for part in parts), (parts, proc.stdout[-500:])

    return check


def _cli(reader: str, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 60
         ) -> Callable[[Path], Run]:
    def build(tmp: Path) -> Run:
        script = tmp / "train.py"
        script.write_text("print('ran')\n")
        (tmp / "gpukit_probe_model.py").write_text("from torch import nn\n\ndef f():\n    return nn.Linear(4, 4)\n")
        return Run(reader, argv=[a.replace("SCRIPT", str(script)) for a in argv], env={**FAKE, **(env or {})},
                   cwd=tmp, timeout_s=timeout_s, check=_refused)

    return build


def _spec(reader: str, make: Callable[[Path], Path]) -> Callable[[Path], Run]:
    argv = ["doctor"] if reader == "doctor (CLI)" else [reader.split()[0]]
    return lambda tmp: Run(reader, argv=argv, env={"GPUKIT_FAKE_GPUS": str(make(tmp))}, timeout_s=20,
                           check=_refused)


def _nested_spec(tmp: Path) -> Path:
    path = tmp / "nested.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    return path


def _big_spec(tmp: Path) -> Path:
    path = tmp / "big.json"
    with open(path, "wb") as fh:
        fh.truncate(64 << 20)  # sparse: 64 MiB of zeros, no disk used
    return path


def _detect(env: dict[str, str]) -> Callable[[Path], Run]:
    code = "from gpukit.cluster import environment\nenvironment()\n"
    return lambda tmp: Run("cluster.environment", code=code, env=env, timeout_s=20, check=_refused)


def _session(env: dict[str, str]) -> Callable[[Path], Run]:
    code = "import gpukit\nsession = gpukit.Session(devices='cpu')\n"
    return lambda tmp: Run("Session", code=code, env=env, timeout_s=60, check=_refused)


PROBES: dict[str, Callable[[Path], Run]] = {
    # -- gpukit doctor: every variable judged by a finding that names it --------------------------
    "doctor_nodelist_range_1e9": _doctor({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": HUGE_RANGE},
                                         "cluster.environment", "fail", HUGE_RANGE, "65,536"),
    "doctor_nodelist_25_digits": _doctor({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": DIGITS_25},
                                         "cluster.environment", "fail", "above"),
    "doctor_nodelist_product_4e9": _doctor({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": PRODUCT},
                                           "cluster.environment", "fail", "4,294,967,296 hosts"),
    "doctor_tasks_per_node_1e11": _doctor({**STEP, "SLURM_STEP_TASKS_PER_NODE": TASKS},
                                          "cluster.environment", "fail", "SLURM_STEP_TASKS_PER_NODE"),
    "doctor_job_id_abc": _doctor({"SLURM_JOB_ID": "abc"}, "cluster.environment", "fail", "SLURM_JOB_ID='abc'"),
    "doctor_job_id_negative": _doctor({"SLURM_JOB_ID": "-1"}, "cluster.environment", "fail", "SLURM_JOB_ID='-1'"),
    "doctor_job_id_1e309": _doctor({"SLURM_JOB_ID": "1e309"}, "cluster.environment", "fail", "SLURM_JOB_ID='1e309'"),
    "doctor_master_addr_a..b": _doctor({"MASTER_ADDR": "a..b"}, "network.master", "fail", "MASTER_ADDR='a..b'"),
    "doctor_master_addr_dot": _doctor({"MASTER_ADDR": "."}, "network.master", "fail", "MASTER_ADDR='.'"),
    "doctor_master_addr_300_chars": _doctor({"MASTER_ADDR": "a" * 300}, "network.master", "fail", "300 characters"),
    "doctor_master_port_400_digits": _doctor({"MASTER_ADDR": "localhost", "MASTER_PORT": "9" * 400},
                                             "network.port", "fail", "MASTER_PORT="),
    "doctor_cuda_visible_devices_5000_digits": _doctor({"CUDA_VISIBLE_DEVICES": "9" * 5000},
                                                       "cuda.visible_devices", "fail", "CUDA_VISIBLE_DEVICES"),
    "doctor_shm_path_regular_file": _doctor_path("GPUKIT_SHM_PATH", _file, "system.shm", "regular file"),
    "doctor_shm_path_fifo": _doctor_path("GPUKIT_SHM_PATH", _fifo, "system.shm", "FIFO"),
    "doctor_shm_path_etc_passwd": _doctor_path("GPUKIT_SHM_PATH", lambda tmp: Path("/etc/passwd"), "system.shm",
                                               "regular file"),
    "doctor_shm_path_missing": _doctor_path("GPUKIT_SHM_PATH", lambda tmp: tmp / "absent", "system.shm",
                                            "cannot measure"),
    "doctor_claim_dir_is_a_file": _doctor_path("GPUKIT_CLAIM_DIR", _file, "gpu.claims", "not a directory"),
    "doctor_claim_dir_relative": _doctor({"GPUKIT_CLAIM_DIR": "-1"}, "gpu.claims", "fail", "GPUKIT_CLAIM_DIR '-1'",
                                         "relative path"),
    "doctor_claim_dir_fifo": _doctor_path("GPUKIT_CLAIM_DIR", _fifo, "gpu.claims", "FIFO"),
    "run_claim_dir_relative": _cli("run", ["run", "--gpus", "1", "SCRIPT"], {"GPUKIT_CLAIM_DIR": "-1"}),
    "select_claim_dir_relative": _cli("select", ["select"], {"GPUKIT_CLAIM_DIR": "-1"}),
    # ls still shows the GPUs, and says what is wrong with the claim folder
    "ls_claim_dir_dev_zero": lambda tmp: Run("ls", argv=["ls"], env={**FAKE, "GPUKIT_CLAIM_DIR": "/dev/zero"},
                                             timeout_s=20, check=_says("TITAN X", "character device", "not a directory")),
    "doctor_cli_shm_path_missing": _cli("doctor (CLI)", ["doctor", "--shm-path", "/nonexistent-gpukit-probe"]),
    "doctor_cli_shm_path_file": _cli("doctor (CLI)", ["doctor", "--shm-path", "/etc/passwd"]),
    "doctor_cli_fake_spec_fifo": _spec("doctor (CLI)", _fifo),
    # -- fake-GPU specs: regular files of bounded size only -----------------------------------------
    "ls_fake_spec_fifo": _spec("ls", _fifo),
    "ls_fake_spec_dev_zero": _spec("ls", lambda tmp: Path("/dev/zero")),
    "ls_fake_spec_64_mib": _spec("ls", _big_spec),
    "ls_fake_spec_nested_100k": _spec("ls", _nested_spec),
    "select_fake_spec_fifo": _spec("select", _fifo),
    # -- CLI values --------------------------------------------------------------------------------
    "run_master_addr_nan": _cli("run", ["run", "--cpu", "--master-addr", "nan", "--rdzv-timeout", "20", "SCRIPT"],
                                timeout_s=120),
    "run_master_addr_a..b": _cli("run", ["run", "--cpu", "--master-addr", "a..b", "SCRIPT"]),
    "run_master_port_400_digits": _cli("run", ["run", "--cpu", "--master-port", "9" * 400, "SCRIPT"]),
    "run_signal_empty": _cli("run", ["run", "--cpu", "--signal", "", "SCRIPT"]),
    "run_record_empty": _cli("run", ["run", "--cpu", "--record", "", "SCRIPT"]),
    "run_module_empty": _cli("run", ["run", "--cpu", "-m", ""]),
    "run_wait_inf": _cli("run", ["run", "--cpu", "--wait", "inf", "SCRIPT"]),
    "run_slurm_nodelist_range_1e9": _cli("run", ["run", "--cpu", "SCRIPT"],
                                         {**STEP, "SLURM_JOB_NODELIST": HUGE_RANGE}),
    "run_slurm_tasks_per_node_1e11": _cli("run", ["run", "--cpu", "SCRIPT"],
                                          {**STEP, "SLURM_STEP_TASKS_PER_NODE": TASKS}),
    "run_gpus_5000_digits": _cli("run", ["run", "--gpus", "9" * 5000, "SCRIPT"]),
    "run_gpus_superscript_digit": _cli("run", ["run", "--gpus", "1,\u00b2", "SCRIPT"]),
    "select_exclude_5000_digits": _cli("select", ["select", "--exclude", "9" * 5000]),
    "select_wait_inf": _cli("select", ["select", "--wait", "inf"]),
    "select_wait_1e309": _cli("select", ["select", "--wait", "1e309"]),
    "select_wait_1e26": _cli("select", ["select", "--wait", "1e26"]),
    "plan_fsdp_without_nproc_or_gpus": _cli("plan", ["plan", "gpukit_probe_model:f", "--batch-shape", "4,4",
                                                     "--strategy", "fsdp"],
                                            {"GPUKIT_FAKE_GPUS": str(EXAMPLES / "no-driver.json")}),
    # -- the detector the Session uses ------------------------------------------------------------
    "detect_nodelist_product_4e9": _detect({**STEP, "SLURM_JOB_NODELIST": PRODUCT}),
    "detect_tasks_per_node_1e11": _detect({**STEP, "SLURM_STEP_TASKS_PER_NODE": TASKS}),
    "detect_master_addr_dot": _detect({**STEP, "MASTER_ADDR": "."}),
    "detect_world_size_5000_digits": _detect({"RANK": "0", "WORLD_SIZE": "9" * 5000, "LOCAL_RANK": "0"}),
    "session_slurm_nodelist_product_4e9": _session({**STEP, "SLURM_JOB_NODELIST": PRODUCT}),
    "session_torchrun_master_port_400_digits": _session({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                                         "TORCHELASTIC_RUN_ID": "probe", "MASTER_ADDR": "localhost",
                                                         "MASTER_PORT": "9" * 400}),
}
