"""The Store contract on the wire: which methods travel, how values and typed errors are encoded.

Shared by the HTTP store's client (mortal.state.http_store) and server (mortal.state.http_server),
so the two cannot drift apart. A call is `POST /v1/<method>` with `{"args": {name: value}}`; the
answer is `{"result": value}` (200) or `{"error": {"type": "Conflict", "message": ...}}` with the
status of `STATUS`. Argument and result types are read from the `Store` method annotations, so a
new Store method travels without a change here (and `test_every_store_method_travels` checks it).

Rows are SQLModel table models: pydantic's TypeAdapter does not validate those (table models skip
validation by design), so `decode` builds them with `Model.model_validate`, which does.
What it must not do: open sockets or touch a database.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python
from sqlmodel import SQLModel

from mortal.state.errors import (
    AlreadyExists,
    ChangeRefused,
    Conflict,
    Fenced,
    Forbidden,
    InvalidName,
    InvalidValue,
    NotFound,
    StoreError,
    Unauthorized,
    Unavailable,
)
from mortal.state.store import Store

PREFIX = "/v1/"
TOKEN_ENV = "MORTAL_STATE_TOKEN"  # the bearer token, on both sides
HEALTH_PATH = "/healthz"
# Arguments that carry the caller's clock (a test's way to move time on a SqlStore in this process). Over
# HTTP the server's clock decides leases: the client refuses to send them and the server drops them.
CLIENT_CLOCK_ARGS = frozenset({"now"})
LOCAL_ONLY = frozenset({"close"})  # a client closes its own connections; nothing travels
# Calls that change nothing: safe to send again after a connection broke mid-request.
READS = frozenset(
    {
        "migrate",
        "get_run",
        "run_uid",
        "list_runs",
        "list_workers",
        "list_checkpoints",
        "latest_checkpoint",
        "latest_weights",
        "list_weights",
        "list_events",
        "list_metrics",
        "get_lease",
        "step_results",
        "step_states",
        "task_tally",
        "list_completions",
        "completion_steps",
    }
)
# Writes whose second delivery leaves the store as the first did and answers the caller as the first
# did: safe to send again after a connection broke mid-request, as reads are. Each one, and why:
IDEMPOTENT_WRITES = frozenset(
    {
        "heartbeat",  # sets heartbeat_at/state/step to the same values; fenced by the incarnation either way
        "report_stacks",  # sets stacks_written_at once per request: a second report leaves it
        "renew_task",  # guarded by (task, lease_token): extends the same lease again; True while it is held
        "add_metrics",  # replaces the (run, step, name) values: one value per name, the latest
        "add_completions",  # replaces the step's completions
        "acquire_lease",  # the holder's renewal keeps its token: the same lease comes back
        "release_lease",  # expiring an expired lease, or one another holds, is a no-op
        "mark_deleted",  # documented idempotent: deleted_at is set once
        "end_worker",  # a worker already ended keeps its first terminal state, returned unchanged
        "set_worker_handle",  # sets the same handle
    }
)
# Not retried after the request may have reached the server (each gives a different answer, or a second
# effect, the second time): create_worker (a second incarnation), lease_task (a second task),
# complete_task (False: the task is done, and the worker would think its lease lost), add_event (a
# duplicate), publish_weights / update_spec / write_status with a resource_version (Conflict: the version
# moved), report_exit (Fenced: the worker has ended), apply_run (unchanged, not created), purge_run,
# record_checkpoint, delete_* (NotFound), enqueue_tasks / reset_tasks (a count of 0), request_stacks (a
# second request would forget the worker's answer to the first).

# Typed errors and their HTTP status. The client raises the same class again from the "type" field.
STATUS: dict[str, int] = {
    "NotFound": 404,
    "AlreadyExists": 409,
    "Conflict": 409,
    "ChangeRefused": 409,
    "Fenced": 412,  # the fencing token is the request's precondition, and it no longer holds
    "ValueError": 422,
    "InvalidValue": 422,  # a value the database cannot hold (a NUL in a text)
    "InvalidName": 422,  # a name the store refuses (mortal.state.names)
    "Unauthorized": 401,
    "Forbidden": 403,
    "BadRequest": 400,
    "UnknownMethod": 404,
    "Unavailable": 503,
    "Internal": 500,  # a bug or a broken database behind the server; the client raises Unavailable
}
ERROR_TYPES: dict[str, type[Exception]] = {
    "NotFound": NotFound,
    "AlreadyExists": AlreadyExists,
    "Conflict": Conflict,
    "ChangeRefused": ChangeRefused,
    "Fenced": Fenced,
    "ValueError": ValueError,
    "InvalidValue": InvalidValue,
    "InvalidName": InvalidName,
    "Unauthorized": Unauthorized,
    "Forbidden": Forbidden,
    "Unavailable": Unavailable,
}


@dataclass(frozen=True)
class Method:
    """One Store method as the wire sees it."""

    name: str
    signature: inspect.Signature  # without `self`
    hints: dict[str, Any]  # parameter name -> annotation; "return" -> the result's

    @property
    def read_only(self) -> bool:
        return self.name in READS

    @property
    def idempotent(self) -> bool:
        """Safe to send again when the client cannot know whether the first one was applied."""
        return self.name in READS or self.name in IDEMPOTENT_WRITES


@cache
def methods() -> dict[str, Method]:
    """Every abstract Store method but the local-only ones, by name."""
    out = {}
    for name in sorted(Store.__abstractmethods__ - LOCAL_ONLY):
        func = getattr(Store, name)
        sig = inspect.signature(func)
        params = [p for p in sig.parameters.values() if p.name != "self"]
        out[name] = Method(name, sig.replace(parameters=params), typing.get_type_hints(func))
    return out


def encode(value: Any) -> Any:
    """A JSON-ready form of an argument or result (rows, dataclasses, datetimes, enums)."""
    return to_jsonable_python(value)


def decode(annotation: Any, value: Any) -> Any:
    """`value` (JSON) as `annotation` says; raises pydantic.ValidationError or TypeError when it does not
    fit."""
    if value is None:
        return None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:
            return decode(arms[0], value)
    elif origin is list and args:
        return [decode(args[0], item) for item in value]
    elif origin is tuple and args and Ellipsis not in args:
        if len(args) != len(value):
            raise TypeError(f"expected {len(args)} items, got {len(value)}")
        return tuple(decode(a, item) for a, item in zip(args, value, strict=True))
    elif isinstance(annotation, type) and issubclass(annotation, SQLModel):
        return annotation.model_validate(value)
    return _adapter(annotation).validate_python(value)


@cache
def _adapter(annotation: Any) -> TypeAdapter[Any]:
    return TypeAdapter(annotation)


def decode_args(method: Method, args: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a call, typed; TypeError for an unknown or missing name."""
    unknown = set(args) - set(method.signature.parameters)
    if unknown:
        raise TypeError(f"{method.name}() got unexpected arguments {sorted(unknown)}")
    method.signature.bind(**args)  # missing required arguments raise TypeError here
    return {name: decode(method.hints[name], value) for name, value in args.items()}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and body that carry `exc` back to the client."""
    kind = next((name for name, cls in ERROR_TYPES.items() if type(exc) is cls), None)
    if kind is None:
        kind = next((name for name, cls in ERROR_TYPES.items() if isinstance(exc, cls)), "Internal")
    return STATUS[kind], {"error": {"type": kind, "message": str(exc)}}


def error_from(status: int, body: Any) -> Exception:
    """The exception a client raises for an error answer (a StoreError when the type is not known)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        text = str(body)[:300]
        return (
            Unavailable(f"HTTP {status}: {text}") if status >= 500 else StoreError(f"HTTP {status}: {text}")
        )
    kind, message = str(error.get("type")), str(error.get("message", ""))
    cls = ERROR_TYPES.get(kind)
    if cls is None:
        return (Unavailable if status >= 500 else StoreError)(f"{kind}: {message}")
    return cls(message)
