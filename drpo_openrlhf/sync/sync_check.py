"""The engines' weights checked exactly against the actor's, before the first rollout and
after every weight sync (``--drpo.verify_weight_sync``, on by default).

OpenRLHF's sync (``trainer/ray/ppo_actor.py: broadcast_to_vllm``) sends each actor parameter
to every vLLM engine; nothing checks that the engines load it, nor that the weights vLLM
loaded from disk at start-up are the actor's. A run whose engines dropped every tensor
trained for 32 steps and exited 0. These mixins close that:

- ``SentDigestsActor`` (actor ranks): rank 0 digests each tensor it sends, while it is
  gathered for sending, by seeing the ``update_weight`` call it makes on the first engine;
  and, before the first rollout, the shape and digest of every tensor it would send.
- ``SyncReportingEngine`` (vLLM engine actors): forwards ``map_weight_layout``,
  ``begin_weight_sync`` and ``weight_sync_report`` to every worker (``vllm_sync_worker``),
  and scores the probe.
- ``VerifiedSyncTrainer`` (the driver's trainer): at start-up, has every worker map where
  each actor tensor lives in its parameters and, unless the run resumes (its first sync comes
  first), compares what the engines hold with the actor's weights; around each sync, starts
  the recording, then compares what every engine loaded and holds with what was sent
  (``weight_digest.check_sync``). A difference stops the run with ``WeightSyncError`` naming
  the engine, the parameters and the step. Then every engine is told the weights' version
  (``weight_version``), before anything generates with them.
- The weight probe: after each check the actor scores a fixed text token by token; the
  engines score it before the next rollout's first request (``ProbingSamplesGenerator``; an
  asynchronous run's generator: ``runtime/async_trainer.py``), when OpenRLHF has woken them
  under ``--vllm.enable_sleep`` and they are idle, so each scores it alone, in the same shape.
  An engine that scores it differently from the others or too far from the actor stops the
  run (``sync/weight_probe.py``, ``--drpo.weight_probe``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial, wraps
from typing import Any, TypeVar

import ray
import torch
from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

from drpo_openrlhf.sync import engine_settings
from drpo_openrlhf.sync.weight_digest import Digest, WorkerReport, check_sync, digest
from drpo_openrlhf.sync.weight_probe import (
    PROBE_TOKENS,
    ActorLimits,
    WeightProbeError,
    compare_probe,
    probe_token_ids,
)
from drpo_openrlhf.sync.weight_version import tag_version

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


Method = TypeVar("Method", bound=Callable[..., Any])


def releasing_device_cache(method: Method) -> Method:
    """After ``method`` (a one-off forward or gather on the actor's GPU: the probe's fp32
    logits, each parameter gathered whole), the CUDA allocator's cached blocks go back to
    the device: colocated vLLM engines map their KV cache into the same GPU next (about
    2-3 GiB at 7B/8B), as OpenRLHF empties the cache after its own colocated forwards."""

    @wraps(method)
    def released(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:  # the method's frame, and the tensors only it held, are gone here
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    return released  # type: ignore[return-value]


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

    def actor_settings(self) -> dict[str, str] | None:
        """On rank 0, what the actor runs, for ``engine_settings.check``."""
        if torch.distributed.get_rank() != 0:
            return None
        model = self.trainer.actor.model.module
        return engine_settings.actor_settings(model, self.trainer.strategy.args.data.max_len)

    @releasing_device_cache
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """The actor's log-prob of each probe token after those before it, at temperature 1
        as vLLM's prompt log-probs; run on every rank (ZeRO-3 gathers, ring attention) through
        the forward the experience maker uses."""
        ids = torch.tensor([token_ids])
        actor, temperature = self.actor, self.actor.temperature
        actor.temperature = 1.0
        try:
            mask = torch.ones(1, len(token_ids) - 1, dtype=torch.bool)
            log_probs = self.forward(ids, mask, torch.ones_like(ids))
        finally:
            actor.temperature = temperature
        return log_probs[0].float().tolist()

    @releasing_device_cache
    def actor_weights(self, digests: bool) -> dict[str, tuple] | None:
        """On rank 0, name -> (shape as sent, digest or None) of every tensor a sync sends
        (``broadcast_to_vllm``'s selection); the digests need each parameter gathered, on every
        rank, as the sync gathers it."""
        import deepspeed  # here: the engines import this module, and DeepSpeed is the actor's

        trainer, rank0 = self.trainer, torch.distributed.get_rank() == 0
        args = trainer.strategy.args
        model = trainer.actor.model.module
        vlm = getattr(trainer.actor, "is_vlm", False)
        weights = {}
        for name, param in model.named_parameters():
            if vlm and not param.requires_grad:
                continue
            if not digests and args.ds.tensor_parallel_size == 1:  # no gather needed
                shape = param.ds_shape if args.ds.zero_stage == 3 else param.shape
                weights[name] = (tuple(shape), None)
                continue
            if args.ds.tensor_parallel_size > 1:
                gather = deepspeed.module_inject.layers.GatherReplacedLayerParams(
                    [param], model, enabled=True
                )
            else:
                gather = deepspeed.zero.GatheredParameters([param], enabled=args.ds.zero_stage == 3)
            with gather:  # shapes as broadcast_to_vllm reads them, inside its gather
                shape = param.ds_shape if args.ds.zero_stage == 3 else param.shape
                if rank0:
                    weights[name] = (tuple(shape), digest(param.data) if digests else None)
        return weights if rank0 else None


class SyncReportingEngine:
    """Mixin of the vLLM engine's Ray class: the recorder's calls on all its workers."""

    async def map_weight_layout(self, shapes: dict) -> None:
        await self.llm.collective_rpc("map_weight_layout", args=(shapes,))

    async def begin_weight_sync(self) -> None:
        await self.llm.collective_rpc("begin_weight_sync")

    async def weight_sync_report(self) -> list[dict]:
        return await self.llm.collective_rpc("weight_sync_report")

    async def engine_settings(self) -> list[dict[str, str]]:
        return await self.llm.collective_rpc("engine_settings")

    async def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """vLLM's log-prob of each probe token after those before it (prompt log-probs: from
        the raw logits at temperature 1, whatever the sampling settings). A request for prompt
        log-probs never reads the prefix cache (vLLM's ``SamplingParams``
        ``skip_reading_prefix_cache``), so the probe computes every position afresh."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        output = await self.generate(token_ids, params)
        return [
            entry[token].logprob
            for token, entry in zip(token_ids[1:], output.prompt_logprobs[1:], strict=True)
        ]


