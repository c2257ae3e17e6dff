"""Time one actor update (``ppo_train`` over a whole rollout) of DRPO against OpenRLHF's PPO.

Both methods train the same model from the same seed on the same synthetic rollout, with the
same micro-batch size, ZeRO stage, dtype and gradient checkpointing, through OpenRLHF's real
``DeepspeedStrategy`` / ``Actor`` / ``ActorPPOTrainer`` (DRPO swaps in ``DRPOActorTrainer``;
PPO gets GRPO-style group-normalised advantages). Each method runs as ``--ranks`` processes
of its own (data-parallel ranks: gloo on CPU, one GPU each on CUDA), so peak memory is per
method and rank. PPO's ranks get OpenRLHF's contiguous chunks of the rollout, DRPO's their
shares under the cross-rank layout, as the two drivers deal them. Before every call the
old log-probs are recomputed with the current weights, so each call is a fresh rollout step
(pi_old = the policy, as in training). On CPU the two methods take turns, one call each,
and CPU seconds are reported beside wall seconds: on a shared machine other load inflates
wall time, not CPU time.

Per call and method: pi_old's scoring (no-grad forwards of the rollout, as the driver asks
for them before the update) and the update, apart and together as the *actor phase*;
CPU seconds summed over the ranks and of the slowest rank, peak RSS of
the largest rank, the actor's forwards per optimizer step (with and without grad, counted on
the ``Actor`` module; optimizer steps counted by DeepSpeed), DRPO's mode and how many of its
optimizer steps ran the penalty pass (``drpo/penalty_pass``).

DRPO's time is split into its *scores pass* (no-grad forwards that give the current scores;
skipped on the first optimizer step of a rollout), the *all-gather* of the scalars, the
*coefficients* (``loss_coefficients`` and its per-micro-step forms: autograd on the
scalars) and the rest, the *gradient pass*.

    python scripts/bench_actor_update.py                  # tiny Qwen2 on CPU, ~2 min
    python scripts/bench_actor_update.py --ranks 8 --micro-batch 4 --prompts 16 \
        --train-batch 32 --num-layers 2 --kl-estimate microstep  # 1.5B recipe layout, gloo
    python scripts/bench_actor_update.py --device cuda    # R1-Distill-Qwen-1.5B shape, bf16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from queue import Queue
from unittest import mock

import torch

from drpo_openrlhf import testing
from drpo_openrlhf.update.keys import GROUP_KEY

METHODS = ("drpo", "ppo")
# DRPO's functions that exchange scalars between ranks or differentiate the objective with
# respect to them, and the bucket of the split their time goes to.
EXCHANGE = {
    "all_gather_counts": "gather",
    "all_gather_scalars": "gather",
    "loss_coefficients": "coefficients",
    "microstep_coefficients": "coefficients",
    "group_score_coefficients": "coefficients",
}
TAG = "@bench"  # prefix of the worker's messages on its stdout
MODELS = {
    # Big enough on CPU that matrix products, not Python overhead, dominate a micro-step.
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
    # The architecture of deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (random weights).
    "r1-distill-qwen-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}
# Per-device defaults: a rollout of whole prompt groups with 4 optimizer steps, as in the
# paper (train batch = rollout / 4).
DEFAULTS = {
    "cpu": dict(
        model="tiny",
        prompts=8,
        n=8,
        train_batch=16,
        micro_batch=4,
        prompt_len=(32, 96),
        response_len=(64, 256),
        zero_stage=2,
        dtype="fp32",
        gradient_checkpointing=False,
        repeats=3,
        threads=1,
    ),
    "cuda": dict(
        model="r1-distill-qwen-1.5b",
        prompts=4,
        n=8,
        train_batch=8,
        micro_batch=2,
        prompt_len=(128, 512),
        response_len=(1024, 4096),
        zero_stage=3,
        dtype="bf16",
        gradient_checkpointing=True,
        repeats=3,
        threads=0,
    ),
}
# Dense bf16 peak (TFLOP/s, no sparsity) by GPU name; first match wins.
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=sorted(MODELS))
    p.add_argument("--num-layers", type=int, help="override the model's layer count")
    p.add_argument("--prompts", type=int, help="prompts per rollout")
    p.add_argument("--n", type=int, help="responses per prompt")
    p.add_argument("--train-batch", type=int, help="responses per optimizer step")
    p.add_argument("--micro-batch", type=int, help="responses per micro-batch on one rank")
    p.add_argument(
        "--ranks", type=int, default=1, help="data-parallel ranks (processes) per method"
    )
    p.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--response-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    p.add_argument("--dtype", choices=("fp32", "bf16"))
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction)
    p.add_argument("--packing", action="store_true", help="OpenRLHF's --ds.packing_samples")
    p.add_argument(
        "--kl-estimate",
        choices=("minibatch", "microstep"),
        default="minibatch",
        help="DRPO's --drpo.kl_estimate; microstep with a micro-batch that is a multiple of n\n"
        "runs the one-pass update (no scores pass)",
    )
    p.add_argument("--lr", type=float, default=2e-6, help="actor learning rate (the paper's)")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (e.g. flash_attention_2)")
    p.add_argument("--repeats", type=int, help="timed ppo_train calls, after one warm-up call")
    p.add_argument("--threads", type=int, help="torch CPU threads per worker (0: torch's default)")
    p.add_argument("--peak-tflops", type=float, help="bf16 peak to compare with (GPU)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument(
        "--ppo-drop-logits",
        action="store_true",
        help="ablation: PPO's actor output without its fp32 logits, which OpenRLHF's PPO step\n"
        "holds through the backward and DRPO's never asks for (the peak-memory gap)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def worker_argv(args: argparse.Namespace, method: str, rank: int, port: int) -> list[str]:
    """The command line of rank ``rank`` of ``method``, timing exactly ``args``."""
    argv = [sys.executable, __file__, "--worker", method, "--device", args.device]
    argv += ["--rank", str(rank), "--port", str(port)]
    argv += ["--model", args.model, "--attn", args.attn, "--dtype", args.dtype]
    argv += ["--kl-estimate", args.kl_estimate, "--lr", repr(args.lr)]
    numbers = ("prompts", "n", "train_batch", "micro_batch", "ranks", "zero_stage", "repeats")
    for flag in (*numbers, "threads"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("prompt_len", "response_len"):
        argv += [f"--{flag.replace('_', '-')}", *map(str, getattr(args, flag))]
    if args.num_layers is not None:
        argv += ["--num-layers", str(args.num_layers)]
    argv.append(
        "--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing"
    )
    if args.packing:
        argv.append("--packing")
    if args.ppo_drop_logits:
        argv.append("--ppo-drop-logits")
    return argv


# ---------------------------------------------------------------- worker (one method) ----


def synthetic_rollout(args: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of ``prompts x n`` responses in generation order, with 0/1 scores
    (each prompt has a correct and a wrong one), group ids and GRPO advantages (for PPO)."""
    from drpo_openrlhf.algo.advantages import group_advantages

    gen = torch.Generator().manual_seed(0)
    prompts, n = args.prompts, args.n
    b = prompts * n
    prompt_len = torch.randint(
        args.prompt_len[0], args.prompt_len[1] + 1, (prompts,), generator=gen
    )
    prompt_len = prompt_len.repeat_interleave(n)
    response_len = torch.randint(
        args.response_len[0], args.response_len[1] + 1, (b,), generator=gen
    )
    total = prompt_len + response_len
    positions = torch.arange(int(total.max()))
    is_prompt = positions < prompt_len[:, None]
    attention_mask = (positions < total[:, None]).long()
    prompt_tokens = torch.randint(1, vocab, (prompts, positions.numel()), generator=gen)
    sequences = torch.randint(1, vocab, (b, positions.numel()), generator=gen)
    sequences = torch.where(is_prompt, prompt_tokens.repeat_interleave(n, 0), sequences)
    scores = (torch.rand(b, generator=gen) < 0.5).float()
    scores[0::n], scores[1::n] = 1.0, 0.0
    advantages = torch.tensor(
        [a for g in scores.view(prompts, n) for a in group_advantages(g, "grpo")]
    )
    action_mask = (~is_prompt & attention_mask.bool())[:, 1:]
    return dict(
        sequences=sequences * attention_mask,
        attention_mask=attention_mask,
        action_mask=action_mask,
        advantages=advantages[:, None] * action_mask,
        scores=scores,
        group=torch.arange(prompts).repeat_interleave(n),
    )


