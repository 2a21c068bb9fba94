"""Proxies of environment instances that live outside the rollout worker's process: in a child process
(spec.rollout.environmentService mode processPool) or on an environment server (mode http).

Who calls it: mortal.workers.rollout.tools.Toolbox.from_spec builds one proxy class per environment class
(`proxy_class_of` from the class itself, `proxy_class_described` from a server's description) and uses it
as the environment's factory: each instance of it stands for one remote instance, built when first used.
mortal.workers.rollout.multiturn then calls it as it calls an environment: `reset(**row)`, its public methods
as tools (the Toolbox calls them), `get_reward()` through the reward. A proxy's public methods have the
class's names, signatures, type hints and docstrings, so the tool schemas TRL builds from them are the
class's own. Its other public attributes are read from the remote instance (a reward function reading
`env.reward` works too); they cross as pickles to a child, as JSON to a server.

What a proxy adds: it keeps its rollout's calls since the last reset (reset itself first). When the instance
is lost (its process died or was killed, the server lost its session), the next request builds a new one
and replays those calls in order (their answers ignored), so the environment's state is restored as far as
the environment is deterministic, then tries the request once more; lost again, a tool call fails
(`EnvironmentLost`: the model reads the error, as for a tool that raised) and a reset raises it. Every
request has a deadline: rollout.toolTimeoutSeconds for a tool, environmentService.resetTimeoutSeconds for
building, reset and get_reward; past it the backend kills the instance's process (EnvironmentTimedOut, a
CallTimedOut: the model is told the tool timed out). A call that timed out is not replayed: the state it
may have left is lost with its process.
What it must not do: retry a call that raised (the environment answered), retry more than once, or decide
where instances run (the backends do).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from mortal.workers.deadline import CallTimedOut
from mortal.workers.errors import ServiceOutage
from mortal.workers.rollout.environment_schema import (
    NOT_TOOLS,
    DescriptionError,
    method_doc,
    public_functions,
    rebuild_function,
)

log = logging.getLogger("mortal.worker")

OPS = {"reset": "reset", "get_reward": "get_reward"}  # every other public method is a tool: "call"


class EnvironmentLost(Exception):
    """The instance is gone: its process died or was killed, or the server does not know its session."""


class EnvironmentUnreachable(EnvironmentLost, ServiceOutage):
    """The environment server cannot be reached (refused, reset, no route), even after the instance was
    rebuilt: a reset, tool call or get_reward that meets it relaunches the worker (ServiceOutage)."""


class EnvironmentTimedOut(CallTimedOut):
    """A request ran past its deadline; the instance's process was killed (its other instances are lost)."""


class EnvironmentRaised(Exception):
    """The environment's own code raised; str() is what the model reads, as for an in-process tool."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def raised_kind(exc: BaseException) -> str:
    """The name of the exception type the environment's own code raised, where it ran: a pooled or served
    environment's comes back as EnvironmentRaised, which names it."""
    return exc.kind if isinstance(exc, EnvironmentRaised) else type(exc).__name__


class EnvironmentBuildFailed(Exception):
    """The environment's class cannot be imported where it runs, or its constructor raised there."""


class Backend(Protocol):
    """Where instances live: mortal.workers.rollout.environment_pool.ProcessPool, or
    mortal.workers.rollout.environment_client.HttpEnvironments."""

    def create(self, reference: str, seconds: float) -> Any: ...

    def alive(self, handle: Any) -> bool: ...

    def request(self, handle: Any, op: str, payload: Any, seconds: float, what: str) -> Any: ...

    def release(self, handle: Any) -> None: ...


@dataclass(frozen=True)
class ProxySettings:
    """What every proxy of one environment class shares."""

    backend: Backend
    reference: str  # 'module:Class', as rollout.environment names it
    mode: str  # processPool or http, for messages
    call_seconds: float  # rollout.toolTimeoutSeconds
    reset_seconds: float  # environmentService.resetTimeoutSeconds


