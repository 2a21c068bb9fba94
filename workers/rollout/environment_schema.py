"""An environment class's methods as JSON, and back: what an environment server tells a rollout worker so that
the worker can offer the model the same tools without importing the class.

Who calls it: mortal.workers.rollout.environment_server (`describe_class`, once per served class, answered
at GET /v1/environments) and mortal.workers.rollout.environment_proxy (`rebuild_function`, once per method of
a class served over http). A method is described by what TRL's schema is built from (transformers'
get_json_schema): its name, its docstring as written, its parameters (name, kind, whether it has a default)
and its type hints as a small tree of the types get_json_schema understands (str, int, float, bool, None,
Any, list, tuple, dict, Union, Literal, Enum). The worker rebuilds a function with that signature, those
hints and that docstring, so get_json_schema gives the same schema on both sides (a test compares them).
A hint outside that set travels as an opaque name and becomes a class of that name, which get_json_schema
refuses as it refuses the original. Defaults do not travel: a parameter with one gets a marker default,
which the schema ignores (the server applies the real default).
What it must not do: evaluate anything it receives (type names are looked up in a fixed table, never
eval'd), or describe private methods.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

NOT_TOOLS = ("reset", "get_reward")
SCALARS: dict[str, Any] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": bool,
    "None": type(None),
    "Any": Any,
}
CONTAINERS: dict[str, Any] = {"list": list, "tuple": tuple, "dict": dict}
JSON_SCALARS = (str, int, float, bool, type(None))
PARAMETER_KINDS = {
    "POSITIONAL_ONLY": inspect.Parameter.POSITIONAL_ONLY,
    "POSITIONAL_OR_KEYWORD": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "VAR_POSITIONAL": inspect.Parameter.VAR_POSITIONAL,
    "KEYWORD_ONLY": inspect.Parameter.KEYWORD_ONLY,
    "VAR_KEYWORD": inspect.Parameter.VAR_KEYWORD,
}
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_TYPE_DEPTH = 8


class ServerDefault:
    """The default of a rebuilt parameter: the server knows the real one."""

    def __repr__(self) -> str:
        return "<the server's default>"


SERVER_DEFAULT = ServerDefault()


class DescriptionError(ValueError):
    """A description from an environment server that does not have the expected shape."""


def public_functions(cls: type) -> list[tuple[str, Callable[..., Any], bool]]:
    """(name, function, is_static) of each public function of `cls`, listed on the class as TRL lists an
    environment's tools (inspect.getmembers: by name; properties are not evaluated)."""
    out = []
    for name, function in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_"):
            continue
        out.append((name, function, isinstance(inspect.getattr_static(cls, name), staticmethod)))
    return out


def schema_problem(function: Callable[..., Any]) -> str | None:
    """Why TRL cannot tell the model of this tool (transformers' get_json_schema, built from its signature,
    type hints and docstring, fails on it), or None. None too where transformers is not installed (the CLI's
    machine): the rollout worker checks again at its start."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        return None
    try:
        get_json_schema(function)
    except Exception as exc:  # noqa: BLE001 - whatever it raises on the user's function is the finding
        return f"{type(exc).__name__}: {exc}"
    return None


def tool_problems(cls: type) -> list[tuple[str, str]]:
    """(method name, schema_problem) of each of an environment class's tools whose schema cannot be built;
    a method is bound to a placeholder instance, as TRL describes a bound method (no `self`)."""
    out = []
    for name, function, static in public_functions(cls):
        if name in NOT_TOOLS:
            continue
        problem = schema_problem(function if static else types.MethodType(function, object()))
        if problem is not None:
            out.append((name, problem))
    return out


def repeated_tool_name(tools: list[tuple[str, Callable[..., Any]]]) -> str | None:
    """Why two of spec.rollout.tools, as (reference, function), would reach the model under one name, or None.
    The model calls a tool by its function's __name__, so one of the two would answer every call: an alias
    (`calc2 = calculator`) counts, which the spec's own check of the references' last parts cannot see."""
    first: dict[str, str] = {}
    for ref, tool in tools:
        name = getattr(tool, "__name__", None)
        if name is None:
            continue
        if name in first:
            return f"{first[name]!r} and {ref!r} are both the function {name!r} to the model; rename one"
        first[name] = ref
    return None


def tool_name_clash(cls: type, standalone: set[str]) -> str | None:
    """Why environment class `cls` cannot sit beside the standalone tools named `standalone`, or None: a
    method of one of their names would offer the model two tools of one name, one answering every call."""
    for name, _, _ in public_functions(cls):
        if name not in NOT_TOOLS and name in standalone:
            return f"method {name} has the name of a tool of spec.rollout.tools; rename one"
    return None


def method_doc(cls: type, name: str) -> str | None:
    """The method's docstring as TRL reads it (inspect.getdoc: inherited from a base when it has none)."""
    return inspect.getdoc(getattr(cls, name))


