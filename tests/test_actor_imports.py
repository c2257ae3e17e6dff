"""What each Ray actor's process imports on CPU: an engine's, DeepSpeed never (OpenRLHF keeps
it out of the vLLM engines' environment, and its import is about 3 CPU-s of every engine's
start-up); a policy actor's, not the driver's trainer. Each in a fresh interpreter, as a
Ray worker of a CPU run starts: ``cpu_support.enable`` first (the workers' setup hook), then
the actor's module, whose classes Ray unpickles by reference."""

from __future__ import annotations

import json
import subprocess
import sys

from time_bounds import scaled

PROBE = """
import json, sys
from drpo_openrlhf.runtime import cpu_support
seen = {}
def look(step):
    from drpo_openrlhf import upstream
    patched = "openrlhf.utils.distributed_util.stateless_init_process_group" in upstream._installed
    names = ("deepspeed", "openrlhf.trainer.ppo_trainer", "openrlhf.trainer.ray.launcher")
    seen[step] = {"modules": [m for m in names if m in sys.modules], "patched": patched}
cpu_support.enable()
look("enabled")
for step in sys.argv[1:]:
    __import__(step)
    look(step)
print(json.dumps(seen))
"""


def imports(*modules: str) -> dict[str, dict]:
    """After ``cpu_support.enable()`` and each of ``modules`` in turn: which of DeepSpeed,
    OpenRLHF's trainer and its model side are imported, and whether OpenRLHF is patched."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *modules],
        capture_output=True,
        text=True,
        timeout=scaled(300),  # a hang guard: about 10 s measured on 2 cores
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_an_engine_imports_no_deepspeed_and_the_model_side_is_patched_once_imported():
    seen = imports(
        "drpo_openrlhf.runtime.engine_actors",
        "drpo_openrlhf.runtime.policy_actors",
        "drpo_openrlhf.runtime.ray_actors",
    )
    assert seen["enabled"] == {"modules": [], "patched": False}
    assert seen["drpo_openrlhf.runtime.engine_actors"] == {"modules": [], "patched": False}
    # the policy actor's side: DeepSpeed and OpenRLHF's model side, patched; no trainer
    assert seen["drpo_openrlhf.runtime.policy_actors"] == {
        "modules": ["deepspeed", "openrlhf.trainer.ray.launcher"],
        "patched": True,
    }
    # the probe sees an import where there is one: the trainer's module imports OpenRLHF's
    assert "openrlhf.trainer.ppo_trainer" in seen["drpo_openrlhf.runtime.ray_actors"]["modules"]


def test_a_reference_actors_process_is_patched_without_the_policy_actor():
    """OpenRLHF's reference and reward model actors (``launcher.py``) are not ours: their
    process imports the model side alone, and is patched all the same."""
    seen = imports("openrlhf.trainer.ray.launcher")
    assert seen["openrlhf.trainer.ray.launcher"]["patched"]
