"""cspan.train: `cspan prepare` and `cspan train` (see docs/ARCHITECTURE.md for what this package holds and may import)."""

__version__ = "0.1.0"
