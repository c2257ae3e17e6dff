"""OpenRLHF's ``Actor`` with its log-probs computed in chunks (``chunked_logprobs``).

Installed on the DRPO actor by swapping the class of the ``Actor`` OpenRLHF built
(``install``), so that both of its callers use it: the DRPO loss (``actor_trainer._scalars``)
and the old log-probs of the experience maker (``PolicyModelActor.forward``). The HF model
still runs its own forward (DeepSpeed's engine, ZeRO-3 hooks, gradient checkpointing are
untouched) but is asked for no logits (``logits_to_keep`` = no position); its decoder's last
hidden states are caught by a forward hook, and the output layer is then called once more as
a module, its forward swapped for the chunked log-probs for that one call.

Only what DRPO and OpenRLHF's PPO update (the baselines) call is supported: action log-probs
of padded or packed samples, with the model's output when asked (``return_output``: the PPO
update reads only its MoE ``aux_loss``; its ``logits`` hold no position). Under ring attention
(packed samples only, as OpenRLHF forces) each rank computes the log-probs of its slice of the
packed tokens in chunks and OpenRLHF's helpers gather them, exactly as its own forward does.
Anything else (entropy, all-gathered logits, ring attention over padded rows, multimodal
inputs) is refused, not silently computed unchunked.
"""

from __future__ import annotations

import torch
from openrlhf.models import Actor
from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor
from torch import Tensor

from drpo_openrlhf import upstream
from drpo_openrlhf.update.chunked_logprobs import chunked_token_log_probs

OFF_HINT = "set --drpo.logprob_chunk_tokens 0 for OpenRLHF's unchunked forward"


class ChunkedLogProbActor(Actor):
    """``Actor`` whose action log-probs never hold more than ``logprob_chunk_tokens`` tokens'
    logits at once."""

    logprob_chunk_tokens: int

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        return_output: bool = False,
        allgather_logits: bool = False,
        return_logprobs: bool = False,
        ring_attn_group=None,
        packed_seq_lens=None,
        return_entropy: bool = False,
        **mm_inputs,
    ) -> Tensor:
        unsupported = {
            "action_mask=None": action_mask is None,
            "return_entropy": return_entropy,
            "allgather_logits": allgather_logits,
            "ring attention without packed samples": ring_attn_group is not None
            and not self.packing_samples,
            "multimodal inputs": bool(mm_inputs) or getattr(self, "is_vlm", False),
        }
        refused = [name for name, asked in unsupported.items() if asked]
        if refused:
            raise NotImplementedError(
                f"chunked log-probs do not support {', '.join(refused)}; {OFF_HINT}"
            )
        batch, seqlen = sequences.shape
        if self.packing_samples:
            sequences, position_ids, labels, pad_len, indices = unpad_and_slice_tensor(
                sequences, attention_mask, ring_attn_group
            )
            mask = None
        else:
            labels = torch.roll(sequences, shifts=-1, dims=1)
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            mask = attention_mask
        hidden, output = self._last_hidden_states(sequences, mask, position_ids)
        log_probs = self._log_probs(hidden, labels)
        if self.packing_samples:
            log_probs = gather_and_pad_tensor(
                log_probs, ring_attn_group, pad_len, indices, batch, seqlen
            )
        log_probs = log_probs[:, :-1]
        action_log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask.float()
        return (action_log_probs, output) if return_output else action_log_probs

    def _last_hidden_states(
        self, sequences: Tensor, attention_mask: Tensor | None, position_ids: Tensor
    ) -> tuple[Tensor, dict]:
        """The decoder's output (after its final norm) from the model's own forward, which
        computes logits for no position, and that forward's output."""
        caught: list[Tensor] = []

        def catch(_module, _inputs, output) -> None:
            caught.append(output[0])  # a tuple or a ModelOutput: last_hidden_state first

        handle = self.model.get_decoder().register_forward_hook(catch)
        try:
            output = self.model(
                sequences,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=torch.empty(0, dtype=torch.long, device=sequences.device),
            )
        finally:
            handle.remove()
        if len(caught) != 1 or output["logits"].shape[1] != 0:
            raise RuntimeError(
                f"the model's decoder ran {len(caught)} times and it returned logits for "
                f"{output['logits'].shape[1]} positions; expected once and none ({OFF_HINT})"
            )
        return caught[0], output

    def _log_probs(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """Chunked log-probs inside one call of the output projection module, so that ZeRO-3
        gathers its weight once per forward and once per backward, the same number of times
        on every rank whatever its token count (per-chunk calls would not match across ranks
        and hang their collectives)."""
        lm_head = self.model.get_output_embeddings()
        if type(lm_head) is not torch.nn.Linear or lm_head.bias is not None:
            raise NotImplementedError(
                f"chunked log-probs need a bias-free nn.Linear output layer, got {lm_head}; "
                + OFF_HINT
            )

        def log_probs_forward(h: Tensor) -> Tensor:
            return chunked_token_log_probs(
                h, labels, lm_head.weight, self.temperature, self.logprob_chunk_tokens
            )

        lm_head.forward = log_probs_forward
        try:
            return lm_head(hidden)
        finally:
            del lm_head.forward


def install(actor: Actor, chunk_tokens: int) -> None:
    """Make ``actor`` compute its log-probs ``chunk_tokens`` tokens at a time (0: leave it)."""
    if chunk_tokens < 0:
        raise ValueError(f"--drpo.logprob_chunk_tokens must be >= 0, got {chunk_tokens}")
    if chunk_tokens == 0:
        return
    if type(actor) is not Actor:
        raise TypeError(f"chunked log-probs replace OpenRLHF's Actor, got {type(actor)}")
    upstream.swap_class(actor, ChunkedLogProbActor)
    actor.logprob_chunk_tokens = chunk_tokens
