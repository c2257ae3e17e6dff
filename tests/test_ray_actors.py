"""The DRPO Ray actor classes start as real Ray actors, and a CPU run's workers end without the
interpreter's teardown (local cluster, fake GPU resources)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from time_bounds import scaled


@pytest.mark.slow
def test_drpo_policy_actor_is_a_ray_actor_subclass_of_openrlhfs(fake_gpu_ray):
    from drpo_openrlhf.runtime.policy_actors import DRPOPolicyModelActor

    actor = DRPOPolicyModelActor.options(num_cpus=1, num_gpus=1).remote(1, 0, None, None)
    names = ray.get(
        actor.__ray_call__.remote(lambda self: [c.__name__ for c in type(self).__mro__])
    )
    assert names[0] == "_DRPOPolicyModelActor"
    assert "PolicyModelActor" in names and "BaseModelActor" in names
    env = ray.get(
        actor.__ray_call__.remote(lambda self: (os.environ["RANK"], os.environ["WORLD_SIZE"]))
    )
    assert env == ("0", "1")
    ray.kill(actor)


EXIT_MARKS = """
import atexit, os

def mark(kind):
    open(os.path.join(os.environ["EXIT_MARKS"], f"{kind}-{os.getpid()}"), "w").close()

class Teardown:
    def __init__(self):  # what __del__ needs, bound now: module globals may be gone by then
        self.path = os.path.join(os.environ["EXIT_MARKS"], f"torn_down-{os.getpid()}")

    def __del__(self, open=open):
        open(self.path, "w").close()

kept = Teardown()  # a module global: freed only by the interpreter's teardown
atexit.register(mark, "exit_handler")
"""
# The actor imports exit_marks itself (Ray sends a class defined here by value). It ends as
# a run's actors do after their driver (Ray's graceful exit, through Worker.main_loop's end);
# the driver waits for that, as its own exit would force-kill the actor first.
DRIVER = """
import json, os, sys, time
import ray

@ray.remote(num_cpus=0)
class Probe:
    def pid(self):
        import exit_marks
        return os.getpid()

ray.init(address=sys.argv[1], runtime_env=json.loads(sys.argv[2]), log_to_driver=False)
probe = Probe.remote()
pid = ray.get(probe.pid.remote())
probe.__ray_terminate__.remote()
deadline = time.monotonic() + float(sys.argv[3])
while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
    time.sleep(0.1)
print(pid)
"""


def actor_exit_marks(address: str, tmp_path, hook: str | None) -> set[str]:
    """The marks an actor's process left when it ended: its exit handler's and, where the
    interpreter tore it down, its module global's ``__del__``."""
    marks = tmp_path / "marks"
    marks.mkdir(parents=True)
    (tmp_path / "exit_marks.py").write_text(EXIT_MARKS)
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {"PYTHONPATH": pythonpath, "EXIT_MARKS": str(marks)}
    runtime_env = {"env_vars": env} | ({"worker_process_setup_hook": hook} if hook else {})
    # hang guards: the driver's wait for its actor's end, then its own; the test's two
    # drivers took 15 s together (2 cores at load 2-3)
    ending_s = scaled(120)
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, address, json.dumps(runtime_env), str(ending_s)],
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pid = int(done.stdout.split()[-1])
    assert not Path(f"/proc/{pid}").exists(), f"the actor did not end within {ending_s:.0f} s"
    return {m.name.rsplit("-", 1)[0] for m in marks.iterdir() if m.name.endswith(f"-{pid}")}


@pytest.mark.slow
def test_a_cpu_runs_actor_ends_without_the_teardown(fake_gpu_ray, tmp_path):
    """The hook a CPU run's workers get (``cpu_support.enable``) ends them through
    ``exit_now``: exit handlers, no teardown. The control, without it, shows the teardown."""
    from drpo_openrlhf.runtime.launch import CPU_WORKER_SETUP_HOOK

    hooked = actor_exit_marks(fake_gpu_ray, tmp_path / "hooked", CPU_WORKER_SETUP_HOOK)
    assert hooked == {"exit_handler"}
    control = actor_exit_marks(fake_gpu_ray, tmp_path / "plain", None)
    assert control == {"exit_handler", "torn_down"}
