"""Who may do what on the HTTP store (mortal.state.auth), on a server started for real on loopback over
SQLite and PostgreSQL: a worker's token reaches its own run and role only, nothing admin; the server's
clock decides leases; a bad token is refused before the body is read; every call is in the access log,
and no token ever is."""

from __future__ import annotations

import contextlib
import json
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests

from mortal.state import NewTask, WorkerRef, wire
from mortal.state.auth import (
    ACTOR_CALLS,
    ROLLOUT_CALLS,
    RUN_NAMED,
    WORKER_TOKEN_PREFIX,
    Authority,
    WorkerClaims,
    mint_worker_token,
)
from mortal.state.errors import Fenced, Forbidden, NotFound, Unauthorized
from mortal.state.http_server import Served, make_app, previous_tokens_from, serve
from mortal.state.http_store import HttpStore

ADMIN = "auth-test-admin-t0ken"
SPEC = {"model": {"name": "tiny"}}


@pytest.fixture
def served(sql_store_url: str, tmp_path: Path) -> Iterator[Served]:
    with serve(sql_store_url, ADMIN, access_log=tmp_path / "access.log") as server:
        yield server


@pytest.fixture
def admin(served: Served) -> HttpStore:
    return HttpStore(served.url, token=ADMIN, retry_seconds=2)


def two_runs(admin: HttpStore) -> dict[str, WorkerRef]:
    """Runs a and b, each with an actor and a rollout, and a queued task in each."""
    refs = {}
    for run in ("a", "b"):
        admin.apply_run(run, SPEC)
        for role in ("actor", "rollout"):
            row = admin.create_worker(run, role, 0, "local", 30)
            refs[f"{run}/{role}"] = WorkerRef(run, role, 0, row.incarnation)
        admin.enqueue_tasks(refs[f"{run}/actor"], [NewTask(step=0, slot=0, min_weight_version=0)])
    return refs


def as_worker(served: Served, ref: WorkerRef, admin_token: str = ADMIN) -> HttpStore:
    return HttpStore(served.url, token=mint_worker_token(admin_token, ref), retry_seconds=2)


def test_a_rollout_token_reaches_its_own_runs_tasks_and_nothing_else(
    served: Served, admin: HttpStore
) -> None:
    refs = two_runs(admin)
    rollout_a = as_worker(served, refs["a/rollout"])
    with pytest.raises(Forbidden, match="run 'a', not 'b'"):
        rollout_a.lease_task(refs["b/rollout"], 30)
    with pytest.raises(Forbidden, match="cannot write as"):
        rollout_a.lease_task(WorkerRef("a", "rollout", 1, refs["a/rollout"].incarnation), 30)
    with pytest.raises(Forbidden):
        rollout_a.step_results("b", 0)
    with pytest.raises(Forbidden):
        rollout_a.list_workers()  # every run's
    task = rollout_a.lease_task(refs["a/rollout"], 30)
    assert task is not None and task.run == "a"
    assert rollout_a.complete_task(refs["a/rollout"], task.id, task.lease_token, {"reward": 1.0})
    rollout_a.heartbeat(refs["a/rollout"], step=0)
    rollout_a.add_metrics(refs["a/rollout"], 0, {"reward": 1.0})
    assert [t.state for t in rollout_a.step_results("a", 0)] == ["done"]
    assert admin.step_states("b", 0) == ["queued"], "b's task was never leased"


def test_a_worker_token_can_do_nothing_admin(served: Served, admin: HttpStore) -> None:
    refs = two_runs(admin)
    before = admin.get_run("a")
    rollout_a = as_worker(served, refs["a/rollout"])
    admin_calls = [
        lambda s: s.apply_run("a", {"model": {"name": "reward-code-of-mine"}}),
        lambda s: s.update_spec("a", {"model": {"name": "reward-code-of-mine"}}, before.resource_version),
        lambda s: s.write_status("a", {"phase": "Failed"}),
        lambda s: s.mark_deleted("a"),
        lambda s: s.purge_run("a"),
        lambda s: s.create_worker("a", "rollout", 5, "local", 30),
        lambda s: s.end_worker(1, "Lost"),
        lambda s: s.acquire_lease("controller", "me", 3600),
        lambda s: s.release_lease("controller", "me"),
        lambda s: s.list_runs(),
        lambda s: s.migrate(),
    ]
    for call in admin_calls:
        with pytest.raises(Forbidden):
            call(rollout_a)
    with pytest.raises(Forbidden, match="not a call a rollout worker makes"):
        rollout_a.record_checkpoint(refs["a/rollout"], 1, "/x", 0)
    after = admin.get_run("a")
    assert (after.spec, after.phase, after.resource_version, after.deleted_at) == (
        before.spec,
        before.phase,
        before.resource_version,
        None,
    )
    assert admin.get_lease("controller") is None and len(admin.list_workers("a")) == 2