class EnvironmentProxy:
    """The base of the proxy classes `proxy_class_of` and `proxy_class_described` build (module docstring)."""

    _mortal_settings: ClassVar[ProxySettings]
    _mortal_class: ClassVar[type | None] = None  # the real class, where the worker imported it
    _mortal_functions: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        self._mortal_lock = threading.RLock()
        self._mortal_handle: Any = None
        self._mortal_log: list[tuple[str, Any]] = []  # (op, payload) of reset and the calls after it

    def __repr__(self) -> str:
        settings = self._mortal_settings
        return f"<{type(self).__name__} in {settings.mode}: {settings.reference}>"

    def __getattr__(self, name: str) -> Any:
        """A public attribute of the remote instance (its value, not a live reference)."""
        if name.startswith("_") or name in NOT_TOOLS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return self._mortal_invoke("attribute", name)
        except EnvironmentRaised as exc:
            if exc.kind == "AttributeError":
                raise AttributeError(str(exc)) from None
            raise

    def _mortal_invoke(self, op: str, payload: Any = None, seconds: float | None = None) -> Any:
        """One request on the remote instance (module docstring: replay, one retry, deadlines). `seconds`:
        the deadline of this request and of each step of a rebuild it needs, where the caller has its own
        (an environment server, for its client's request)."""
        settings = self._mortal_settings
        limit = seconds
        if seconds is None:
            seconds = settings.call_seconds if op == "call" else settings.reset_seconds
        what = _describe(type(self).__name__, op, payload)
        with self._mortal_lock:
            if op == "reset":
                self._mortal_log = []
            for attempt in (1, 2):
                try:
                    handle = self._mortal_instance(limit)
                    value = settings.backend.request(handle, op, payload, seconds, what)
                except EnvironmentLost as exc:
                    self._mortal_release()
                    if attempt == 1:
                        log.warning(
                            "%s: %s; a new instance replays the rollout's %d earlier requests, then the "
                            "request is tried again",
                            what,
                            exc,
                            len(self._mortal_log),
                        )
                        continue
                    again = (
                        EnvironmentUnreachable if isinstance(exc, EnvironmentUnreachable) else EnvironmentLost
                    )
                    raise again(
                        f"{what}: the environment was lost again after it was rebuilt and replayed ({exc})"
                    ) from exc
                except EnvironmentTimedOut:
                    self._mortal_release()  # its process was killed: rebuilt and replayed when next used
                    raise
                except EnvironmentRaised:
                    self._mortal_record(op, payload)
                    raise
                self._mortal_record(op, payload)
                return value
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _mortal_record(self, op: str, payload: Any) -> None:
        if op in ("reset", "call"):
            self._mortal_log.append((op, payload))

    def _mortal_instance(self, seconds: float | None = None) -> Any:
        """The live remote instance: the current one, or a new one with the log replayed into it (each step
        within `seconds`, else within the settings' deadlines)."""
        settings = self._mortal_settings
        handle = self._mortal_handle
        if handle is not None and settings.backend.alive(handle):
            return handle
        self._mortal_release()
        try:
            handle = settings.backend.create(settings.reference, seconds or settings.reset_seconds)
        except EnvironmentRaised as exc:  # refused before anything ran (a body over a server's limit)
            raise EnvironmentBuildFailed(f"building {settings.reference}() was refused: {exc}") from exc
        for op, payload in self._mortal_log:
            what = "replaying " + _describe(type(self).__name__, op, payload)
            limit = seconds or (settings.call_seconds if op == "call" else settings.reset_seconds)
            try:
                settings.backend.request(handle, op, payload, limit, what)
            except EnvironmentRaised:
                pass  # it raised the first time too, or the model was told what it raised
            except EnvironmentTimedOut as exc:
                settings.backend.release(handle)
                raise EnvironmentLost(f"{what} timed out, so the rollout's state cannot be restored") from exc
            except BaseException:
                settings.backend.release(handle)
                raise
        self._mortal_handle = handle
        return handle

    def _mortal_release(self) -> None:
        """Let the backend drop the remote instance (lost, timed out, or the Toolbox's close)."""
        with self._mortal_lock:
            handle, self._mortal_handle = self._mortal_handle, None
            if handle is not None:
                self._mortal_settings.backend.release(handle)


def _describe(name: str, op: str, payload: Any) -> str:
    if op == "call":
        return f"tool {payload[0]} of {name}"
    if op == "attribute":
        return f"attribute {payload} of {name}"
    return f"{name}.{op}()"


def own_deadline(tool: Callable[..., Any]) -> bool:
    """Whether `tool` is a proxy's method, which keeps its own deadline (mortal.workers.rollout.tools calls it
    directly rather than on a thread)."""
    return getattr(tool, "_mortal_own_deadline", False) is True


def _forwarder(op: str, name: str) -> Callable[..., Any]:
    if op == "call":

        def forward(self: EnvironmentProxy, *args: Any, **kwargs: Any) -> Any:
            return self._mortal_invoke("call", (name, args, kwargs))
    else:

        def forward(self: EnvironmentProxy, *args: Any, **kwargs: Any) -> Any:
            return self._mortal_invoke(op, (args, kwargs) if op == "reset" else None)

    return forward


SELF = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)


def proxy_class_of(cls: type, settings: ProxySettings) -> type[EnvironmentProxy]:
    """A proxy class for `cls` (imported in the worker): each public function forwarded, dressed as the
    original (functools.update_wrapper: name, docstring, hints resolved in the original's module)."""
    namespace: dict[str, Any] = {
        "__doc__": cls.__doc__,
        "__qualname__": cls.__qualname__,
        "_mortal_settings": settings,
        "_mortal_class": cls,
    }
    functions = public_functions(cls)
    for name, function, static in functions:
        forward = _forwarder(OPS.get(name, "call"), name)
        functools.update_wrapper(forward, function)
        forward.__doc__ = method_doc(cls, name)
        signature = inspect.signature(function)
        if static:  # bound like the others: `self` first, so the bound signature is the original's
            signature = signature.replace(parameters=[SELF, *signature.parameters.values()])
        forward.__signature__ = signature  # type: ignore[attr-defined]
        forward._mortal_own_deadline = True  # type: ignore[attr-defined]
        namespace[name] = forward
    namespace["_mortal_functions"] = frozenset(name for name, _, _ in functions)
    return type(cls.__name__, (EnvironmentProxy,), namespace)


def proxy_class_described(description: dict[str, Any], settings: ProxySettings) -> type[EnvironmentProxy]:
    """A proxy class from an environment server's description (mortal.workers.rollout.environment_schema):
    the worker need not import the class. DescriptionError when the description is malformed."""
    name = description.get("name")
    methods = description.get("methods")
    if not isinstance(name, str) or not name.isidentifier() or not isinstance(methods, list):
        raise DescriptionError(
            f"the environment server described {settings.reference} without a name or methods"
        )
    namespace: dict[str, Any] = {
        "__doc__": description.get("doc") if isinstance(description.get("doc"), str) else None,
        "_mortal_settings": settings,
    }
    for described in methods:
        if not isinstance(described, dict):
            raise DescriptionError(f"a method of {settings.reference} is described as {described!r:.200}")
        method = str(described.get("name"))
        forward = rebuild_function(described, _forwarder(OPS.get(method, "call"), method))
        forward._mortal_own_deadline = True  # type: ignore[attr-defined]
        namespace[method] = forward
    namespace["_mortal_functions"] = frozenset(n for n in namespace if not n.startswith("_"))
    return type(name, (EnvironmentProxy,), namespace)
