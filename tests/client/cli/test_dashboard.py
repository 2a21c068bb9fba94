"""`mortalctl dashboard`: the read-only web page, fetched over real HTTP from a loopback port.

A store holding a run with metrics, events, workers, a checkpoint and completions (one of them a
<script> the model wrote) is served by the dashboard's waitress server on a free port; the pages and
JSON endpoints are fetched with requests. Checked: what they show, that model text is escaped, that
nothing is written (no INSERT/UPDATE/DELETE reaches the database, the row counts stay), and that a
refresh costs a bounded number of statements however many runs and rows there are. The content test
runs on every store (the dashboard reads a store served over HTTP as the other verbs do); the
statement counts need a SQL engine to listen on.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from clihelpers import QUICKSTART, actor, set_status
from ruamel.yaml import YAML
from sqlalchemy import event

from mortal.client.cli.dashboard import open_read_only, serve
from mortal.client.cli.dashboard_data import ReadOnlyStore
from mortal.client.cli.dashboard_html import esc
from mortal.state import NewCompletion, Store, WorkerRef, open_store

SCRIPT = '<script>document.title="pwned"</script><img src=x onerror=alert(1)>'


def _spec(name: str) -> dict:
    doc = YAML(typ="safe").load(QUICKSTART.read_text())
    return doc["spec"]


def populate(store: Store, name: str = "quickstart", steps: int = 6) -> WorkerRef:
    """A run as the controller and its actor leave it mid-training."""
    store.apply_run(name, _spec(name))
    ref = actor(store, name)
    rollout = store.create_worker(name, "rollout", 0, "local", lease_seconds=30)
    store.heartbeat(WorkerRef(name, "rollout", 0, rollout.incarnation), step=steps, weight_version=steps)
    for step in range(1, steps + 1):
        store.add_metrics(ref, step, {"reward": step / 10, "loss": 1.0 / step, "kl": 0.01})
    store.record_checkpoint(ref, 5, f"/home/u/.mortal/runs/{name}/checkpoints/step-5-i1", 5)
    store.add_event(name, "Normal", "WorkerStarted", "actor-0 started (incarnation 1)")
    store.add_event(name, "Warning", "WorkerLost", "rollout-1 lost: no heartbeat for 10s <b>")
    prompt = "user: What is 13 + 14?"
    for step in (5, steps):
        store.add_completions(
            ref,
            step,
            [
                NewCompletion(
                    sample=0,
                    prompt=prompt,
                    completion="27",
                    rewards={"correct_answer": 1.0},
                    reward=1.2,
                    advantage=0.8,
                    weight_version=step,
                ),
                NewCompletion(
                    sample=1,
                    prompt=prompt,
                    completion=SCRIPT,
                    rewards={"correct_answer": 0.0},
                    reward=-0.1,
                    advantage=-0.9,
                    weight_version=step,
                ),
                NewCompletion(
                    sample=2,
                    prompt=prompt,
                    completion="twenty-seven",
                    rewards={"correct_answer": 0.0},
                    reward=0.3,
                    advantage=0.1,
                    weight_version=step,
                ),
                NewCompletion(
                    sample=3,
                    prompt=prompt,
                    completion="unscored",
                    rewards={"correct_answer": None},
                    reward=None,
                    advantage=None,
                    weight_version=step,
                ),
            ],
        )
    set_status(
        store,
        name,
        phase="Running",
        observedGeneration=1,
        step=steps,
        weightVersion=steps,
        reward=0.6,
        conditions=[
            {"type": "Ready", "status": "True", "reason": "WorkersReady", "message": "all ready"},
            {
                "type": "RewardHealthy",
                "status": "False",
                "reason": "RewardStuck",
                "message": "correct_answer gave every sample 0.0",
            },
            {"type": "Progressing", "status": "True", "reason": "StepEnded", "message": ""},
        ],
    )
    return ref


@contextmanager
def dashboard(url: str) -> Iterator[tuple[str, ReadOnlyStore]]:
    store = open_read_only(url)
    try:
        with serve(store, port=0, refresh_seconds=1) as served:
            yield served, store
    finally:
        store.close()


@pytest.fixture
def populated(store_url: str) -> str:
    store = open_store(store_url)
    try:
        populate(store)
    finally:
        store.close()
    return store_url


def _engine(store: ReadOnlyStore):
    return store._store._engine


@contextmanager
def statements(store: ReadOnlyStore) -> Iterator[list[str]]:
    """Every SQL statement the dashboard's store sends while the block runs."""
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        seen.append(" ".join(statement.split()))

    engine = _engine(store)
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def _queries(seen: list[str]) -> list[str]:
    return [s for s in seen if s.upper().startswith("SELECT")]


