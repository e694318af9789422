"""Settings declared once: a pydantic-settings model is the single declaration of a verb's settings.

Each field of a :class:`pydantic_settings.BaseSettings` model declares one setting: its name, type, range
(``Field(ge=..., le=...)``, finite numbers with ``allow_inf_nan=False``), default and help (``description``). From
that one declaration this module generates

- the command-line flags of the verb (kebab-case, ``--name``; booleans as ``--name/--no-name``; lists repeat the
  flag), through pydantic-settings' :class:`~pydantic_settings.CliSettingsSource`;
- the environment variables (``CSPAN_NAME``, the model's ``env_prefix``);
- a settings file: ``--config FILE.toml`` (or ``CSPAN_CONFIG``), whose keys are the field names (snake or kebab
  case), at the top level (read by every verb given the file, so each must know them) and in a table named after
  the verb (``[serve]``), whose keys add to and override the top level's: one file can hold several verbs. A table
  that names no installed verb (a misspelled ``[sevre]``) is refused; a file that holds a credential (a ``secret``
  field such as ``token``, a URL with a password) and can be read by other users is warned about.

Precedence: command line, then environment, then the settings file, then the declared default. A value out of
range, whatever its source, is reported as one line naming the flag, the environment variable or the file key, and
the command exits with status 2 before any work starts (:class:`SettingsError`).

A repeatable flag (a ``list`` field) takes each value verbatim: ``--span "1.0:Hello, world"`` is one item, commas,
brackets and quotes included (pydantic-settings' own list syntax, which splits on commas and reads JSON, applies
only to the environment and the settings file).

Field extras (``Field(json_schema_extra={...})``) refine the generated flag: ``group`` (the help section),
``metavar``, ``hidden`` (not listed in ``--help``).

Usage, in a verb's ``register(parser)``::

    add_settings_arguments(parser, ServeSettings)
    parser.set_defaults(handler=lambda args: run(settings_from_args(args)))

Models that live where ``cspan.core`` cannot be imported (``cspan.backends``) declare ``SETTINGS_CONFIG``-like
configuration themselves; :mod:`cspan.core.cli` builds their verbs from the model (see ``SettingsCommand`` there).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tomllib
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import BeforeValidator, ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource, EnvSettingsSource, NoDecode, SettingsConfigDict
from pydantic_settings import SettingsError as SourceError

from .environment import closest_name
from .errors import SettingsError

SETTINGS_CONFIG = SettingsConfigDict(
    env_prefix="CSPAN_",
    cli_kebab_case=True,
    cli_implicit_flags=True,
    cli_hide_none_type=True,
    cli_avoid_json=True,
    extra="forbid",
    validate_default=True,
)
"""The ``model_config`` every settings model of the project uses (``CSPAN_`` environment, kebab-case flags)."""


T = TypeVar("T")


def _one_or_json_list(value: Any) -> Any:
    """A list setting's value as text (an environment variable): a JSON list (``'["a", "b"]'``) or, otherwise, the
    text as one item (``CSPAN_ALLOW_HOST=talk.example.org``); lists (flags, a settings file) pass unchanged."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"starts with '[' but is not a JSON list ({exc.msg}); give one value or a JSON list"
            ) from None
    return [value] if text else []


EnvList = Annotated[list[T], NoDecode, BeforeValidator(_one_or_json_list)]
"""A repeatable setting (``--allow-host A --allow-host B``) whose environment variable takes one value as is, or a
JSON list for several."""

CONFIG_ENV = "CSPAN_CONFIG"
"""Environment variable naming a settings file when ``--config`` is not given."""

S = TypeVar("S", bound=BaseSettings)

_MODEL = "_settings_model"
_SOURCE = "_settings_source"
_VERB = "_settings_verb"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(model: type[BaseSettings], name: str) -> str:
    return f"{model.model_config.get('env_prefix', '')}{name}".upper()


def _hidden(model: type[BaseSettings]) -> set[str]:
    """The fields marked ``hidden`` (test switches): taken from the command line (or Python) only, never from a
    settings file or the environment, where a stray value could turn them on for a public server."""
    return {
        name
        for name, field in model.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("hidden")
    }


