"""Peak GPU memory of a run, estimated from its flags before anything starts.

A recipe that cannot fit fails an hour into its first job (after Ray, vLLM and the model
load) with a CUDA out-of-memory error that names no flag. This estimate runs in the entry
point's parser, on the login node, and refuses such a setting naming the flag to change.

It is an upper-bound style estimate per GPU of the hybrid engine's three phases, from the
model's shape and the run's flags; each term is listed with its formula in docs/launch.md
("Memory plan"), with the assumptions that were not measured on a GPU.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from drpo_openrlhf.flags import flag

GIB = 2**30
# An 80 GB H100/A100 as nvidia-smi reports it: 81,559 MiB.
DEFAULT_CAPACITY_GIB = 81559 / 1024
# Assumed, not measured here (docs/launch.md): allocator fragmentation and what the listed
# terms miss take at most this share of the card.
HEADROOM = 0.10
CUDA_CONTEXT_GIB = 1.0  # per process: CUDA context, cuBLAS workspace, NCCL communicators
VLLM_ASLEEP_GIB = 2.0  # a sleeping vLLM engine: its context and CUDA-graph pool
# DeepSpeed's defaults, which OpenRLHF's "auto" values fall back to (config_utils drops them).
REDUCE_BUCKET = 5e8
PREFETCH_BUCKET = 5e7
ADAM_BYTES = 12  # fp32 master weight, first and second moments


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a decoder-only transformer."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        kv = 2 * self.kv_heads * self.head_dim * self.hidden
        norms = 2 * self.hidden
        return 2 * self.hidden * self.hidden + kv + 3 * self.hidden * self.intermediate + norms

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * self.layer_params + self.hidden  # + final norm

    @property
    def token_layer_elements(self) -> int:
        """Activations one token keeps through one layer: norms, q, k, v, attention output,
        o-projection, gate, up, activation product, down-projection."""
        return 6 * self.hidden + 2 * self.kv_heads * self.head_dim + 3 * self.intermediate

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        return cls(
            hidden=config["hidden_size"],
            layers=config["num_hidden_layers"],
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
            heads=config["num_attention_heads"],
            kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            tied=bool(config.get("tie_word_embeddings", False)),
        )


# The recipes' models, from their published config.json, so that the plan works on a login
# node that has not downloaded them.
KNOWN_SHAPES = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ModelShape(1536, 28, 8960, 151936, 12, 2, False),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": ModelShape(3584, 28, 18944, 152064, 28, 4, False),
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": ModelShape(4096, 32, 14336, 128256, 32, 8, False),
}


def model_shape(name: str) -> ModelShape | None:
    """The shape from a local model's config.json, the Hugging Face cache, or the recipes'
    table; None when none has it or the config is not a decoder's."""
    config = Path(name).expanduser() / "config.json"
    if not config.is_file():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json") if name.count("/") == 1 else None
        config = Path(cached) if isinstance(cached, str) else None
    if config is None:
        return KNOWN_SHAPES.get(name)
    try:
        return ModelShape.from_config(json.loads(config.read_text()))
    except (KeyError, TypeError, ValueError):  # not a decoder's config: no estimate
        return None


@dataclass(frozen=True)
class Term:
    """One consumer of a phase's memory, and the flag that shrinks it."""

    name: str
    gib: float
    flag: str


@dataclass(frozen=True)
class Phase:
    name: str
    terms: tuple[Term, ...]

    @property
    def gib(self) -> float:
        return sum(t.gib for t in self.terms)