def _writes(seen: list[str]) -> list[str]:
    return [s for s in seen if re.match(r"(INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|REPLACE)\b", s, re.I)]


def test_pages_and_json_show_the_run_and_escape_model_text(populated: str) -> None:
    with dashboard(populated) as (url, _):
        index = requests.get(url + "/", timeout=10)
        assert index.status_code == 200 and index.headers["Content-Type"].startswith("text/html")
        assert "script-src 'self'" in index.headers["Content-Security-Policy"]
        assert 'href="/runs/quickstart"' in index.text and "Running" in index.text and "6/30" in index.text
        assert '<span class="badge bad" title="RewardHealthy=False: RewardStuck' in index.text
        assert "0.600" in index.text

        runs = requests.get(url + "/api/runs", timeout=10).json()
        [item] = runs["items"]
        assert (item["name"], item["phase"], item["step"], item["maxSteps"], item["reward"]) == (
            "quickstart",
            "Running",
            6,
            30,
            0.6,
        )
        assert [(c["type"], c["status"]) for c in item["conditions"]] == [
            ("Ready", "True"),
            ("RewardHealthy", "False"),
            ("Progressing", "True"),
        ]

        page = requests.get(url + "/runs/quickstart", timeout=10)
        assert page.status_code == 200
        text = page.text
        for shown in (
            "<svg",
            "reward <span class=latest>step 6: 0.6</span>",
            "loss <span class=latest>step 6: 0.1667",
            "WorkerLost",
            "rollout-1 lost: no heartbeat for 10s &lt;b&gt;",
            "step-5-i1",
            "Completions of step 6",
            "4 samples, 1 unscored",
            "<td>rollout</td>",
            "<td>actor</td>",
        ):
            assert shown in text, shown
        assert SCRIPT not in text and "<script>document" not in text and "<img src=x" not in text
        assert esc(SCRIPT) in text
        assert text.count("<script") == 1  # the dashboard's own file, nothing else

        worst, best = text.index("worst 3"), text.index("best 3")
        assert worst < text.index(esc(SCRIPT)) < best  # reward -0.1 is the worst
        assert "<pre>unscored</pre>" not in text  # an unscored sample is neither worst nor best

        doc = requests.get(url + "/api/runs/quickstart?step=5&k=1", timeout=10)
        assert doc.headers["Content-Type"] == "application/json"
        assert "<" not in doc.text  # model text in JSON is \\u003c-escaped wherever it is pasted
        body = doc.json()
        assert body["completions"]["step"] == 5 and body["completions"]["steps"] == [5, 6]
        assert [c["completion"] for c in body["completions"]["worst"]] == [
            SCRIPT
        ]  # the text itself, unharmed
        assert [c["completion"] for c in body["completions"]["best"]] == ["27"]
        assert body["curves"]["reward"] == [[s, s / 10] for s in range(1, 7)]
        assert "kl" not in body["curves"]
        assert [
            (w["role"], w["replica"], w["incarnation"], w["state"], w["gpu"]) for w in body["workers"]
        ] == [("actor", 0, 1, "Running", "none"), ("rollout", 0, 2, "Running", "none")]
        assert [c["step"] for c in body["checkpoints"]] == [5]
        assert [e["reason"] for e in body["events"]] == ["WorkerLost", "WorkerStarted"]  # newest first
        assert "sections" not in body

        sections = requests.get(url + "/api/runs/quickstart?sections=1", timeout=10).json()["sections"]
        assert set(sections) == {"summary", "curves", "workers", "checkpoints", "events", "completions"}
        assert esc(SCRIPT) in sections["completions"] and SCRIPT not in sections["completions"]

        assert (
            requests.get(url + "/static/dashboard.js", timeout=10)
            .headers["Content-Type"]
            .startswith("text/javascript")
        )
        assert requests.get(url + "/static/dashboard.css", timeout=10).status_code == 200


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_bad_requests_answer_without_a_trace(populated: str) -> None:
    with dashboard(populated) as (url, _):
        missing = requests.get(url + "/runs/nope", timeout=10)
        assert missing.status_code == 404 and "trainingrun &#x27;nope&#x27; not found" in missing.text
        assert requests.get(url + "/api/runs/nope", timeout=10).json() == {
            "error": "trainingrun 'nope' not found"
        }
        no_step = requests.get(url + "/api/runs/quickstart?step=3", timeout=10)
        assert no_step.status_code == 400 and "no completions at step 3" in no_step.json()["error"]
        assert requests.get(url + "/api/runs/quickstart?step=x", timeout=10).status_code == 400
        assert requests.get(url + "/api/runs/quickstart?k=0", timeout=10).status_code == 400
        assert requests.get(url + "/static/../state.db", timeout=10).status_code == 404
        assert requests.get(url + "/nothing", timeout=10).status_code == 404
        assert requests.post(url + "/api/runs", timeout=10).status_code == 405