def openrlhf_flags(args: argparse.Namespace) -> list[str]:
    flags = {
        "--rollout.n_samples_per_prompt": args.n,
        "--rollout.batch_size": args.prompts,
        "--rollout.temperature": 0.6,
        "--rollout.max_new_tokens": args.response_len[1],
        "--train.batch_size": args.train_batch,
        "--train.micro_batch_size": args.micro_batch,
        "--actor.num_gpus_per_node": args.ranks,
        "--ds.zero_stage": args.zero_stage,
        "--ds.attn_implementation": args.attn,
        "--actor.adam.lr": args.lr,
        "--actor.adam.weight_decay": 0.01,
        "--actor.lr_scheduler": "constant",
        "--actor.lr_warmup_ratio": 0,
        "--actor.max_norm": 1.0,
        "--algo.kl.init_coef": 0,
    }
    out = [str(x) for item in flags.items() for x in item]
    out += ["--actor.adam.betas", "0.9", "0.999"]
    if args.packing:
        out.append("--ds.packing_samples")
    if args.gradient_checkpointing:
        out.append("--actor.gradient_checkpointing_enable")
    return out


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = dict(MODELS[args.model])
    if args.num_layers is not None:
        spec["num_hidden_layers"] = args.num_layers
    config = Qwen2Config(**spec, use_cache=False, attn_implementation=args.attn)
    torch.manual_seed(0)
    with torch.device(args.device):  # a 1.5B model initialises in seconds on the GPU
        model = Qwen2ForCausalLM(config)
    return model.to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)


