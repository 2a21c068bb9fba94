"""Environments as services (spec.rollout.environmentService): instances in child processes (processPool) or
on an environment server (http), behind proxies whose tools are the class's own.

The proxies' tools must give TRL the class's schemas, answer as the in-process instance answers (the same
ToolOutcomes for the same calls), survive a killed process with the rollout's state replayed, kill a call
past its deadline and answer it as failed; the server must check its token, bound its bodies and never run
what is not a tool. The environment classes are in service_environments.py (the children import them).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from rollout_helpers import assets_available
from service_environments import Broken, Ledger
from transformers.utils import get_json_schema

from mortal.specs.training import RolloutSpec
from mortal.workers.rollout.environment_proxy import (
    EnvironmentLost,
    EnvironmentProxy,
    EnvironmentRaised,
    EnvironmentUnreachable,
    ProxySettings,
    proxy_class_described,
    proxy_class_of,
)
from mortal.workers.rollout.environment_schema import describe_class
from mortal.workers.rollout.environment_server import serve
from mortal.workers.rollout.tools import EnvironmentReward, Toolbox, ToolLoadError, environment_methods

LEDGER = "service_environments:Ledger"
TOKEN = "test-token-" + "0" * 20


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _schemas(environment: Any) -> list[dict[str, Any]]:
    return [get_json_schema(method) for method in environment_methods(environment)]


def _rollout(mode: str = "processPool", **service: Any) -> RolloutSpec:
    return RolloutSpec.model_validate(
        {
            "environment": LEDGER,
            "toolTimeoutSeconds": service.pop("toolTimeoutSeconds", 10),
            "environmentService": {"mode": mode, **service},
        }
    )


@pytest.fixture
def pooled() -> Iterator[Toolbox]:
    box = Toolbox.from_spec(_rollout(processes=1))
    yield box
    box.close()


def _pid(box: Toolbox, environment: Any) -> int:
    outcome = box.call(box.tools_for(environment), _call("pid"))
    assert not outcome.failed, outcome
    return int(outcome.content)


class _NoBackend:
    """A backend for proxies whose schemas alone are looked at."""

    def create(self, reference: str, seconds: float) -> Any:
        raise AssertionError("nothing is built")

    alive = request = release = create


def test_proxies_offer_the_classes_tools_with_the_same_schemas_and_names() -> None:
    settings = ProxySettings(_NoBackend(), LEDGER, "test", 1.0, 1.0)
    in_process = Ledger()
    pooled = proxy_class_of(Ledger, settings)()
    # what an environment server sends, through JSON as on the wire
    served = proxy_class_described(json.loads(json.dumps(describe_class(Ledger, LEDGER))), settings)()
    expected = _schemas(in_process)
    assert [s["function"]["name"] for s in expected] == [
        "balance", "crash", "deposit", "fail", "hang", "paint", "pid", "rate", "weigh"
    ]  # fmt: skip
    assert _schemas(pooled) == expected
    assert _schemas(served) == expected
    for proxy in (pooled, served):
        assert type(proxy).__name__ == "Ledger"
        assert callable(proxy.reset) and callable(proxy.get_reward)
        assert "_private" not in dir(type(proxy))
    # the enum, Literal, optional list, tuple, dict and union parameters kept their meaning
    paint = next(s for s in expected if s["function"]["name"] == "paint")["function"]["parameters"]
    assert paint["properties"]["colour"]["enum"] == ["red", "green"]
    assert paint["required"] == ["colour"]


def test_a_type_trl_cannot_describe_fails_on_both_sides() -> None:
    class Odd:
        def reset(self) -> None:
            return None

        def go(self, where: Ledger) -> str:
            """Go.

            Args:
                where: Somewhere.
            """
            return "went"

    settings = ProxySettings(_NoBackend(), "x:Odd", "test", 1.0, 1.0)
    served = proxy_class_described(json.loads(json.dumps(describe_class(Odd, "x:Odd"))), settings)()
    for environment in (Odd(), proxy_class_of(Odd, settings)(), served):
        with pytest.raises(Exception, match="Couldn't convert the type hint"):
            _schemas(environment)


def test_pooled_tools_answer_as_in_process_ones_and_a_killed_process_is_replaced_with_the_state_replayed(
    pooled: Toolbox,
) -> None:
    local = Toolbox(environments={None: Ledger})
    [remote], [here] = pooled.environments_for([None]), local.environments_for([None])
    assert isinstance(remote, EnvironmentProxy) and remote.reset(owner="ann", opening=5) == here.reset(
        owner="ann", opening=5
    )
    calls = [
        _call("deposit", amount=3),
        _call("deposit", amount=4, note="rent"),
        _call("fail", why="the bank is closed"),
        _call("paint", colour="red"),
        _call("balance"),
        _call("nope"),
        {"type": "function", "function": {"name": "deposit", "arguments": "3"}},
    ]
    for call in calls:
        assert pooled.call(pooled.tools_for(remote), call) == local.call(local.tools_for(here), call)
    assert remote.total == 12 and remote.rich is False and remote.get_reward() == 12.0
    assert getattr(remote, "missing", "absent") == "absent"

    first = _pid(pooled, remote)
    os.kill(first, signal.SIGKILL)
    # the next call meets the dead process: a new one is built, reset and both deposits replayed, then it runs
    outcome = pooled.call(pooled.tools_for(remote), _call("deposit", amount=1))
    assert outcome.content == "balance 13" and not outcome.failed
    assert _pid(pooled, remote) != first
    assert remote.get_reward() == 13.0

    remote.reset(owner="bob")  # a reset starts the rollout's record again
    assert pooled.call(pooled.tools_for(remote), _call("balance")).content == "0"


def test_a_call_past_the_deadline_kills_its_process_and_is_answered_as_failed() -> None:
    told: list[str] = []
    box = Toolbox.from_spec(_rollout(processes=1, toolTimeoutSeconds=1.0))
    box.on_timeout = told.append
    try:
        [environment] = box.environments_for([None])
        environment.reset(owner="ann", opening=7)
        tools = box.tools_for(environment)
        before = _pid(box, environment)
        started = time.monotonic()
        outcome = box.call(tools, _call("hang", seconds=60))
        assert outcome.failed and outcome.content == str({"error": "tool hang timed out after 1 s"})
        assert time.monotonic() - started < 10
        assert len(told) == 1 and "toolTimeoutSeconds" in told[0]
        assert "its environment's process was killed" in told[0] and "stacks" not in told[0]
        with pytest.raises(ProcessLookupError):
            os.kill(before, 0)  # killed (and reaped), not left running
        assert box.call(tools, _call("balance")).content == "7"  # rebuilt: reset replayed, the hang not
        assert _pid(box, environment) != before
    finally:
        box.close()


def test_a_process_that_dies_again_fails_the_call_and_raises_for_a_reset(pooled: Toolbox) -> None:
    [environment] = pooled.environments_for([None])
    environment.reset(owner="ann", opening=2)
    outcome = pooled.call(pooled.tools_for(environment), _call("crash"))
    assert outcome.failed and "lost again after it was rebuilt and replayed" in outcome.content
    assert "(killed by signal 9; EOFError)" in outcome.content  # how it ended, read as it died
    assert (
        pooled.call(pooled.tools_for(environment), _call("balance")).content == "2"
    )  # the crash not replayed
    with pytest.raises(EnvironmentLost, match="lost again"):
        environment.reset(owner="crash")


def test_a_class_that_cannot_be_built_fails_the_run_at_start() -> None:
    spec = RolloutSpec.model_validate(
        {"environment": "service_environments:Broken", "environmentService": {"mode": "processPool"}}
    )
    assert Broken.__name__ == "Broken"
    with pytest.raises(ToolLoadError, match="no licence for the simulator") as failed:
        Toolbox.from_spec(spec)
    assert failed.value.reason == "EnvironmentFailed"


def test_the_environment_reward_scores_proxies_of_its_class(pooled: Toolbox) -> None:
    environments = pooled.environments_for([None, None])
    for opening, environment in zip((3, 4), environments, strict=True):
        environment.reset(opening=opening)
    assert EnvironmentReward("r", LEDGER)(["a", "b"], environments) == [3.0, 4.0]
    assert EnvironmentReward("r", LEDGER, importable=False)(["a", "b"], environments) == [3.0, 4.0]
    other = "mortal.workers.rollout.builtin_tools:ArithEnvironment"
    assert EnvironmentReward("r", other)(["a", "b"], environments) == [None, None]
    assert EnvironmentReward("r", other, importable=False)(["a", "b"], environments) == [None, None]


def test_a_dict_of_pooled_environments_shares_one_pool_and_each_reward_scores_its_class() -> None:
    arith = "mortal.workers.rollout.builtin_tools:ArithEnvironment"
    spec = RolloutSpec.model_validate(
        {"environment": {"ledger": LEDGER, "arith": arith}, "environmentService": {"mode": "processPool"}}
    )
    box = Toolbox.from_spec(spec)
    try:
        ledger, sums = box.environments_for(["ledger", "arith"])
        assert (type(ledger).__name__, type(sums).__name__) == ("Ledger", "ArithEnvironment")
        ledger.reset(opening=3)
        sums.reset(answer="2")
        assert box.call(box.tools_for(sums), _call("submit", answer="2")).content == "submitted"
        assert EnvironmentReward("l", LEDGER)(["a", "b"], [ledger, sums]) == [3.0, None]
        assert EnvironmentReward("s", arith, importable=False)(["a", "b"], [ledger, sums]) == [None, 1.0]
    finally:
        box.close()


# -- over HTTP -------------------------------------------------------------------------------------------
class _Served:
    """An environment server on a thread of the test; `stop` ends it (as a crashed server host would)."""

    def __init__(self, port: int = 0) -> None:
        self.server = serve([LEDGER], "127.0.0.1", port, TOKEN, processes=1, max_body_bytes=64 * 1024)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.stopped = False
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.shutdown()
            self.server.server_close()
            self.server.service.close()


@pytest.fixture
def served() -> Iterator[_Served]:
    running = _Served()
    yield running
    running.stop()


@pytest.fixture
def server(served: _Served) -> str:
    return served.url


def test_a_served_environment_runs_end_to_end(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENV_TOKEN", TOKEN)
    box = Toolbox.from_spec(_rollout("http", url=server, tokenEnv="ENV_TOKEN"))
    local = Toolbox(environments={None: Ledger})
    try:
        [remote], [here] = box.environments_for([None]), local.environments_for([None])
        assert type(remote)._mortal_class is None  # built from the server's description alone
        assert _schemas(remote) == _schemas(here)
        assert remote.reset(owner="ann", opening=5) == here.reset(owner="ann", opening=5)
        for call in (
            _call("deposit", amount=3),
            _call("fail", why="closed"),
            _call("paint", colour="green", shade="dark", tags=["x"]),
            _call("nope"),
        ):
            assert box.call(box.tools_for(remote), call) == local.call(local.tools_for(here), call)
        assert remote.total == 8 and remote.get_reward() == 8.0
        assert EnvironmentReward("r", LEDGER, importable=False)(["a"], [remote]) == [8.0]

        # the server's child killed: the server rebuilds the instance and replays the session
        os.kill(_pid(box, remote), signal.SIGKILL)
        assert box.call(box.tools_for(remote), _call("deposit", amount=1)).content == "balance 9"
        # the session lost (closed, expired, a restarted server): the worker builds a new one and replays
        box.service.release(remote._mortal_handle)
        remote._mortal_handle.stale = False  # as if the worker had not noticed
        assert box.call(box.tools_for(remote), _call("deposit", amount=1)).content == "balance 10"
    finally:
        box.close()


def test_the_server_checks_the_token_bounds_bodies_and_runs_only_tools(server: str) -> None:
    http = urllib3.PoolManager(retries=False)

    def post(path: str, body: Any, token: str | None = TOKEN) -> Any:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return http.request("POST", server + path, body=json.dumps(body).encode(), headers=headers)

    assert http.request("GET", server + "/healthz").status == 200
    assert http.request("GET", server + "/v1/environments").status == 401
    assert post("/v1/sessions", {"environment": LEDGER, "timeoutSeconds": 5}, token=None).status == 401
    assert post("/v1/sessions", {"environment": LEDGER, "timeoutSeconds": 5}, token="wrong").status == 401
    refused = post("/v1/sessions", {"environment": "os:system", "timeoutSeconds": 5})
    assert refused.status == 400 and "not served here" in refused.json()["error"]

    created = post("/v1/sessions", {"environment": LEDGER, "timeoutSeconds": 30})
    assert created.status == 200, created.data
    session = created.json()["result"]["session"]
    big = post(f"/v1/sessions/{session}/reset", {"kwargs": {"owner": "x" * 70_000}, "timeoutSeconds": 5})
    assert big.status == 413 and "over the server's 65536-byte limit" in big.json()["error"]
    for method in ("_private", "reset", "__init__", "get_reward"):
        answer = post(f"/v1/sessions/{session}/call", {"method": method, "kwargs": {}, "timeoutSeconds": 5})
        assert answer.status == 400 and "is not a tool" in answer.json()["error"]
    attribute = post(f"/v1/sessions/{session}/attribute", {"name": "__class__", "timeoutSeconds": 5})
    assert attribute.status == 400
    called = post(f"/v1/sessions/{session}/call", {"method": "balance", "kwargs": {}, "timeoutSeconds": 5})
    assert called.json() == {"outcome": "ok", "result": "0"}
    assert post("/v1/sessions/nope/call", {"method": "balance", "timeoutSeconds": 5}).json()["unknownSession"]
    assert post(f"/v1/sessions/{session}/call", {"method": "balance", "timeoutSeconds": -1}).status == 400


def test_a_wrong_token_or_a_class_not_served_fails_the_run_at_start(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENV_TOKEN", "wrong")
    with pytest.raises(ToolLoadError, match="refused the token"):
        Toolbox.from_spec(_rollout("http", url=server, tokenEnv="ENV_TOKEN"))
    monkeypatch.delenv("ENV_TOKEN")
    with pytest.raises(ToolLoadError, match=r"\$ENV_TOKEN is not set") as unset:
        Toolbox.from_spec(_rollout("http", url=server, tokenEnv="ENV_TOKEN"))
    assert unset.value.reason == "SecretMissing"  # the run's reason says what to fix
    monkeypatch.setenv("ENV_TOKEN", TOKEN)
    spec = RolloutSpec.model_validate(
        {
            "environment": "service_environments:Broken",
            "environmentService": {"mode": "http", "url": server, "tokenEnv": "ENV_TOKEN"},
        }
    )
    with pytest.raises(ToolLoadError, match=f"it serves {LEDGER}"):
        Toolbox.from_spec(spec)


def test_a_server_that_is_gone_makes_a_tool_call_a_reward_or_a_reset_relaunch_the_worker(
    served: _Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outage is neither the model's doing (its tool call is not answered with it) nor the user's code
    failing (get_reward does not fail the run): each raises EnvironmentUnreachable, a ServiceOutage."""
    monkeypatch.setenv("ENV_TOKEN", TOKEN)
    box = Toolbox.from_spec(_rollout("http", url=served.url, tokenEnv="ENV_TOKEN"))
    try:
        [environment] = box.environments_for([None])
        environment.reset(owner="ann")
        served.stop()
        with pytest.raises(EnvironmentUnreachable, match="is unreachable"):
            box.call(box.tools_for(environment), _call("balance"))
        with pytest.raises(EnvironmentUnreachable, match="is unreachable"):
            EnvironmentReward("Ledger")(["done"], [environment])
        with pytest.raises(EnvironmentUnreachable, match="lost again"):
            environment.reset(owner="bob")
    finally:
        box.close()


