"""The memory plan (``runtime/memory_plan.py``): model sizes from shapes, the recipes fit
80 GB cards and pass their own preflight, settings that cannot fit are refused naming the
flag, and docs/launch.md shows the numbers the code computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_checks import RECIPES, expected_recipe_args

from drpo_openrlhf import train
from drpo_openrlhf.runtime import memory_plan
from drpo_openrlhf.runtime.memory_plan import KNOWN_SHAPES, ModelShape

DOCS = Path(__file__).resolve().parents[1] / "docs" / "launch.md"
NODES = {"1.5b": 1, "7b": 2, "8b": 2}  # the recipes' #SBATCH --nodes


def recipe_argv(size: str, tmp_path: Path, **changes) -> list[str]:
    """The command a recipe submits (as tests/test_launch_scripts.py checks it), as argv."""
    values = expected_recipe_args(size, tmp_path, tmp_path / "run", NODES[size])
    values.pop("logger.wandb.key")
    for flag in ("data.prompt_dataset", "eval.dataset", "data.max_samples"):
        values.pop(flag)  # inputs are not what this tests
    values.update(changes)
    argv = []
    for flag, value in values.items():
        if value is True:
            argv.append(f"--{flag}")
        elif value is not False:
            argv += [f"--{flag}", *map(str, value if isinstance(value, list) else [value])]
    return argv


def recipe_plan(size: str, tmp_path: Path, **changes) -> memory_plan.MemoryPlan:
    argv = train.with_defaults(recipe_argv(size, tmp_path, **changes), train.DRPO_DEFAULTS)
    args = train.build_parser().parse_args(argv)
    return memory_plan.plan(args, KNOWN_SHAPES[RECIPES[size]["model"]], 81559 / 1024)


@pytest.mark.parametrize(
    ("model", "published"),
    [
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1.777e9),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 7.616e9),
        ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", 8.030e9),
    ],
)
def test_known_shapes_give_the_published_sizes(model, published):
    """Qwen2's q/k/v biases are left out: a 0.01 % difference."""
    assert abs(KNOWN_SHAPES[model].params / published - 1) < 1e-3


def test_shape_counts_every_parameter_of_a_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    shape = memory_plan.model_shape(str(tmp_path))
    assert shape == ModelShape(32, 3, 48, 97, 4, 2, tied=False)
    assert shape.params == sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_a_config_that_is_not_a_decoders_gives_no_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "something"}))
    assert memory_plan.model_shape(str(tmp_path)) is None
    assert memory_plan.model_shape("nobody/unknown-model") is None


@pytest.mark.parametrize("size", list(RECIPES))
def test_recipes_fit_an_80gb_card_and_pass_their_preflight(size, tmp_path):
    plan = recipe_plan(size, tmp_path)
    assert [p.name for p in plan] == ["generation", "scoring", "training"]
    assert all(p.gib <= plan.limit_gib for p in plan), plan.table()
    run, _ = train.parse(recipe_argv(size, tmp_path))
    assert run.memory_plan == plan.table()


@pytest.mark.parametrize("size", list(RECIPES))
@pytest.mark.parametrize(("tokens", "ring"), [(16384, 2), (32768, 4)])
def test_long_variants_fit_an_80gb_card_and_pass_their_preflight(size, tokens, ring, tmp_path):
    """LONG=16k / 32k (slurm/launch_ray_job.sh): what the recipe submits then."""
    changes = {
        "rollout.max_new_tokens": tokens,
        "data.max_len": 1024 + tokens,
        "ds.ring_attn_size": ring,
    }
    plan = recipe_plan(size, tmp_path, **changes)
    assert all(p.gib <= plan.limit_gib for p in plan), plan.table()
    run, _ = train.parse(recipe_argv(size, tmp_path, **changes))
    assert run.memory_plan == plan.table()
    # docs/launch.md, Long responses: the recipe's row shows these phases
    row = next(r for r in DOCS.read_text().splitlines() if r.startswith(f"| {size.upper()} |"))
    shown = " / ".join(f"{p.gib:.1f}" for p in plan)
    assert shown in row, (row, shown)


