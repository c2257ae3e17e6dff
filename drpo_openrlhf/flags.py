"""One way to read an OpenRLHF flag, whichever shape the flags come in.

The entry point parses the command line into a flat ``argparse.Namespace`` whose attribute
names keep their dots (``"ds.zero_stage"``); OpenRLHF's ``hierarchize`` hands its actors a
nested one (``args.ds.zero_stage``). Code that runs on both sides (the batch layout) or moves
between them reads through ``flag``. Imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

from typing import Any


def flag(args: object, name: str) -> Any:
    """The value of ``--name`` (``name`` without the dashes, e.g. ``"rollout.batch_size"``)
    from OpenRLHF's flat or nested flags. Raises ``AttributeError`` for a flag not there."""
    flat = vars(args)
    if name in flat:
        return flat[name]
    value = args
    for part in name.split("."):
        value = getattr(value, part)
    return value
