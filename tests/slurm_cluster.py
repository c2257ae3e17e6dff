"""A real Slurm on this machine for tests: two nodes with 8 fake GPUs each (tests/test_slurm_*.py).

Debian's `slurm-wlm` and `munge` run as root: one `munged` with its own key and socket, one
`slurmctld`, and two `slurmd -N n1|n2` on two ports of this host. Fake GPUs are GRES whose
device files are symlinks to /dev/null (Slurm drops a file-less `Gres=gpu:8` and marks the
node INVAL). Everything lives in a fresh directory under /tmp; the daemons are started here
and stopped here, and every process that carries this cluster's marker in its environment
(daemons, slurmstepd, job and step processes) is gone when `stop()` returns.

When the packages are missing and this process is root with apt-get, `ensure_installed()`
installs them (about 8 s) with services kept from starting (policy-rc.d), so the packages'
own daemons never run. Elsewhere the tests are skipped with the reason.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from time_bounds import calibration, scaled

PACKAGES = ("slurm-wlm", "munge")
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")
NODES = ("n1", "n2")
GPUS_PER_NODE = 8
CPUS_PER_NODE = 2
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
PR_SET_PDEATHSIG = 1
# Hang guards, in seconds on the reference machine (each stretched by the time scale): the
# daemons' start until every node is idle, one Slurm command, a job's wait by default, the
# stop's wait for the queue to empty and for each daemon to exit. The daemons were idle
# 0.3 s after their start (2 cores at load 2-5); a Slurm command takes well under a second.
START_S, COMMAND_S, JOB_S, QUEUE_EMPTY_S, DAEMON_EXIT_S = 60, 60, 90, 20, 10


def missing_reason() -> str | None:
    """Why a real Slurm cannot run here (None when it can, possibly after installing)."""
    if all(shutil.which(p, path=_sbin_path()) for p in PROGRAMS):
        return None if os.geteuid() == 0 else "the real-Slurm tests run the daemons as root"
    if os.geteuid() != 0:
        return "the real-Slurm tests need root to install and run Debian's slurm-wlm and munge"
    if shutil.which("apt-get") is None:
        return "slurm-wlm and munge are not installed and there is no apt-get to install them"
    return None


def ensure_installed() -> float:
    """Install slurm-wlm and munge with apt-get when missing; returns the seconds it took."""
    if all(shutil.which(p, path=_sbin_path()) for p in PROGRAMS):
        return 0.0
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # No daemon from the packages themselves: invoke-rc.d and deb-systemd-invoke ask
    # policy-rc.d, and 101 means "do not start".
    guard = not POLICY_RC_D.exists()
    if guard:
        POLICY_RC_D.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
    try:
        for cmd in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
        ):
            result = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
    finally:
        if guard:
            POLICY_RC_D.unlink()
    return time.monotonic() - started


def _die_with_parent() -> None:
    """In the daemon before exec: SIGTERM when the test process dies, even if killed."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/bin", "/sbin"])


def _free_ports(count: int) -> int:
    """First of `count` consecutive free TCP ports on 127.0.0.1 (slurmctld's, then the slurmds'
    range)."""
    for base in range(20000 + os.getpid() % 5000, 40000, 7):
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports")


