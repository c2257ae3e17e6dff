"""OpenRLHF's real actor stack (``DeepspeedStrategy``, ``Actor``, ``ActorPPOTrainer``) built in
one process the way its Ray ``PolicyModelActor`` builds it, without Ray and, on CPU, without
CUDA. Shared by the exactness tests and ``scripts/bench_actor_update.py``, hence in the package:
a script never reaches into ``tests/``.

Substitutions: torch's AdamW instead of DeepSpeed's FusedAdam (whose JIT build takes ~40 s and
needs a compiler toolchain); on CPU also gloo with a CPU device mesh, and answers to the
``torch.cuda`` device queries OpenRLHF makes unconditionally. OpenRLHF's ``Actor`` imports
flash-attn: on CPU its stand-in must be on the path already (the CPU venv's ``.pth`` file,
or the tests' ``stand_ins``, whose ``PYTHONPATH`` the ranks' processes inherit).
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from unittest import mock

import torch


def free_port() -> int:
    """A TCP port nobody listens on now, for a rendezvous on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank process of the multi-rank tests imports; on CPU they are imported once, in
# a forkserver that the ranks fork from (about 10 CPU-s per process of torch, DeepSpeed,
# transformers, OpenRLHF and vLLM, which OpenRLHF's actor module imports)
RANK_IMPORTS = ["torch", "deepspeed", "transformers", "drpo_openrlhf.update.actor_trainer"]


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int, device: str = "cpu") -> None:
    """``fn(rank, *args)`` in ``nprocs`` new processes, joined (``torch.multiprocessing.spawn``'s
    contract). On CPU they fork from a forkserver that has imported ``RANK_IMPORTS`` and
    touched nothing else, so a rank starts in a fraction of a second instead of importing
    them again; each runs under the caller's environment as it is now (the forkserver keeps
    the one of its start). CUDA ranks spawn fresh, as CUDA does not survive a fork."""
    import multiprocessing

    import torch.multiprocessing as mp

    if device != "cpu":
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
        return
    multiprocessing.set_forkserver_preload(RANK_IMPORTS)
    target = functools.partial(_in_environ, dict(os.environ), fn)
    mp.start_processes(target, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _in_environ(environ: dict[str, str], fn: Callable[..., None], rank: int, *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def set_rank_env(rank: int, world: int, port: int, device: str = "cpu") -> None:
    """What a launcher would export for this rank; ``LOCAL_RANK`` selects the GPU on CUDA."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank) if device == "cuda" else "-1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHDYNAMO_DISABLE="1",
        HF_HUB_OFFLINE="1",
    )


def openrlhf_args(flags: list[str]):
    """OpenRLHF's nested args for ``flags``, completed as ``train_ppo_ray``'s main does."""
    from openrlhf.utils.config import hierarchize

    from drpo_openrlhf.runtime.openrlhf_cli import openrlhf_parser

    args = hierarchize(openrlhf_parser().parse_args(flags))
    if args.actor.eps_clip_low_high is None:
        args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)
    return args


def setup_strategy(args, param_dtype: str, device: str = "cpu"):
    """``DeepspeedStrategy`` with distributed set up; ``param_dtype`` may be ``fp32``, which
    OpenRLHF's flag does not offer but its DeepSpeed config supports."""
    from openrlhf.utils import get_strategy
    from openrlhf.utils.deepspeed import deepspeed as openrlhf_ds
    from torch.distributed.device_mesh import init_device_mesh

    strategy = get_strategy(args)
    strategy.param_dtype = param_dtype
    get_config = strategy.get_ds_train_config

    def torch_adam_config(*a, **k):
        config = get_config(*a, **k)
        if "optimizer" in config:
            config["optimizer"]["params"]["torch_adam"] = True
            config["zero_allow_untested_optimizer"] = True
        return config

    strategy.get_ds_train_config = torch_adam_config
    cpu_mesh = lambda _device, *a, **k: init_device_mesh("cpu", *a, **k)  # noqa: E731
    patch = mock.patch.object(openrlhf_ds, "init_device_mesh", cpu_mesh)
    with patch if device == "cpu" else nullcontext():
        strategy.setup_distributed()
    return strategy


def prepare_actor(strategy, model: torch.nn.Module, scheduler_steps: int = 10):
    """Wrap ``model`` in OpenRLHF's ``Actor`` and DeepSpeed engine; returns actor, optim, sched.

    The model is built normally and partitioned by ``deepspeed.initialize``: loading under
    ``zero.Init`` gathers through ``GatheredParameters``, which is unsafe on gloo (see
    ``whole_parameters``)."""
    from openrlhf.models import Actor

    args = strategy.args
    actor = Actor(model, temperature=args.rollout.temperature)
    actor.packing_samples = args.ds.packing_samples
    if args.actor.gradient_checkpointing_enable:
        actor.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={
                "use_reentrant": args.actor.gradient_checkpointing_reentrant
            }
        )
    cfg = dict(
        optim=args.actor.optim,
        muon=vars(args.actor.muon),
        adam=vars(args.actor.adam),
        lr_scheduler=args.actor.lr_scheduler,
        lr_warmup_ratio=args.actor.lr_warmup_ratio,
        min_lr_ratio=args.actor.min_lr_ratio,
        max_norm=args.actor.max_norm,
        scheduler_steps=scheduler_steps,
    )
    return strategy.prepare((actor, cfg))


@contextmanager
def fp32_tensor_parallel() -> Iterator[None]:
    """OpenRLHF hands DeepSpeed AutoTP ``dtype=torch.bfloat16`` whatever ``param_dtype``
    says; keep the test model in fp32 so that its update can be compared exactly."""
    import deepspeed

    init = deepspeed.tp_model_init

    def fp32_init(*args, **kwargs):
        return init(*args, **{**kwargs, "dtype": torch.float32})

    with mock.patch.object(deepspeed, "tp_model_init", fp32_init):
        yield


def whole_parameters(module: torch.nn.Module, zero_stage: int, tp: int = 1) -> list[torch.Tensor]:
    """Float64 copies of every parameter of ``module``, gathered whole under ZeRO-3 or
    DeepSpeed AutoTP (``tp`` > 1: each layer gathers its shards with its own all-gather).

    Not ``deepspeed.zero.GatheredParameters``: it starts one async all-gather per parameter
    and waits on the last one only. NCCL completes a stream's collectives in order, so that
    suffices on GPUs; gloo spreads them over worker threads, and on two CPU ranks about 2% of
    gathers returned uninitialised memory. Each all-gather here is synchronous
    (tests/test_whole_parameters.py repeats it many times)."""
    params = list(module.parameters())
    if tp > 1:
        from deepspeed.module_inject.layers import GatherReplacedLayerParams

        whole = []
        for p in params:
            with GatherReplacedLayerParams([p], module):
                whole.append(p.detach().clone().double())
        return whole
    if zero_stage != 3:
        return [p.detach().clone().double() for p in params]
    world = torch.distributed.get_world_size()
    whole = []
    for p in params:
        parts = [torch.empty_like(p.ds_tensor) for _ in range(world)]
        torch.distributed.all_gather(parts, p.ds_tensor.detach())
        whole.append(torch.cat(parts)[: p.ds_numel].view(p.ds_shape).double())
    return whole


@contextmanager
def cuda_queries_answered(device: str, current: int | str) -> Iterator[None]:
    """On CPU, answer ``torch.cuda.current_device()`` with ``current`` and make
    ``torch.cuda.synchronize`` a no-op; on CUDA change nothing."""
    if device != "cpu":
        yield
        return
    with (
        mock.patch("torch.cuda.current_device", lambda: current),
        mock.patch("torch.cuda.synchronize", lambda *a: None),
    ):
        yield


def ppo_trainer(strategy, actor, optim, scheduler, device: str = "cpu"):
    """OpenRLHF's ``ActorPPOTrainer`` as ``PolicyModelActor`` configures it (no vLLM, no EMA).

    Its replay buffer formats ``cuda:{current_device()}``, hence ``0`` here; run ``ppo_train``
    under ``cuda_queries_answered(device, "cpu")``, which moves batches to the CPU."""
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    with cuda_queries_answered(device, 0):
        return ActorPPOTrainer(
            strategy,
            actor,
            ema_model=None,
            actor_optim=optim,
            actor_scheduler=scheduler,
            micro_train_batch_size=strategy.args.train.micro_batch_size,
            tokenizer=None,
            dataloader_pin_memory=False,
        )


def experience(
    data: dict[str, torch.Tensor],
    old_log_probs: torch.Tensor,
    info: dict[str, torch.Tensor],
    rollout_log_probs: torch.Tensor | None = None,
):
    """An OpenRLHF ``Experience`` of right-padded rows, with per-row ``info`` (the prompt-group
    ids and slots the DRPO experience maker adds); ``advantages`` when ``data`` has them (for
    the stock PPO loss); ``rollout_log_probs``: the vLLM engines' log-probs of its tokens."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    b = data["sequences"].shape[0]
    return Experience(
        sequences=data["sequences"],
        attention_mask=data["attention_mask"],
        action_mask=data["action_mask"],
        action_log_probs=old_log_probs,
        rollout_log_probs=rollout_log_probs,
        advantages=data.get("advantages"),
        rewards=data["scores"],
        scores=data["scores"],
        response_length=data["action_mask"].sum(-1).float(),
        truncated=torch.zeros(b),
        total_length=data["attention_mask"].sum(-1).float(),
        prompts=["p"] * b,
        labels=["l"] * b,
        info=info,
    )


def openrlhf_share(count: int, world: int, rank: int, batch_size: int = 1) -> torch.Tensor:
    """The rollout positions ``rank`` receives from OpenRLHF's stock driver: the rollout cut
    into experience batches of ``batch_size`` (``--rollout.micro_batch_size``), then the
    ``rank``-th contiguous chunk of ``ceil(batches / world)`` batches
    (``async_run_method_batch``). The baseline PPO update trains on this share."""
    batches = -(-count // batch_size)
    chunk = -(-batches // world) * batch_size
    return torch.arange(count)[rank * chunk : (rank + 1) * chunk]


def dealt_share(
    group_ids: torch.Tensor,
    layout,
    rank: int = 0,
    allow_partial: bool = False,
    lengths: list[int] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The rollout positions ``rank`` receives under DRPO's cross-rank layout and their
    ``info`` (group ids and slots), as ``experience.deal_samples`` deals them (``lengths``:
    each share of a step cut longest first, where ``cut_longest_first``)."""
    from drpo_openrlhf.update.keys import GROUP_KEY, SLOT_KEY
    from drpo_openrlhf.update.layout import deal_rollout

    dealt = deal_rollout(group_ids.tolist(), layout, allow_partial=allow_partial, lengths=lengths)
    pairs = dealt[rank]
    positions = torch.tensor([i for i, _ in pairs], dtype=torch.long)
    slots = torch.tensor([s for _, s in pairs], dtype=torch.long)
    return positions, {GROUP_KEY: group_ids[positions], SLOT_KEY: slots}


def rollout_samples(data: dict[str, torch.Tensor]) -> list:
    """The rows of a right-padded rollout as the single-response ``Experience`` samples
    OpenRLHF's samples generator makes (unpadded, rewards and scores in ``info``), in
    generation order: what ``split_rollout_samples`` receives."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    samples = []
    for row in range(data["sequences"].shape[0]):
        length = int(data["attention_mask"][row].sum())
        score = data["scores"][row : row + 1].float()
        samples.append(
            Experience(
                sequences=data["sequences"][row : row + 1, :length],
                attention_mask=data["attention_mask"][row : row + 1, :length],
                action_mask=data["action_mask"][row : row + 1, : length - 1],
                rewards=score.clone(),
                scores=score.clone(),
                response_length=data["action_mask"][row : row + 1].sum(-1).float(),
                truncated=torch.zeros(1, dtype=torch.bool),
                total_length=torch.tensor([float(length)]),
                prompts=["p"],
                labels=["l"],
                info={"reward": score.clone(), "score": score.clone()},
            )
        )
    return samples
