"""cspan.server: the applications `cspan infer` and `cspan serve` (see docs/ARCHITECTURE.md for what this package holds and may import)."""

__version__ = "0.1.0"