def test_unchunked_log_probs_of_the_15b_recipe_are_refused_naming_the_flag(tmp_path, capsys):
    """Micro-batches of 4 responses of 9,216 tokens through a 151,936-word vocabulary. pi_old
    scores the update's micro-batches (one response more in a short last rollout)."""
    plan = recipe_plan("1.5b", tmp_path, **{"drpo.logprob_chunk_tokens": 0})
    scoring, training = (
        next(p for p in plan if p.name == name) for name in ("scoring", "training")
    )
    logits = next(t for t in scoring.terms if t.name == "logits")
    assert logits.gib == pytest.approx(5 * 9216 * 151936 * 6 / 2**30)  # bf16 + fp32 copies
    logits = next(t for t in training.terms if t.name == "logits")
    assert logits.gib == pytest.approx(4 * 9216 * 151936 * 12 / 2**30)  # and their gradients
    assert logits.gib > 60
    argv = recipe_argv("1.5b", tmp_path, **{"drpo.logprob_chunk_tokens": 0})
    with pytest.raises(SystemExit):
        train.parse(argv)
    err = capsys.readouterr().err
    assert "does not fit in GPU memory" in err and "--drpo.logprob_chunk_tokens 1024" in err


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"ds.zero_stage": 0}, "--ds.zero_stage"),  # 8B's Adam states unsharded: 90 GiB
        ({"train.micro_batch_size": 16, "actor.gradient_checkpointing_enable": False}, "--actor"),
        ({"vllm.gpu_memory_utilization": 0.95}, "--vllm.gpu_memory_utilization"),
    ],
)
def test_settings_that_cannot_fit_name_what_to_change(changes, flag, tmp_path, capsys):
    plan = recipe_plan("8b", tmp_path, **changes)
    assert plan.problems() and all(flag in problem for problem in plan.problems())
    with pytest.raises(SystemExit):
        train.parse(recipe_argv("8b", tmp_path, **changes))
    assert flag in capsys.readouterr().err


def test_a_reference_model_scores_unchunked(tmp_path):
    """A baseline with a KL penalty: OpenRLHF's reference model materialises its logits, in
    the rollout's micro-batches (a baseline's experience is split by OpenRLHF)."""
    changes = {"algo.kl.init_coef": 0.01, "shaping.method": "rloo_lp"}
    plan = recipe_plan("1.5b", tmp_path, **changes)
    assert any("reference model" in p for p in plan.problems())
    smaller = recipe_plan("1.5b", tmp_path, **changes, **{"rollout.micro_batch_size": 2})
    assert not smaller.problems()
    assert any(t.name == "reference weights" for p in smaller for t in p.terms)


def test_tensor_parallel_logits_name_the_micro_batch_not_chunks(tmp_path, capsys):
    """Under AutoTP the log-probs are unchunked (train.py refuses chunks), so the advice for
    too large logits is a smaller micro-batch."""
    tp = {"ds.tensor_parallel_size": 2, "drpo.logprob_chunk_tokens": 0}
    with pytest.raises(SystemExit):
        train.parse(recipe_argv("1.5b", tmp_path, **tp))
    err = capsys.readouterr().err
    assert "logits 62.6 GiB: --train.micro_batch_size (log-probs are not chunked" in err
    smaller = {"train.micro_batch_size": 1, "rollout.micro_batch_size": 1}
    train.parse(recipe_argv("1.5b", tmp_path, **tp, **smaller))


def test_no_check_at_capacity_zero_or_for_an_unknown_model(tmp_path, capsys):
    run, _ = train.parse(recipe_argv("1.5b", tmp_path, **{"drpo.gpu_memory_gib": 0}))
    assert run.memory_plan is None
    unknown = recipe_argv("1.5b", tmp_path, **{"actor.model_name_or_path": "nobody/unknown"})
    assert train.parse(unknown)[0].memory_plan is None


