"""The weight sync between the DeepSpeed actor and the vLLM engines, and what checks it: the
positional digest, the probe, the engines' start and tags, the vLLM worker extensions (CUDA
and CPU). Nothing of DRPO's objective is here.

May import ``algo`` (the probe's and the gap's plain-torch math); never ``update``,
``runtime`` or ``rewards`` (checked by ``make lint``).
"""
