"""The weight check sees places, and the engines' first weights, through
``python -m drpo_openrlhf.train`` with real vLLM CPU engines (issue 35).

Breakages from ``tests/sync_break_site`` (``sync_breakage.py``), chosen per test through the
file ``DRPO_TEST_SYNC_BREAK`` names. An engine whose first weights are not the actor's must
stop the run before the first rollout. Right values in the wrong places (``PLACES``: rows
reversed, a square matrix transposed, gate and up swapped) must stop it at the first sync:
``test_weight_sync_guard.py`` checks that in the run that breaks the first sync in the other
ways too, on a third engine. That the guard is what stops them:
``test_weight_sync_guard.py``'s control runs the same breakages with the guard off to the end.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_e2e_pipeline import train

from drpo_openrlhf.demo.training import local_ray_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SITE = Path(__file__).parent / "sync_break_site"
GUARD = "weight sync check failed"
LAYER0, LAYER1 = "model.layers.0", "model.layers.1"
# one engine: k's rows reversed, a square o_proj transposed, gate and up swapped
PLACES = {
    "0": {
        "permute": f"{LAYER0}.self_attn.k_proj.weight",
        "transpose": f"{LAYER1}.self_attn.o_proj.weight",
        "swap": [f"{LAYER1}.mlp.gate_proj.weight", f"{LAYER1}.mlp.up_proj.weight"],
    }
}
BROKEN = [PLACES["0"]["permute"], PLACES["0"]["transpose"], *PLACES["0"]["swap"]]
CHANGED = f"{LAYER1}.mlp.down_proj.weight"  # the one tensor the other checkpoint changes


@pytest.fixture(scope="module")
def break_file(tmp_path_factory):
    return tmp_path_factory.mktemp("sync-break") / "breaks.json"


@contextmanager
def break_site_cluster(break_file: Path, num_gpus: int) -> Iterator[str]:
    """A local cluster whose workers import the break site, which reads the breakages from
    ``break_file`` at each use (none until a test writes some)."""
    break_file.write_text("{}")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(SITE))
        env.setenv("DRPO_TEST_SYNC_BREAK", f"@{break_file}")
        with local_ray_cluster(num_gpus=num_gpus) as address:
            yield address


@pytest.fixture(scope="module")
def ray_address(break_file):
    """One cluster for the module."""
    with break_site_cluster(break_file, num_gpus=3) as address:
        yield address


def another_checkpoint(toy, folder: Path) -> Path:
    """The actor's checkpoint with one element of one tensor moved by one bf16 step."""
    shutil.copytree(toy["base"], folder)
    weights = load_file(folder / "model.safetensors")
    changed = weights[CHANGED].clone()
    changed.view(-1)[7] = changed.view(-1)[7].bfloat16().float() * (1 + 2**-7)
    weights[CHANGED] = changed
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_an_engine_started_from_another_checkpoint_stops_before_the_first_rollout(
    toy, ray_address, break_file, tmp_path
):
    other = another_checkpoint(toy, tmp_path / "other")
    break_file.write_text(json.dumps({"0": {"start_from": str(other)}}))
    done = train(toy, tmp_path / "run", ray_address=ray_address, steps=2)
    assert done.returncode != 0
    out = done.output
    assert "SYNC BREAK: first weights loaded from" in out
    assert f"{GUARD} before the first rollout" in out, out[-3000:]
    named = set(re.findall(r"holds other values or places than the actor's '([^']+)'", out))
    assert named == {CHANGED}, named
    assert "Global step 1:" not in out
