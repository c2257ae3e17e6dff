"""Stand-ins for srun, scontrol, scancel, ray, hostname, ip and nvidia-smi (and ray-no-agent:
the real `ray` that answers some submissions as a dashboard without a job agent does).

Each executable in this directory calls one function here. Every call appends one JSON line
(program, argv, node, a few environment variables) to $FAKE_LOG, so a test can assert the
exact commands a launch script ran on which node. A blocking `ray start` registers its GPUs
in $FAKE_STATE, which is what the fake `ray status` reports, and blocks until SIGTERM
(recorded as ``<stopped>``). tests/test_launch_scripts.py uses them
all; tests/test_slurm_recipes.py uses the `ray` stand-in alone under a real Slurm. Like the
real ones, srun answers SIGTERM by killing its tasks (SIGKILL) and `scancel --signal=TERM JOB`
sends SIGTERM to the steps' processes, not to the batch shell. Nothing real is started.

Knobs (environment): FAKE_JOB=succeed|fail|block|train (what `ray job submit` does; train:
resume when the command's --ckpt.path holds a checkpoint, else write one (global_step20) and
block; on the launcher's stop request it saves global_step21 and ends, as the trainer does,
unless FAKE_STOP=ignore: a step that outlasts the launcher's grace),
FAKE_RAY_START_FAIL / FAKE_RAY_NO_REGISTER (comma-separated nodes whose `ray start` fails /
never registers), FAKE_RAY_DASHBOARD_FAIL=N (the first N `ray start --head` calls fail as
Ray's does when a dashboard module did not start in time: its output on stderr, exit 1),
FAKE_RAY_RAYLET_TIMEOUT=N (the same, as when the head's raylet did not register in Ray's 30 s),
FAKE_GPUS (GPUs `nvidia-smi -L` lists), FAKE_SUBMIT_NO_AGENT=N (the first N
`ray job submit` calls of each submission id fail as Ray's CLI does when the dashboard finds
no job agent on the head: its traceback on stderr, exit 1, no job).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TRACKED_ENV = (
    "GPUS_PER_NODE",
    "SLURM_CPUS_ON_NODE",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "WANDB_API_KEY",
    "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT",
    "RAY_DASHBOARD_STARTUP_TIMEOUT_S",
)
IFACE_PREFIX = {"eth0": "192.168.0.", "ib0": "10.10.0."}


def node() -> str:
    return os.environ.get("SLURMD_NODENAME", "workstation")


def record(prog: str, argv: list[str]) -> None:
    entry = {
        "prog": prog,
        "argv": argv,
        "node": node(),
        "env": {k: os.environ[k] for k in TRACKED_ENV if k in os.environ},
    }
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\n")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host lists, e.g. ``gpu[01-03,7],login1`` (enough for the tests)."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", hostlist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    return hosts


def node_index() -> int:
    nodes = expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", ""))
    return nodes.index(node()) if node() in nodes else 0


def _listed(var: str) -> bool:
    return node() in os.environ.get(var, "").split(",")


def _block_until_terminated(on_ready, on_term) -> None:
    """Act like a long-running process: ready only once SIGTERM is handled, so no race. A
    second SIGTERM while stopping (Slurm signals a step's every process, the launcher's node
    wrapper forwards its own) is ignored, as it is by a process already on its way out."""

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        on_term()
        sys.exit(0)

    signal.signal(signal.SIGTERM, handler)
    on_ready()
    while True:
        signal.pause()


def srun(argv: list[str]) -> int:
    record("srun", argv)
    opts: dict[str, str] = {}
    args = list(argv)
    while args and args[0].startswith("-"):
        arg = args.pop(0)
        if arg == "--overlap":
            opts["overlap"] = "1"
        elif arg in ("-w", "-N", "-n", "-x"):
            opts[arg] = args.pop(0)
        elif "=" in arg and arg.split("=")[0] in (
            "--nodes",
            "--ntasks",
            "--ntasks-per-node",
            "--nodelist",
            "--exclude",
        ):
            key, value = arg.split("=", 1)
            opts[key] = value
        else:
            print(f"fake srun: unsupported option {arg}", file=sys.stderr)
            return 2
    if not args:
        print("fake srun: no command", file=sys.stderr)
        return 2
    listed = opts.get("-w") or opts.get("--nodelist")
    if listed:
        nodes = expand_hostlist(listed)
    else:
        excluded = set(expand_hostlist(opts.get("-x") or opts.get("--exclude") or ""))
        allocated = expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
        nodes = [n for n in allocated if n not in excluded]
    want = int(opts.get("--nodes") or opts.get("-N") or len(nodes))
    ntasks = int(opts.get("--ntasks") or opts.get("-n") or want)
    if want > len(nodes) or ntasks != want:
        print(f"fake srun: cannot place {ntasks} task(s) on {want} of {nodes}", file=sys.stderr)
        return 2
    children: list[subprocess.Popen] = []

    def force_termination(signum, frame):
        record("srun", ["<SIGTERM>"])
        for child in children:
            child.send_signal(signal.SIGKILL)

    signal.signal(signal.SIGTERM, force_termination)
    for i, n in enumerate(nodes[:want]):
        env = {**os.environ, "SLURMD_NODENAME": n, "SLURM_PROCID": str(i)}
        children.append(subprocess.Popen(args, env=env))
    return max(child.wait() for child in children)


def scancel(argv: list[str]) -> int:
    record("scancel", argv)
    if argv != ["--signal=TERM", os.environ.get("SLURM_JOB_ID")]:
        return 2
    for pid_file in Path(os.environ["FAKE_STATE"]).glob("node-*"):
        os.kill(int(pid_file.name.split("-")[1]), signal.SIGTERM)
    return 0


def scontrol(argv: list[str]) -> int:
    record("scontrol", argv)
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(expand_hostlist(argv[2])))
        return 0
    return 0 if argv[:1] == ["requeue"] else 2


def _registered(state: Path) -> int:
    return sum(int(p.read_text()) for p in state.glob("gpus-*"))


def ray(argv: list[str]) -> int:
    record("ray", argv)
    state = Path(os.environ["FAKE_STATE"])
    if argv[:1] == ["start"]:
        if _listed("FAKE_RAY_START_FAIL"):
            print("fake ray: start failed", file=sys.stderr)
            return 1
        head_start = _count(state / "head-starts") if "--head" in argv else None
        for knob, output in (
            ("FAKE_RAY_DASHBOARD_FAIL", DASHBOARD_TIMEOUT_OUTPUT),
            ("FAKE_RAY_RAYLET_TIMEOUT", RAYLET_TIMEOUT_OUTPUT),
        ):
            if head_start is not None and head_start < _env_int(knob):
                sys.stderr.write(output)
                return 1
        gpus = next(a.split("=", 1)[1] for a in argv if a.startswith("--num-gpus="))
        slot = state / f"gpus-{node()}"
        pid_file = state / f"node-{os.getpid()}"  # lets the tests kill leftovers by id
        pid_file.touch()

        def register():
            if not _listed("FAKE_RAY_NO_REGISTER"):
                slot.write_text(gpus)

        def stopped():
            slot.unlink(missing_ok=True)
            pid_file.unlink()
            record("ray", ["<stopped>"])

        _block_until_terminated(register, stopped)
    if argv[:1] == ["status"]:
        total = _registered(state)
        if not total:
            print("ConnectionError: could not find any running Ray instance", file=sys.stderr)
            return 1
        print(f"Resources\n{'-' * 20}\nTotal Usage:\n 0.0/64.0 CPU\n 0.0/{total}.0 GPU\n")
        return 0
    if argv[:2] == ["job", "submit"]:
        if _no_agent(argv, state):
            return 1
        mode = os.environ.get("FAKE_JOB", "succeed")
        print(f"fake job log line ({mode})", flush=True)
        if mode == "train":
            ckpt = Path(argv[argv.index("--ckpt.path") + 1])
            actor = ckpt / "_actor"
            if (actor / "latest").exists():
                record("ray", ["<job resumed>", (actor / "latest").read_text()])
                return 0
            (actor / "global_step20").mkdir(parents=True)
            (actor / "latest").write_text("global_step20")
            return _train_until_stopped(ckpt, state)
        if mode == "block":
            pid_file = state / f"client-{os.getpid()}"
            pid_file.touch()

            def stopped():
                pid_file.unlink()
                record("ray", ["<job client stopped>"])

            _block_until_terminated((state / "job-running").touch, stopped)
        return 1 if mode == "fail" else 0
    if argv[:2] == ["job", "stop"]:
        return 0
    print(f"fake ray: unsupported {argv}", file=sys.stderr)
    return 2


# What `ray job submit` (Ray 2.55) prints when the dashboard answers HTTP 500 "No available
# agent to submit job, please try again later." (ray/dashboard/modules/job/job_head.py):
# JobSubmissionClient._raise_error's RuntimeError, uncaught by the CLI.
NO_AGENT_TRACEBACK = """Traceback (most recent call last):
  File "ray/dashboard/modules/job/sdk.py", line 267, in submit_job
    self._raise_error(r)
  File "ray/dashboard/modules/dashboard_sdk.py", line 298, in _raise_error
    raise RuntimeError(
RuntimeError: Request failed with status code 500: No available agent to submit job, please \
try again later..
"""


# What `ray start --head --include-dashboard=true` (Ray 2.55) prints on stderr when one of the
# dashboard's modules did not start within RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT:
# ray/_private/services.py's error lines, then its exception with the last lines of
# dashboard.log, which hold the dashboard's own error (cut here).
DASHBOARD_TIMEOUT_OUTPUT = """\
2026-11-30 21:14:03,512\tERROR services.py:1405 -- Failed to start the dashboard
2026-11-30 21:14:03,513\tERROR services.py:1430 -- Error should be written to 'dashboard.log' \
or 'dashboard.err'. We are printing the last 20 lines for you.
Traceback (most recent call last):
  File "ray/_private/services.py", line 1460, in start_api_server
    raise Exception(last_log_str)
Exception:
The last 20 lines of /tmp/ray/session_2026-11-30_21-13-31_004211_811/logs/dashboard.log (it \
contains the error message from the dashboard):
2026-11-30 21:14:02,377\tERROR dashboard.py:326 -- The dashboard on node n1 failed with the \
following error:
Traceback (most recent call last):
  File "ray/dashboard/subprocesses/handle.py", line 153, in wait_for_module_ready
    raise RuntimeError(
RuntimeError: Module MetricsHead failed to start. Timeout after 30.0 seconds.
"""

RAYLET_TIMEOUT_OUTPUT = """\
2026-12-02 14:32:11,204\tINFO node.py:417 -- Failed to get node info b'RPC error: Deadline \
Exceeded'
Traceback (most recent call last):
  File "ray/_private/node.py", line 423, in __init__
    raise Exception(
Exception: The current node timed out during startup. This could happen because some of the \
raylet failed to startup or the GCS has become overloaded.
"""


def _env_int(var: str) -> int:
    return int(os.environ.get(var, "0"))


def _count(calls: Path) -> int:
    """How many times this was counted before (a file in $FAKE_STATE), counting this call."""
    n = int(calls.read_text()) if calls.exists() else 0
    calls.write_text(str(n + 1))
    return n


def _no_agent(argv: list[str], state: Path) -> bool:
    """Answer this submission as Ray does without a job agent (FAKE_SUBMIT_NO_AGENT times per
    submission id); counts the calls per id in $FAKE_STATE."""
    submission_id = argv[argv.index("--submission-id") + 1]
    if _count(state / f"submits-{submission_id}") >= _env_int("FAKE_SUBMIT_NO_AGENT"):
        return False
    sys.stderr.write(NO_AGENT_TRACEBACK)
    return True


def ray_no_agent(argv: list[str]) -> int:
    """Ray's own CLI ($FAKE_REAL_RAY), except that the first FAKE_SUBMIT_NO_AGENT `ray job
    submit` calls of each submission id get the answer of a dashboard without a job agent."""
    if argv[:2] == ["job", "submit"] and _no_agent(argv, Path(os.environ["FAKE_STATE"])):
        return 1
    real = os.environ["FAKE_REAL_RAY"]
    os.execv(real, [real, *argv])


def _train_until_stopped(ckpt: Path, state: Path) -> int:
    """A training job after its checkpoint of step 20: SIGTERM (the teardown) ends it; the
    stop request file makes it save step 21 and end with 0, unless FAKE_STOP=ignore."""
    pid_file = state / f"client-{os.getpid()}"
    pid_file.touch()

    def stopped(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pid_file.unlink()
        record("ray", ["<job client stopped>"])
        sys.exit(0)

    signal.signal(signal.SIGTERM, stopped)
    (state / "job-running").touch()
    honour = os.environ.get("FAKE_STOP") != "ignore"
    while not (honour and (ckpt / "DRPO_STOP_REQUESTED").exists()):
        time.sleep(0.1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (ckpt / "_actor" / "global_step21").mkdir()
    (ckpt / "_actor" / "latest").write_text("global_step21")
    pid_file.unlink()
    record("ray", ["<job stopped on request>", "global_step21"])
    return 0


def hostname(argv: list[str]) -> int:
    if argv == ["--ip-address"]:
        print(f"{IFACE_PREFIX['eth0']}{node_index() + 1}")
    else:
        print(node())
    return 0


def ip(argv: list[str]) -> int:
    record("ip", argv)
    if argv[:5] != ["-o", "-4", "addr", "show", "dev"] or len(argv) != 6:
        return 2
    iface = argv[5]
    if iface not in IFACE_PREFIX:
        print(f'Device "{iface}" does not exist.', file=sys.stderr)
        return 1
    addr = f"{IFACE_PREFIX[iface]}{node_index() + 1}"
    print(f"3: {iface}    inet {addr}/16 brd 10.10.255.255 scope global {iface}")
    return 0


def nvidia_smi(argv: list[str]) -> int:
    if argv != ["-L"]:
        return 2
    for i in range(int(os.environ.get("FAKE_GPUS", "0"))):
        print(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-fake-{i})")
    return 0


def main(prog: str) -> None:
    commands = {
        "srun": srun,
        "scontrol": scontrol,
        "scancel": scancel,
        "ray": ray,
        "ray-no-agent": ray_no_agent,
        "hostname": hostname,
        "ip": ip,
        "nvidia-smi": nvidia_smi,
    }
    sys.exit(commands[prog](sys.argv[1:]))
