"""Runs OpenRLHF's real actor update (DeepSpeed on gloo, CPU) with DRPO swapped in, and the
single-process one-piece reference it must match. Used by the exactness tests.

``DRPO_TEST_DEVICE=cuda`` runs the DeepSpeed ranks on GPUs instead (NCCL, one GPU per rank,
fp32 without TF32); worlds larger than the GPU count are skipped. The reference stays on the
CPU, so the comparison also covers CUDA's kernels against the CPU's.

The exactness modules share their ranks: each defines ``CASES`` (by world size) and a
``drpo_results`` fixture returning ``shared_results``, which runs the cases of every collected
module using that fixture in one spawn per world size (a rank's start-up costs 5-20 s), with
per-case state reset as a fresh process would have it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from drpo_openrlhf import testing

N, PROMPTS, TRAIN_BATCH = 4, 8, 16  # responses per prompt, prompts per rollout, per step
MAX_TOKENS = 40  # --train.max_tokens_per_gpu of the dynamic-batching cases
VOCAB, LR = 48, 0.05
DEVICE = os.environ.get("DRPO_TEST_DEVICE", "cpu")


@dataclass(frozen=True)
class Case:
    zero_stage: int
    micro_batch_size: int
    packing: bool = False
    kl_estimate: str = "minibatch"
    dynamic: bool = False  # dynamic batching: groups scattered over ranks, token budgets
    short: int = 0  # responses missing at the end of the last rank (an episode's last rollout)
    chunk: int = 0  # --drpo.logprob_chunk_tokens (0: OpenRLHF's unchunked forward)
    # a positive reward other than length (--drpo.positive_reward): each response carries its
    # score in experience.info, as the vLLM engines put it there
    preference: bool = False
    # --ds.ring_attn_size: consecutive ranks share responses and split their packed tokens
    # (OpenRLHF packs samples under ring attention); the flash-attn stand-in's kernels
    ring: int = 1
    # --ds.tensor_parallel_size: DeepSpeed AutoTP splits the layers over consecutive ranks
    tp: int = 1
    # --drpo.lambda_by_pass_rate with this --drpo.pass_rate_prior (None: a fixed lambda)
    pass_rate_prior: float | None = None
    # a rollout correction (level, mode, gating, low, high) on the engines' log-probs of
    # ``engine_log_probs`` (None: off, the engines' log-probs not in the experience)
    correction: tuple[str, str, str, float, float] | None = None

    @property
    def name(self) -> str:
        packed = "packed" if self.packing else "padded"
        batching = "dynamic" if self.dynamic else f"micro{self.micro_batch_size}"
        name = f"zero{self.zero_stage}-{batching}-{packed}-{self.kl_estimate}-short{self.short}"
        name += "-preference" if self.preference else ""
        name += f"-ring{self.ring}" if self.ring > 1 else ""
        name += f"-tp{self.tp}" if self.tp > 1 else ""
        name += f"-pass_rate{self.pass_rate_prior:g}" if self.pass_rate_prior is not None else ""
        name += "-is_" + "_".join(map(str, self.correction)) if self.correction else ""
        return name + (f"-chunk{self.chunk}" if self.chunk else "")


def layout(case: Case, world: int):
    """The case's layout over ``world`` data-parallel ranks (ring groups, under SP)."""
    from drpo_openrlhf.update.layout import Layout

    return Layout(
        world, N, PROMPTS, TRAIN_BATCH, case.micro_batch_size, dynamic_batching=case.dynamic
    )


def rank_share(case: Case, rank: int, world: int) -> tuple[torch.Tensor, dict]:
    """The rollout positions data-parallel rank ``rank`` of ``world`` receives and their
    ``info`` (group ids; slots unless under dynamic batching; positive rewards when the case
    has them)."""
    from drpo_openrlhf.rewards.positive_engine import POSITIVE_KEY
    from drpo_openrlhf.update.keys import GROUP_KEY

    group_ids = torch.arange(PROMPTS * N) // N
    # under dynamic batching OpenRLHF deals responses out by length, so a group's responses
    # land on different ranks: interleave to mimic that
    if case.dynamic:
        local = torch.arange(rank, PROMPTS * N, world)
        info = {GROUP_KEY: group_ids[local]}
    else:  # the driver deals the (possibly short) rollout as experience.deal_samples does
        from drpo_openrlhf.update.layout import cut_longest_first

        short = group_ids[: PROMPTS * N - case.short]
        dealt = layout(case, world)
        lengths = None
        if cut_longest_first(dealt, case.kl_estimate):
            lengths = rollout()["attention_mask"].sum(-1).tolist()
        local, info = testing.dealt_share(short, dealt, rank, case.short > 0, lengths)
    if case.preference:
        info[POSITIVE_KEY] = rollout()["preference"][local]
    return local, info