def test_an_actor_token_does_the_actors_writes_for_its_run_only(served: Served, admin: HttpStore) -> None:
    refs = two_runs(admin)
    actor_a = as_worker(served, refs["a/actor"])
    assert actor_a.enqueue_tasks(refs["a/actor"], [NewTask(step=1, slot=0, min_weight_version=0)]) == 1
    actor_a.publish_weights(refs["a/actor"], 1, 1, "/w/1")
    assert actor_a.latest_weights("a").version == 1
    with pytest.raises(Forbidden):
        actor_a.enqueue_tasks(refs["b/actor"], [NewTask(step=1, slot=0, min_weight_version=0)])
    assert actor_a.lease_task(refs["a/actor"], 30).run == "a", (
        "it serves its own tasks when it has no rollouts"
    )
    with pytest.raises(Forbidden, match="not a call a rollout worker makes"):
        as_worker(served, refs["a/rollout"]).enqueue_tasks(
            refs["a/rollout"], [NewTask(step=2, slot=0, min_weight_version=0)]
        )
    with pytest.raises(Forbidden):
        actor_a.add_event("b", "Normal", "Spoofed", "not my run")


def _run_named_calls() -> dict[str, Callable[[HttpStore], object]]:
    """Every call a worker token may make that names run `a` without a WorkerRef (the store fences those)."""
    return {
        "get_run": lambda s: s.get_run("a"),
        "list_workers": lambda s: s.list_workers("a"),
        "list_checkpoints": lambda s: s.list_checkpoints("a"),
        "latest_checkpoint": lambda s: s.latest_checkpoint("a"),
        "latest_weights": lambda s: s.latest_weights("a"),
        "list_weights": lambda s: s.list_weights("a"),
        "list_events": lambda s: s.list_events("a"),
        "list_metrics": lambda s: s.list_metrics("a"),
        "list_completions": lambda s: s.list_completions("a"),
        "completion_steps": lambda s: s.completion_steps("a"),
        "step_results": lambda s: s.step_results("a", 0),
        "step_states": lambda s: s.step_states("a", 0),
        "add_event": lambda s: s.add_event("a", "Warning", "Spoofed", "from the deleted run's worker"),
    }


def test_the_run_named_calls_are_every_worker_call_without_a_worker_argument() -> None:
    named = {m for m in ACTOR_CALLS if "worker" not in wire.methods()[m].signature.parameters}
    assert named == set(_run_named_calls())


def test_a_token_of_a_deleted_run_is_refused_by_the_run_applied_again_under_its_name(
    served: Served, admin: HttpStore, tmp_path: Path
) -> None:
    """A run deleted and applied again gets a new uid and counts its incarnations from 1 again: the leftover
    actor of the first (its token still valid) has the new actor's very slot and incarnation, and names the
    run as the new one does. Its token's run uid tells them apart on every call, those naming the run only
    included."""
    admin.apply_run("a", SPEC)
    first = admin.get_run("a").uid
    row = admin.create_worker("a", "actor", 0, "local", 30)
    ref = WorkerRef("a", "actor", 0, row.incarnation)
    old = HttpStore(served.url, token=mint_worker_token(ADMIN, ref, run_uid=first), retry_seconds=2)
    for call in _run_named_calls().values():
        call(old)  # all allowed while its run lives
    old.publish_weights(ref, 1, 1, "/w/1")
    admin.end_worker(row.id, "Stopped")
    admin.mark_deleted("a", purge=True)
    admin.purge_run("a")
    for name, call in _run_named_calls().items():
        gone = NotFound if name == "get_run" else Forbidden  # the store's answer comes first: nothing to see
        with pytest.raises(gone, match="not found|which was deleted; no run of that name exists now"):
            call(old)

    admin.apply_run("a", SPEC)
    second = admin.get_run("a").uid
    row = admin.create_worker("a", "actor", 0, "local", 30)
    assert second != first and WorkerRef("a", "actor", 0, row.incarnation) == ref, "the same slot, anew"
    new = HttpStore(served.url, token=mint_worker_token(ADMIN, ref, run_uid=second), retry_seconds=2)
    new.heartbeat(ref)
    new.publish_weights(ref, 1, 1, "/w/new")
    for call in _run_named_calls().values():
        with pytest.raises(Forbidden, match=f"of uid {first}, which was deleted; .* now has uid {second}"):
            call(old)
    with pytest.raises(Fenced, match="launched for an earlier run named 'a'"):
        old.heartbeat(ref)  # a WorkerRef call: the store fences it by the token's uid, as before
    assert admin.list_events("a") == [], "the deleted run's worker wrote nothing into the new run"
    for call in _run_named_calls().values():
        call(new)  # the current run's token works
    assert new.get_run("a").uid == second and new.latest_weights("a").path == "/w/new"
    assert len(admin.list_events("a")) == 1
    # a token minted before tokens carried a run uid keeps the name check alone
    assert as_worker(served, ref).latest_weights("a").path == "/w/new"
    calls = [json.loads(line) for line in (tmp_path / "access.log").read_text().splitlines()]
    refused = [c for c in calls if c["status"] == 403]
    assert len(refused) == 2 * len(_run_named_calls()) - 1  # all but get_run of the purged run (NotFound)
    assert {(c["who"], c["run"]) for c in refused} == {("worker:a/actor-0#1", "a")}


