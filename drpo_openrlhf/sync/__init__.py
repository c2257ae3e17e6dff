"""The weight sync between the DeepSpeed actor and the vLLM engines, and what checks it: the
positional digest, the probe, the engines' start and tags, the vLLM worker extensions (CUDA
and CPU). Nothing of DRPO's objective is here.

The probe's and the rollout gap's statistics (``weight_probe``, ``logprob_gap``) are plain
PyTorch, as the algorithm core is. May import ``algo``; never ``update``, ``runtime`` or
``rewards`` (checked by ``make lint``).
"""