def tiny_model(attention: str = "sdpa"):
    """The test policy; ``attention="flash_attention_2"`` routes its attention through the
    function OpenRLHF's ring attention registers under that name (set after construction:
    transformers refuses to build a flash-attention model without CUDA)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32)  # the same draws in every process
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).float()
    model.config._attn_implementation = attention
    return model


def rollout(seed: int = 0) -> dict[str, torch.Tensor]:
    """A rollout of PROMPTS x N responses, right-padded, in generation order."""
    gen = torch.Generator().manual_seed(seed)
    b = PROMPTS * N
    prompt_len = torch.randint(2, 5, (PROMPTS,), generator=gen).repeat_interleave(N)
    response_len = torch.randint(1, 9, (b,), generator=gen)
    total = prompt_len + response_len
    t = int(total.max())
    sequences = torch.randint(1, VOCAB, (b, t), generator=gen)
    prompt_tokens = torch.randint(1, VOCAB, (PROMPTS, t), generator=gen).repeat_interleave(N, 0)
    positions = torch.arange(t)
    is_prompt = positions < prompt_len[:, None]
    sequences = torch.where(is_prompt, prompt_tokens, sequences)
    attention_mask = (positions < total[:, None]).long()
    sequences = sequences * attention_mask
    action_mask = (~is_prompt & attention_mask.bool())[:, 1:]
    correct = torch.rand(b, generator=gen) < 0.5
    correct[0::N], correct[1::N] = True, False  # every prompt has both kinds
    # a positive reward other than length, on the scale of several reflections' difference
    preference = torch.rand(b, generator=gen, dtype=torch.float64)
    return dict(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        scores=correct.float(),
        group=torch.arange(PROMPTS).repeat_interleave(N),
        preference=preference,
    )


def engine_log_probs(old: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """The vLLM engines' log-probs of the sampled tokens: pi_old's off by a per-response
    offset and per-token noise, so that some tokens and some responses fall outside a
    correction's band (the same draws in every process)."""
    gen = torch.Generator().manual_seed(1)
    offset = 0.5 * torch.randn(old.shape[0], 1, generator=gen)
    noise = 0.3 * torch.randn(old.shape, generator=gen)
    return (old - offset - noise) * action_mask


def old_log_probs(data) -> torch.Tensor:
    from openrlhf.models import Actor

    actor = Actor(tiny_model(), temperature=0.6)
    actor.packing_samples = False
    with torch.no_grad():
        return actor(data["sequences"], data["action_mask"], attention_mask=data["attention_mask"])


def openrlhf_args(case: Case, world: int):
    """OpenRLHF's args of the case on ``world`` ranks (all of them, ring ranks included)."""
    flags = [
        "--rollout.n_samples_per_prompt",
        str(N),
        "--rollout.batch_size",
        str(PROMPTS),
        "--rollout.temperature",
        "0.6",
        "--train.batch_size",
        str(TRAIN_BATCH),
        "--train.micro_batch_size",
        str(case.micro_batch_size),
        "--actor.num_gpus_per_node",
        str(world),
        "--ds.zero_stage",
        str(case.zero_stage),
        "--actor.adam.lr",
        str(LR),
        "--actor.adam.eps",
        "1.0",
        "--actor.adam.betas",
        "0.9",
        "0.999",
        "--actor.lr_scheduler",
        "constant",
        "--actor.lr_warmup_ratio",
        "0",
        "--actor.max_norm",
        "0",
        "--rollout.max_new_tokens",
        "8",
        "--algo.kl.init_coef",
        "0",
    ]
    if case.packing:
        flags.append("--ds.packing_samples")
    if case.ring > 1:
        assert case.packing, "OpenRLHF packs samples under ring attention"
        flags += ["--ds.ring_attn_size", str(case.ring)]
    if case.tp > 1:
        flags += ["--ds.tensor_parallel_size", str(case.tp)]
    if case.dynamic:
        flags += ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", str(MAX_TOKENS)]
    return testing.openrlhf_args(flags)