def test_entropy_bonus_needs_unchunked_log_probs(tmp_path, capsys):
    base = ["--shaping.method", "rloo_lp", "--shaping.params", "alpha=0.2"]
    base += recipe_argv("1.5b", tmp_path, **{"actor.entropy_coef": 0.01})
    with pytest.raises(SystemExit):
        train.parse(base)
    assert "--drpo.logprob_chunk_tokens 0" in capsys.readouterr().err


@pytest.mark.parametrize("size", list(RECIPES))
def test_docs_show_what_the_code_computes(size, tmp_path):
    """docs/launch.md, Memory plan: each recipe's table as ``recipe_plan`` prints it."""
    assert recipe_plan(size, tmp_path).table() in DOCS.read_text()


LENGTHS = [2048, 8192, 16384, 32768]


def sequence_parallel_table(size: str, tmp_path: Path, checkpointing: bool = True) -> str:
    """docs/performance.md, Sequence parallelism: the training phase's activations + logits
    (and its total) per GPU for micro-batches of one response of each length, by ring size,
    with the recipe's gradient checkpointing or without."""
    rows = [
        "| SP | " + " | ".join(f"{n // 1024}k tokens" for n in LENGTHS) + " |",
        "|---:|" + "---:|" * len(LENGTHS),
    ]
    for ring in (1, 2, 4, 8):
        cells = []
        for n in LENGTHS:
            changes = {"data.max_len": n, "train.micro_batch_size": 1, "ds.ring_attn_size": ring}
            changes["actor.gradient_checkpointing_enable"] = checkpointing
            phases = recipe_plan(size, tmp_path, **changes)
            training = next(p for p in phases if p.name == "training")
            gib = {t.name: t.gib for t in training.terms}
            cells.append(f"{gib['activations']:.1f} + {gib['logits']:.1f} ({training.gib:.1f})")
        rows.append(f"| {ring} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


@pytest.mark.parametrize(("size", "checkpointing"), [("1.5b", True), ("7b", True), ("7b", False)])
def test_docs_show_the_sequence_parallel_memory_the_code_computes(size, checkpointing, tmp_path):
    """Ring attention divides each GPU's tokens, hence its activations (and unchunked
    logits), by the ring size; docs/performance.md shows what ``plan`` computes."""
    table = sequence_parallel_table(size, tmp_path, checkpointing)
    assert table in (DOCS.parent / "performance.md").read_text()


@pytest.mark.parametrize(
    ("size", "zero", "shards"), [("1.5b", 2, 1), ("1.5b", 3, 8), ("7b", 3, 16), ("8b", 3, 16)]
)
def test_a_sleeping_actor_keeps_its_weights_beside_vllm(size, zero, shards, tmp_path):
    """``--ds.enable_sleep`` offloads optimizer states, master weights and gradients, not the
    bf16 weights (OpenRLHF leaves ``lp_params`` out): ZeRO-2 keeps them whole, ZeRO-3 its
    shard (1.5B over 8 GPUs, 7B/8B over 16)."""
    plan = recipe_plan(size, tmp_path, **{"ds.zero_stage": zero})
    generation = next(p for p in plan if p.name == "generation")
    weights = next(t for t in generation.terms if t.name == "weights")
    params = KNOWN_SHAPES[RECIPES[size]["model"]].params
    assert weights.gib == pytest.approx(2 * params / shards / 2**30)


def test_colocated_vllm_that_does_not_sleep_keeps_its_share_while_the_actor_trains(tmp_path):
    """Without ``--vllm.enable_sleep`` the engines hold their KV cache through scoring and
    training: the 8B recipe no longer fits, and the refusal names the flag."""
    plan = recipe_plan("8b", tmp_path, **{"vllm.enable_sleep": False})
    for phase in plan:
        vllm = next(t for t in phase.terms if t.name == "vLLM")
        assert vllm.gib == pytest.approx(0.6 * 81559 / 1024)
    assert any("--vllm.enable_sleep" in problem for problem in plan.problems())
