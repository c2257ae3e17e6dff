"""Every weight sync checked exactly (``--drpo.verify_weight_sync``, on by default).

OpenRLHF's sync (``trainer/ray/ppo_actor.py: broadcast_to_vllm``) sends each actor parameter
to every vLLM engine; nothing checks that the engines load it. A run whose engines dropped
every tensor trained for 32 steps and exited 0 (issue 22). Three mixins close that:

- ``SentDigestsActor`` (actor ranks): rank 0 digests each tensor it sends, while it is
  gathered for sending, by seeing the ``update_weight`` call it makes on the first engine.
- ``SyncReportingEngine`` (vLLM engine actors): forwards ``begin_weight_sync`` and
  ``weight_sync_report`` to every worker of the engine (``vllm_sync_worker``).
- ``VerifiedSyncTrainer`` (the driver's trainer): around each sync, starts the recording,
  then compares what every engine loaded and holds with what was sent
  (``weight_digest.check_sync``) and stops the run with ``WeightSyncError`` naming the
  engine, the parameters and the rollout step.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import ray
import torch

from drpo_openrlhf.integration.weight_digest import Digest, WorkerReport, check_sync, digest

SYNC_METHODS = ("update_weight", "update_weight_cuda_ipc")


class _DigestingMethod:
    def __init__(self, method: Any, params: Mapping[str, torch.Tensor], sent: dict) -> None:
        self._method, self._params, self._sent = method, params, sent

    def remote(self, name: str, *args, **kwargs):
        self._sent[name] = digest(self._params[name].data)
        return self._method.remote(name, *args, **kwargs)


class _DigestingEngine:
    """An engine handle whose sync calls first digest the named actor parameter: OpenRLHF
    makes them inside the parameter's ZeRO-3 gather, so the digest costs no extra gather."""

    def __init__(self, engine: Any, params: Mapping[str, torch.Tensor], sent: dict) -> None:
        self._engine, self._params, self._sent = engine, params, sent

    def __getattr__(self, attr: str) -> Any:
        method = getattr(self._engine, attr)
        if attr in SYNC_METHODS:
            return _DigestingMethod(method, self._params, self._sent)
        return method


@contextmanager
def digests_of_sent(trainer: Any) -> Iterator[dict[str, Digest]]:
    """During an ``ActorPPOTrainer.broadcast_to_vllm``, collect on rank 0 the digest of every
    tensor sent, by name."""
    sent: dict[str, Digest] = {}
    engines = trainer.vllm_engines
    if engines and torch.distributed.get_rank() == 0:
        params = dict(trainer.actor.model.module.named_parameters())
        trainer.vllm_engines = [_DigestingEngine(engines[0], params, sent), *engines[1:]]
    try:
        yield sent
    finally:
        trainer.vllm_engines = engines


def _verifying(args: Any) -> bool:
    return args.drpo_run.verify_weight_sync


class SentDigestsActor:
    """Mixin of the actor's Ray class (``PolicyModelActor``): keeps rank 0's digests of the
    last sync for the driver."""

    _sent_digests: dict[str, Digest] | None = None

    def broadcast_to_vllm(self) -> None:
        if not _verifying(self.trainer.strategy.args):
            return super().broadcast_to_vllm()
        with digests_of_sent(self.trainer) as sent:
            super().broadcast_to_vllm()
        self._sent_digests = sent if torch.distributed.get_rank() == 0 else None

    def sent_weight_digests(self) -> dict[str, Digest] | None:
        return self._sent_digests


class SyncReportingEngine:
    """Mixin of the vLLM engine's Ray class: the recorder's calls on all its workers."""

    async def begin_weight_sync(self) -> None:
        await self.llm.collective_rpc("begin_weight_sync")

    async def weight_sync_report(self) -> list[dict]:
        return await self.llm.collective_rpc("weight_sync_report")


def worker_report(raw: dict) -> WorkerReport:
    return WorkerReport(
        loads={name: [tuple(p) for p in places] for name, places in raw["loads"].items()},
        params={name: Digest(*value) for name, value in raw["params"].items()},
    )


class VerifiedSyncTrainer:
    """Mixin of the driver's ``PPOTrainer``: every ``broadcast_to_vllm`` is checked."""

    _sync_when = "at the start of the resumed run"

    def train_step(self, rollout_samples, global_step: int):
        self._sync_when = f"after rollout step {global_step + 1}"
        return super().train_step(rollout_samples, global_step)

    def broadcast_to_vllm(self) -> None:
        if not _verifying(self.args):
            return super().broadcast_to_vllm()
        ray.get([engine.begin_weight_sync.remote() for engine in self.vllm_engines])
        super().broadcast_to_vllm()
        ranks = ray.get(self.actor_model_group.async_run_method(method_name="sent_weight_digests"))
        sent = next(s for s in ranks if s is not None)
        reports = ray.get([engine.weight_sync_report.remote() for engine in self.vllm_engines])
        check_sync(sent, [[worker_report(w) for w in r] for r in reports], self._sync_when)
