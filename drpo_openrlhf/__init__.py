"""DRPO (Decoupled Reward Policy Optimization) on top of OpenRLHF 0.11.2."""

__version__ = "0.1.0"