@dataclass(frozen=True)
class MemoryPlan:
    phases: tuple[Phase, ...]
    capacity_gib: float

    @property
    def limit_gib(self) -> float:
        return self.capacity_gib * (1 - HEADROOM)

    def problems(self) -> list[str]:
        """One message per phase that does not fit, naming its largest terms' flags."""
        out = []
        for phase in self.phases:
            if phase.gib <= self.limit_gib:
                continue
            largest = sorted(phase.terms, key=lambda t: -t.gib)[:2]
            advice = "; ".join(f"{t.name} {t.gib:.1f} GiB: {t.flag}" for t in largest)
            out.append(
                f"the {phase.name} phase needs ~{phase.gib:.1f} GiB per GPU, over "
                f"{self.limit_gib:.1f} GiB ({1 - HEADROOM:.0%} of --drpo.gpu_memory_gib "
                f"{self.capacity_gib:.1f}). Largest: {advice} (docs/launch.md, Memory plan)"
            )
        return out

    def table(self) -> str:
        """Markdown: one column per phase, GiB per term."""
        names = list(dict.fromkeys(t.name for p in self.phases for t in p.terms))
        rows = [
            "| per GPU, GiB | " + " | ".join(p.name for p in self.phases) + " |",
            "|---|" + "---:|" * len(self.phases),
        ]
        for name in names:
            cells = [next((f"{t.gib:.1f}" for t in p.terms if t.name == name), "") for p in self]
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
        rows.append("| **total** | " + " | ".join(f"**{p.gib:.1f}**" for p in self) + " |")
        return "\n".join(rows)

    def __iter__(self):
        return iter(self.phases)


def _vllm_beside_actor(args: argparse.Namespace, vllm_gib: float) -> Term:
    """What a colocated vLLM engine holds while the actor scores and trains: its context and
    graph pool when it sleeps, else its whole share (KV cache and weights stay allocated)."""
    if flag(args, "vllm.enable_sleep"):
        return Term("vLLM asleep", VLLM_ASLEEP_GIB, "")
    return Term("vLLM", vllm_gib, "--vllm.enable_sleep (frees it while the actor runs)")


def _weights_asleep(zero: int, weight_bytes: float, world: int) -> Term:
    """The actor's 16-bit weights while it sleeps: OpenRLHF's ``offload_deepspeed_states``
    moves optimizer states, fp32 master weights and gradients to the CPU but not the weights
    themselves (``lp_params`` is left out of its list), so their shard stays on the GPU."""
    if zero == 3:
        return Term("weights", weight_bytes / world / GIB, "more actor GPUs")
    return Term("weights", weight_bytes / GIB, "--ds.zero_stage 3 shards it over the actor GPUs")


def _gib(n: float) -> float:
    """Bytes as GiB, the unit every term and the capacity are compared in."""
    return n / GIB


def _model_state(
    args: argparse.Namespace, shape: ModelShape, world: int, zero: int, width: int
) -> list[Term]:
    """The actor's weights, gradients and Adam states per GPU: what the ZeRO stage shards and
    the flags that shrink each."""
    p, h, v = shape.params, shape.hidden, shape.vocab
    fp32_accum = flag(args, "ds.grad_accum_dtype") == "fp32" and zero != 2  # ZeRO-2 ignores it
    zero3_flag = "--ds.zero_stage 3 shards it over the actor GPUs"
    if zero == 3:
        live = max(v * h, shape.layer_params) + PREFETCH_BUCKET
        weights = Term("weights", _gib(width * (p / world + live)), "more actor GPUs")
    else:
        weights = Term("weights", _gib(width * p), zero3_flag)
    grad_width = 4 if fp32_accum else width
    grad_elems = p / world + REDUCE_BUCKET if zero >= 2 else p + (p / world if zero == 1 else 0)
    grads = Term("gradients", _gib(grad_width * grad_elems), zero3_flag)
    optimizer = Term(
        "optimizer (Adam fp32)",
        0.0 if flag(args, "ds.adam_offload") else _gib(ADAM_BYTES * p / (world if zero else 1)),
        "--ds.adam_offload" + (", or more actor GPUs" if zero else ", or --ds.zero_stage >= 1"),
    )
    return [weights, grads, optimizer]