class SlurmCluster:
    """Two-node Slurm on localhost; `env()` is the environment a client (sbatch) needs."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="drpo-slurm-", dir="/tmp"))
        self.dir.chmod(0o755)  # munged refuses a socket directory others cannot enter
        self.conf = self.dir / "slurm.conf"
        self.socket = self.dir / "munge.socket"
        self.daemons: list[subprocess.Popen] = []
        self.marker = f"DRPO_TEST_SLURM={self.dir}"

    def env(self, **extra: str) -> dict[str, str]:
        """os.environ without Slurm's own variables, plus this cluster's config and marker."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        name, value = self.marker.split("=", 1)
        env |= {"SLURM_CONF": str(self.conf), name: value, "PATH": _sbin_path()}
        return env | extra

    def write_config(self) -> None:
        host = socket.gethostname()
        ctld_port = _free_ports(1 + len(NODES))
        slurmd_port = ctld_port + 1
        gpu_dir = self.dir / "gpus"
        gpu_dir.mkdir()
        for i in range(GPUS_PER_NODE):
            (gpu_dir / f"gpu{i}").symlink_to("/dev/null")
        for sub in ("state", *(f"spool/{n}" for n in NODES)):
            (self.dir / sub).mkdir(parents=True)
        nodes = f"n[1-{len(NODES)}]"
        d = self.dir
        self.conf.write_text(
            f"""ClusterName=drpotest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
GresTypes=gpu
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=300
NodeName={nodes} NodeHostname={host} NodeAddr=127.0.0.1 Port=[{slurmd_port}-{slurmd_port + len(NODES) - 1}] CPUs={CPUS_PER_NODE} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""  # noqa: E501
        )
        (self.dir / "gres.conf").write_text(
            f"NodeName={nodes} Name=gpu File={gpu_dir}/gpu[0-{GPUS_PER_NODE - 1}]\n"
        )

    def _daemon(self, name: str, *argv: str) -> None:
        log = open(self.dir / f"{name}.out", "w")  # noqa: SIM115 - the child holds it
        with log:
            proc = subprocess.Popen(
                argv,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.daemons.append(proc)

    def start(self, timeout: float = START_S) -> float:
        """Start munged, slurmctld and the slurmds; wait until every node is idle (each wait
        ``timeout``, stretched by the time scale)."""
        started = time.monotonic()
        self.write_config()
        key = self.dir / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        self._daemon(
            "munged", "munged", "-F", f"--key-file={key}", f"--socket={self.socket}",
            f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/munged.log",
            f"--seed-file={self.dir}/munged.seed",
        )  # fmt: skip
        self._wait(lambda: self.socket.exists(), timeout, "munged never created its socket")
        self._daemon("slurmctld", "slurmctld", "-D")
        for node in NODES:
            self._daemon(f"slurmd-{node}", "slurmd", "-D", "-N", node)
        self._wait(self._nodes_idle, timeout, "the nodes never became idle")
        return time.monotonic() - started

    def _nodes_idle(self) -> bool:
        result = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def _wait(self, ready, timeout: float, what: str) -> None:
        bound_s = scaled(timeout)
        deadline = time.monotonic() + bound_s
        while not ready():
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode})\n{self.logs()}")
            if time.monotonic() > deadline:
                made_of = f"{timeout:g} s x {calibration().describe()}"
                raise RuntimeError(f"{what} within {bound_s:.0f} s ({made_of})\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out"))
        )

    def run(self, *argv: str, check: bool = True, **extra: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            argv, env=self.env(**extra), capture_output=True, text=True, timeout=scaled(COMMAND_S)
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {result.stdout}{result.stderr}")
        return result

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def steps(self) -> list[str]:
        """Ids of the job steps running now (batch steps not counted)."""
        out = self.run("squeue", "-h", "-s", "-o", "%i").stdout
        return [s for s in out.split() if not s.endswith((".batch", ".extern"))]

    def wait_job(self, job_id: str, done, timeout: float | None = None) -> dict[str, str]:
        """The job's info once ``done(info)``. A ``timeout`` given is kept as it is (a
        caller's bound may be what it tests: a stop before a held generation ends); the
        default, a hang guard, is ``JOB_S`` stretched by the time scale."""
        bound_s = scaled(JOB_S) if timeout is None else timeout
        made_of = f"{JOB_S} s x {calibration().describe()}" if timeout is None else "as given"
        started = time.monotonic()
        while not done(info := self.job(job_id)):
            if (waited := time.monotonic() - started) > bound_s:
                raise AssertionError(
                    f"job {job_id} stuck for {waited:.0f} s, over its bound of {bound_s:.0f} s"
                    f" ({made_of}), in {info}\n{self.logs()}"
                )
            time.sleep(0.2)
        return info

    def marked_processes(self) -> list[int]:
        """Ids of live processes that carry this cluster's marker (not this test process)."""
        marker = self.marker.encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if marker in environ.split(b"\0") and stat.rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        return found

    def job_processes(self) -> dict[int, str]:
        """Live processes of jobs (slurmstepd, steps, what they started, Ray's included) by
        id, with their command lines: every marked process but the daemons (and
        slurmscriptd, which slurmctld forks)."""
        daemons = {p.pid for p in self.daemons if p.poll() is None}
        ctld = {p.pid for p in self.daemons if p.args[0] == "slurmctld"}
        found = {}
        for pid in self.marked_processes():
            try:
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue  # ended meanwhile
            if pid not in daemons and parent not in ctld:
                found[pid] = cmdline.decode(errors="replace").strip()
        return found

    def stop(self) -> list[int]:
        """Cancel every job, stop the daemons, kill what is left; returns the ids killed last."""
        if self.daemons and all(p.poll() is None for p in self.daemons):
            self.run("scancel", "--partition=debug", check=False)
            deadline = time.monotonic() + scaled(QUEUE_EMPTY_S)
            while time.monotonic() < deadline:
                if not self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip():
                    break
                time.sleep(0.2)
        for proc in reversed(self.daemons):  # slurmds, slurmctld, munged last
            proc.terminate()
            try:
                proc.wait(timeout=scaled(DAEMON_EXIT_S))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = self.marked_processes()
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
        return left


def module_cluster() -> Iterator[SlurmCluster]:
    """A module's Slurm cluster (``yield from`` it in a module-scoped fixture): skipped where
    Slurm cannot run, and no process of it may outlive it."""
    import pytest

    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    ensure_installed()
    slurm = SlurmCluster()
    try:
        slurm.start()
        yield slurm
    finally:
        left = slurm.stop()
    assert left == [], f"processes of the test cluster outlived it: {left}"
