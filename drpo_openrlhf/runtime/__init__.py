"""The run's plumbing: OpenRLHF's parser and entry point, the Ray actors DRPO places, the
checks before launch, device and CPU support, the memory plan, checkpoints, stops and exits.

May import ``update``, ``sync``, ``rewards`` and ``algo``; nothing below imports it (checked by
``make lint``).
"""