def test_forged_expired_and_rotated_tokens(
    served: Served, admin: HttpStore, sql_store_url: str, tmp_path: Path
) -> None:
    refs = two_runs(admin)
    token = mint_worker_token(ADMIN, refs["a/rollout"])
    prefix, payload, mac = token.split(".")
    other = mint_worker_token(ADMIN, refs["b/rollout"]).split(".")[1]
    for forged in (
        f"{prefix}.{other}.{mac}",
        mint_worker_token("not-the-admin", refs["a/rollout"]),
        mint_worker_token(ADMIN, refs["a/rollout"], lifetime_seconds=-1),
        f"{WORKER_TOKEN_PREFIX}..",
        "",
    ):
        with pytest.raises(Unauthorized):
            HttpStore(served.url, token=forged, retry_seconds=2).step_states("a", 0)
    # rotation: the new admin token, the old one still accepted, its workers' tokens too
    assert previous_tokens_from({"MORTAL_STATE_PREVIOUS_TOKENS": f" {ADMIN}, ,older "}) == [ADMIN, "older"]
    with serve(
        sql_store_url, "rotated-admin-t0ken", access_log=tmp_path / "rotated.log", previous_tokens=[ADMIN]
    ) as rotated:
        assert HttpStore(rotated.url, token=token).step_states("a", 0) == ["queued"]
        assert HttpStore(rotated.url, token=ADMIN).get_run("b").name == "b"
        assert as_worker(rotated, refs["a/rollout"], "rotated-admin-t0ken").step_states("a", 0) == ["queued"]
    with (
        serve(sql_store_url, "rotated-admin-t0ken", access_log=tmp_path / "rotated.log") as done,
        pytest.raises(Unauthorized),
    ):
        HttpStore(done.url, token=token, retry_seconds=2).step_states("a", 0)


def test_the_authority_tells_admin_from_workers_by_the_token_alone() -> None:
    authority = Authority([ADMIN])
    ref = WorkerRef("a", "rollout", 2, 7)
    claims = authority.identify(mint_worker_token(ADMIN, ref, run_uid="u1")).worker
    assert claims == WorkerClaims("a", "u1", "rollout", 2, 7, claims.exp) and claims.ref.run_uid == "u1"
    assert authority.identify(ADMIN).worker is None and authority.identify(ADMIN + "x") is None
    assert authority.identify(mint_worker_token(ADMIN, ref), now=time.time() + 10**9) is None, "expired"


# -- the server's clock -------------------------------------------------------------------------------------
def test_a_client_now_in_the_future_does_not_extend_a_lease(served: Served, admin: HttpStore) -> None:
    far = datetime(2100, 1, 1, tzinfo=UTC).isoformat()
    answer = requests.post(
        f"{served.url}/v1/acquire_lease",
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=10,
        json={"args": {"name": "controller", "holder": "squatter", "duration_seconds": 1, "now": far}},
    )
    lease = answer.json()["result"]
    assert datetime.fromisoformat(lease["expires_at"]) < datetime.now(UTC) + timedelta(seconds=5)
    time.sleep(1.2)
    taken = admin.acquire_lease("controller", "real-controller", 10)
    assert taken is not None and (taken.holder, taken.token) == ("real-controller", 2)
    with pytest.raises(ValueError, match="server's"):
        admin.acquire_lease("controller", "real-controller", 10, now=datetime.now(UTC))


def test_a_client_now_in_the_future_does_not_steal_a_leased_task(served: Served, admin: HttpStore) -> None:
    refs = two_runs(admin)
    held = admin.lease_task(refs["a/rollout"], 60)
    thief = admin.create_worker("a", "rollout", 1, "local", 30)
    far = datetime(2100, 1, 1, tzinfo=UTC).isoformat()
    worker = {"run": "a", "role": "rollout", "replica": 1, "incarnation": thief.incarnation}
    answer = requests.post(
        f"{served.url}/v1/lease_task",
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=10,
        json={"args": {"worker": worker, "lease_seconds": 30, "now": far}},
    )
    assert answer.json() == {"result": None}
    assert admin.step_results("a", 0)[0].lease_token == held.lease_token