# -- describing (on the server) -----------------------------------------------------------------------------
def describe_type(hint: Any, depth: int = 0) -> dict[str, Any]:
    """A type hint as a JSON tree (module docstring: which types keep their meaning)."""
    if depth > MAX_TYPE_DEPTH:
        return {"t": "opaque", "name": "deeply nested type"}
    if hint is Ellipsis:
        return {"t": "..."}
    for name, scalar in SCALARS.items():
        if hint is scalar:
            return {"t": name}
    if hint is None:
        return {"t": "None"}
    origin, args = get_origin(hint), get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [member.value for member in hint]
        if all(type(v) in JSON_SCALARS for v in values):
            return {"t": "Enum", "name": hint.__name__, "values": values}
    if origin is None:
        for name, container in CONTAINERS.items():
            if hint is container:
                return {"t": name}
        return {"t": "opaque", "name": _type_name(hint)}
    if origin is Union or origin is types.UnionType:
        return {"t": "Union", "args": [describe_type(a, depth + 1) for a in args]}
    if origin is Literal:
        if all(type(a) in JSON_SCALARS for a in args):
            return {"t": "Literal", "values": list(args)}
        return {"t": "opaque", "name": _type_name(hint)}
    for name, container in CONTAINERS.items():
        if origin is container:
            return {"t": name, "args": [describe_type(a, depth + 1) for a in args]}
    return {"t": "opaque", "name": _type_name(hint)}


def _type_name(hint: Any) -> str:
    name = getattr(hint, "__name__", None) or str(hint)
    return str(name)[:200]


def describe_function(cls: type, name: str, function: Callable[..., Any], static: bool) -> dict[str, Any]:
    """One method: its name, docstring, parameters and (for a tool) type hints, as JSON."""
    signature = inspect.signature(function)
    parameters = [
        {"name": p.name, "kind": p.kind.name, "default": p.default is not inspect.Parameter.empty}
        for p in signature.parameters.values()
    ]
    described: dict[str, Any] = {
        "name": name,
        "doc": method_doc(cls, name),
        "static": static,
        "parameters": parameters,
        "hints": None,
    }
    if name not in NOT_TOOLS:
        # the tool's schema needs them; TRL fails on hints it cannot resolve, and so does the server's start
        hints = typing.get_type_hints(function)
        described["hints"] = [[key, describe_type(value)] for key, value in hints.items()]
        described["annotated"] = [
            p.name for p in signature.parameters.values() if p.annotation is not inspect.Parameter.empty
        ]
    return described


def describe_class(cls: type, reference: str) -> dict[str, Any]:
    """What a worker needs to offer `cls`'s tools: its name, the reference it is served as, its methods."""
    return {
        "name": cls.__name__,
        "reference": reference,
        "doc": cls.__doc__,
        "methods": [describe_function(cls, n, f, s) for n, f, s in public_functions(cls)],
    }


