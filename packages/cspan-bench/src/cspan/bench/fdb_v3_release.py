"""The world of Full-Duplex-Bench v3 as the benchmark releases it, for ``cspan bench fdb-v3 run --fdb-v3-dir DIR``.

``DIR`` is the benchmark's ``v3/`` folder (a checkout of its public repository plus the released data). From it:

- ``mock_apis.py``: the mock backends, ``MockAPIRegistry(latency_profile="instant").call(name, **args) -> dict``
  (with ``latency_injector.py`` beside it). It is imported and run in this process: point ``--fdb-v3-dir`` only at
  a copy you trust. A fresh registry serves each scenario, so one booking never leaks into the next;
- ``lk_agent_tool.py``: the benchmark's LiveKit agent, read as text (never imported; it needs LiveKit): the
  agent's ``instructions`` become the model's persona, and every method decorated with a ``description`` becomes a
  tool with that description, the method's parameters (names, ``str``/``int``/``float`` annotations, defaults) and
  the per-parameter notes of its docstring's ``Args:`` section;
- ``benchmark_data_v2.json`` (scenarios) and ``fdb_v3_data_released/`` (recordings): the defaults of
  ``--scenarios`` and ``--data`` when present.

The router sees exactly these tools, and a call runs the release's own mock API. Which tools change state
(``kind="action"``, for the router's guard) is taken from this project's catalogue (``fdb_v3_bank()``).
:meth:`FDBv3Release.describe` is what the results record as their ``world`` (with SHA-256 of the files read).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cspan.bench.errors import BenchDataError

MOCK_APIS = "mock_apis.py"
AGENT_FILE = "lk_agent_tool.py"
SCENARIO_FILE = "benchmark_data_v2.json"
DATA_DIR = "fdb_v3_data_released"
LATENCY_PROFILE = "instant"
"""The mock APIs' latency profile (the benchmark's default for its agents)."""

_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


@dataclass(frozen=True)
class ParamSpec:
    """One tool parameter: its name, annotation (``"str"``...), whether it is required, default and description."""

    name: str
    annotation: str | None
    required: bool
    default: Any = None
    description: str = ""


@dataclass(frozen=True)
class ToolSpec:
    """One tool of the benchmark's agent: name, description and parameters."""

    name: str
    description: str
    params: tuple[ParamSpec, ...]


def _docstring_args(doc: str | None) -> dict[str, str]:
    """``Args:`` section of a Google-style docstring -> ``{name: description}``."""
    out: dict[str, str] = {}
    if not doc:
        return out
    in_args = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.lower().rstrip(":") == "args":
            in_args = True
            continue
        if in_args:
            m = re.match(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
            if m:
                out[m.group(1)] = m.group(2).strip()
            elif not stripped:
                continue
            else:
                in_args = False
    return out


def _literal(node: ast.AST, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError) as exc:
        raise BenchDataError(f"{where} is not a literal ({ast.unparse(node)[:80]})") from exc


def _tool_from(fn: ast.FunctionDef | ast.AsyncFunctionDef, source: str) -> ToolSpec | None:
    description = None
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call):
            for kw in deco.keywords:
                if kw.arg == "description":
                    description = _literal(kw.value, f"{source}: {fn.name} description")
    if description is None:
        return None
    docs = _docstring_args(ast.get_docstring(fn))
    args = [a for a in fn.args.args if a.arg not in ("self", "cls")]
    defaults: list[Any] = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
    params = []
    for arg, default in zip(args, defaults, strict=True):
        annotation = ast.unparse(arg.annotation) if arg.annotation is not None else None
        params.append(
            ParamSpec(
                name=arg.arg,
                annotation=annotation,
                required=default is None,
                default=None if default is None else _literal(default, f"{source}: {fn.name}({arg.arg}=...)"),
                description=docs.get(arg.arg, ""),
            )
        )
    return ToolSpec(name=fn.name, description=str(description), params=tuple(params))