def add_settings_arguments(
    parser: argparse.ArgumentParser, model: type[BaseSettings], *, config_file: bool = True
) -> None:
    """Add one flag per field of ``model`` to ``parser`` (and ``--config``); :func:`settings_from_args` reads them.

    Args:
        parser: the verb's parser.
        model: the settings model (a ``BaseSettings`` subclass; ``SETTINGS_CONFIG`` as its ``model_config``).
        config_file: also add ``--config FILE`` (a TOML settings file).
    """
    groups: dict[str, Any] = {}

    def add_argument(target: Any, *names: str, **kwargs: Any) -> Any:
        field = model.model_fields.get(kwargs.get("dest", ""))
        extra = field.json_schema_extra if field is not None and isinstance(field.json_schema_extra, dict) else {}
        if "metavar" in kwargs:  # a name the reader knows (PORT, ORIGIN) rather than a type (int, list[str])
            default_name = (
                kwargs.get("dest", "value").upper().removesuffix("S")
                if kwargs.get("action") == "append"
                else kwargs.get("dest", "value").upper()
            )
            kwargs["metavar"] = extra.get("metavar") or default_name.replace("_", "-")
        if isinstance(kwargs.get("help"), str):  # nothing said for an empty default: "(default: )" says nothing
            kwargs["help"] = kwargs["help"].replace(" (default factory: list)", "").replace(" (default: )", "")
        if extra.get("hidden"):
            kwargs["help"] = argparse.SUPPRESS
        elif field is not None and field.description and (not kwargs.get("help") or "(default:" in field.description):
            kwargs["help"] = field.description  # a description that says its default itself replaces the generated one
        group = extra.get("group")
        if group and target is parser:
            if group not in groups:
                groups[group] = parser.add_argument_group(str(group))
            target = groups[group]
        return target.add_argument(*names, **kwargs)

    source = CliSettingsSource(model, root_parser=parser, add_argument_method=add_argument)
    if config_file:
        parser.add_argument(
            "--config",
            type=Path,
            default=None,
            metavar="FILE",
            help=f"settings file (TOML: keys as the flags' names, top level and/or under [{parser.prog.split()[-1]}], "
            "which overrides the top level; "
            f"env {CONFIG_ENV}); flags and CSPAN_* variables override it",
        )
    parser.set_defaults(**{_MODEL: model, _SOURCE: source, _VERB: parser.prog.split()[-1]})


def settings_models(parser: argparse.ArgumentParser) -> list[type[BaseSettings]]:
    """The settings models of ``parser`` and of its verbs and sub-verbs (those given to :func:`add_settings_arguments`),
    each once: for the ``cspan`` parser, those of every installed verb."""
    found: list[type[BaseSettings]] = []
    model = parser.get_default(_MODEL)
    if model is not None:
        found.append(model)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # an alias is the same parser
                found += [m for m in settings_models(sub) if m not in found]
    return found


