"""``make demo``: the product's main job on a toy task, on CPU (``run.py``)."""