# -- rebuilding (on the worker) -----------------------------------------------------------------------------
def rebuild_type(tree: Any, depth: int = 0) -> Any:
    """A JSON tree of describe_type -> the type hint (looked up in fixed tables, nothing evaluated)."""
    if depth > MAX_TYPE_DEPTH or not isinstance(tree, dict) or not isinstance(tree.get("t"), str):
        raise DescriptionError(f"a type in the environment server's description is malformed: {tree!r:.200}")
    kind = tree["t"]
    if kind == "...":
        return Ellipsis
    if kind in SCALARS:
        return SCALARS[kind]
    if kind == "Enum":
        values = _json_scalars(tree.get("values"))
        name = _identifier(tree.get("name"), "Enum")
        return enum.Enum(name, [(f"MEMBER_{i}", v) for i, v in enumerate(values)])  # type: ignore[misc]
    if kind == "Literal":
        return Literal[tuple(_json_scalars(tree.get("values")))]
    if kind == "opaque":
        return type(_identifier(tree.get("name"), "Opaque"), (), {"__module__": "environment_server"})
    args = tree.get("args")
    if args is not None and not isinstance(args, list):
        raise DescriptionError(f"the type arguments of {kind} are not a list: {args!r:.200}")
    rebuilt = [rebuild_type(a, depth + 1) for a in args or []]
    if kind == "Union":
        if not rebuilt:
            raise DescriptionError("a Union without members")
        return Union[tuple(rebuilt)]  # noqa: UP007 -- built from a list of types
    if kind in CONTAINERS:
        container = CONTAINERS[kind]
        if args is None:
            return container
        if kind == "tuple" and not rebuilt:
            return tuple[()]
        return container[tuple(rebuilt)] if len(rebuilt) > 1 else container[rebuilt[0]]
    raise DescriptionError(f"unknown type {kind!r} in the environment server's description")


def _json_scalars(values: Any) -> list[Any]:
    if not isinstance(values, list) or not values or any(type(v) not in JSON_SCALARS for v in values):
        raise DescriptionError(f"Literal or Enum values must be a list of JSON scalars: {values!r:.200}")
    return values


def _identifier(name: Any, fallback: str) -> str:
    text = re.sub(r"\W", "_", str(name))[:100] if name else fallback
    return text if NAME.match(text) else fallback


def rebuild_signature(described: dict[str, Any], hints: dict[str, Any]) -> inspect.Signature:
    """The method's signature with `self` first (a static method's too: the proxy binds every method)."""
    raw = described.get("parameters")
    if not isinstance(raw, list):
        raise DescriptionError(f"method {described.get('name')!r} has no parameter list")
    annotated = set(described.get("annotated") or [])
    parameters = []
    for item in raw:
        if (
            not isinstance(item, dict)
            or not NAME.match(str(item.get("name")))
            or item.get("kind") not in (PARAMETER_KINDS)
        ):
            raise DescriptionError(f"a parameter of {described.get('name')!r} is malformed: {item!r:.200}")
        name = item["name"]
        annotation = hints.get(name, Any) if name in annotated else inspect.Parameter.empty
        parameters.append(
            inspect.Parameter(
                name,
                PARAMETER_KINDS[item["kind"]],
                default=SERVER_DEFAULT if item.get("default") else inspect.Parameter.empty,
                annotation=annotation,
            )
        )
    if (
        described.get("static")
        or not parameters
        or parameters[0].kind
        not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        )
    ):
        parameters.insert(0, inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD))
    try:
        return inspect.Signature(parameters)
    except ValueError as exc:
        raise DescriptionError(
            f"the parameters of {described.get('name')!r} are not a signature: {exc}"
        ) from exc


def rebuild_function(described: dict[str, Any], body: Callable[..., Any]) -> Callable[..., Any]:
    """`body` (self, *args, **kwargs) dressed as the described method: its name, docstring, signature and
    type hints, so get_json_schema of the bound result equals that of the original's."""
    name = described.get("name")
    if not isinstance(name, str) or not NAME.match(name) or name.startswith("_"):
        raise DescriptionError(
            f"a method name in the environment server's description is malformed: {name!r}"
        )
    doc = described.get("doc")
    if doc is not None and not isinstance(doc, str):
        raise DescriptionError(f"the docstring of {name!r} is not text")
    pairs = described.get("hints") or []
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise DescriptionError(f"the type hints of {name!r} are malformed")
    hints = {str(key): rebuild_type(tree) for key, tree in pairs}
    body.__name__ = body.__qualname__ = name
    body.__doc__ = doc
    body.__annotations__ = hints
    body.__signature__ = rebuild_signature(described, hints)  # type: ignore[attr-defined]
    return body