def _read_config(path: Path, verb: str, model: type[BaseSettings]) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SettingsError(f"settings file {path} does not exist") from None
    except OSError as exc:
        raise SettingsError(f"settings file {path} cannot be read: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        hint = ""
        if path.suffix.lower() == ".json":  # Moshi's --config is the model's config.json
            hint = (
                "; --config is cspan's TOML settings file, not a model's config.json (Moshi's --config): a checkpoint "
                "folder or file holding config.json is given with --checkpoint (docs/COMING-FROM-MOSHI.md)"
            )
        raise SettingsError(f"settings file {path} is not valid TOML: {exc}{hint}") from None
    verbs = _verbs() | {verb}
    for key, value in data.items():
        if isinstance(value, dict) and key not in verbs and key.replace("-", "_") not in model.model_fields:
            raise SettingsError(
                f"settings file {path}: [{key}] names no installed cspan verb (installed: {', '.join(sorted(verbs))}); "
                f"`cspan {verb}` reads the top level and [{verb}]"
            )
    section = data.get(verb)
    top = [(k, v) for k, v in data.items() if not (isinstance(v, dict) and k in verbs)]  # read by every command
    own = list(section.items()) if isinstance(section, dict) else []  # the [verb] table: adds and overrides
    values: dict[str, Any] = {}
    hidden = _hidden(model)
    for key, value in top + own:
        name = key.replace("-", "_")
        if name in hidden:  # releases before 2026-12-04 read it from a file; a stray one must not turn it on
            raise SettingsError(
                f"settings file {path}: {key!r} is {_flag(name)}, a test switch taken from the command line only "
                "(remove it from the file)"
            )
        if name not in model.model_fields:
            known = sorted(n.replace("_", "-") for n in model.model_fields if n not in hidden)
            close = closest_name(key.replace("_", "-"), known)
            hint = f"did you mean {close!r}?" if close else f"known: {', '.join(known)}"
            place = f"under [{verb}]" if (key, value) in own else "at the top level, which every command reads"
            raise SettingsError(f"settings file {path}: unknown key {key!r} {place}, for `cspan {verb}` ({hint})")
        annotation = model.model_fields[name].annotation
        problem = _toml_type_problem(value, annotation)
        if problem is not None:
            raise SettingsError(f"settings file {path}: {key}: {problem}")
        if isinstance(value, str) and value.startswith("~") and _is_path(annotation):
            value = str(Path(value).expanduser())  # a shell expands ~ in a flag, nothing does in a file
        values[name] = value
    _warn_if_secret_readable(path, model, values)
    return values


def _verbs() -> set[str]:
    """The installed verbs (``cspan.commands`` entry points): the tables a settings file may hold."""
    from importlib.metadata import entry_points

    return {ep.name for ep in entry_points(group="cspan.commands")}


def _warn_if_secret_readable(path: Path, model: type[BaseSettings], values: dict[str, Any]) -> None:
    """Warn when a settings file that holds a credential (a ``secret`` field such as ``token``, or a URL with a
    password) can be read by other users, as libpq does for ``~/.pgpass`` and ssh for a private key."""
    held = [
        name
        for name, value in values.items()
        if bool((model.model_fields[name].json_schema_extra or {}).get("secret")) or _credential_url(value)
    ]
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if held and os.name == "posix" and mode & 0o077:
        logging.getLogger(__name__).warning(
            "settings file %s holds a credential (%s) and can be read by other users (mode %03o); "
            "chmod 600 %s, or give it in the environment",
            path,
            ", ".join(n.replace("_", "-") for n in held),
            mode & 0o777,
            path,
        )


_SCALAR_WORDS = {bool: "true or false", int: "a whole number", float: "a number"}


def _scalar_types(annotation: Any) -> set[type] | None:
    """The scalar types (``bool``, ``int``, ``float``) a field takes, where it takes nothing else (None aside);
    None for any other field."""
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    found: set[type] = set()
    for member in members:
        if member is type(None):
            continue
        if get_origin(member) is Annotated:
            member = get_args(member)[0]
        if member not in _SCALAR_WORDS:
            return None
        found.add(member)
    return found or None


def _toml_type_problem(value: Any, annotation: Any) -> str | None:
    """Why ``value``, read from a settings file, is not of a boolean or numeric field's type (None when it is, or
    the field is of another type: its own validation speaks for it). TOML values are typed: a file's ``true`` or
    ``"3"`` is not taken for a number, nor ``1`` or ``"yes"`` for a boolean (the command line and the environment,
    which are text, are converted)."""
    if get_origin(annotation) is list:
        (item,) = get_args(annotation) or (Any,)
        if isinstance(value, str) and _scalar_types(item) is not None:  # "1.5" or "[1, 2]": text, not a list
            return f"must be a list, not {_toml(value)} (TOML values are typed: write [1.5, 3] for two values)"
        for element in value if isinstance(value, list) else ():
            problem = _toml_type_problem(element, item)
            if problem is not None:
                return f"an item {problem}"
        return None
    types = _scalar_types(annotation)
    if types is None or value is None:
        return None
    if isinstance(value, bool):
        fits = bool in types
    elif isinstance(value, int | float):
        fits = bool(types & {int, float})  # an int for a float; a fractional one for an int: pydantic's message
    else:
        fits = False
    if fits:
        return None
    wanted = " or ".join(_SCALAR_WORDS[t] for t in (bool, int, float) if t in types)
    given = _toml(value)
    hint = ""
    if isinstance(value, str) and types & {int, float}:
        try:
            hint = f" (TOML values are typed: write {float(value):g}, without the quotes)"
        except ValueError:
            pass
    elif isinstance(value, str) and bool in types and value.strip().lower() in ("true", "false"):
        hint = f" (TOML values are typed: write {value.strip().lower()}, without the quotes)"
    return f"must be {wanted}, not {given}{hint}"


def _toml(value: Any) -> str:
    """``value`` as a settings file writes it: ``true``, ``"3"``, ``2024-01-01`` (a TOML date), ``[1, "2"]``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return value.isoformat() if hasattr(value, "isoformat") else str(value)  # numbers; dates and times


def _is_path(annotation: Any) -> bool:
    """Whether a field's type is a path (``Path``, ``Path | None``)."""
    return annotation is Path or Path in get_args(annotation)


_CREDENTIAL_URL = re.compile(r"(?i)://[^/?#]*@|[?&][^=&]*(?:pass|secret|token|key|auth|sig|credential|session)[^=&]*=")
"""A URL with a user part (``https://bob:pw@host``) or a secret-looking query parameter (``?api_key=``): the
parameter names of ``cspan.backends.urls.SECRET_PARAM``, which redacts them (core cannot import the backends)."""


def _credential_url(value: Any) -> bool:
    """Whether ``value`` is text that may hold a credential in a URL (a ``--router``, ``--db``, ``--mcp`` value): not
    echoed in an error; the field's own message names it with the secret hidden."""
    return isinstance(value, str) and "://" in value and _CREDENTIAL_URL.search(value) is not None


def _json_item(text: str) -> str:
    """``text`` as an item of a JSON list: a number as it is (``0.5``), anything else quoted (``"a"``)."""
    text = text.strip()
    return text if re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", text) else json.dumps(text)


def _describe(model: type[BaseSettings], exc: ValidationError, sources: dict[str, str]) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        name = str(err["loc"][0]) if err["loc"] else ""
        where = sources.get(name, _flag(name))
        given = err.get("input")
        message = (
            "required, and not given" if err["type"] == "missing" else str(err["msg"]).removeprefix("Value error, ")
        )
        if isinstance(given, list | tuple) and len(given) == 1:  # a repeatable flag given once
            given = given[0]
        shown = ""
        quoted = isinstance(given, str) and repr(given)[:60] in message  # the validator's message names it
        field = model.model_fields.get(name)
        secret = field is not None and bool((field.json_schema_extra or {}).get("secret"))  # a credential: not echoed
        if (
            given is not None
            and not isinstance(given, dict)
            and not quoted
            and not secret
            and not _credential_url(given)
        ):
            text = repr(given)
            shown = f" (got {text if len(text) <= 80 else text[:60] + '...' + f' ({len(str(given))} characters)'})"
        if len(err["loc"]) == 2 and isinstance(given, str) and "," in given and err["type"] != "value_error":
            # an item of a repeatable setting that is a type's parse error, such as CSPAN_FORCE_RET_AT=0.5,1.5
            example = ", ".join(_json_item(part) for part in given.split(",")[:2])
            shown += f"; several values are the flag repeated, or a JSON list in {_env(model, name)}: '[{example}]'"
        lines.append(f"{where}: {message}{shown}")
    return "; ".join(lines) or str(exc)


def load_settings(
    model: type[S],
    cli: dict[str, Any] | None = None,
    *,
    config: Path | None = None,
    verb: str = "",
    cli_source: CliSettingsSource[Any] | None = None,
    parsed_args: argparse.Namespace | None = None,
) -> S:
    """Build ``model`` from the command line, the environment, a settings file and the defaults (in that order).

    Args:
        model: the settings model.
        cli: values given in Python (highest precedence; used by tests and embedding code).
        config: a TOML settings file (default: ``$CSPAN_CONFIG`` when set).
        verb: the verb whose ``[verb]`` table the file may hold.
        cli_source, parsed_args: the parsed command line (from :func:`add_settings_arguments`).

    Raises:
        SettingsError: an invalid value (the message names the flag, variable or file key) or a bad settings file.
    """
    if config is None and os.environ.get(CONFIG_ENV):
        config = Path(os.environ[CONFIG_ENV])
    sources = {name: f"{_flag(name)} / {_env(model, name)}" for name in model.model_fields}
    for name in _hidden(model):
        if _env(model, name) in os.environ:
            raise SettingsError(
                f"{_env(model, name)}: {_flag(name)} is a test switch, taken from the command line only (unset it)"
            )
    values: dict[str, Any] = {}
    cli_settings = cli_source(parsed_args=parsed_args) if cli_source is not None and parsed_args is not None else None
    if config is not None:
        file_values = _read_config(config, verb, model)
        env_values = EnvSettingsSource(model)()
        given = {*(cli or {}), *(cli_settings() if cli_settings is not None else {})}  # the command line wins
        for name, value in file_values.items():
            if name not in env_values:
                values[name] = value
                if name not in given:
                    sources[name] = f"{config}: {name.replace('_', '-')}"
    values.update(cli or {})
    try:
        if cli_settings is not None:
            return model(_cli_settings_source=cli_settings, **values)  # type: ignore[call-arg]
        return model(**values)
    except ValidationError as exc:
        raise SettingsError(_describe(model, exc, sources)) from None
    except SourceError as exc:  # a value pydantic-settings could not decode (a malformed list in CSPAN_*)
        match = re.search(r'field "(\w+)"', str(exc))
        where = sources.get(match.group(1), "") if match else ""
        raise SettingsError(f"{where}: {exc}" if where else str(exc)) from None


def settings_from_args(args: argparse.Namespace) -> Any:
    """The settings model built from arguments parsed by a parser set up with :func:`add_settings_arguments`.

    Raises:
        SettingsError: as :func:`load_settings`.
    """
    model = getattr(args, _MODEL)
    # Repeated flags are taken verbatim (validated by pydantic), not through the CLI source's list syntax, which
    # would split "1.0:Hello, world" at the comma and read "[x]" as a list.
    parsed = argparse.Namespace(**vars(args))
    repeated: dict[str, Any] = {}
    for name in model.model_fields:
        value = getattr(parsed, name, None)
        if isinstance(value, list):
            repeated[name] = value
            delattr(parsed, name)
    return load_settings(
        model,
        repeated,
        config=getattr(args, "config", None),
        verb=getattr(args, _VERB, ""),
        cli_source=getattr(args, _SOURCE),
        parsed_args=parsed,
    )


__all__ = [
    "CONFIG_ENV",
    "SETTINGS_CONFIG",
    "EnvList",
    "SettingsError",
    "add_settings_arguments",
    "load_settings",
    "settings_from_args",
    "settings_models",
]