def parse_agent(source_text: str, source: str = AGENT_FILE) -> tuple[str, list[ToolSpec]]:
    """Read the benchmark agent's persona and tools from its source text (not executed).

    Returns ``(instructions, tools)``: the first string literal passed as ``instructions=`` anywhere in the file,
    and every function decorated with a call that has a ``description=`` keyword, in file order.

    Raises:
        BenchDataError: the file does not parse, holds no ``instructions=`` string or no described tool.
    """
    try:
        tree = ast.parse(source_text, filename=source)
    except SyntaxError as exc:
        raise BenchDataError(f"{source} is not valid Python ({exc.msg}, line {exc.lineno})") from exc
    persona = None
    tools: list[ToolSpec] = []
    for node in ast.walk(tree):
        if persona is None and isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "instructions" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    persona = kw.value.value
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            spec = _tool_from(node, source)
            if spec is not None:
                tools.append(spec)
    if persona is None:
        raise BenchDataError(f"{source}: no instructions='...' string (the agent's persona) found")
    if not tools:
        raise BenchDataError(f"{source}: no tool method decorated with description='...' found")
    tools.sort(key=lambda t: _line_of(tree, t.name))
    return " ".join(persona.split()), tools


def _line_of(tree: ast.AST, name: str) -> int:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node.lineno
    return 0


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class FDBv3Release:
    """The benchmark's released v3 folder: persona, tool declarations, the mock APIs, scenarios and data.

    Build it with :func:`load_release`.
    """

    root: Path
    persona: str
    tools: list[ToolSpec]
    files: dict[str, str]
    _module: Any = field(default=None, repr=False)

    @property
    def scenarios_path(self) -> Path | None:
        """``benchmark_data_v2.json`` when the folder has it."""
        return release_inputs(self.root)[0]

    @property
    def data_dir(self) -> Path | None:
        """``fdb_v3_data_released/`` when the folder has it."""
        return release_inputs(self.root)[1]

    def describe(self) -> dict[str, Any]:
        """The ``world`` record of results: kind, folder, tools, latency profile and the files' SHA-256."""
        return {
            "kind": "fdb-v3-release",
            "dir": str(self.root),
            "persona": "the benchmark agent's instructions (lk_agent_tool.py)",
            "tools": [t.name for t in self.tools],
            "mock_apis": f"{MOCK_APIS} MockAPIRegistry(latency_profile={LATENCY_PROFILE!r})",
            "sha256": dict(self.files),
        }

    def _mock_module(self) -> Any:
        if self._module is None:
            path = self.root / MOCK_APIS
            name = f"_cspan_fdb_v3_mock_apis_{self.files[MOCK_APIS][:12]}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise BenchDataError(f"{path} cannot be imported")
            module = importlib.util.module_from_spec(spec)
            # mock_apis.py imports its siblings (latency_injector.py) by plain name: resolve them from this folder
            # only, and leave sys.modules as it was afterwards (another release, or a same-named module elsewhere).
            local = {p.stem for p in self.root.glob("*.py")}
            saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n.split(".")[0] in local}
            sys.path.insert(0, str(self.root))
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                raise BenchDataError(f"{path} failed to import: {type(exc).__name__}: {exc}") from exc
            finally:
                sys.path.remove(str(self.root))
                for name in [n for n in sys.modules if n.split(".")[0] in local]:
                    del sys.modules[name]
                sys.modules.update(saved)
            if not hasattr(module, "MockAPIRegistry"):
                raise BenchDataError(f"{path} defines no MockAPIRegistry")
            self._module = module
        return self._module

    def registry(self) -> Any:
        """A fresh ``MockAPIRegistry(latency_profile="instant")`` of the release.

        Raises:
            BenchDataError: ``mock_apis.py`` does not import or the registry cannot be built.
        """
        try:
            return self._mock_module().MockAPIRegistry(latency_profile=LATENCY_PROFILE)
        except BenchDataError:
            raise
        except Exception as exc:
            raise BenchDataError(f"{self.root / MOCK_APIS}: MockAPIRegistry() failed: {exc}") from exc

    async def tool_bank(self, *, timeout_s: float = 10.0) -> Any:
        """A :class:`~cspan.backends.tools.ToolBank` of the release's tools over a fresh registry.

        Raises:
            BenchDataError: the mock APIs do not import.
        """
        from pydantic import Field, create_model

        from cspan.backends.tools import Tool, ToolArgs, ToolBank

        registry = self.registry()
        kinds = await _catalogue_kinds()
        tools = []
        for spec in self.tools:
            fields: dict[str, Any] = {}
            for p in spec.params:
                typ: Any = _TYPES.get(p.annotation or "", Any)
                if not p.required and p.default is None:
                    typ = typ | None
                default = ... if p.required else p.default
                fields[p.name] = (typ, Field(default=default, description=p.description or None))
            model = create_model(f"Release_{spec.name}_Args", __base__=ToolArgs, **fields)
            kind, domain = kinds.get(spec.name, ("read", ""))
            tools.append(
                Tool(
                    name=spec.name,
                    description=spec.description,
                    parameters=model,
                    fn=_registry_call(registry, spec.name),
                    kind=kind,
                    timeout_s=timeout_s,
                    domain=domain,
                )
            )
        return ToolBank(tools)


