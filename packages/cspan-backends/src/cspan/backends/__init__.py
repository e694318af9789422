"""cspan.backends: what the model calls when it emits ``<ret>``: transcribers, router, tool bank, Context DB.

This package never imports torch or ``cspan.core``; it satisfies the ``Transcriber`` and ``Retriever``
protocols of ``cspan.core`` structurally.
"""

__version__ = "0.1.0"