def sync() -> None:
    """Wait for queued GPU work, so that wall-clock times are the work's."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def clocks() -> tuple[float, float]:
    """Wall-clock and process CPU seconds (all threads). CPU time is what a shared machine's
    load does not inflate, as long as a worker's threads do not wait on each other."""
    sync()
    return time.perf_counter(), time.process_time()


def timed(fn: Callable, buckets: dict[str, list[float]], name: Callable[[], str | None]):
    """``fn`` adding its [wall, CPU] seconds to ``buckets[name()]`` (``None``: not timed)."""

    def wrapper(*a, **k):
        key = name()
        if key is None:
            return fn(*a, **k)
        start = clocks()
        out = fn(*a, **k)
        end = clocks()
        total = buckets.setdefault(key, [0.0, 0.0])
        total[0] += end[0] - start[0]
        total[1] += end[1] - start[1]
        return out

    return wrapper


def drop_logits(forward: Callable) -> Callable:
    """``forward`` whose model output (returned with ``return_output``) no longer references
    the fp32 logits; what autograd saved for the backward is untouched."""

    def wrapper(*a, **k):
        out = forward(*a, **k)
        if isinstance(out, tuple):
            out[1]["logits"] = None
        return out

    return wrapper


def old_log_probs(actor, data: dict[str, torch.Tensor], micro: int, device: str) -> torch.Tensor:
    """pi_old's log-probs, as OpenRLHF's experience maker gives them: no-grad forwards of
    ``micro`` rows of the rank's share (DRPO's are its update's micro-batches, as dealt)."""
    actor.eval()
    out = torch.zeros(data["action_mask"].shape)
    with torch.no_grad():
        for i in range(0, out.shape[0], micro):
            rows = slice(i, i + micro)
            width = int(data["attention_mask"][rows].sum(-1).max())  # trim the common padding
            out[rows, : width - 1] = actor(
                data["sequences"][rows, :width].to(device),
                data["action_mask"][rows, : width - 1].to(device),
                attention_mask=data["attention_mask"][rows, :width].to(device),
            ).cpu()
    return out


