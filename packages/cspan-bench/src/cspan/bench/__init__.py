"""cspan.bench: `cspan bench ...` span latency, Full-Duplex-Bench, tool use and spoken QA (see docs/ARCHITECTURE.md for what this package holds and may import)."""

__version__ = "0.1.0"