def test_a_worker_starting_while_the_server_is_down_waits_for_it_then_ends_to_be_relaunched_not_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An outage is not the run's fault: the start asks again while nothing answers, and past its wait ends
    the worker with EnvironmentUnreachable (a crash, relaunched under restartPolicy), not a fatal error."""
    import socket

    from mortal.workers.rollout import tools

    with socket.socket() as probe:  # a port where nothing listens yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("ENV_TOKEN", TOKEN)
    spec = _rollout("http", url=f"http://127.0.0.1:{port}", tokenEnv="ENV_TOKEN")
    monkeypatch.setattr(tools, "UNREACHABLE_WAIT_SECONDS", 0.5)
    with pytest.raises(EnvironmentUnreachable) as raised:
        Toolbox.from_spec(spec)
    assert not isinstance(raised.value, ToolLoadError)

    monkeypatch.setattr(tools, "UNREACHABLE_WAIT_SECONDS", 60.0)
    back: list[_Served] = []
    starter = threading.Timer(1.0, lambda: back.append(_Served(port)))  # the server is back meanwhile
    starter.start()
    try:
        box = Toolbox.from_spec(spec)
        assert back, "the worker started before the server was back"
        box.close()
    finally:
        starter.join()
        for running in back:
            running.stop()


# -- through the tool loop -------------------------------------------------------------------------------
@pytest.mark.skipif(not assets_available(), reason="needs the test assets (SmolLM2's tokenizer)")
def test_the_tool_loop_with_a_pooled_environment_gives_the_in_process_rollouts_and_rewards() -> None:
    """ArithScript calls the calculator, submits its result to ArithEnvironment, then answers: ids, masks,
    messages and get_reward must be the same whether the environment lives in the worker or a child."""
    from tool_helpers import ArithScript, smollm2_tokenizer

    from mortal.workers.messages import RolloutRequest
    from mortal.workers.rollout.engines import GenerationParams
    from mortal.workers.rollout.multiturn import MultiTurn

    tokenizer = smollm2_tokenizer()
    arith = "mortal.workers.rollout.builtin_tools:ArithEnvironment"
    requests = [
        RolloutRequest(
            prompt=[{"role": "user", "content": f"What is {a} + {b}?"}],
            row={"answer": str(a + b), "prompt": "x"},
            num_generations=2,
            seed=a,
        )
        for a, b in ((2, 3), (40, 2))
    ]

    def run(mode: str) -> tuple[list[Any], list[Any]]:
        spec = RolloutSpec.model_validate(
            {
                "tools": ["mortal.workers.rollout.builtin_tools:calculator"],
                "environment": arith,
                "environmentService": {"mode": mode, **({"processes": 2} if mode == "processPool" else {})},
            }
        )
        box = Toolbox.from_spec(spec)
        try:
            loop = MultiTurn(
                ArithScript(tokenizer), tokenizer, box, GenerationParams(max_tokens=160), "qwen2_5"
            )
            rollouts = [r for group in loop.rollouts(requests) for r in group]
            kept = [(r.completion_ids, r.mask, r.messages, r.tool_calls, r.tool_failures) for r in rollouts]
            scores = EnvironmentReward("ArithEnvironment", arith)(
                [r.messages for r in rollouts], [r.environment for r in rollouts]
            )
            return kept, scores
        finally:
            box.close()

    pooled, here = run("processPool"), run("inProcess")
    assert pooled == here, "a pooled environment changed the rollouts"
    assert here[1] == [1.0] * 4 and all(r[3] == 2 for r in here[0])  # calculator, then submit: both ran


@pytest.mark.skipif(not assets_available(), reason="needs the test assets (SmolLM2's tokenizer)")
def test_the_tool_loop_lets_an_unreachable_server_relaunch_the_worker_but_fails_on_a_broken_reset() -> None:
    from tool_helpers import ScriptedEngine, smollm2_tokenizer

    from mortal.workers.errors import FatalWorkerError
    from mortal.workers.messages import RolloutRequest
    from mortal.workers.rollout.engines import GenerationParams
    from mortal.workers.rollout.multiturn import MultiTurn

    class Unreachable:
        def reset(self, **row: Any) -> None:
            raise EnvironmentUnreachable("the environment server at http://envs is unreachable")

    class Broken(Unreachable):
        def reset(self, **row: Any) -> None:
            raise EnvironmentLost("its process died again")

    tokenizer = smollm2_tokenizer()
    request = RolloutRequest(
        prompt=[{"role": "user", "content": "Task: plain."}], row={}, num_generations=1, seed=0
    )

    class RaisedElsewhere(Unreachable):  # a pooled or served environment's own exception, as it comes back
        def reset(self, **row: Any) -> None:
            raise EnvironmentRaised("ConnectionError", "the database is down")

    cases = (
        (Unreachable, EnvironmentUnreachable, "unreachable"),
        (Broken, FatalWorkerError, "raised EnvironmentLost: its process died again"),
        (RaisedElsewhere, FatalWorkerError, "raised ConnectionError: the database is down"),
    )
    for environment, error, says in cases:
        box = Toolbox(environments={None: environment})
        loop = MultiTurn(ScriptedEngine(tokenizer), tokenizer, box, GenerationParams(max_tokens=8), "qwen2_5")
        with pytest.raises(error, match=says):
            loop.rollouts([request])


# -- a whole run -----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not assets_available(), reason="needs the test assets (SmolLM2's tokenizer)")
def test_a_run_with_pooled_environments_trains_and_leaves_no_process_behind(
    sqlite_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout worker (its whole main) builds the pool from the spec, the rollouts' environments live in
    its children, get_reward scores through them, and the worker's end stops them."""
    import psutil
    from actor_helpers import actor_spec, create_run, worker_context
    from rollout_helpers import make_tiny_model
    from tool_helpers import ArithScript

    from mortal.workers.actor import loop as actor
    from mortal.workers.rollout import loop as rollout
    from mortal.workers.runtime import EXIT_SUCCEEDED

    monkeypatch.setattr(rollout, "select_engine", lambda *args, **kwargs: ArithScript)
    arith = "mortal.workers.rollout.builtin_tools:ArithEnvironment"
    spec = actor_spec(
        str(make_tiny_model(tmp_path / "model")),
        generation={"maxTokens": 160, "engine": "transformers"},
        rollout={
            "replicas": 1,
            "tools": ["mortal.workers.rollout.builtin_tools:calculator"],
            "environment": arith,
            "environmentService": {"mode": "processPool", "processes": 2},
            "chatTemplate": "qwen2_5",
            "maxToolCallingIterations": 2,
        },
        rewards=[
            {"function": "actor_helpers:parity_reward"},
            {"env": "environment", "name": "ArithEnvironment", "args": {"class": arith}},
            {"function": "service_environments:served_elsewhere", "weight": 0.0},
        ],
        algorithm={"numGenerations": 4, "batchSize": 8, "maxSteps": 2, "learningRate": 1e-2},
        checkpoint={"every": 2, "keep": 1},
    )
    run = create_run(sqlite_store, "pooled", spec)
    rollout_ctx = worker_context(sqlite_store, run, "rollout", 0)
    exits: list[int] = []
    worker = threading.Thread(target=lambda: exits.append(rollout.main(rollout_ctx)), daemon=True)
    worker.start()
    assert actor.main(worker_context(sqlite_store, run, "actor")) == EXIT_SUCCEEDED
    rollout_ctx.stopping.set()
    worker.join(timeout=60)
    assert exits == [EXIT_SUCCEEDED]
    metrics: dict[int, dict[str, float]] = {}
    for row in sqlite_store.list_metrics("pooled"):
        metrics.setdefault(row.step, {})[row.name] = row.value
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert metrics[step]["rewards/served_elsewhere/mean"] == 1.0
        assert metrics[step]["rewards/ArithEnvironment/mean"] == 1.0  # submitted through a child
        assert metrics[step]["tools/turns"] == 3.0 and metrics[step]["tools/failure_frequency"] == 0.0
    assert [p for p in psutil.Process().children(recursive=True) if "environment_host" in _command(p)] == []


def _command(process: Any) -> str:
    """A child's command line; empty for one that has ended (a zombie another test left unreaped counts as
    ended: it runs nothing)."""
    import psutil

    try:
        return " ".join(process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return ""
