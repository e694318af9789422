"""Errors of ``cspan prepare`` and ``cspan train`` (rooted at :class:`cspan.core.errors.CspanError`).

Messages say what is wrong, where (the file, and for dialogue files the JSON field such as
``turns[2].words[0].start``), and how to fix it.
"""

from __future__ import annotations

from cspan.core.errors import CspanError, SettingsError


class DataError(CspanError):
    """A dialogue (JSON + audio) or a prepared dataset is invalid; the message names the file and the field."""


class DatasetMismatchError(DataError, SettingsError):
    """A prepared ``--out-dir`` that the settings of the run do not fit: prepared with another tokenizer, codec or
    persona prefix layout (the ``--checkpoint``'s) or another recorded option (``--persona``, ``--max-span-frames``,
    ``--voice``). Names the flag and both values; exit status 2, as every setting that does not fit what it names."""


class TrainError(CspanError):
    """A training run cannot start or resume (bad options, incompatible checkpoint or dataset)."""


class TrainSettingsError(TrainError, SettingsError):
    """A ``cspan train`` setting does not fit the run it names (resuming with options that change the result): names
    the flag and both values; exit status 2."""


__all__ = ["DataError", "DatasetMismatchError", "TrainError", "TrainSettingsError"]
