"""DRPO inside OpenRLHF 0.11.2: subclasses and entry-point glue (imports OpenRLHF lazily)."""
