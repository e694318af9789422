"""Configuration models (pydantic) read from the upstream ``config.json`` layouts.

``LMConfig`` mirrors the keyword arguments of Kyutai's ``LMModel`` (``moshi/models/loaders.py``,
``_lm_kwargs``); ``MimiConfig`` mirrors ``loaders._mimi_config``. Both accept the upstream dicts as they are.
"""

from __future__ import annotations
