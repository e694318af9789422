"""The ``CSPAN_*`` environment: the names cspan reads, and a warning at start for any other.

cspan reads two kinds of ``CSPAN_*`` variable:

- a settings model's (:mod:`cspan.core.settings`): one per field, the model's ``env_prefix`` followed by the field's
  name in capitals (``CSPAN_MAX_SESSIONS``, ``CSPAN_ASR_SERVE_PORT``), or the field's alias;
  :func:`settings_env_names` derives them from the model, as pydantic-settings does;
- a variable read directly by name (a default path, an engine switch, a test switch): :data:`DIRECT_ENV`, declared
  here once for every package (core names the variables of ``cspan.backends`` and ``cspan.bench`` too; it imports
  neither). docs/OPERATORS.md, "Environment variables", lists the same names: ``tests/test_docs.py`` holds the two
  equal, and ``tests/test_environment.py`` holds every ``CSPAN_*`` name the sources read to this list.

Any other ``CSPAN_*`` variable is a misspelling (``CSPAN_MAX_SESION``) or a setting that no longer exists, which
pydantic-settings would ignore without a word: :func:`cspan.core.cli.main` warns about each one at the start of
every verb (:func:`warn_unknown_env`), naming the closest known one. Known means known to any installed verb, not only
to the one run: one environment file commonly serves ``cspan serve``, ``cspan asr-serve`` and ``cspan tools serve``.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import AliasChoices, AliasPath
from pydantic_settings import BaseSettings

PREFIX = "CSPAN_"
"""The prefix of every variable cspan reads; only variables with it are checked."""

DIRECT_ENV: dict[str, str] = {
    # settings
    "CSPAN_CONFIG": "a settings file for every verb that takes --config (cspan.core.settings)",
    # model files (cspan.core.checkpoint, cspan.core.voice, cspan.core.archive)
    "CSPAN_CHECKPOINT": "the checkpoint of every verb that loads one when none is given (also --checkpoint)",
    "CSPAN_BASE": "the base of a fine-tune checkpoint (also --base)",
    "CSPAN_VOICES_DIR": "a folder of voice files whose names --voice may use",
    "CSPAN_CACHE_DIR": "where extracted voice archives go (default ~/.cache/cspan)",
    # backends and tools (cspan.backends, cspan.server, cspan.bench)
    "CSPAN_ASR_URL": "the transcriber's URL (what `cspan backends env` prints; below CSPAN_ASR)",
    "CSPAN_ROUTER_URL": "the router's URL (what `cspan backends env` prints; below CSPAN_ROUTER)",
    "CSPAN_ASR_MODEL": "the model name sent to an OpenAI-style transcriber (cspan bench; serve and infer's --asr-model)",
    "CSPAN_ROUTER_MODEL": "the model name at the router URL (cspan bench; serve and infer's --router-model)",
    "CSPAN_ASR_TOKEN": "cspan asr-serve's token when CSPAN_ASR_SERVE_TOKEN and --token are not given",
    "CSPAN_DB": "the Context DB (cspan db, cspan users; serve and infer's --db)",
    "CSPAN_STATE_DIR": "where `cspan backends` records the servers it started (default ~/.local/state/cspan)",
    "CSPAN_ASSUME_GPU": "`cspan backends start`: start the GPU servers on a machine without nvidia-smi",
    "CSPAN_WEATHER_URL": "the weather tool's forecast server",
    "CSPAN_GEOCODING_URL": "the weather tool's geocoding server",
    # engine switches (docs/PERFORMANCE.md, "Switches"; cspan.core.modules.fused.settings_from_env)
    "CSPAN_FUSED": "0: no Triton kernels; 1: also for float32 models",
    "CSPAN_PDL": "0: launch the kernels without programmatic dependent launch",
    "CSPAN_GEMV": "0: the depformer on cuBLAS",
    "CSPAN_DECODE_CONFIG": "the decode-attention kernel's configuration (tuning runs)",
    "CSPAN_ATTENTION": "auto, triton or flashinfer: the engine's decode attention",
    "CSPAN_SPAN_OVERLAP": "0: a mixed step's block attention after its decode attention, on one stream",
    # development (tests/, noxfile.py)
    "CSPAN_FIXTURES": "the tests' fixtures folder (default ../shared/fixtures)",
    "CSPAN_TEST_INTERPRETER": "1: also run the tests that run the Triton kernels in Triton's interpreter",
    "CSPAN_TEST_LOG": "the log level of the servers the tests start (default warning)",
    "CSPAN_SKIP_BROWSER": "skip the tests that drive a browser",
    "CSPAN_TORCH_SPEC": "the torch requirement of nox's sessions",
}
"""Every ``CSPAN_*`` variable read by name rather than through a settings model, with what it does: the one
declaration (docs/OPERATORS.md, "Environment variables", lists the same)."""


def _field_env_names(name: str, field: Any, prefix: str) -> list[str]:
    """The variables pydantic-settings reads for one field: its aliases (the prefix is not applied to them), else the
    prefix and its name."""
    alias = field.validation_alias if field.validation_alias is not None else field.alias
    if alias is None:
        return [prefix + name]
    choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
    names = []
    for choice in choices:
        if isinstance(choice, AliasPath):
            choice = choice.path[0]
        if isinstance(choice, str):
            names.append(choice)
    return names


def settings_env_names(model: type[BaseSettings]) -> set[str]:
    """The environment variables ``model`` reads: ``env_prefix`` + field name, or the field's aliases, in capitals
    unless the model is ``case_sensitive``. With ``env_nested_delimiter`` set, each field also gives a pattern,
    ``CSPAN_FIELD__*``: any variable that starts with ``CSPAN_FIELD__`` (a nested field's) is known."""
    config = model.model_config
    prefix = str(config.get("env_prefix") or "")
    delimiter = config.get("env_nested_delimiter")
    names: set[str] = set()
    for name, field in model.model_fields.items():
        for env in _field_env_names(name, field, prefix):
            names.add(env)
            if delimiter:
                names.add(f"{env}{delimiter}*")
    return names if config.get("case_sensitive") else {n.upper() for n in names}


def known_env_names(models: Iterable[type[BaseSettings]]) -> set[str]:
    """The ``CSPAN_*`` variables cspan reads: those of ``models`` and :data:`DIRECT_ENV`."""
    known = set(DIRECT_ENV)
    for model in models:
        known |= settings_env_names(model)
    return known


def closest_name(name: str, known: Iterable[str], *, prefix: str = "") -> str | None:
    """The name of ``known`` closest to ``name``, compared in capitals after ``prefix`` (the ``CSPAN_`` every variable
    shares would make every pair of names look alike), or None when none is close: what an unknown ``CSPAN_*``
    variable or settings-file key (:mod:`cspan.core.settings`) was probably meant to be."""
    tails = {k.removeprefix(prefix).upper(): k for k in known if k.startswith(prefix) and not k.endswith("*")}
    # 0.75: PROT -> PORT is close, ADMIN_TOKEN -> ASR_TOKEN (0.7) is another setting, not a misspelling of it
    close = difflib.get_close_matches(name.removeprefix(prefix).upper(), sorted(tails), n=1, cutoff=0.75)
    return tails[close[0]] if close else None


def unknown_env(
    environ: Mapping[str, str], models: Iterable[type[BaseSettings]], *, named: Iterable[str] = ()
) -> list[tuple[str, str | None]]:
    """The ``CSPAN_*`` variables of ``environ`` that cspan does not read, each with the closest known name (or None).

    Args:
        environ: the environment (``os.environ``).
        models: the settings models of every installed verb.
        named: variables the command line names (``--judge-key-env CSPAN_KEY``), read by that name: not reported.

    Returns:
        ``(variable, suggestion)`` pairs, sorted by variable.
    """
    models = list(models)
    known = known_env_names(models)
    # a model that is not case_sensitive reads its variables in any case (CSPAN_max_sessions): known in capitals
    folded = {n for m in models if not m.model_config.get("case_sensitive") for n in settings_env_names(m)}
    patterns = tuple(k.removesuffix("*") for k in known if k.endswith("*"))  # nested fields' (CSPAN_FIELD__*)
    skip = set(named)
    found = []
    for var in sorted(environ):
        if not var.startswith(PREFIX) or var in known or var.upper() in folded or var in skip:
            continue
        if patterns and (var.startswith(patterns) or var.upper().startswith(patterns)):
            continue
        found.append((var, closest_name(var, known, prefix=PREFIX)))
    return found


def _message(var: str, suggestion: str | None) -> str:
    """The warning for one unknown variable."""
    hint = f" (did you mean {suggestion}?)" if suggestion else ""
    return f"{var} is not a cspan setting{hint}; it is ignored"


def warn_unknown_env(
    environ: Mapping[str, str], models: Iterable[type[BaseSettings]], *, argv: Iterable[str] = ()
) -> list[str]:
    """Log a warning for each ``CSPAN_*`` variable of ``environ`` that cspan does not read (:func:`unknown_env`).

    Args:
        environ: the environment.
        models: the settings models of every installed verb.
        argv: the command line; a variable it names (as an argument, or after ``=``) is not reported.

    Returns:
        The variables warned about.
    """
    named = {part for arg in argv for part in (arg, arg.partition("=")[2]) if part.startswith(PREFIX)}
    log = logging.getLogger(__name__)
    found = unknown_env(environ, models, named=named)
    for var, suggestion in found:
        log.warning("%s", _message(var, suggestion))
    return [var for var, _ in found]


__all__ = [
    "DIRECT_ENV",
    "PREFIX",
    "closest_name",
    "known_env_names",
    "settings_env_names",
    "unknown_env",
    "warn_unknown_env",
]
