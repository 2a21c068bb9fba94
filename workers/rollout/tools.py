"""Tools and environments of a tool-calling run (spec.rollout.tools / environment), loaded in the rollout
worker.

Who calls it: mortal.workers.rollout.loop builds a `Toolbox` once (before the model, so a wrong reference
fails the run at once); mortal.workers.rollout.multiturn asks it for each rollout's tools (`tools_for`) and
calls them. TRL's semantics (1.16): standalone tools are shared by every rollout; an environment class is
built once per concurrent rollout and reset before each generation, its public methods being that
rollout's tools; a tool's result becomes str(result), and one that raises or is unknown answers
{'error': message} and counts as a failure. mortal adds a deadline per call (mortal.workers.deadline: a hung
tool keeps its thread, never the rollout), and calls different rollouts' tools at once (`call_each`, each
rollout's own in order; standalone tools, maybe not written for threads, one call at a time).
Where environment instances live is spec.rollout.environmentService's: in this process (inProcess, TRL's
way), or elsewhere behind proxies (mortal.workers.rollout.environment_proxy) that stand in for the class:
child processes (processPool: mortal.workers.rollout.environment_pool) or an environment server (http:
mortal.workers.rollout.environment_client). A proxy's methods keep their own deadline (a process can be
killed, a thread cannot), so they are called directly rather than on an abandoned thread.
What it must not do: run model-written code itself (that goes through the reward sandbox), or let a broken
reference look like a retryable crash (FatalWorkerError).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from mortal.specs.deadlines import DEFAULT_RESET_TIMEOUT_SECONDS
from mortal.workers import references
from mortal.workers.deadline import Abandoner, CallTimedOut, TooManyAbandonedCalls
from mortal.workers.errors import FatalWorkerError, ServiceOutage, exception_text
from mortal.workers.rollout.environment_proxy import (
    EnvironmentProxy,
    EnvironmentUnreachable,
    ProxySettings,
    own_deadline,
    proxy_class_of,
)
from mortal.workers.rollout.environment_schema import (
    NOT_TOOLS,
    repeated_tool_name,
    schema_problem,
    tool_name_clash,
)

# Rollouts whose tool calls run at once. Tools mostly wait (a sandbox process, a web request), so more
# than the cores; bounded so a task of hundreds of rollouts does not start hundreds of sandboxes together.
CONCURRENT_ROLLOUTS = 16
TOLD_EVERY_SECONDS = 60.0  # a tool that keeps timing out makes one Warning event a minute, not one a call
log = logging.getLogger(__name__)
# How long a starting worker waits for an environment server that does not answer before it ends (relaunched)
UNREACHABLE_WAIT_SECONDS = 60.0


class ToolLoadError(FatalWorkerError):
    """A tool or environment reference cannot be imported or built (the run fails with the reason):
    ToolNotFound (it cannot be imported or is not served), ToolInvalid (not a tool TRL can offer),
    EnvironmentFailed (building an instance raised), SecretMissing (the service's token is not set)."""

    def __init__(self, message: str, reason: str = "ToolNotFound") -> None:
        super().__init__(reason, message)


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call's result as the model sees it, and whether it failed (raised, timed out, unknown)."""

    name: str
    arguments: Any
    content: str
    failed: bool


def tokenizable(text: str) -> str:
    """`text` with each lone surrogate written as its escape (\\udcff): what bytes decoded with
    surrogateescape (os.fsdecode of a program's output) hold, and what the tokenizer refuses outright (a
    TypeError that would end the worker, not the tool call). Valid text comes back unchanged."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_methods(environment: Any, tools: list[Callable[..., Any]], ref: str) -> None:
    """An environment's tools must be describable, and none may take a standalone tool's name
    (environment_schema.tool_name_clash, which apply's probe asks too)."""
    if (clash := tool_name_clash(type(environment), {tool.__name__ for tool in tools})) is not None:
        raise ToolLoadError(f"spec.rollout.environment: {ref!r}: {clash}", "ToolInvalid")
    for method in environment_methods(environment):
        if (problem := schema_problem(method)) is not None:
            raise ToolLoadError(
                f"spec.rollout.environment: {ref!r}: method {method.__name__}: TRL cannot describe it: "
                f"{problem}",
                "ToolInvalid",
            )


def _import(ref: str, where: str) -> Any:
    try:
        return references.resolve(ref)
    except (ImportError, AttributeError) as exc:
        raise ToolLoadError(f"{where} {ref!r} cannot be imported on the rollout worker: {exc}") from exc


def environment_methods(environment: Any) -> list[Callable[..., Any]]:
    """An environment's tools: its public functions but reset and get_reward, bound to the instance
    (listed on the class, as TRL does, so properties are not evaluated)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


@dataclass
class Toolbox:
    """The run's standalone tools and environment classes (by name; None is the single unnamed one)."""

    tools: list[Callable[..., Any]] = field(default_factory=list)
    # the class, or its proxy class (environmentService processPool or http)
    environments: dict[str | None, type] = field(default_factory=dict)
    timeout_seconds: float = 30.0
    max_iterations: int | None = None
    _pool: dict[str | None, list[Any]] = field(default_factory=dict)
    _standalone_lock: threading.Lock = field(default_factory=threading.Lock)
    abandoner: Abandoner = field(default_factory=Abandoner)
    # told what timed out (the rollout records a Warning event)
    on_timeout: Callable[[str], None] | None = None
    # tool -> when it was last told: one a minute at most
    _told: dict[str, float] = field(default_factory=dict)
    # where proxied instances live (environment_pool.ProcessPool, environment_client.HttpEnvironments)
    service: Any = None
    reset_seconds: float = DEFAULT_RESET_TIMEOUT_SECONDS  # rollout.environmentService.resetTimeoutSeconds

    @classmethod
    def from_spec(cls, rollout: Any) -> Toolbox:
        """spec.rollout's tools and environment, imported and each environment built once (TRL probes one)."""
        tools = [_import(ref, "spec.rollout.tools:") for ref in rollout.tools]
        for i, (ref, tool) in enumerate(zip(rollout.tools, tools, strict=True)):
            if not callable(tool):
                raise ToolLoadError(
                    f"spec.rollout.tools: {ref!r} is not callable (it is a {type(tool).__name__})",
                    "ToolInvalid",
                )
            if (problem := schema_problem(tool)) is not None:
                raise ToolLoadError(
                    f"spec.rollout.tools[{i}]: {ref!r}: TRL cannot describe it: {problem}", "ToolInvalid"
                )
        if (clash := repeated_tool_name(list(zip(rollout.tools, tools, strict=True)))) is not None:
            raise ToolLoadError(f"spec.rollout.tools: {clash}", "ToolInvalid")
        refs = rollout.environment
        named = {} if refs is None else {None: refs} if isinstance(refs, str) else dict(refs)
        mode = rollout.environment_service.mode
        service: Any = None
        if mode == "http" and named:
            service, environments = _served_environments(rollout, named)
        else:
            environments = {name: _import(ref, "spec.rollout.environment:") for name, ref in named.items()}
            if mode == "processPool" and named:
                service, environments = _pooled_environments(rollout, named, environments)
        box = cls(
            tools=tools,
            environments=environments,
            timeout_seconds=rollout.tool_timeout_seconds,
            max_iterations=rollout.max_tool_calling_iterations,
            service=service,
            reset_seconds=rollout.environment_service.reset_timeout_seconds,
        )
        for name, factory in environments.items():
            probe = box._build(name, factory)
            if not callable(getattr(probe, "reset", None)):
                raise ToolLoadError(
                    f"spec.rollout.environment: {named[name]!r} has no reset() method; TRL's "
                    "environment_factory needs one (it is called before each generation)",
                    "ToolInvalid",
                )
            box._pool[name] = [probe]
            _check_methods(probe, tools, named[name])
        return box

    def close(self) -> None:
        """Drop the proxied instances and stop their processes (nothing to do in process)."""
        for pool in self._pool.values():
            for environment in pool:
                if isinstance(environment, EnvironmentProxy):
                    environment._mortal_release()
        if self.service is not None:
            self.service.close()

    @property
    def multi_environment(self) -> bool:
        return bool(self.environments) and None not in self.environments

    def _build(self, name: str | None, factory: type) -> Any:
        try:
            environment = factory()
            if isinstance(environment, EnvironmentProxy):
                environment._mortal_instance()  # built there now, so a broken class fails the run at once
            return environment
        except Exception as exc:
            raise ToolLoadError(
                f"spec.rollout.environment {name or ''}: building {factory.__name__}() failed: "
                f"{type(exc).__name__}: {exc}",
                "EnvironmentFailed",
            ) from exc

    def environment_name(self, row: dict[str, Any]) -> str | None:
        """The environment a dataset row picks (its `environment` column when the spec gives a dict)."""
        if not self.multi_environment:
            return None
        name = row.get("environment")
        if name not in self.environments:
            raise FatalWorkerError(
                "UnknownEnvironment",
                f"a dataset row has environment={name!r}, which is not "
                f"among spec.rollout.environment's names {sorted(map(str, self.environments))}",
            )
        return name

    def environments_for(self, names: list[str | None]) -> list[Any]:
        """One environment instance per rollout (None where the run has none), drawn from the pool, built only
        when this task needs more concurrent instances of one than exist (TRL's construct once, reset
        often)."""
        if not self.environments:
            return [None] * len(names)
        taken: dict[str | None, int] = {}
        out = []
        for name in names:
            pool = self._pool.setdefault(name, [])
            index = taken.get(name, 0)
            if index == len(pool):
                pool.append(self._build(name, self.environments[name]))
            taken[name] = index + 1
            out.append(pool[index])
        return out

    def reset(self, environment: Any, row: dict[str, Any]) -> Any:
        """environment.reset(**row)'s observation; CallTimedOut past environmentService.resetTimeoutSeconds.
        An instance in this process resets on a thread abandoned past the deadline, as a hung tool's is
        (TooManyAbandonedCalls passes through); a proxy's reset keeps its own (its process is killed)."""
        if isinstance(environment, EnvironmentProxy):
            return environment.reset(**row)
        what = f"{type(environment).__name__}.reset"
        return self.abandoner.call(lambda: environment.reset(**row), self.reset_seconds, what)

    def tools_for(self, environment: Any) -> list[Callable[..., Any]]:
        """The tools a rollout may call: the standalone ones, then its environment's methods."""
        return self.tools + (environment_methods(environment) if environment is not None else [])

    def call_each(
        self, rollouts: Sequence[tuple[list[Callable[..., Any]], list[dict[str, Any]]]]
    ) -> list[list[ToolOutcome]]:
        """The outcomes of each rollout's (tools, tool calls), in order: one rollout's calls one after the
        other, different rollouts' at once (this module's docstring says what stays serial)."""

        def answer(rollout: tuple[list[Callable[..., Any]], list[dict[str, Any]]]) -> list[ToolOutcome]:
            tools, calls = rollout
            return [self.call(tools, call) for call in calls]

        if len(rollouts) <= 1:
            return [answer(r) for r in rollouts]
        with ThreadPoolExecutor(
            max_workers=min(len(rollouts), CONCURRENT_ROLLOUTS), thread_name_prefix="mortal-tools"
        ) as pool:
            return list(pool.map(answer, rollouts))

    def call(self, tools: list[Callable[..., Any]], tool_call: dict[str, Any]) -> ToolOutcome:
        """One parsed tool call ({'type': 'function', 'function': {'name', 'arguments'}}) -> its outcome."""
        if tool_call.get("type") != "function":
            name = str(tool_call.get("name", "unknown"))
            return ToolOutcome(
                name, None, str({"error": f"Unsupported tool call type: {tool_call.get('type')}"}), True
            )
        function = tool_call.get("function") or {}
        name, arguments = str(function.get("name")), function.get("arguments")
        by_name = {tool.__name__: tool for tool in tools}
        if name not in by_name:
            return ToolOutcome(name, arguments, str({"error": f"Tool {name} not found."}), True)
        if not isinstance(arguments, dict):
            return ToolOutcome(
                name, arguments, str({"error": f"arguments of {name} must be an object"}), True
            )
        tool = by_name[name]
        if any(tool is shared for shared in self.tools):
            with self._standalone_lock:
                result, error = run_with_timeout(
                    tool, arguments, self.timeout_seconds, self.abandoner, self._timed_out
                )
        else:
            result, error = run_with_timeout(
                tool, arguments, self.timeout_seconds, self.abandoner, self._timed_out
            )
        if error is not None:
            return ToolOutcome(name, arguments, str({"error": error}), True)
        # str(result), as TRL makes a tool message's content (TRL passes a list through for images; mortal's
        # rollouts are text only); the result's own __str__ is the user's code, and may raise
        try:
            return ToolOutcome(name, arguments, tokenizable(str(result)), False)
        except Exception as exc:
            kind = type(result).__name__
            refused = f"tool {name} returned a {kind} that str() fails on: {exception_text(exc)}"
            return ToolOutcome(name, arguments, str({"error": refused}), True)

    def _timed_out(self, name: str, seconds: float, killed: bool) -> None:
        now = time.monotonic()
        if self.on_timeout is None or now - self._told.get(name, -TOLD_EVERY_SECONDS) < TOLD_EVERY_SECONDS:
            return
        self._told[name] = now
        left = (
            "its environment's process was killed (the instances it held are rebuilt when next used)"
            if killed
            else "its stacks are in the worker's log"
        )
        self.on_timeout(
            f"tool {name} did not return within rollout.toolTimeoutSeconds ({seconds:g} s); the model "
            f"was told it timed out and the rollout went on; {left}"
        )


def run_with_timeout(
    tool: Callable[..., Any],
    arguments: dict[str, Any],
    seconds: float,
    abandoner: Abandoner | None = None,
    on_timeout: Callable[[str, float, bool], None] | None = None,
) -> tuple[Any, str | None]:
    """(result, None), or (None, the error message) when the tool raised or ran past `seconds` (then its
    stacks are in the log). TooManyAbandonedCalls passes through: the worker is to be relaunched."""
    name = getattr(tool, "__name__", "tool")
    if own_deadline(tool):  # a proxy's method: its backend kills what runs past the deadline
        try:
            return tool(**arguments), None
        except CallTimedOut:
            if on_timeout is not None:
                on_timeout(name, seconds, True)  # the backend killed the instance's process
            return None, f"tool {name} timed out after {seconds:g} s"
        except (FatalWorkerError, ServiceOutage):  # a wrong token, a server down: not the model's doing
            raise
        except Exception as exc:  # what the environment raised, or EnvironmentLost: the model reads it
            return None, exception_text(exc)

    def invoke() -> Any:
        value = tool(**arguments)
        return asyncio.run(value) if inspect.iscoroutine(value) else value

    try:
        return (abandoner or Abandoner()).call(invoke, seconds, f"tool {name}"), None
    except CallTimedOut:
        if on_timeout is not None:
            on_timeout(name, seconds, False)  # abandoned: the Abandoner logged its stacks
        return None, f"tool {name} timed out after {seconds:g} s"
    except (TooManyAbandonedCalls, KeyboardInterrupt):
        raise
    except BaseException as exc:  # a user's tool: whatever it raises becomes the model's error message
        return None, exception_text(exc)


class EnvironmentReward:
    """`env: environment` in spec.rewards: each rollout's environment's get_reward(), TRL's environment
    reward.

    With `args: {class: 'module:Class'}` only rollouts whose environment is exactly that class are scored
    (None for the others), as TRL adds one such reward per class; without, every environment that has
    get_reward is. Rollouts without an environment, or whose environment has none, score None.
    """

    def __init__(self, name: str, class_ref: str | None = None, importable: bool = True) -> None:
        """`importable` False (environmentService http): the class need not be importable here; proxies
        are matched by the reference they were built from."""
        self.__name__ = name
        self.only_ref = class_ref
        self.only = _import(class_ref, "spec.rewards[].args.class") if class_ref and importable else None
        if self.only is not None and not callable(getattr(self.only, "get_reward", None)):
            raise ToolLoadError(
                f"spec.rewards {name!r}: {class_ref!r} has no get_reward() method", "ToolInvalid"
            )

    def __call__(
        self, completions: list[Any], environments: list[Any] | None = None, **kwargs: Any
    ) -> list[Any]:
        if environments is None:
            return [None] * len(completions)
        return [self._one(e) for e in environments]

    def _one(self, environment: Any) -> Any:
        if self.only_ref is not None and not self._scores(environment):
            return None
        get_reward = getattr(environment, "get_reward", None)
        if get_reward is None:
            return None
        value = get_reward()
        return asyncio.run(value) if inspect.iscoroutine(value) else value

    def _scores(self, environment: Any) -> bool:
        """Whether `environment` is of args.class: the class itself, or a proxy of it (by its class where
        the worker imported it, else by its reference)."""
        if isinstance(environment, EnvironmentProxy):
            proxied = environment._mortal_class
            if proxied is not None and self.only is not None:
                return proxied is self.only
            return environment._mortal_settings.reference == self.only_ref
        return type(environment) is self.only


def _pooled_environments(
    rollout: Any, named: dict[str | None, str], classes: dict[str | None, type]
) -> tuple[Any, dict[str | None, type]]:
    """environmentService processPool: a pool of child processes, and a proxy class per environment class."""
    from mortal.workers.rollout.environment_pool import ProcessPool

    service = rollout.environment_service
    pool = ProcessPool(service.processes or min(CONCURRENT_ROLLOUTS, os.cpu_count() or 1))
    return pool, {
        name: proxy_class_of(
            cls,
            ProxySettings(
                pool, named[name], "processPool", rollout.tool_timeout_seconds, service.reset_timeout_seconds
            ),
        )
        for name, cls in classes.items()
    }


def _described_once_reachable(client: Any, url: str) -> dict[str, dict[str, Any]]:
    """The server's description, asked again while nothing answers at its address, for up to
    UNREACHABLE_WAIT_SECONDS: a server restarting or briefly down is an outage, not the run's fault. Past
    that EnvironmentUnreachable ends this worker as a crash (relaunched under restartPolicy, which fails the
    run only after sameFailureLimit such ends), never at once as a fatal error."""

    def said(state: RetryCallState) -> None:
        log.warning(
            "the environment server at %s cannot be reached (%s); asking again in %.1f s",
            url,
            state.outcome.exception() if state.outcome else "?",
            state.upcoming_sleep,
        )

    for attempt in Retrying(
        retry=retry_if_exception_type(EnvironmentUnreachable),
        stop=stop_after_delay(UNREACHABLE_WAIT_SECONDS),
        wait=wait_exponential(multiplier=0.5, max=5.0),
        before_sleep=said,
        reraise=True,
    ):
        with attempt:
            return client.describe()
    raise AssertionError("unreachable: tenacity reraises the last failure")


def _served_environments(rollout: Any, named: dict[str | None, str]) -> tuple[Any, dict[str | None, type]]:
    """environmentService http: the server's client, and a proxy class per environment class, built from the
    server's description (the class need not be importable here)."""
    from mortal.workers.rollout.environment_client import EnvironmentServiceError, HttpEnvironments
    from mortal.workers.rollout.environment_proxy import proxy_class_described
    from mortal.workers.rollout.environment_schema import DescriptionError

    service = rollout.environment_service
    token = os.environ.get(service.token_env, "")
    if not token:
        raise ToolLoadError(
            f"spec.rollout.environmentService.tokenEnv: ${service.token_env} is not set on the rollout "
            "worker; list it in spec.secrets and set it where the controller runs",
            "SecretMissing",
        )
    client = HttpEnvironments(service.url, token)
    try:
        served = _described_once_reachable(client, service.url)
        out = {}
        for name, ref in named.items():
            if ref not in served:
                raise ToolLoadError(
                    f"spec.rollout.environment: {ref!r} is not served by the environment server at "
                    f"{service.url}; it serves {', '.join(sorted(served)) or 'nothing'}"
                )
            settings = ProxySettings(
                client, ref, "http", rollout.tool_timeout_seconds, service.reset_timeout_seconds
            )
            out[name] = proxy_class_described(served[ref], settings)
    except (EnvironmentServiceError, DescriptionError) as exc:
        client.close()
        raise ToolLoadError(f"spec.rollout.environmentService: {exc}", "EnvironmentServiceFailed") from exc
    except ToolLoadError:
        client.close()
        raise
    return client, out