def test_on_loopback_only_requests_naming_localhost_are_answered(populated: str) -> None:
    """DNS rebinding: a web page whose own name was made to resolve to 127.0.0.1 sends that name as Host;
    the dashboard, listening on loopback, answers only to localhost and loopback addresses."""
    with dashboard(populated) as (url, _):
        port = url.rsplit(":", 1)[1]
        evil = requests.get(url + "/api/runs", headers={"Host": f"evil.example.com:{port}"}, timeout=10)
        assert evil.status_code == 403 and "quickstart" not in evil.text
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST"):
            assert requests.get(url + "/api/runs", headers={"Host": host}, timeout=10).status_code == 200


@pytest.mark.parametrize(
    "store_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_read_only_and_a_bounded_number_of_statements_per_refresh(store_url: str) -> None:
    writer = open_store(store_url)
    populate(writer, "a")
    with dashboard(store_url) as (url, store):
        assert not any(
            hasattr(store, m)
            for m in (
                "apply_run",
                "write_status",
                "add_event",
                "add_metrics",
                "create_worker",
                "heartbeat",
                "purge_run",
                "migrate",
            )
        )
        with statements(store) as seen:
            requests.get(url + "/api/runs?sections=1", timeout=10).raise_for_status()
        one_run_list = _queries(seen)
        with statements(store) as seen:
            requests.get(url + "/api/runs/a?sections=1", timeout=10).raise_for_status()
        one_run_page = _queries(seen)

        for name in ("b", "c", "d"):  # more runs, each with more rows: a refresh costs the same
            populate(writer, name, steps=20)
        ref = WorkerRef("a", "actor", 0, 1)
        for step in range(7, 40):
            writer.add_metrics(ref, step, {"reward": 0.5, "loss": 0.5})
        with statements(store) as seen:
            for path in (
                "/",
                "/api/runs?sections=1",
                "/runs/a",
                "/api/runs/a?sections=1",
                "/api/runs/a?step=5",
            ):
                requests.get(url + path, timeout=10).raise_for_status()
        assert _writes(seen) == []
        queries = _queries(seen)
    writer.close()

    assert len(one_run_list) == 1, one_run_list  # list_runs, whatever the number of runs
    # runs, metrics, events, workers, checkpoints: one each; completions: its steps, then one step's samples
    assert len(one_run_page) == 7, one_run_page
    assert len(queries) == 2 * 1 + 3 * 7, queries


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_nothing_is_written_the_row_counts_stay(populated: str) -> None:
    from sqlalchemy import text

    def counts() -> dict[str, int]:
        store = open_store(populated)
        try:
            with store._engine.connect() as conn:
                return {
                    t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()
                    for t in ("runs", "workers", "events", "metrics", "checkpoints", "completions")
                }
        finally:
            store.close()

    before = counts()
    db = Path(populated.removeprefix("sqlite:///"))
    with dashboard(populated) as (url, _):
        for path in ("/", "/runs/quickstart", "/api/runs/quickstart?step=5", "/api/runs?sections=1"):
            requests.get(url + path, timeout=10).raise_for_status()
    assert counts() == before and all(before.values())
    assert db.exists()


def test_an_unmigrated_or_missing_store_is_refused_not_created(mortal_home: Path) -> None:
    from mortal.client.cli.context import CliError

    missing = mortal_home / "nothing" / "state.db"
    with pytest.raises(CliError, match="no state store at"):
        open_read_only(f"sqlite:///{missing}")
    assert not missing.parent.exists()
    empty = mortal_home / "empty.db"
    import sqlite3

    sqlite3.connect(empty).close()
    with pytest.raises(CliError, match="the dashboard never migrates"):
        open_read_only(f"sqlite:///{empty}")


def test_a_port_in_use_is_a_clear_error_naming_the_flag(populated: str) -> None:
    import socket

    from typer.testing import CliRunner

    from mortal.client.cli.main import app

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["--state-url", populated, "dashboard", "--port", str(port)])
    assert result.exit_code == 1, result.output
    assert (
        f"--port {port}" in result.output and "in use" in result.output and "Traceback" not in result.output
    )