def _registry_call(registry: Any, name: str) -> Any:
    def call(**kwargs: Any) -> Any:
        return registry.call(name, **kwargs)

    call.__name__ = name
    return call


_KINDS: dict[str, tuple[str, str]] = {}


async def _catalogue_kinds() -> dict[str, tuple[str, str]]:
    """``{tool: (kind, domain)}`` of this project's v3 catalogue (read once from ``fdb_v3_bank()``)."""
    if not _KINDS:
        from cspan.backends.tools.catalog import fdb_v3_bank

        async with fdb_v3_bank(confirm_actions=False) as bank:
            _KINDS.update({t.name: (t.kind, t.domain) for t in bank})
    return _KINDS


def release_inputs(path: Path) -> tuple[Path | None, Path | None]:
    """``(benchmark_data_v2.json, fdb_v3_data_released/)`` of the benchmark's v3 folder, each None when absent: what
    scoring reads (nothing is imported, the mock APIs and agent file are not needed).

    Raises:
        BenchDataError: ``path`` is not a folder.
    """
    root = Path(path)
    if not root.is_dir():
        raise BenchDataError(f"--fdb-v3-dir {root} is not a folder")
    scenarios, data = root / SCENARIO_FILE, root / DATA_DIR
    return (scenarios if scenarios.is_file() else None), (data if data.is_dir() else None)


def load_release(path: Path) -> FDBv3Release:
    """Read the benchmark's v3 folder (see the module docstring). Imports nothing yet.

    Raises:
        BenchDataError: the folder, ``mock_apis.py`` or ``lk_agent_tool.py`` is missing, or the agent file cannot be
            read.
    """
    root = Path(path)
    if not root.is_dir():
        raise BenchDataError(f"--fdb-v3-dir {root} is not a folder")
    missing = [name for name in (MOCK_APIS, AGENT_FILE) if not (root / name).is_file()]
    if missing:
        raise BenchDataError(
            f"--fdb-v3-dir {root} lacks {', '.join(missing)}; point it at the benchmark's v3/ folder (the public "
            "Full-Duplex-Bench repository)"
        )
    agent = root / AGENT_FILE
    persona, tools = parse_agent(agent.read_text(encoding="utf-8"), str(agent))
    files = {name: _sha256(root / name) for name in (MOCK_APIS, AGENT_FILE, SCENARIO_FILE) if (root / name).is_file()}
    return FDBv3Release(root=root.resolve(), persona=persona, tools=tools, files=files)
