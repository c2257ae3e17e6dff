"""The trust region's noise floor: the token-mean KL(pi_old || pi_theta) estimate at identical
weights, when the old log-probs and the update's forward batch the same responses differently.

The rollout scores pi_old in rollout micro-batches, in generation order, without a graph; the
update forwards the same responses in its own micro-batches (another size, another order,
other padding), with a graph. At identical weights the two should give the same log-probs;
in bf16 they do not, and a KL estimate above ``delta`` makes the hinge fire on rounding alone.
This script measures that floor for each pair of layouts, so that it can be compared with
``delta`` (docs/algorithm.md) and so that a fix (score pi_old in the update's micro-batches)
can be seen to remove it.

    python scripts/measure_kl_floor.py --model shape:smollm2 --device cuda --dtype bf16
    python scripts/measure_kl_floor.py --model dir:~/.cache/drpo_openrlhf/smollm2 --device cpu

``--model`` is ``dir:PATH`` (a Hugging Face model), ``gguf:FILE`` (transformers' GGUF
loader) or ``shape:NAME`` (random weights of a named shape). Only torch and transformers are
needed, so it runs on a bare GPU machine too.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

SHAPES = {  # random-weight stand-ins of real shapes (config fields of transformers)
    "smollm2": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "qwen1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def load_model(spec: str, dtype: torch.dtype, attn: str):
    """The model named by ``--model`` and a tokenizer (None for a random shape)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kind, _, value = spec.partition(":")
    if kind == "shape":
        fields = dict(SHAPES[value])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        return model.to(dtype), None
    if kind == "gguf":
        path = Path(value).expanduser()
        kwargs = dict(gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, dtype=dtype, attn_implementation=attn, **kwargs
        )
        return model, AutoTokenizer.from_pretrained(path.parent, **kwargs)
    if kind == "dir":
        path = Path(value).expanduser()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
        return model, AutoTokenizer.from_pretrained(path)
    raise SystemExit(f"--model must be dir:PATH, gguf:FILE or shape:NAME, not {spec!r}")


def sample_rollout(model, tokenizer, args, device) -> list[tuple[list[int], int]]:
    """``responses`` (prompt + response token ids, prompt length) sampled from the model, each
    response cut to a random length so that micro-batches pad as a rollout's do."""
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prompts = []
    for p in range(args.responses // args.n):
        if tokenizer is not None and tokenizer.chat_template:
            text = f"What is {7 + p} + {5 + 3 * p}? Think step by step."
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(chat, add_special_tokens=False).input_ids
        else:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(16, 64))]
        prompts += [ids] * args.n
    width = max(map(len, prompts))
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            pad_token_id=pad,
        )
    rollout = []
    for prompt, row in zip(prompts, out[:, width:].tolist(), strict=True):
        length = rng.randint(max(1, args.max_new_tokens // 8), args.max_new_tokens)
        rollout.append((prompt + row[:length], len(prompt)))
    return rollout


def token_log_probs(model, rollout, order, micro, device, *, grad: bool) -> list[torch.Tensor]:
    """Each response's token log-probs (fp32, as OpenRLHF's actor computes them), forwarded in
    micro-batches of ``micro`` responses taken in ``order`` and right-padded to the longest."""
    result: list[torch.Tensor | None] = [None] * len(rollout)
    model.train(grad)
    for start in range(0, len(order), micro):
        rows = order[start : start + micro]
        width = max(len(rollout[i][0]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for r, i in enumerate(rows):
            seq = rollout[i][0]
            ids[r, : len(seq)] = torch.tensor(seq, device=device)
            mask[r, : len(seq)] = 1
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        for r, i in enumerate(rows):
            seq, prompt_len = rollout[i]
            result[i] = logp[r, prompt_len - 1 : len(seq) - 1].detach().cpu()
        del logits, logp
    model.train(False)
    return result  # type: ignore[return-value]


def compare(old: list[torch.Tensor], new: list[torch.Tensor]) -> dict[str, float]:
    """The trust region's estimate (token mean of ``old - new``), the gap's size, and how the
    estimate's noise scales with the batch.

    A rounding difference at one token carries on to the later tokens of its response, so the
    responses, not the tokens, are the independent units: ``kl_se`` is the estimate's standard
    error over responses (the ratio estimator's, ``sqrt(sum (S_i - k T_i)^2) / sum T_i`` for
    response sums ``S_i`` over ``T_i`` tokens), and ``kl_se_x_sqrt_tokens`` is it times the
    square root of the token count: a batch of ``T`` tokens of such responses has an estimate
    noisy by about ``kl_se_x_sqrt_tokens / sqrt(T)``."""
    diff = torch.cat([o - n for o, n in zip(old, new, strict=True)]).double()
    sums = torch.stack([(o - n).double().sum() for o, n in zip(old, new, strict=True)])
    counts = torch.tensor([float(o.numel()) for o in old], dtype=torch.float64)
    kl = diff.mean()
    se = ((sums - kl * counts).square().sum().sqrt() / counts.sum()).item()
    return {
        "kl_token_mean": kl.item(),
        "abs_mean": diff.abs().mean().item(),
        "abs_max": diff.abs().max().item(),
        "tokens_differing": int((diff != 0).sum()),
        "kl_se": se,
        "kl_se_x_sqrt_tokens": se * counts.sum().sqrt().item(),
        "identical": bool((diff == 0).all()),
    }


def dealt_order(count: int, n: int, seed: int) -> list[int]:
    """An update's order: whole prompt groups, shuffled, as the DRPO deal leaves them."""
    groups = [list(range(g, g + n)) for g in range(0, count, n)]
    random.Random(seed + 1).shuffle(groups)
    return [i for g in groups for i in g]


def measure(args) -> dict:
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, DTYPES[args.dtype], args.attn)
    model.to(device)
    loaded = time.perf_counter() - started
    rollout = sample_rollout(model, tokenizer, args, device)
    generation_order = list(range(len(rollout)))
    update_order = dealt_order(len(rollout), args.n, args.seed)

    def run(order, micro, grad):
        return token_log_probs(model, rollout, order, micro, device, grad=grad)

    old = run(generation_order, args.rollout_micro, grad=False)  # what OpenRLHF scores
    layouts = {
        # the same pass again: is the forward deterministic at all?
        "rollout_layout_again": run(generation_order, args.rollout_micro, grad=False),
        # the rollout's micro-batches under autograd: the graph's own effect
        "rollout_layout_with_graph": run(generation_order, args.rollout_micro, grad=True),
        # what the update forwards today: its micro-batches, its order, with a graph
        "update_layout_with_graph": run(update_order, args.train_micro, grad=True),
        # one response per forward: the order-free layout
        "one_per_forward": run(generation_order, 1, grad=False),
    }
    update_old = run(update_order, args.train_micro, grad=False)
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "attn": args.attn,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "responses": len(rollout),
        "tokens": sum(len(s) - p for s, p in rollout),
        "rollout_micro": args.rollout_micro,
        "train_micro": args.train_micro,
        "load_s": round(loaded, 1),
        "old_vs": {name: compare(old, new) for name, new in layouts.items()},
        # the fix: pi_old scored in the update's own micro-batches
        "update_layout_old_vs_update": compare(update_old, layouts["update_layout_with_graph"]),
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--responses", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--rollout-micro", type=int, default=8)
    parser.add_argument("--train-micro", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = measure(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