def drpo_config(case: Case):
    from drpo_openrlhf.algo import DRPOConfig

    positive = "fewer_reflections" if case.preference else "length"
    from drpo_openrlhf.algo.rollout_correction import RolloutCorrection

    schedule = {}
    if case.pass_rate_prior is not None:
        schedule = dict(lambda_by_pass_rate=True, pass_rate_prior=case.pass_rate_prior)
    if case.correction is not None:
        schedule["rollout_correction"] = RolloutCorrection(*case.correction)
    return DRPOConfig(kl_estimate=case.kl_estimate, max_len=8, positive_reward=positive, **schedule)


def count_forwards(module: torch.nn.Module) -> list[int]:
    """A list that grows by one at every forward of ``module``."""
    calls: list[int] = []
    module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def record_slices(actor, model: torch.nn.Module) -> list[tuple[int, int]]:
    """``(tokens of the micro-batch, tokens this rank's model forwarded)`` per actor forward:
    under ring attention each rank must forward only its slice of the packed tokens."""
    pairs: list[tuple[int, int]] = []

    def actor_hook(_module, args, kwargs) -> None:
        pairs.append((int(kwargs["attention_mask"].sum()), -1))

    def model_hook(_module, args, _kwargs) -> None:
        pairs[-1] = (pairs[-1][0], args[0].shape[-1])

    actor.register_forward_pre_hook(actor_hook, with_kwargs=True)
    model.register_forward_pre_hook(model_hook, with_kwargs=True)
    return pairs


def whole_group_microsteps(case: Case, world: int) -> bool:
    """Global micro-steps hold whole groups: dynamic batching (whose tiny sequences always
    pack under ``MAX_TOKENS``) or ``n`` dividing micro-batch x ranks."""
    return case.dynamic or (case.micro_batch_size * world) % N == 0


def one_pass_expected(case: Case, world: int) -> bool:
    """The actor's one-pass update applies: micro-step KL and whole-group micro-steps."""
    return case.kl_estimate == "microstep" and whole_group_microsteps(case, world)


