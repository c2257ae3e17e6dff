import sys

from drpo_openrlhf.sweep.cli import main

sys.exit(main())
