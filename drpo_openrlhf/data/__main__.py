"""``python -m drpo_openrlhf.data``: the same as the ``drpo-data`` console script."""

from drpo_openrlhf.data.cli import main

raise SystemExit(main())