def rss_mib() -> float:
    """Current resident set size."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def send(kind: str, payload: dict) -> None:
    """A message to the parent; other stdout lines (DeepSpeed's prints) are ignored."""
    print(f"{TAG} {kind} {json.dumps(payload)}", flush=True)


def count_forwards(actor: torch.nn.Module) -> Counter:
    """Forwards of ``actor`` from now on, keyed by whether grad was enabled."""
    counts: Counter = Counter()
    actor.register_forward_pre_hook(lambda *_: counts.update([torch.is_grad_enabled()]))
    return counts


def run_worker(args: argparse.Namespace) -> None:
    """Build everything for rank ``args.rank`` of ``args.worker``, then run one timed
    ``ppo_train`` per ``run`` line on stdin until ``done``."""
    testing.set_rank_env(args.rank, args.ranks, args.port, args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    from drpo_openrlhf.algo import DRPOConfig
    from drpo_openrlhf.update import actor_trainer as drpo_module

    strategy = testing.setup_strategy(
        testing.openrlhf_args(openrlhf_flags(args)), args.dtype, args.device
    )
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    matmul_params = params - model.get_input_embeddings().weight.numel()
    steps = args.prompts * args.n // args.train_batch
    actor, optim, scheduler = testing.prepare_actor(strategy, model, steps * (args.repeats + 1))
    trainer = testing.ppo_trainer(strategy, actor, optim, scheduler, args.device)
    data = synthetic_rollout(args, MODELS[args.model]["vocab_size"])
    if args.worker == "drpo":  # dealt as DRPO's experience maker deals it
        trainer.__class__ = drpo_module.DRPOActorTrainer
        config = DRPOConfig(kl_estimate=args.kl_estimate, max_len=args.response_len[1])
        trainer.enable_drpo(config)
        positions, info = testing.dealt_share(data["group"], trainer.drpo_layout, args.rank)
    else:  # OpenRLHF's contiguous chunk
        if args.ppo_drop_logits:
            actor.forward = drop_logits(actor.forward)
        count, batch = len(data["group"]), strategy.args.rollout.micro_batch_size
        positions = testing.openrlhf_share(count, args.ranks, args.rank, batch)
        info = {GROUP_KEY: data["group"][positions]}
    data = {k: v[positions] for k, v in data.items()}

    buckets: dict[str, list[float]] = {}
    with ExitStack() as stack:
        stack.enter_context(testing.cuda_queries_answered(args.device, "cpu"))
        if args.worker == "drpo":
            no_grad = lambda: None if torch.is_grad_enabled() else "scores"  # noqa: E731
            scalars = drpo_module.DRPOActorTrainer._scalars
            stack.enter_context(
                mock.patch.object(
                    drpo_module.DRPOActorTrainer, "_scalars", timed(scalars, buckets, no_grad)
                )
            )
            for name, bucket in EXCHANGE.items():
                fn = timed(getattr(drpo_module, name), buckets, lambda b=bucket: b)
                stack.enter_context(mock.patch.object(drpo_module, name, fn))
        send(
            "ready",
            dict(
                method=args.worker,
                rank=args.rank,
                optimizer_steps=steps,
                mode=getattr(trainer, "drpo_mode", None),
                responses=len(positions),
                response_tokens=int(data["action_mask"].sum()),
                tokens=int(data["attention_mask"].sum()),
                params=params,
                matmul_params=matmul_params,
                rss_before_mib=rss_mib(),
            ),
        )
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        forwards = count_forwards(actor)
        for command in sys.stdin:
            if command.strip() != "run":
                break
            # a new rollout step: pi_old is the current policy, scored as the driver would
            # (timed apart from the update, forwards not counted)
            before = clocks()
            old = old_log_probs(actor, data, args.micro_batch, args.device)
            scored = clocks()
            trainer.replay_buffer.clear()
            trainer.replay_buffer.append(testing.experience(data, old, info))
            buckets.clear()
            forwards.clear()
            stepped = actor.model.global_steps
            start = clocks()
            status = trainer.ppo_train(0.0)
            end = clocks()
            if not math.isfinite(status["policy_loss"]):
                raise RuntimeError(f"{args.worker}: non-finite policy_loss {status}")
            send(
                "call",
                dict(
                    wall=end[0] - start[0],
                    cpu=end[1] - start[1],
                    pi_old_wall=scored[0] - before[0],
                    pi_old_cpu=scored[1] - before[1],
                    split=buckets,
                    optimizer_steps=actor.model.global_steps - stepped,
                    forwards_grad=forwards[True],
                    forwards_no_grad=forwards[False],
                    penalty_pass=status.get("drpo/penalty_pass"),
                    kl=status.get("drpo/kl"),  # mean over steps: the penalty acts above delta
                ),
            )
    peaks = dict(peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if args.device == "cuda":
        peaks.update(
            peak_cuda_gib=torch.cuda.max_memory_allocated() / 2**30,
            gpu=torch.cuda.get_device_name(),
        )
    send("result", peaks)


# ---------------------------------------------------------------- parent (report) ----


class Ranks:
    """The rank processes of some methods, driven one ``ppo_train`` call at a time.

    Their messages arrive on one queue, read by a thread per process: a rank that dies is
    noticed at once (its peers would wait in a collective forever), and no rank blocks on a
    full stdout pipe while the parent waits on another."""

    def __init__(self, args: argparse.Namespace, methods: list[str]) -> None:
        env = os.environ | {"TORCHDYNAMO_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
        self.messages: Queue = Queue()
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.tails: dict[tuple[str, int], deque[str]] = {}  # last output lines, shown on failure
        for method in methods:
            port = testing.free_port()
            for rank in range(args.ranks):
                key = (method, rank)
                self.tails[key] = deque(maxlen=200)
                self.procs[key] = subprocess.Popen(
                    worker_argv(args, method, rank, port),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=env,
                )
                threading.Thread(target=self._read, args=(key,), daemon=True).start()

    def _read(self, key: tuple[str, int]) -> None:
        for line in self.procs[key].stdout:
            if line.startswith(f"{TAG} "):
                kind, payload = line[len(TAG) + 1 :].split(" ", 1)
                self.messages.put((key, kind, json.loads(payload)))
            else:
                self.tails[key].append(line)
        self.messages.put((key, "exit", None))

    def ask(self, methods: list[str], command: str | None, kind: str) -> dict[str, list[dict]]:
        """Send ``command`` (if any) to every rank of ``methods``; their ``kind`` messages, in
        rank order per method."""
        keys = [key for key in self.procs if key[0] in methods]
        if command:
            for key in keys:
                self.procs[key].stdin.write(command + "\n")
                self.procs[key].stdin.flush()
        got: dict[tuple[str, int], dict] = {}
        while len(got) < len(keys):
            key, got_kind, payload = self.messages.get()
            if got_kind != kind:
                self._fail(key)
            got[key] = payload
        return {m: [got[key] for key in keys if key[0] == m] for m in methods}

    def _fail(self, key: tuple[str, int]) -> None:
        for proc in self.procs.values():
            proc.kill()
        sys.stderr.write("".join(self.tails[key]))
        code = self.procs[key].wait()
        raise SystemExit(f"the {key[0]} worker of rank {key[1]} exited ({code})")

    def wait(self) -> None:
        for proc in self.procs.values():
            proc.wait()


def measure(args: argparse.Namespace) -> list[dict]:
    """Each method's static facts and peak memory per rank, and its timed calls (warm-up
    dropped), each with the parent's wall seconds and every rank's report.

    On CPU both methods' ranks live at once and take turns, one call each, alternating who
    goes first: a shared machine's changing load then hits both alike. On a GPU they run one
    after the other, as two resident 1.5B trainers would not fit together."""
    batches = [args.methods] if args.device == "cpu" else [[m] for m in args.methods]
    results = []
    for methods in batches:
        ranks = Ranks(args, methods)
        facts = ranks.ask(methods, None, "ready")
        calls: dict[str, list[dict]] = {m: [] for m in methods}
        for turn in range(args.repeats + 1):
            for method in methods[::-1] if turn % 2 else methods:
                start = time.perf_counter()
                reports = ranks.ask([method], "run", "call")[method]
                calls[method].append(dict(wall=time.perf_counter() - start, ranks=reports))
        ends = ranks.ask(methods, "done", "result")
        ranks.wait()
        for m in methods:
            per_rank = [f | e for f, e in zip(facts[m], ends[m], strict=True)]
            results.append(
                dict(method=m, mode=per_rank[0]["mode"], ranks=per_rank, calls=calls[m][1:])
            )
    return results


def summarise(result: dict, peak_tflops: float | None) -> dict[str, float]:
    """The reported quantities of one method: medians over the timed calls of sums or maxima
    over the ranks; forwards per optimizer step over all timed calls, the largest rank's."""
    calls, ranks = result["calls"], result["ranks"]
    # the slowest rank's update; pi_old's scoring before it; the actor phase of a step, both
    # as the driver waits for them (the parent's clock around the call)
    wall = statistics.median(max(r["wall"] for r in c["ranks"]) for c in calls)
    steps = statistics.median(c["ranks"][0]["optimizer_steps"] for c in calls)
    tokens = sum(r["response_tokens"] for r in ranks)
    row = {"wall s per ppo_train": wall}
    row["wall s, pi_old scoring"] = statistics.median(
        max(r["pi_old_wall"] for r in c["ranks"]) for c in calls
    )
    row["wall s, actor phase"] = statistics.median(c["wall"] for c in calls)
    if "gpu" not in ranks[0]:
        cpu = statistics.median(sum(r["cpu"] for r in c["ranks"]) for c in calls)
        slowest = statistics.median(max(r["cpu"] for r in c["ranks"]) for c in calls)
        row |= {"CPU s per ppo_train": cpu, "CPU s, slowest rank": slowest}
        row |= {"CPU s per optimizer step": cpu / steps, "response tokens per CPU s": tokens / cpu}
        row["CPU s, pi_old scoring"] = statistics.median(
            sum(r["pi_old_cpu"] for r in c["ranks"]) for c in calls
        )
        row["CPU s, actor phase"] = statistics.median(
            sum(r["pi_old_cpu"] + r["cpu"] for r in c["ranks"]) for c in calls
        )
    row["response tokens/s"] = tokens / wall
    row["peak RSS MiB, max rank"] = max(r["peak_rss_mib"] for r in ranks)
    row["RSS growth MiB, max rank"] = max(r["peak_rss_mib"] - r["rss_before_mib"] for r in ranks)
    if "gpu" in ranks[0]:
        row["peak CUDA GiB, max rank"] = max(r["peak_cuda_gib"] for r in ranks)
        # 6 N FLOP per token for one forward+backward; DRPO's extra no-grad forward is
        # overhead, not model FLOPs, and attention's own FLOPs are left out as usual.
        all_tokens = sum(r["tokens"] for r in ranks)
        tflops = 6 * ranks[0]["matmul_params"] * all_tokens / wall / 1e12
        row["model TFLOP/s"] = tflops
        if peak_tflops:
            row["MFU %"] = 100 * tflops / peak_tflops
    row["optimizer steps per call"] = steps
    for kind in ("grad", "no_grad"):
        per_rank = [
            sum(c["ranks"][r][f"forwards_{kind}"] for c in calls)
            / sum(c["ranks"][r]["optimizer_steps"] for c in calls)
            for r in range(len(ranks))
        ]
        row[f"forwards/step, {kind.replace('_', ' ')}"] = max(per_rank)
    if calls[0]["ranks"][0]["penalty_pass"] is not None:  # DRPO's share of steps, per call
        row["penalty-pass steps per call"] = statistics.mean(
            c["ranks"][0]["penalty_pass"] * c["ranks"][0]["optimizer_steps"] for c in calls
        )
    return row


def drpo_split(result: dict) -> list[str]:
    """DRPO's median call split into scores pass, all-gather, coefficients and gradient pass,
    in CPU seconds summed over the ranks on CPU (robust to other load) and rank 0's wall
    seconds on a GPU."""
    clock = "wall" if "gpu" in result["ranks"][0] else "cpu"
    pick = 0 if clock == "wall" else 1
    ranks = [0] if clock == "wall" else range(len(result["ranks"]))

    def total(call: dict, part: str | None) -> float:
        reports = [call["ranks"][r] for r in ranks]
        if part is None:
            return sum(r[clock] for r in reports)
        return sum(r["split"].get(part, [0.0, 0.0])[pick] for r in reports)

    calls = result["calls"]
    whole = statistics.median(total(c, None) for c in calls)
    scores = statistics.median(total(c, "scores") for c in calls)
    gather = statistics.median(total(c, "gather") for c in calls)
    coefficients = statistics.median(total(c, "coefficients") for c in calls)
    grad = whole - scores - gather - coefficients
    steps = result["ranks"][0]["optimizer_steps"]
    return [
        f"DRPO split of a ppo_train call ({clock} seconds, medians):",
        f"  scores pass (no-grad forwards, steps 2..{steps}) {scores:8.3f} {scores / whole:6.1%}",
        f"  all-gather of the scalars                  {gather:8.3f} {gather / whole:6.1%}",
        f"  coefficients (autograd on the scalars)     {coefficients:8.3f} "
        f"{coefficients / whole:6.1%}",
        f"  gradient pass (fwd+bwd+optimizer, rest)    {grad:8.3f} {grad / whole:6.1%}",
        f"  scores pass / gradient pass = {scores / grad:.3f} over the call, "
        f"{scores / grad * steps / (steps - 1):.3f} on a step that has one",
    ]


def pair_ratios(results: list[dict], phase: bool = False) -> list[float]:
    """DRPO/PPO CPU seconds (all ranks) of each turn's pair of calls, of the update or of
    the actor phase (``phase``: pi_old's scoring too): their spread."""

    def cpu(call: dict) -> float:
        return sum(r["cpu"] + (r["pi_old_cpu"] if phase else 0.0) for r in call["ranks"])

    calls = {r["method"]: r["calls"] for r in results}
    return [cpu(d) / cpu(p) for d, p in zip(calls["drpo"], calls["ppo"], strict=True)]


def number(value: float) -> str:
    return f"{value:12,.0f}" if abs(value) >= 1000 else f"{value:12.4g}"


def gpu_peak(args: argparse.Namespace, results: list[dict]) -> float | None:
    """The bf16 peak to compute MFU against: ``--peak-tflops``, else the GPU's, if known."""
    gpu = results[0]["ranks"][0].get("gpu")
    if args.peak_tflops is not None or gpu is None:
        return args.peak_tflops
    return next((p for key, p in BF16_PEAK_TFLOPS if key in gpu), None)


def report(
    args: argparse.Namespace,
    results: list[dict],
    rows: dict[str, dict[str, float]],
    load: tuple[float, float],
) -> str:
    first = results[0]["ranks"][0]
    peak = gpu_peak(args, results)
    both = len(rows) == 2
    device = (
        f"{first['gpu']}, bf16 peak {peak} TFLOP/s"
        if "gpu" in first
        else (
            f"{os.cpu_count()} CPU cores, load average {load[0]:.1f} before / {load[1]:.1f} after"
        )
    )
    ranks = results[0]["ranks"]
    mode = next((r["mode"] for r in results if r["mode"]), "-")
    lines = [
        f"device {args.device} ({device})",
        f"model {args.model}: {first['params'] / 1e6:.1f}M parameters "
        f"({first['matmul_params'] / 1e6:.1f}M without the input embedding)",
        f"rollout {args.prompts} prompts x {args.n} = {args.prompts * args.n} responses, "
        f"{sum(r['response_tokens'] for r in ranks)} response / "
        f"{sum(r['tokens'] for r in ranks)} total tokens; "
        f"{first['optimizer_steps']} optimizer steps of {args.train_batch}, "
        f"{args.ranks} rank(s) x micro-batch {args.micro_batch}",
        f"ZeRO-{args.zero_stage}, {args.dtype}, gradient checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'}, "
        f"{'packed' if args.packing else 'padded'}, attn {args.attn}, lr {args.lr:g}; "
        f"median of {args.repeats} calls after 1 warm-up",
        f"DRPO kl_estimate {args.kl_estimate}: {mode} update",
        "",
        f"{'':32}" + "".join(f"{m.upper():>12}" for m in rows) + ("    DRPO/PPO" if both else ""),
    ]
    for key in rows[results[0]["method"]]:
        line = f"{key:32}" + "".join(number(row.get(key, math.nan)) for row in rows.values())
        ratio = both and key in rows["ppo"] and key in rows["drpo"] and rows["ppo"][key]
        lines.append(line + (f"{rows['drpo'][key] / rows['ppo'][key]:12.3f}" if ratio else ""))
    if both:
        for phase, what in ((False, "update"), (True, "actor phase")):
            ratios = pair_ratios(results, phase)
            lines.append(
                f"DRPO/PPO CPU s of each turn's pair of calls, {what}: "
                f"{min(ratios):.3f} .. {max(ratios):.3f}"
            )
    for r in results:
        calls = ", ".join(
            f"{c['wall']:.2f}/{sum(x['cpu'] for x in c['ranks']):.2f}" for c in r["calls"]
        )
        lines.append(f"{r['method']} calls, wall/CPU s (all ranks): {calls}")
    drpo = [r for r in results if r["method"] == "drpo"]
    if drpo and first["optimizer_steps"] > 1:
        lines += ["", *drpo_split(drpo[0])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    load_before = os.getloadavg()[0]
    results = measure(args)
    rows = {r["method"]: summarise(r, gpu_peak(args, results)) for r in results}
    text = report(args, results, rows, (load_before, os.getloadavg()[0]))
    print(text)
    if args.json:
        setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        out = {"args": setup, "summary": rows, "results": results, "report": text}
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
