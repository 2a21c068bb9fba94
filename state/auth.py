"""Who may call what on the HTTP store: the admin credential, and the scoped tokens of workers.

Two kinds of bearer token, as the Kubernetes API server has users and service accounts:
- The admin token (MORTAL_STATE_TOKEN of the server, the controller and the people who run mortalctl):
  every Store method.
- A worker token, minted by the controller for each worker it launches: the calls a worker of that role
  makes for its own run (`WORKER_CALLS`, `ACTOR_CALLS`, `ROLLOUT_CALLS`), as its own slot and incarnation
  (a WorkerRef argument must be the token's). Nothing of another run, nothing admin: no spec, status,
  worker rows, purge or leases. A Store method not named here is admin only, so a new one is safe.
  Nothing of an earlier run of the same name either: a WorkerRef call is fenced by the token's run uid in
  the store, and a call that names the run only is checked against the run's current uid by the server
  (`run_uid_to_check`, `check_run_uid`: `authorize` stays pure, the server reads the uid).

Why HMAC-signed tokens, with the key derived from the admin token: the controller that mints and the
server that verifies may run on different machines (a laptop and the Modal app), and the one secret they
already share is the admin token. Deriving the key from it (HMAC of a fixed label) needs no new secret to
distribute, no key file, no row per launch and no read per request; a worker cannot recover the admin
token or the key from its token (HMAC is one-way), nor change a claim without the key. Tokens stored
hashed in the store would need a write per launch, a read per request and their own clean-up.
A token stops working when it expires (`exp`), when the admin token is rotated (its key goes with it),
and, for every write, when its incarnation ends: the store fences a WorkerRef that is no longer live.

Rotation: start the server with the new admin token and the old one in MORTAL_STATE_PREVIOUS_TOKENS
(comma separated), then give the controller (and people) the new one; workers keep working on tokens the
old key signed, and new launches get tokens of the new key. Drop the old one once its workers are gone.
What it must not do: log or return a token, or compare one in time that depends on its content.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mortal.state.errors import Forbidden
from mortal.state.store import WorkerRef
from mortal.state.wire import TOKEN_ENV

WORKER_TOKEN_PREFIX = "mortal-w1"
WORKER_TOKEN_SECONDS = 30 * 24 * 3600  # a worker token's lifetime; a worker that outlives it is relaunched
_KEY_LABEL = b"mortal worker token signing key v1"

# What any worker may call for its own run: reads, its liveness, its last word, events and metrics.
WORKER_CALLS = frozenset(
    {
        "get_run",
        "list_workers",
        "list_checkpoints",
        "latest_checkpoint",
        "latest_weights",
        "list_weights",
        "list_events",
        "list_metrics",
        "list_completions",
        "completion_steps",
        "step_results",
        "step_states",
        "heartbeat",
        "report_stacks",
        "report_exit",
        "add_event",
        "add_metrics",
    }
)
ROLLOUT_CALLS = WORKER_CALLS | {"lease_task", "renew_task", "complete_task"}
# The actor owns its run's task queue and its outputs; it serves tasks itself when the run has no rollouts.
ACTOR_CALLS = ROLLOUT_CALLS | {
    "record_checkpoint",
    "delete_checkpoint",
    "publish_weights",
    "delete_weights",
    "enqueue_tasks",
    "reset_tasks",
    "add_completions",
}
ROLE_CALLS = {"actor": ACTOR_CALLS, "rollout": ROLLOUT_CALLS}
# The methods whose `name` argument is a run's name (acquire_lease's is a lease's).
RUN_NAMED = frozenset(
    {
        "apply_run",
        "fork_run",
        "rollback_run",
        "get_run",
        "run_uid",
        "update_spec",
        "write_status",
        "mark_deleted",
        "purge_run",
    }
)


@dataclass(frozen=True)
class WorkerClaims:
    """What a worker token says: the one worker incarnation it speaks for, and until when (unix seconds)."""

    run: str
    run_uid: str
    role: str
    replica: int
    incarnation: int
    exp: int

    @property
    def ref(self) -> WorkerRef:
        return WorkerRef(self.run, self.role, self.replica, self.incarnation, self.run_uid or None)


@dataclass(frozen=True)
class Identity:
    """Who a request comes from: the admin (worker None) or one worker incarnation."""

    worker: WorkerClaims | None = None

    @property
    def name(self) -> str:
        """As the access log writes it (never the token)."""
        return "admin" if self.worker is None else f"worker:{self.worker.ref.id}"


ADMIN = Identity()


def run_of(method: str, kwargs: dict[str, Any]) -> str | None:
    """The run a call is about (None for calls about no one run: list_runs, leases, worker rows by id)."""
    worker = kwargs.get("worker")
    if isinstance(worker, WorkerRef):
        return worker.run
    if isinstance(kwargs.get("run"), str):
        return kwargs["run"]
    if method in RUN_NAMED and isinstance(kwargs.get("name"), str):
        return kwargs["name"]
    return None


def authorize(identity: Identity, method: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments if `identity` may make it; Forbidden otherwise. A worker's WorkerRef argument
    must be its token's slot and incarnation; it gets the token's run uid, so the store fences it off a
    newer run of the same name too."""
    claims = identity.worker
    if claims is None:
        return kwargs
    if method not in ROLE_CALLS.get(claims.role, frozenset()):
        raise Forbidden(f"{method} is not a call a {claims.role} worker makes (token of {claims.ref.id})")
    run = run_of(method, kwargs)
    if run != claims.run:
        raise Forbidden(f"the token of {claims.ref.id} is for run {claims.run!r}, not {run!r}")
    worker = kwargs.get("worker")
    if isinstance(worker, WorkerRef):
        mine = claims.ref
        if (worker.run, worker.role, worker.replica, worker.incarnation) != (
            mine.run,
            mine.role,
            mine.replica,
            mine.incarnation,
        ):
            raise Forbidden(f"the token of {mine.id} cannot write as {worker.id}")
        if mine.run_uid and worker.run_uid not in (None, mine.run_uid):
            raise Forbidden(f"the token of {mine.id} is for another run of that name")
        kwargs = {**kwargs, "worker": dataclasses.replace(worker, run_uid=mine.run_uid or worker.run_uid)}
    return kwargs