def test_listening_beyond_loopback_warns_that_anyone_reaching_it_reads_the_store(
    populated: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from mortal.client.cli import dashboard as command
    from mortal.client.cli.main import app

    def ctrl_c() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "wait_for_ctrl_c", ctrl_c)
    wide = CliRunner().invoke(
        app, ["--state-url", populated, "dashboard", "--host", "0.0.0.0", "--port", "0"]
    )
    assert (
        wide.exit_code == 0 and "warning: --host 0.0.0.0: anyone who reaches this address" in wide.stderr
    ), (wide.output, wide.exception)
    here = CliRunner().invoke(app, ["--state-url", populated, "dashboard", "--port", "0"])
    assert here.exit_code == 0 and "warning" not in here.stderr


def test_as_a_process_on_the_port_it_was_given(populated: str, mortal_home: Path) -> None:
    """`mortalctl dashboard --port P` as a user starts it: it serves the store until it is stopped."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MORTAL_STATE_URL": populated}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mortal.client.cli.main", "dashboard", "--port", str(port)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                answer = requests.get(f"http://127.0.0.1:{port}/api/runs", timeout=2)
                break
            except requests.ConnectionError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the dashboard did not start within 30 s"
                time.sleep(0.2)
        assert [r["name"] for r in answer.json()["items"]] == ["quickstart"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert f"mortal dashboard at http://127.0.0.1:{port}/" in (proc.stderr.read() if proc.stderr else "")


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs a headless chromium")
@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_browser_runs_no_model_text_and_draws_the_page(populated: str, tmp_path: Path) -> None:
    """Chromium loads the run's page (its script refreshes the sections once): the completion's <script>
    stays text (the title is the dashboard's), the curves and sections are there."""
    with dashboard(populated) as (url, _):
        out = subprocess.run(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                f"--user-data-dir={tmp_path}",
                "--virtual-time-budget=3000",
                "--dump-dom",
                url + "/runs/quickstart",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    dom = out.stdout
    assert "<title>quickstart · mortal</title>" in dom, out.stderr[-2000:]
    assert "pwned" not in dom.split("</title>")[0]
    assert "<polyline" in dom and "Completions of step 6" in dom
    assert "live · " in dom  # the script refreshed the sections from the JSON endpoint
    assert "&lt;script&gt;document.title" in dom


@pytest.mark.parametrize(
    "phase, condition, status, shown",
    [
        ("Running", "Ready", "True", "ok"),
        ("Running", "RewardHealthy", "False", "bad"),
        ("Running", "Progressing", "Unknown", "unknown"),
        ("Recovering", "Ready", "False", "bad"),  # workers are missing
        ("Starting", "Ready", "False", "neutral"),  # not yet: expected
        ("Suspended", "Ready", "False", "neutral"),
        ("Succeeded", "Ready", "False", "neutral"),  # it finished: not an error
        ("Succeeded", "Progressing", "True", "neutral"),  # nor good news after the end
        ("Succeeded", "RewardHealthy", "False", "neutral"),
        ("Failed", "Ready", "False", "neutral"),
        ("Failed", "RewardHealthy", "False", "bad"),  # may say why it failed
        ("Failed", "WeightsInSync", "True", "neutral"),
    ],
)
def test_condition_colour_follows_the_run_phase(phase, condition, status, shown):
    from mortal.client.cli.dashboard_html import condition_class

    assert condition_class({"type": condition, "status": status, "reason": "R"}, phase) == shown


def test_checkpoint_paths_may_wrap_after_each_slash():
    from mortal.client.cli.dashboard_html import run_sections

    view = {
        "run": {
            "name": "a",
            "phase": "Succeeded",
            "step": 1,
            "maxSteps": 1,
            "reward": None,
            "age": "1s",
            "conditions": [],
        },
        "curves": {},
        "events": [],
        "workers": [],
        "checkpoints": [{"step": 1, "weightVersion": 1, "path": "/very/long/<b>/step-1", "age": "1s"}],
        "completions": {"step": None},
    }
    assert (
        "<code>/<wbr>very/<wbr>long/<wbr>&lt;b&gt;/<wbr>step-1</code>"
        in run_sections(view, False, 3)["checkpoints"]
    )
    css = (
        Path(__file__).resolve().parents[3] / "mortal/client/cli/dashboard_static/dashboard.css"
    ).read_text()
    assert ".columns > section { min-width: 0;" in css  # a grid cell may shrink below its widest path


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_long_text_is_cut_with_a_marker_and_its_endpoint_returns_it_whole(populated: str) -> None:
    from mortal.client.cli.dashboard_data import TEXT_SHOWN

    huge = "x" * (3 * 1024 * 1024) + "<script>END</script>"
    writer = open_store(populated)
    try:
        event = writer.add_event("quickstart", "Warning", "Huge", huge)
        ref = WorkerRef("quickstart", "actor", 0, 1)
        writer.add_completions(
            ref,
            7,
            [
                NewCompletion(
                    sample=0,
                    prompt="p",
                    completion=huge,
                    rewards={"c": 1.0},
                    reward=1.0,
                    advantage=0.0,
                    weight_version=7,
                )
            ],
        )
    finally:
        writer.close()
    with dashboard(populated) as (url, _):
        refresh = requests.get(url + "/api/runs/quickstart?sections=1&step=7", timeout=30)
        assert len(refresh.content) < 100_000  # a page's worth, not the megabytes stored
        body = refresh.json()
        [shown] = [e for e in body["events"] if e["reason"] == "Huge"]
        marker = (
            f"… [cut: {len(huge):,} characters in all; the full text: /api/runs/quickstart/events/{event.id}]"
        )
        assert shown["message"] == "x" * TEXT_SHOWN + marker
        assert esc(marker) in body["sections"]["events"]
        assert body["completions"]["best"][0]["completion"].endswith("/api/runs/quickstart/completions/7/0]")

        whole = requests.get(url + f"/api/runs/quickstart/events/{event.id}", timeout=30).json()
        assert whole["message"] == huge
        sample = requests.get(url + "/api/runs/quickstart/completions/7/0", timeout=30).json()
        assert sample["completion"] == huge
        assert requests.get(url + "/api/runs/quickstart/status", timeout=30).json()["name"] == "quickstart"
        assert requests.get(url + "/api/runs/quickstart/events/999999", timeout=30).status_code == 404
        assert requests.get(url + "/api/runs/quickstart/nothing/1", timeout=30).status_code == 404


def _idle_sockets(url: str, count: int) -> list:
    import socket

    host, port = url.removeprefix("http://").split(":")
    return [socket.create_connection((host, int(port)), timeout=5) for _ in range(count)]


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_idle_sockets_do_not_lock_a_new_client_out(populated: str) -> None:
    """200 open connections that send nothing (more than waitress' default limit of 100): a page still
    loads."""
    with dashboard(populated) as (url, _):
        idle = _idle_sockets(url, 200)
        try:
            started = time.monotonic()
            assert requests.get(url + "/api/runs", timeout=10).status_code == 200
            assert time.monotonic() - started < 5
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_past_the_connection_limit_idle_sockets_are_shed(populated: str) -> None:
    store = open_read_only(populated)
    try:
        with serve(store, port=0, idle_seconds=1, connection_limit=20) as url:
            idle = _idle_sockets(url, 40)
            try:
                started = time.monotonic()
                assert requests.get(url + "/api/runs", timeout=15).status_code == 200
                assert time.monotonic() - started < 6  # the idle ones were closed after a second
                assert idle[0].recv(1) == b""  # closed by the server
            finally:
                for sock in idle:
                    sock.close()
    finally:
        store.close()


def test_the_page_script_never_assigns_html():
    """The sections arrive escaped; the script moves parsed nodes in, so store text can only become text
    nodes."""
    script = (
        Path(__file__).resolve().parents[3] / "mortal/client/cli/dashboard_static/dashboard.js"
    ).read_text()
    assert "innerHTML" not in script and "outerHTML" not in script and "DOMParser" in script