def worker_report(raw: dict) -> WorkerReport:
    return WorkerReport(
        loads={name: [tuple(p) for p in places] for name, places in raw["loads"].items()},
        held={name: Digest(*value) for name, value in raw["held"].items()},
        param=dict(raw["param"]),
        unloaded=list(raw["unloaded"]),
    )


def probe_engines(
    engines: list,
    ids: list[int],
    actor: list[float],
    limits: ActorLimits,
    guard: str,
    when: str,
    kinds: list[str] | None = None,
) -> dict[str, float]:
    """Every engine scores the probe ``ids``; compare with the actor's scores ``actor``
    (``weight_probe.compare_probe``, each engine's limit in ``limits``, engines held to each
    other within their ``kinds``), log, and stop the run with ``WeightProbeError`` on what
    ``guard`` (``--drpo.weight_probe``) guards. Returns the probe's metrics. Whoever runs it
    must know the engines idle and holding the weights the actor scored."""
    scores = ray.get([engine.probe_logprobs.remote(ids) for engine in engines])
    result = compare_probe(actor, scores, limits, guard, kinds)
    gaps = ", ".join(f"engine {i} mean {m:.3g} max {x:.3g}" for i, (m, x) in enumerate(result.gaps))
    spread = f"; engines differ by up to {result.engine_spread:.3g}" if len(scores) > 1 else ""
    summary = f"|vLLM - actor| log-prob over {len(actor)} fixed tokens: {gaps}{spread}"
    lines = [f"weight probe {when}: {summary}", *result.notes]
    print("\n".join(f"drpo_openrlhf: {line}" for line in lines), flush=True)
    if result.problems:
        raise WeightProbeError(
            f"weight probe {when} failed (--drpo.weight_probe {guard}):\n  "
            + "\n  ".join(result.problems)
            + f"\n({summary})\nThe digests found every engine's weights exact, so an "
            "engine computes with them otherwise (rotary base or scaling, dtype, attention "
            "kernel, quantization). Engines meant to differ: --drpo.weight_probe actor (from "
            "each other), engines (from the actor) or log (docs/reliability.md)."
        )
    return result.metrics()


class ProbingSamplesGenerator:
    """Mixin of the driver's samples generator: runs the weight probe a check left pending
    before the first request to the engines. OpenRLHF wakes sleeping engines (KV cache too)
    just before (``samples_generator.py: generate_samples``, ``generate_eval_samples``), so
    the probe runs within the memory plan of generation, in every layout, and on idle engines."""

    pending_probe: Callable[[], None] | None = None

    def _dispatch_prompts_to_vllm(self, *args, **kwargs):
        probe, self.pending_probe = self.pending_probe, None
        if probe is not None:
            probe()
        return super()._dispatch_prompts_to_vllm(*args, **kwargs)


