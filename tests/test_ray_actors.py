"""The DRPO Ray actor classes start as real Ray actors (local cluster, fake GPU resources)."""

import os
from pathlib import Path

import pytest
import ray

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def ray_cluster():
    pythonpath = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    ray.init(
        address="local",  # a new cluster, never one a Ray address file on this machine names
        num_cpus=2,
        num_gpus=1,
        include_dashboard=False,
        runtime_env={
            # the workers import OpenRLHF, hence vLLM/flash-attn: stand-ins on CPU
            "worker_process_setup_hook": "stand_ins.install_stand_ins",
            "env_vars": {"PYTHONPATH": pythonpath, "TORCHDYNAMO_DISABLE": "1"},
        },
    )
    yield
    ray.shutdown()


@pytest.mark.slow
def test_drpo_policy_actor_is_a_ray_actor_subclass_of_openrlhfs(ray_cluster):
    from drpo_openrlhf.integration.ray_actors import DRPOPolicyModelActor

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
