"""The DRPO Ray actor classes start as real Ray actors (local cluster, fake GPU resources)."""

import os

import pytest
import ray


@pytest.mark.slow
def test_drpo_policy_actor_is_a_ray_actor_subclass_of_openrlhfs(fake_gpu_ray):
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