# -- the token before the body ------------------------------------------------------------------------------
def raw(served: Served, head: bytes, body: bytes = b"", timeout: float = 10) -> tuple[int, bytes]:
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head)
        with contextlib.suppress(OSError):  # the server answered and closed without reading it
            sock.sendall(body)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:  # closed with the unread body still in its buffer: the answer came first
            pass
    answer = b"".join(chunks)
    return int(answer.split(b" ", 2)[1]), answer.partition(b"\r\n\r\n")[2]


def head(length: int, token: str | None) -> bytes:
    lines = ["POST /v1/apply_run HTTP/1.1", "Host: store", "Connection: close", f"Content-Length: {length}"]
    lines += [f"Authorization: Bearer {token}"] if token is not None else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_bad_token_is_refused_before_the_body_is_read(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    spooled = []
    real = tempfile.TemporaryFile

    def counting(*args: object, **kwargs: object):  # noqa: ANN202 - tempfile's own type
        spooled.append(1)
        return real(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(tempfile, "TemporaryFile", counting)
    started = time.monotonic()
    status, body = raw(served, head(50 << 20, "wrong"))  # announces 50 MiB, sends none: answered at once
    assert status == 401 and json.loads(body)["error"]["type"] == "Unauthorized"
    assert time.monotonic() - started < 5, "the server waited for a body it was going to refuse"
    payload = b'{"args": {"name": "r", "spec": {"x": "' + b"y" * (4 << 20) + b'"}}}'
    assert raw(served, head(len(payload), None), payload)[0] == 401
    assert spooled == [], "a refused body went to a temporary file"
    assert raw(served, head(len(payload), ADMIN), payload)[0] == 200
    assert spooled, "an accepted body of that size is spooled: the check above could fail"


class Unread:
    """A request body that must not be read."""

    def read(self, size: int = -1) -> bytes:
        raise AssertionError("the body of a refused request was read")


@pytest.mark.parametrize("path", ["/v1/apply_run", "/v1/no_such_method", "/elsewhere"])
def test_the_app_refuses_a_bad_token_without_reading_the_body(tmp_path: Path, path: str) -> None:
    """As Modal serves it (no waitress in front): the token is the first thing the app looks at."""
    app = make_app(f"sqlite:///{tmp_path / 'state.db'}", ADMIN)
    statuses: list[str] = []
    for header in ("Bearer wrong", "", f"Basic {ADMIN}"):
        environ = {
            "PATH_INFO": path,
            "REQUEST_METHOD": "POST",
            "CONTENT_LENGTH": str(50 << 20),
            "wsgi.input": Unread(),
            "HTTP_AUTHORIZATION": header,
        }
        answer = json.loads(b"".join(app(environ, lambda status, headers: statuses.append(status))))
        assert answer["error"]["type"] == "Unauthorized"
    assert statuses == ["401 Unauthorized"] * 3
    app.close()


def test_an_oversized_body_is_a_clear_413(served: Served) -> None:
    status, body = raw(served, head(1 << 40, ADMIN))
    assert status == 413 and "max_body" in json.loads(body)["error"]["message"]


# -- the access log -----------------------------------------------------------------------------------------
def test_the_access_log_says_who_called_what_and_never_holds_a_token(
    served: Served, admin: HttpStore, tmp_path: Path
) -> None:
    refs = two_runs(admin)
    token = mint_worker_token(ADMIN, refs["a/rollout"])
    rollout_a = HttpStore(served.url, token=token, retry_seconds=2)
    rollout_a.lease_task(refs["a/rollout"], 30)
    with pytest.raises(Forbidden):
        rollout_a.purge_run("b")
    with pytest.raises(Unauthorized):
        HttpStore(served.url, token="guess", retry_seconds=2).list_runs()
    raw(served, head(50 << 20, "wrong"))
    log = tmp_path / "access.log"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    seen = [(e["who"], e["call"], e["run"], e["status"]) for e in lines]
    assert ("admin", "apply_run", "a", 200) in seen
    assert ("worker:a/rollout-0#2", "lease_task", "a", 200) in seen
    assert ("worker:a/rollout-0#2", "purge_run", "b", 403) in seen
    assert ("unknown", "/v1/list_runs", None, 401) in seen
    assert ("unknown", "/v1/apply_run", None, 401) in seen
    assert all(e["client"] == "127.0.0.1" and e["time"].endswith("Z") for e in lines)
    text = log.read_text()
    assert ADMIN not in text and token not in text and token.split(".")[2] not in text and "guess" not in text
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_every_call_a_worker_may_make_is_a_store_method() -> None:
    """A renamed Store method would otherwise be refused to workers (admin only) without a
    test noticing here."""
    assert set(wire.methods()) >= ACTOR_CALLS | ROLLOUT_CALLS | RUN_NAMED