def dynamic_microsteps(case: Case, world: int, lengths: torch.Tensor, step: torch.Tensor):
    """Rollout positions of each global micro-step of one optimizer step (``step``: its
    positions): whole groups packed as the actor packs them (micro-step KL), or one piece."""
    from drpo_openrlhf.update.layout import pack_group_microsteps

    if case.kl_estimate != "microstep":
        return [step]
    shares = {int(g): [0] * world for g in (step // N).unique()}
    for rank in range(world):
        for i in rank_share(case, rank, world)[0].tolist():
            if i // N in shares:
                shares[i // N][rank] += int(lengths[i])
    groups = pack_group_microsteps(shares, MAX_TOKENS * case.ring)
    assert groups is not None, "the test rollout must pack into one-pass micro-steps"
    return [torch.tensor([i for i in step.tolist() if i // N in g]) for g in groups]


def run_rank(rank: int, world: int, port: int, cases: list[Case], out_dir: str) -> None:
    """One rank: OpenRLHF strategy + actor + trainer, DRPO's ppo_train. Under ring attention
    the ``case.ring`` consecutive ranks of a ring group receive the same share, as OpenRLHF's
    driver deals it."""
    testing.set_rank_env(rank, world, port, DEVICE)
    if DEVICE == "cpu":
        # up to four ranks share the machine's cores: one intra-op thread each (torch's default
        # of one per core in every rank oversubscribed two cores, and gloo's waits with them:
        # updates took about 6x as long)
        torch.set_num_threads(1)
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import transformers.modeling_flash_attention_utils as hf_flash
    from openrlhf.models import ring_attn_utils

    from drpo_openrlhf.update import chunked_actor
    from drpo_openrlhf.update.actor_trainer import DRPOActorTrainer

    # ring_flash_attn wraps this function when OpenRLHF's strategy sets up a ring group, and
    # refuses to wrap its own wrapper: give every case's strategy the original, as a fresh
    # process (one strategy per process in a real run) would have; likewise no ring group
    # (OpenRLHF's strategy sets it only under ring attention, and its trainer reads it back)
    unwrapped = hf_flash._flash_attention_forward
    data = rollout()
    old = old_log_probs(data)
    for case in cases:
        hf_flash._flash_attention_forward = unwrapped
        ring_attn_utils.set_ring_attn_group(None)
        shared = case.ring * case.tp  # consecutive ranks holding the same responses
        local, info = rank_share(case, rank // shared, world // shared)
        strategy = testing.setup_strategy(openrlhf_args(case, world), "fp32", DEVICE)
        attention = "flash_attention_2" if case.ring > 1 else "sdpa"
        with testing.fp32_tensor_parallel():
            actor, optim, scheduler = testing.prepare_actor(strategy, tiny_model(attention))
        chunked_actor.install(actor, case.chunk)
        trainer = testing.ppo_trainer(strategy, actor, optim, scheduler, DEVICE)
        trainer.__class__ = DRPOActorTrainer
        trainer.enable_drpo(drpo_config(case))
        local_data = {k: v[local] for k, v in data.items()}
        engine = None
        if case.correction is not None:
            engine = engine_log_probs(old, data["action_mask"])[local]
        trainer.replay_buffer.append(testing.experience(local_data, old[local], info, engine))
        forwards = count_forwards(actor)
        slices = record_slices(actor, actor.model.module)
        with testing.cuda_queries_answered(DEVICE, "cpu"):
            status = trainer.ppo_train(0.0)
        local_numel = sum(p.numel() for p in actor.model.module.parameters())
        weights = testing.whole_parameters(actor.model.module, case.zero_stage, case.tp)
        weights = [w.cpu() for w in weights]
        if rank == 0:
            result = {
                "weights": weights,
                "status": status,
                "mode": None if case.dynamic else trainer.drpo_mode,
                "forwards": len(forwards),
                "slices": slices,
                "local_numel": local_numel,
            }
            torch.save(result, os.path.join(out_dir, case.name + ".pt"))
        torch.distributed.barrier()


def run_cases(cases: dict[int, list[Case]], out_dirs, prefix: str) -> dict:
    """Every case on its world of gloo ranks (one spawn per world size); results by
    ``(world, case)``. ``out_dirs`` is pytest's ``tmp_path_factory``."""
    from drpo_openrlhf.testing import free_port, spawn_ranks

    results = {}
    for world, world_cases in sorted(cases.items()):
        if not world_cases:
            continue
        if DEVICE == "cuda" and world > torch.cuda.device_count():
            continue  # one GPU per rank: the tests of this world skip (``result``)
        out = out_dirs.mktemp(f"{prefix}{world}")
        args = (world, free_port(), world_cases, str(out))
        spawn_ranks(run_rank, args, world, DEVICE)
        for case in world_cases:
            results[world, case] = torch.load(out / f"{case.name}.pt")
    return results


FIXTURE = "drpo_results"  # the exactness modules' fixture, each returning shared_results
SHARED_RANKS_MODULES = frozenset(  # the modules with a FIXTURE (tests/conftest.py checks)
    {
        "test_drpo_actor_exactness.py",
        "test_drpo_ring_attn_exactness.py",
        "test_drpo_tensor_parallel_exactness.py",
    }
)
_shared: dict[tuple[int, Case], dict] = {}  # this test process's results, by (world, case)


def selected_cases(request) -> dict[int, list[Case]]:
    """The ``CASES`` of the requesting module and of every other collected module with a test
    using ``FIXTURE``, by world; plain cases first in each world, then ring attention's, then
    tensor parallelism's (whatever process-wide state AutoTP leaves behind then meets only
    other tensor-parallel cases, as in a module of its own)."""
    modules = [request.module]
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is not None and module not in modules and FIXTURE in item.fixturenames:
            modules.append(module)
    cases: dict[int, list[Case]] = {}
    for module in modules:
        for world, world_cases in module.CASES.items():
            listed = cases.setdefault(world, [])
            listed += [c for c in world_cases if c not in listed]
    return {w: sorted(c, key=lambda c: (c.tp > 1, c.ring > 1)) for w, c in cases.items()}


def shared_results(request, out_dirs) -> dict:
    """Results by ``(world, case)`` for the requesting module's ``CASES``: on the first
    request, every selected module's cases run together, one spawn per world size (the ranks
    run every case with its own strategy and engine); later requests reuse them."""
    cases = selected_cases(request)
    missing = {w: [c for c in cs if (w, c) not in _shared] for w, cs in cases.items()}
    _shared.update(run_cases(missing, out_dirs, "world"))
    return _shared


def result(results: dict, world: int, case: Case) -> dict:
    """The distributed run's result; skips a world that had too few GPUs to run."""
    if (world, case) not in results:
        pytest.skip(f"{world} ranks need {world} GPUs")
    return results[world, case]


def assert_matches_reference(got: dict, case: Case, world: int) -> None:
    """The distributed run's weights, dropped-response count and logged loss equal the
    one-piece reference's (``world`` data-parallel ranks)."""
    expected, losses = reference_weights(case, world)
    initial = [p.detach().double() for p in tiny_model().parameters()]
    update = max((e - i).abs().max().item() for e, i in zip(expected, initial, strict=True))
    error = max((e - g).abs().max().item() for e, g in zip(expected, got["weights"], strict=True))
    assert update > 1e-2  # the two steps really moved the weights...
    assert error < 1e-5 * update / 1e-2  # ...and both paths moved them identically
    trained = len(losses) * TRAIN_BATCH
    assert got["status"]["drpo/dropped_responses"] == PROMPTS * N - case.short - trained
    assert got["status"]["policy_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)


def reference_weights(case: Case, world: int) -> tuple[list[torch.Tensor], list[float]]:
    """One-piece gradient of each mini-batch objective (same groups per step, ``world``
    data-parallel ranks), torch AdamW."""
    from openrlhf.models import Actor

    from drpo_openrlhf.algo import ResponseScalars, minibatch_loss, response_scalars
    from drpo_openrlhf.algo.rollout_correction import rollout_weights

    data = rollout()
    old = old_log_probs(data)
    engine = engine_log_probs(old, data["action_mask"])
    correction = drpo_config(case).rollout_correction
    actor = Actor(tiny_model(), temperature=0.6)
    actor.packing_samples = False
    optim = torch.optim.AdamW(
        actor.parameters(), lr=LR, betas=(0.9, 0.999), eps=1.0, weight_decay=0
    )
    micro_steps = layout(case, world).micro_steps
    if case.dynamic:  # steps of whole groups in id order
        groups_per_step = TRAIN_BATCH // N
        lengths = data["attention_mask"].sum(-1)
        steps = [
            dynamic_microsteps(
                case, world, lengths, torch.nonzero((data["group"] // groups_per_step) == k)[:, 0]
            )
            for k in range(PROMPTS // groups_per_step)
        ]
    else:  # global micro-step j of step k: every rank's responses in slot k * M + j
        from drpo_openrlhf.update.keys import SLOT_KEY

        shares = [rank_share(case, r, world) for r in range(world)]
        positions = torch.cat([p for p, _ in shares])
        slots = torch.cat([info[SLOT_KEY] for _, info in shares])
        steps = [
            [positions[slots == k * micro_steps + j] for j in range(micro_steps)]
            for k in range(int(slots.max()) // micro_steps + 1)
        ]
    losses = []
    for step in steps:
        parts = []
        for j, idx in enumerate(step):
            log_probs = actor(
                data["sequences"][idx],
                data["action_mask"][idx],
                attention_mask=data["attention_mask"][idx],
            )
            weights = None
            if correction.enabled:
                weights = rollout_weights(
                    correction, old[idx], engine[idx], data["action_mask"][idx]
                )
            parts.append(
                response_scalars(
                    log_probs,
                    old[idx],
                    data["action_mask"][idx],
                    data["scores"][idx].bool(),
                    data["group"][idx],
                    microstep=j,
                    preference=data["preference"][idx] if case.preference else None,
                    weights=weights,
                )
            )
        loss, _ = minibatch_loss(ResponseScalars.concat(parts), drpo_config(case))
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return [p.detach().clone().double() for p in actor.parameters()], losses
