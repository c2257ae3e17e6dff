"""Stand-in for ``flash_attn``, which cannot be built without CUDA.

OpenRLHF imports ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` at module
import time. The CPU environment (``make venv``) puts this directory on the path only when the
real package cannot be imported; production code never imports it. There is deliberately no
``flash_attn.ops``, so OpenRLHF falls back to its torch log-prob path.
"""
