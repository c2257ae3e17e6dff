"""GPU run or CPU run, decided from the Ray cluster the run will use, not from the driver.

Under ``ray job submit --entrypoint-num-cpus 1 -- python -m drpo_openrlhf.train`` (the normal
way on a cluster) the driver process sees no GPU while every worker has one, so
``torch.cuda.is_available()`` in the driver says nothing about the run. The cluster is asked
instead: how many GPUs it advertises, and whether a process holding one of them sees a CUDA
device (a cluster started with ``ray start --num-gpus N`` on a machine without CUDA, as the
tests, the demo and the Slurm fixture do, advertises GPUs that do not exist).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEVICES = ("auto", "gpu", "cpu")
PROBE_TIMEOUT_S = 120.0


class DeviceError(ValueError):
    """``--drpo.device`` contradicts what the cluster offers."""


@dataclass(frozen=True)
class ClusterDevices:
    """What the run's Ray cluster offers.

    ``address``: the cluster to join (None: ``ray.init`` will start a local one on this
    machine); ``gpus``: GPU resources it advertises; ``worker_cuda``: whether a process holding
    one of them sees CUDA, asked on every node with GPUs (True: on some node; None when it
    could not be asked: no GPU, or none free in time); ``nodes_without_cuda``: the nodes whose
    process saw none, named ``host (ip)``.
    """

    address: str | None
    gpus: float
    worker_cuda: bool | None
    nodes_without_cuda: tuple[str, ...] = ()


def choose_mode(requested: str, found: ClusterDevices) -> tuple[str, str | None]:
    """``("gpu" | "cpu", warning or None)`` for ``--drpo.device requested`` on ``found``.

    Raises ``DeviceError`` where the request cannot work: GPU asked of a cluster without (real)
    GPUs, or CPU forced on one whose GPU workers see CUDA (the actor would take the GPUs while
    the engines took the CPU path)."""
    if requested not in DEVICES:
        raise DeviceError(f"--drpo.device must be one of {DEVICES}, got {requested!r}")
    fake = found.gpus > 0 and found.worker_cuda is False
    nodes = ", ".join(found.nodes_without_cuda) or "unnamed"
    if found.worker_cuda and found.nodes_without_cuda and requested != "cpu":
        # some nodes' GPUs work: a GPU run, whose actors or engines on the others would fail
        # at their start, far from the cause
        raise DeviceError(
            f"--drpo.device {requested}: on node(s) {nodes} a process holding a GPU sees no "
            "CUDA device while the cluster's other GPU nodes do: fix those nodes' CUDA setup "
            "(driver, CUDA_VISIBLE_DEVICES) or leave them out of the job"
        )
    if requested == "gpu":
        if found.gpus == 0:
            raise DeviceError("--drpo.device gpu, but the Ray cluster has no GPU resources")
        if fake:
            raise DeviceError(
                f"--drpo.device gpu, but a process holding one of the cluster's {found.gpus:g} "
                f"GPUs sees no CUDA device (GPU resources without GPUs; node(s) {nodes}): fix "
                "the nodes' CUDA setup, or use --drpo.device cpu"
            )
        return "gpu", None
    if requested == "cpu":
        if found.gpus > 0 and found.worker_cuda:
            raise DeviceError(
                f"--drpo.device cpu, but the cluster's {found.gpus:g} GPUs are real (a process "
                "holding one sees CUDA): the CPU path cannot run there; drop --drpo.device cpu"
            )
        return "cpu", None
    if found.gpus == 0:
        return "cpu", None
    if fake:
        return "cpu", (
            f"the Ray cluster advertises {found.gpus:g} GPUs but a process holding one sees no "
            "CUDA device: treating them as CPU slots (CPU run). Pass --drpo.device gpu to make "
            "this an error instead"
        )
    if found.worker_cuda is None:
        return "gpu", (
            f"could not check CUDA on the cluster's {found.gpus:g} GPUs (none free within "
            f"{PROBE_TIMEOUT_S:g} s): assuming a GPU run"
        )
    return "gpu", None


def _listening(address: str, timeout_s: float = 10.0) -> bool:
    """Whether the cluster's GCS port accepts a connection (``ray.init`` would otherwise retry a
    dead address for minutes)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _cuda_in_worker() -> bool:
    return torch.cuda.is_available()


def _gpu_nodes() -> dict[str, str]:
    """The alive nodes that advertise GPUs: node id -> ``host (ip)``."""
    import ray

    return {
        node["NodeID"]: f"{node['NodeManagerHostname']} ({node['NodeManagerAddress']})"
        for node in ray.nodes()
        if node["Alive"] and node["Resources"].get("GPU", 0) > 0
    }


def _probe_nodes(timeout_s: float) -> tuple[bool | None, tuple[str, ...]]:
    """Ask a process holding one GPU on each GPU node whether it sees CUDA, all at once
    (``ClusterDevices.worker_cuda`` and ``.nodes_without_cuda``); a node with no GPU free
    within ``timeout_s`` is not counted."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_gpus=1, num_cpus=0)(_cuda_in_worker)
    refs = {
        probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
        ).remote(): name
        for node_id, name in _gpu_nodes().items()
    }
    if not refs:
        return None, ()
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in pending:
        ray.cancel(ref, force=True)
    answers = {refs[ref]: bool(ray.get(ref)) for ref in ready}
    if not answers:
        return None, ()
    without = tuple(sorted(name for name, cuda in answers.items() if not cuda))
    return any(answers.values()), without


def probe_cluster(timeout_s: float = PROBE_TIMEOUT_S) -> ClusterDevices:
    """Ask the cluster that ``ray.init()`` would join (``RAY_ADDRESS``, or a running local
    cluster) what it offers, every GPU node of it; with none to join, the local cluster
    OpenRLHF starts is this machine, so its CUDA answers. Leaves Ray shut down, as it found
    it."""
    import ray
    from ray._private.services import canonicalize_bootstrap_address

    address = canonicalize_bootstrap_address(None)
    if address is None:
        cuda = torch.cuda.is_available()
        return ClusterDevices(None, float(torch.cuda.device_count()), cuda if cuda else None)
    if not _listening(address):
        raise DeviceError(
            f"nothing answers at the Ray cluster address {address} (named by RAY_ADDRESS, or by "
            "the address file of an earlier `ray start` on this node): start that cluster, or "
            "unset RAY_ADDRESS / run `ray stop` so that the run starts its own"
        )
    ray.init(address=address, log_to_driver=False)
    try:
        gpus = float(ray.cluster_resources().get("GPU", 0))
        worker_cuda, without = _probe_nodes(timeout_s) if gpus > 0 else (None, ())
    finally:
        ray.shutdown()
    return ClusterDevices(address, gpus, worker_cuda, without)


def resolve_mode(requested: str) -> tuple[str, ClusterDevices]:
    """Probe the cluster and choose the mode; logs the choice and any warning."""
    found = probe_cluster()
    mode, warning = choose_mode(requested, found)
    if warning:
        logger.warning(warning)
    where = found.address or "a local Ray cluster on this machine"
    logger.warning(
        "%s run on %s (%g GPU resources; --drpo.device %s)",
        mode.upper(),
        where,
        found.gpus,
        requested,
    )
    return mode, found