def run_uid_to_check(identity: Identity, kwargs: dict[str, Any]) -> str | None:
    """The uid the named run must have for an authorized call of `identity` to be answered: its token's run
    uid, on a call that names its run by name only (`run=`, or `name=` of RUN_NAMED: reads, add_event).
    None where nothing is left to check: the admin; a token without a run uid (minted before they carried
    one), which keeps the name check alone; a call with a WorkerRef, which the store fences by the uid
    itself. The caller reads the run's uid (Store.run_uid) and hands it to `check_run_uid`."""
    claims = identity.worker
    if claims is None or not claims.run_uid or isinstance(kwargs.get("worker"), WorkerRef):
        return None
    return claims.run_uid


def check_run_uid(identity: Identity, current: str | None) -> None:
    """Forbidden unless the run named in the call is, by its uid `current` (None: no such run now), the run
    `identity`'s token was minted for. A run deleted and applied again under its name gets a new uid, so a
    leftover worker of the deleted one (fenced from every write that carries its WorkerRef) cannot read or
    write the new run through the calls that name it."""
    claims = identity.worker
    if claims is None or not claims.run_uid or current == claims.run_uid:
        return
    now = (
        "no run of that name exists now" if current is None else f"the run of that name now has uid {current}"
    )
    raise Forbidden(
        f"the token of {claims.ref.id} is for run {claims.run!r} of uid {claims.run_uid}, which was deleted; "
        f"{now}"
    )


class Authority:
    """Tells who a bearer token belongs to, and mints worker tokens. `tokens`: the admin token first,
    then earlier ones still accepted during a rotation (their workers' tokens too)."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._admin = [t.encode() for t in tokens if t]
        if not self._admin:
            raise ValueError("the HTTP store needs an admin token")
        self._keys = [_signing_key(t) for t in self._admin]

    def identify(self, bearer: str, now: float | None = None) -> Identity | None:
        """The identity of `bearer` (the token, without "Bearer "); None for an unknown, forged or expired
        one."""
        given = bearer.strip().encode()
        admin = False
        for token in self._admin:  # every one compared, so the time taken does not say which matched
            admin |= hmac.compare_digest(given, token)
        if admin:
            return ADMIN
        claims = verify_worker_token(self._keys, given, time.time() if now is None else now)
        return None if claims is None else Identity(claims)

    def mint(self, claims: WorkerClaims) -> str:
        return _sign(self._keys[0], claims)


def mint_worker_token(
    admin_token: str,
    ref: WorkerRef,
    run_uid: str = "",
    lifetime_seconds: float = WORKER_TOKEN_SECONDS,
    now: float | None = None,
) -> str:
    """The token of worker `ref` (the controller calls this when it launches it)."""
    issued = time.time() if now is None else now
    claims = WorkerClaims(
        ref.run, run_uid, ref.role, ref.replica, ref.incarnation, int(issued + lifetime_seconds)
    )
    return Authority([admin_token]).mint(claims)


def launch_token(
    state_url: str, ref: WorkerRef, run_uid: str = "", environ: Mapping[str, str] | None = None
) -> str:
    """The token a worker launched now gets: minted from the launcher's admin token ($MORTAL_STATE_TOKEN) when
    workers reach the store over HTTP; "" for a SQL store (a worker given its URL holds its credentials)."""
    admin = (os.environ if environ is None else environ).get(TOKEN_ENV, "")
    if not admin or not state_url.startswith(("http://", "https://")):
        return ""
    return mint_worker_token(admin, ref, run_uid)


def verify_worker_token(keys: Sequence[bytes], token: bytes, now: float) -> WorkerClaims | None:
    """The claims of a worker token one of `keys` signed and that has not expired; None otherwise."""
    prefix, _, rest = token.partition(b".")
    payload, _, mac = rest.partition(b".")
    if prefix != WORKER_TOKEN_PREFIX.encode() or not payload or not mac:
        return None
    signed = prefix + b"." + payload
    valid = False
    for key in keys:
        valid |= hmac.compare_digest(hmac.new(key, signed, hashlib.sha256).digest(), _unb64(mac) or b"")
    if not valid:
        return None
    try:  # signed by us: the claims are ours, but still checked for shape
        fields = json.loads(_unb64(payload) or b"")
        claims = WorkerClaims(**fields)
    except (ValueError, TypeError):
        return None
    return claims if claims.exp > now else None


def _signing_key(admin_token: bytes) -> bytes:
    return hmac.new(admin_token, _KEY_LABEL, hashlib.sha256).digest()


def _sign(key: bytes, claims: WorkerClaims) -> str:
    payload = _b64(json.dumps(dataclasses.asdict(claims), sort_keys=True, separators=(",", ":")).encode())
    signed = f"{WORKER_TOKEN_PREFIX}.{payload}".encode()
    return f"{WORKER_TOKEN_PREFIX}.{payload}.{_b64(hmac.new(key, signed, hashlib.sha256).digest())}"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: bytes) -> bytes | None:
    try:
        return base64.urlsafe_b64decode(text + b"=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
