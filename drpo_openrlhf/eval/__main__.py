import sys

from drpo_openrlhf.eval.cli import main

sys.exit(main())