class VerifiedSyncTrainer:
    """Mixin of the driver's ``PPOTrainer``: the engines' first weights and every
    ``broadcast_to_vllm`` are checked, then probed."""

    _sync_when = "at the start of the resumed run"
    _probe_ids: list[int] | None = None
    _probe_limits: ActorLimits | None = None
    _probe_kinds: list[str] | None = None  # per engine: ``engine_settings.kernel_kind``
    _probe_metrics: dict[str, float] | None = None
    # the version of the actor's weights (its updates so far), kept by the trainer
    _weights_version = 0

    def _actor_weights(self, digests: bool) -> dict[str, tuple]:
        ranks = ray.get(
            self.actor_model_group.async_run_method(method_name="actor_weights", digests=digests)
        )
        return next(w for w in ranks if w is not None)

    def _engine_reports(self) -> list[list[WorkerReport]]:
        reports = ray.get([engine.weight_sync_report.remote() for engine in self.vllm_engines])
        return [[worker_report(w) for w in r] for r in reports]

    def _check_engine_settings(self, when: str) -> None:
        """What every engine runs against what the actor runs (``engine_settings``)."""
        ranks = ray.get(self.actor_model_group.async_run_method(method_name="actor_settings"))
        actor = next(s for s in ranks if s is not None)
        engines = ray.get([engine.engine_settings.remote() for engine in self.vllm_engines])
        allowed = self.args.drpo_run.allow_engine_difference
        print(f"drpo_openrlhf: {engine_settings.check(actor, engines, when, allowed)}", flush=True)
        self._probe_kinds = [engine_settings.kernel_kind(workers) for workers in engines]
        mixed = engine_settings.mixed_kinds(self._probe_kinds)
        if mixed:
            print(f"drpo_openrlhf: {mixed}", flush=True)

    def init_checkpoint_states(self):
        """Called once at the start of ``fit``, before any sync or rollout: compare what the
        engines run with what the actor runs, map the layout and, in a run that does not
        resume, check the weights vLLM loaded from disk."""
        states = super().init_checkpoint_states()
        if not self.vllm_engines:
            return states
        resuming = states["global_step"] > 0
        self._check_engine_settings("at the resumed run's start" if resuming else "at start-up")
        if not _verifying(self.args):
            return states
        if self.args.vllm.enable_sleep and not resuming:  # asleep since start: weights on host
            batch_vllm_engine_call(self.vllm_engines, "wake_up", tags=["weights"])
        weights = self._actor_weights(digests=not resuming)
        shapes = {name: shape for name, (shape, _) in weights.items()}
        ray.get([engine.map_weight_layout.remote(shapes) for engine in self.vllm_engines])
        if not resuming:
            actor = {name: d for name, (_, d) in weights.items()}
            check_sync(actor, self._engine_reports(), "before the first rollout", synced=False)
            self._probe("before the first rollout")
        return states

    def _probe(self, when: str) -> None:
        """Score the probe on the actor now, on the weights just checked, and leave the
        engines' scoring to the samples generator (``_post_probe``): under
        ``--vllm.enable_sleep`` their KV cache sleeps until OpenRLHF wakes them to generate,
        and the memory plan counts on that. The actor's weights do not change until after
        that rollout."""
        if self._probe_ids is None:  # as long as vLLM's context allows (prompt + 1 token)
            count = min(PROBE_TOKENS, self.args.data.max_len - 1)
            self._probe_ids = probe_token_ids(self.tokenizer, count)
        actor = ray.get(
            self.actor_model_group.async_run_method(
                method_name="probe_logprobs", token_ids=self._probe_ids
            )
        )[0]
        self._post_probe(when, actor)

    def _post_probe(self, when: str, actor: list[float]) -> None:
        """The engines score the probe before the next rollout's first request, in this
        process's samples generator."""
        self.samples_generator.pending_probe = partial(self._probe_engines, when, actor)

    def _probe_engines(self, when: str, actor: list[float]) -> None:
        if self._probe_limits is None:
            self._probe_limits = ActorLimits()
        guard = self.args.drpo_run.weight_probe
        self._probe_metrics = probe_engines(
            self.vllm_engines,
            self._probe_ids,
            actor,
            self._probe_limits,
            guard,
            when,
            self._probe_kinds,
        )

    def train_step(self, rollout_samples, global_step: int):
        self._sync_when = f"after rollout step {global_step + 1}"
        status, step = super().train_step(rollout_samples, global_step)
        if self._probe_metrics:  # the probe of the weights that sampled this rollout
            status.update(self._probe_metrics)
        return status, step

    def broadcast_to_vllm(self) -> None:
        """OpenRLHF's sync, checked and probed; then the engines are told the weights'
        version (``weight_version``), before generation can use them."""
        verifying = _verifying(self.args)
        if verifying:
            ray.get([engine.begin_weight_sync.remote() for engine in self.vllm_engines])
        super().broadcast_to_vllm()
        if verifying:
            ranks = ray.get(
                self.actor_model_group.async_run_method(method_name="sent_weight_digests")
            )
            sent = next(s for s in ranks if s is not None)
            check_sync(sent, self._engine_reports(), self._sync_when)
            print(
                f"drpo_openrlhf: weight sync {self._sync_when} checked: {len(self.vllm_engines)} "
                f"engine(s) hold the {len(sent)} tensors sent, weight version "
                f"{self._weights_version}",
                flush=True,
            )
            self._probe(self._sync_when)
        tag_version(self.vllm_engines, self._weights_version)
