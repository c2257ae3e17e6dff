"""Evaluation of reasoning models: pass@k, response lengths, AES, trade-off plots.

The command line is ``drpo-eval`` (``python -m drpo_openrlhf.eval``); see docs/evaluation.md.
"""

from drpo_openrlhf.eval.metrics import aes, pass_at_k

__all__ = ["aes", "pass_at_k"]