def _resident(
    args: argparse.Namespace,
    shape: ModelShape,
    world: int,
    zero: int,
    width: int,
    vllm_gib: float,
    has_ref: bool,
) -> list[Term]:
    """What stays on an actor GPU while it scores and trains besides the actor's own state:
    the CUDA context, a colocated vLLM engine and the reference model's weights."""
    resident = [Term("CUDA context", CUDA_CONTEXT_GIB, "")]
    colocated = flag(args, "train.colocate_all")
    if colocated:
        resident.append(_vllm_beside_actor(args, vllm_gib))
    if has_ref and colocated:
        ref_elems = shape.params / world if zero == 3 else shape.params
        resident.append(Term("reference weights", _gib(width * ref_elems), "--ref.offload"))
    return resident


def _token_budgets(args: argparse.Namespace, tp: int) -> tuple[int, int, str, str]:
    """Tokens one training and one scoring forward hold per GPU, and the flag that bounds
    each: activations and unchunked logits grow with them."""
    max_len = flag(args, "data.max_len")
    if flag(args, "train.dynamic_batch_enable"):
        # per GPU already: OpenRLHF gives a ring group ring_attn_size times the budget
        train_tokens = flag(args, "train.max_tokens_per_gpu")
        score_tokens = flag(args, "rollout.max_tokens_per_gpu") or train_tokens
        train_flag, score_flag = "--train.max_tokens_per_gpu", "--rollout.max_tokens_per_gpu"
        return train_tokens, score_tokens, train_flag, score_flag
    # ring attention: each GPU of a ring group forwards its slice of the packed tokens
    ring = flag(args, "ds.ring_attn_size")
    train_rows = flag(args, "train.micro_batch_size")
    train_tokens = -(-train_rows * max_len // ring)
    train_flag = "--train.micro_batch_size"
    if flag(args, "shaping.method"):  # OpenRLHF's own split of the rollout
        score_rows, score_flag = (
            flag(args, "rollout.micro_batch_size"),
            "--rollout.micro_batch_size",
        )
    else:
        # DRPO deals the rollout into the update's micro-batches before pi_old (and the
        # reference) score it (update/experience.py: deal_samples); a short last rollout
        # can add one response to a rank's last micro-batch
        score_rows, score_flag = train_rows + 1, train_flag
    score_tokens = -(-score_rows * max_len // ring)
    if tp == 1:  # ring attention and AutoTP together are refused (train.py)
        train_flag += " (or --ds.ring_attn_size)"
        score_flag += " (or --ds.ring_attn_size)"
    return train_tokens, score_tokens, train_flag, score_flag


def _logits(
    args: argparse.Namespace,
    shape: ModelShape,
    tp: int,
    has_ref: bool,
    tokens: tuple[int, int, str, str],
) -> tuple[Term, Term]:
    """The scoring and the training micro-step's logits: often the largest term of a long
    response, so each names the flag (chunking or a smaller budget) that shrinks it."""
    train_tokens, score_tokens, train_flag, score_flag = tokens
    h, v = shape.hidden, shape.vocab
    chunk = flag(args, "drpo.logprob_chunk_tokens")
    train_chunk_flag = score_chunk_flag = "--drpo.logprob_chunk_tokens 1024 computes them in chunks"
    if tp > 1:  # chunked log-probs are refused with AutoTP (runtime/options.py)
        unchunked = " (log-probs are not chunked under --ds.tensor_parallel_size)"
        train_chunk_flag, score_chunk_flag = train_flag + unchunked, score_flag + unchunked
    if chunk:
        # bf16 logits, their fp32 copy and the logits' gradient in bf16, for one chunk; the
        # output layer's fp32 gradient sum (training only).
        score_logits = Term("logits", _gib(chunk * v * 6), "--drpo.logprob_chunk_tokens")
        train_logits = Term(
            "logits", _gib(chunk * v * 8 + 4 * v * h), "--drpo.logprob_chunk_tokens"
        )
    else:
        # OpenRLHF's Actor.forward: bf16 logits, fp32 copy (+ its gradient in fp32 and bf16).
        score_logits = Term("logits", _gib(score_tokens * v * 6), score_chunk_flag)
        train_logits = Term("logits", _gib(train_tokens * v * 12), train_chunk_flag)

    if has_ref:  # OpenRLHF's reference model scores unchunked, after the actor
        ref_logits = _gib(score_tokens * v * 6)
        if ref_logits > score_logits.gib:
            score_logits = Term(
                "logits", ref_logits, f"{score_flag} (the reference model's are not chunked)"
            )
    return score_logits, train_logits


def _generation(
    args: argparse.Namespace,
    model_state: list[Term],
    zero: int,
    weight_bytes: float,
    world: int,
    vllm_gib: float,
) -> Phase:
    """A colocated actor GPU while vLLM generates: the engine awake beside what the sleeping
    (or awake) actor keeps."""
    actor = [
        Term("CUDA context", CUDA_CONTEXT_GIB, ""),
        Term("vLLM", vllm_gib, "--vllm.gpu_memory_utilization"),
    ]
    if flag(args, "ds.enable_sleep"):
        actor.append(_weights_asleep(zero, weight_bytes, world))
    else:
        actor += [t for t in model_state if t.gib]
    return Phase("generation", tuple(actor))


def plan(args: argparse.Namespace, shape: ModelShape, capacity_gib: float) -> MemoryPlan:
    """The three phases of a run per actor GPU: generation (vLLM awake), scoring the rollout
    (old log-probs, the reference's), and the training micro-step."""
    world = flag(args, "actor.num_nodes") * flag(args, "actor.num_gpus_per_node")
    zero = flag(args, "ds.zero_stage")
    width = 2 if flag(args, "ds.param_dtype") in ("bf16", "fp16") else 4
    tp = flag(args, "ds.tensor_parallel_size")
    vllm = flag(args, "vllm.gpu_memory_utilization") * capacity_gib
    has_ref = flag(args, "algo.kl.init_coef") > 0 and not flag(args, "ref.offload")
    model_state = _model_state(args, shape, world, zero, width)
    resident = _resident(args, shape, world, zero, width, vllm, has_ref)
    tokens = _token_budgets(args, tp)
    train_tokens, score_tokens, train_flag, score_flag = tokens
    score_logits, train_logits = _logits(args, shape, tp, has_ref, tokens)

    layer = shape.token_layer_elements * width
    if flag(args, "actor.gradient_checkpointing_enable"):
        # layer inputs + one recomputed layer
        kept = shape.layers * shape.hidden * width + 2 * layer
        act_flag = train_flag
    else:
        kept = shape.layers * 2 * layer
        act_flag = "--actor.gradient_checkpointing_enable"
    phases = [
        Phase(
            "scoring",
            (
                *resident,
                *model_state,
                Term("activations", _gib(score_tokens * layer), score_flag),
                score_logits,
            ),
        ),
        Phase(
            "training",
            (
                *resident,
                *model_state,
                Term("activations", _gib(train_tokens * kept), act_flag),
                train_logits,
            ),
        ),
    ]
    if flag(args, "train.colocate_all"):
        phases.insert(0, _generation(args, model_state, zero, width * shape.params, world, vllm))
    return MemoryPlan(tuple(phases), capacity_gib)


def check(args: argparse.Namespace) -> MemoryPlan | None:
    """The run's plan; raises ``ValueError`` when a phase cannot fit. None when the model's
    shape is unknown (no config.json reachable offline) or the check is off (capacity 0)."""
    capacity = flag(args, "drpo.gpu_memory_gib")
    if capacity <= 0:
        return None
    shape = model_shape(flag(args, "actor.model_name_or_path"))
    if shape is None:
        return None
    memory = plan(args, shape, capacity)
    problems = memory.problems()
    if problems:
        raise ValueError("the run does not fit in GPU memory: " + " | ".join(problems))
    return memory
