"""GPU or CPU run from the Ray cluster, not the driver (``runtime/device.py``)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from time_bounds import scaled

from drpo_openrlhf.models.tiny import build_tiny_model
from drpo_openrlhf.runtime.device import ClusterDevices, DeviceError, choose_mode

REAL_GPUS = ClusterDevices("10.0.0.1:6379", 8.0, True)
FAKE_GPUS = ClusterDevices("127.0.0.1:6379", 2.0, False, ("n1 (127.0.0.1)",))
# two GPU nodes of which one has no working CUDA (a driver missing after a reboot)
ONE_NODE_BROKEN = ClusterDevices("10.0.0.1:6379", 16.0, True, ("gpu7 (10.0.0.7)",))
NO_GPUS = ClusterDevices(None, 0.0, None)
UNPROBED = ClusterDevices("10.0.0.1:6379", 8.0, None)


@pytest.mark.parametrize(
    ("requested", "found", "mode", "warns"),
    [
        # the case: the driver sees no GPU, the cluster's workers do
        ("auto", REAL_GPUS, "gpu", False),
        ("auto", NO_GPUS, "cpu", False),
        ("auto", FAKE_GPUS, "cpu", True),
        ("auto", UNPROBED, "gpu", True),
        ("gpu", REAL_GPUS, "gpu", False),
        ("gpu", UNPROBED, "gpu", False),
        ("cpu", NO_GPUS, "cpu", False),
        ("cpu", FAKE_GPUS, "cpu", False),
    ],
)
def test_mode_follows_the_cluster(requested, found, mode, warns):
    chosen, warning = choose_mode(requested, found)
    assert chosen == mode
    assert (warning is not None) == warns


@pytest.mark.parametrize(
    ("requested", "found", "says"),
    [
        ("gpu", NO_GPUS, "no GPU resources"),
        ("gpu", FAKE_GPUS, r"sees no CUDA device \(GPU resources without GPUs; node\(s\) n1 "),
        ("gpu", ONE_NODE_BROKEN, r"on node\(s\) gpu7 \(10\.0\.0\.7\) a process holding a GPU"),
        ("auto", ONE_NODE_BROKEN, r"--drpo.device auto: on node\(s\) gpu7 \(10\.0\.0\.7\)"),
        ("cpu", ONE_NODE_BROKEN, "drop --drpo.device cpu"),
        ("cpu", REAL_GPUS, "drop --drpo.device cpu"),
        ("tpu", NO_GPUS, "must be one of"),
    ],
)
def test_contradictions_are_errors(requested, found, says):
    with pytest.raises(DeviceError, match=says):
        choose_mode(requested, found)


# Hang guards: the probe's process took 5 s, the refused run's 8 s (2 cores at load 2-3), so
# 180 s is over 20x; the probe's own limit inside the process is below the process's
PROBE = (
    "import dataclasses, json; from drpo_openrlhf.runtime.device import probe_cluster; "
    f"print(json.dumps(dataclasses.asdict(probe_cluster(timeout_s={scaled(60)}))))"
)


def _env(address: str) -> dict[str, str]:
    return {**os.environ, "RAY_ADDRESS": address}


@pytest.mark.slow
def test_probe_asks_a_process_holding_a_gpu(fake_gpu_ray):
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=_env(fake_gpu_ray),
        capture_output=True,
        text=True,
        timeout=scaled(180),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    found = ClusterDevices(**{**answer, "nodes_without_cuda": tuple(answer["nodes_without_cuda"])})
    assert found.gpus == 2.0 and found.worker_cuda is False
    (node,) = found.nodes_without_cuda  # the cluster's one node, by host name and address
    assert re.fullmatch(rf"{re.escape(socket.gethostname())} \([0-9.]+\)", node), node
    assert found.address and found.address.endswith(fake_gpu_ray.rsplit(":", 1)[-1])
    assert choose_mode("auto", found)[0] == "cpu"


@pytest.mark.slow
def test_gpu_requested_of_fake_gpus_stops_before_anything_starts(fake_gpu_ray, tmp_path):
    model = build_tiny_model(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=?", "label": "2"}) + "\n")
    command = [
        sys.executable,
        "-m",
        "drpo_openrlhf.train",
        *("--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data)),
        *("--data.input_key", "prompt", "--data.label_key", "label"),
        *("--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1"),
        *("--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4"),
        *("--train.batch_size", "16", "--train.micro_batch_size", "8"),
        *("--drpo.device", "gpu"),
    ]
    done = subprocess.run(
        command, env=_env(fake_gpu_ray), capture_output=True, text=True, timeout=scaled(180)
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--drpo.device gpu, but a process holding one of the cluster's 2 GPUs" in done.stderr
    assert f"node(s) {socket.gethostname()} (" in done.stderr


def test_a_cluster_that_is_gone_is_a_clear_error(monkeypatch):
    """Ray's address file (or RAY_ADDRESS) naming a stopped cluster: the run stops, saying so."""
    from drpo_openrlhf.runtime import device

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(
        DeviceError, match=r"nothing answers at the Ray cluster address 127\.0\.0\.1:9"
    ):
        device.probe_cluster()
