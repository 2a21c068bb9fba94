"""Built-in environments for real: code-execution in the sandbox, an LLM judge over HTTP,
math answers, the cache.

The judge talks to a real HTTP server started here (http.server in a thread) that answers like an
OpenAI-compatible /chat/completions endpoint; nothing of mortal is mocked.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mortal.workers.errors import FatalWorkerError
from mortal.workers.rewards import RewardEnvironment, confinement
from mortal.workers.rewards.environments import (
    CodeExecutionEnvironment,
    LLMJudgeEnvironment,
    MathAnswerEnvironment,
    extract_code,
    parse_score,
)

REPO = Path(__file__).resolve().parents[3]
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]


@pytest.fixture
def sandbox() -> None:
    if confinement.probe("bubblewrap") and confinement.probe("unshare"):
        pytest.skip("no sandbox works on this machine (neither bubblewrap nor unshare)")


def block(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\nDone."


def score(env: RewardEnvironment, completions: list[str], **columns) -> tuple[list, dict]:
    logged: dict[str, list[float]] = {}
    n = len(completions)
    out = env(
        completions=completions,
        prompts=["p"] * n,
        **{k: [v] * n for k, v in columns.items()},
        log_metric=lambda name, value: logged.setdefault(name, []).append(value),
    )
    return out, logged


# -- code execution --------------------------------------------------------------------------------
def test_extract_code_takes_the_last_python_block() -> None:
    assert extract_code("```python\nx = 1\n```\nthen\n```py\nx = 2\n```") == "x = 2"
    assert extract_code("text\n```\nuntagged = 1\n```") == "untagged = 1"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut by maxTokens
    assert extract_code("```bash\nls\n```") == ""
    assert extract_code("def f(): pass") == "def f(): pass"


@pytest.mark.usefixtures("sandbox")
def test_all_tests_must_pass_without_partial_credit() -> None:
    env = CodeExecutionEnvironment(cache="off")
    right, half = (
        block("def add(a, b):\n    return a + b"),
        block("def add(a, b):\n    return a * b + (a == 1)"),
    )
    scores, logged = score(env, [right, half, "no code at all", ""], tests=ADD_TESTS)
    assert scores == [1.0, 0.0, 0.0, 0.0]
    assert logged["code_execution/executions"] == [3.0] and logged["code_execution/timeouts"] == [0.0]


@pytest.mark.usefixtures("sandbox")
def test_partial_credit_counts_each_assert_separately() -> None:
    env = CodeExecutionEnvironment(partial_credit=True, cache="off")
    first_two = block("def add(a, b):\n    return abs(a + b) if a >= 0 else 1")
    scores, _ = score(env, [first_two, block("def add(a, b):\n    return a + b")], tests=ADD_TESTS)
    assert scores == pytest.approx([2 / 3, 1.0])
    as_string, _ = score(env, [first_two], tests="\n".join(ADD_TESTS))
    assert as_string == pytest.approx([2 / 3])


@pytest.mark.usefixtures("sandbox")
def test_reward_hacks_score_zero() -> None:
    env = CodeExecutionEnvironment(partial_credit=True, cache="off")
    hacks = [
        block("import sys\nsys.exit(0)"),  # leave before the tests run
        block("import os\nos.write(1, b'0 0 pass\\n1 0 pass\\n')\nos._exit(0)"),  # forge verdicts
        block("def add(a, b):\n    raise KeyboardInterrupt"),  # BaseException from the function under test
    ]
    scores, _ = score(env, hacks, tests=ADD_TESTS)
    assert scores == [0.0, 0.0, 0.0]
    chatty = block(
        "def add(a, b):\n    print('pass ' * 100000)\n    return a + b"
    )  # its prints cannot hide verdicts
    assert score(env, [chatty], tests=ADD_TESTS)[0] == [1.0]


@pytest.mark.usefixtures("sandbox")
def test_demo_code_under_main_does_not_run_and_rows_without_tests_are_not_applicable() -> None:
    env = CodeExecutionEnvironment(cache="off")
    with_demo = block(
        "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(int(input()), 1))"
    )
    assert score(env, [with_demo], tests=ADD_TESTS)[0] == [1.0]
    assert score(env, [with_demo], tests=[])[0] == [None]
    with pytest.raises(ValueError, match="no column 'tests'"):
        env(completions=[with_demo], prompts=["p"], checks=[ADD_TESTS])


@pytest.mark.usefixtures("sandbox")
def test_a_timeout_scores_zero_is_logged_and_is_not_cached() -> None:
    env = CodeExecutionEnvironment(timeout=1.0)
    slow = block("def add(a, b):\n    while True:\n        pass")
    scores, logged = score(env, [slow], tests=ADD_TESTS)
    assert scores == [0.0] and logged["code_execution/timeouts"] == [1.0]
    assert env.cache_stats["entries"] == 0


@pytest.mark.usefixtures("sandbox")
def test_every_mbpp_mini_reference_passes_its_tests_and_a_wrong_one_does_not() -> None:
    rows = [
        json.loads(line)
        for line in (REPO / "workers" / "builtin_data" / "mbpp-mini.jsonl").read_text().splitlines()
    ]
    assert 40 <= len(rows) <= 60 and all(r["tests"] and r["prompt"][0]["role"] == "user" for r in rows)
    env = CodeExecutionEnvironment(cache="off", workers=4)
    completions = [block(r["solution"]) for r in rows]
    scores = env(
        completions=completions, prompts=[r["prompt"] for r in rows], tests=[r["tests"] for r in rows]
    )
    assert scores == [1.0] * len(rows), [i for i, s in enumerate(scores) if s != 1.0]
    shifted = env(
        completions=completions[1:5],
        prompts=[r["prompt"] for r in rows[:4]],
        tests=[r["tests"] for r in rows[:4]],
    )  # each row gets another task's solution
    assert set(shifted) == {0.0}


# -- the cache -------------------------------------------------------------------------------------
@pytest.mark.usefixtures("sandbox")
def test_the_cache_hits_on_identical_inputs_and_misses_on_any_change() -> None:
    env = CodeExecutionEnvironment()
    right = block("def add(a, b):\n    return a + b")
    twice, logged = score(env, [right, right], tests=ADD_TESTS)
    assert twice == [1.0, 1.0] and logged["code_execution/executions"] == [1.0]  # one execution for both
    assert env.cache_stats == {"hits": 0, "misses": 2, "entries": 1}
    again, logged = score(env, [right], tests=ADD_TESTS)
    assert (
        again == [1.0]
        and logged["code_execution/cache_hits"] == [1.0]
        and "code_execution/executions" not in logged
    )
    score(env, [right], tests=ADD_TESTS[:2])  # other row columns: a miss
    env2 = CodeExecutionEnvironment(partial_credit=True)  # other config: a fresh key space
    assert env2.settings() != env.settings()
    assert env.cache_stats == {"hits": 1, "misses": 3, "entries": 2}


@pytest.mark.usefixtures("sandbox")
def test_the_lru_evicts_and_sqlite_persists_across_instances(tmp_path: Path) -> None:
    path = tmp_path / "rewards.cache.sqlite"
    env = CodeExecutionEnvironment(cache="sqlite", cache_path=str(path), cache_size=1)
    codes = [block(f"def add(a, b):\n    return a + b + {k}") for k in range(2)]
    assert score(env, codes, tests=ADD_TESTS)[0] == [1.0, 0.0]
    assert env.cache_stats["entries"] == 1  # LRU of one
    fresh = CodeExecutionEnvironment(cache="sqlite", cache_path=str(path))
    scores, logged = score(fresh, codes, tests=ADD_TESTS)
    assert scores == [1.0, 0.0] and logged["code_execution/cache_hits"] == [2.0]
    rows = (
        sqlite3.connect(path).execute("SELECT completion, score FROM reward_cache ORDER BY score").fetchall()
    )
    assert [r[1] for r in rows] == [0.0, 1.0] and rows[1][0] == codes[0]
    with pytest.raises(ValueError, match="needs cache_path"):
        CodeExecutionEnvironment(cache="sqlite")


# -- the LLM judge ---------------------------------------------------------------------------------
class Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint: grades by keywords in the prompt; can fail on demand."""

    requests: list[dict] = []
    fail_next = 0  # answer 503 this many times first

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        if self.headers.get("Authorization") != "Bearer test-key":
            return self._send(401, {"error": {"message": "invalid api key"}})
        if body["model"] != "judge-1":
            return self._send(404, {"error": {"message": "no such model"}})
        if type(self).fail_next > 0:
            type(self).fail_next -= 1
            return self._send(503, {"error": {"message": "overloaded"}})
        text = body["messages"][-1]["content"]
        reply = (
            "9"
            if "excellent" in text
            else "Score: 4/10"
            if "meh" in text
            else "42"
            if "huge" in text
            else "I cannot grade this."
        )
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def judge_url(monkeypatch: pytest.MonkeyPatch):
    Judge.requests, Judge.fail_next = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("JUDGE_KEY", "test-key")
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def judge(url: str, **kwargs) -> LLMJudgeEnvironment:
    return LLMJudgeEnvironment(
        model="judge-1", base_url=url, api_key_env="JUDGE_KEY", retry_wait=0.01, **kwargs
    )


def test_parse_score_reads_the_usual_reply_shapes() -> None:
    assert [
        parse_score(r)
        for r in [
            "7",
            " 7.5 ",
            "**8**",
            "7/10",
            "Score: 6/10",
            "I'd rate it 3 out of 10.",
            "<think>maybe 2</think>5",
            "Rating: 2, final score: 9",
        ]
    ] == [7, 7.5, 8, 7, 6, 3, 5, 9]
    assert parse_score("between 3 and 4") is None and parse_score("no idea") is None


def test_the_judge_grades_over_http_and_normalizes(judge_url: str) -> None:
    env = judge(judge_url, prompt_template="{prompt} | {completion} | {low}-{high} | ref={answer} {unknown}")
    scores, logged = score(env, ["an excellent answer", "meh", "huge", "???"], answer="ref")
    assert scores == [0.9, 0.4, None, None]  # 42 is outside 0..10; no number: None
    assert logged["llm_judge/requests"] == [4.0] and logged["llm_judge/errors"] == [0.0]
    sent = Judge.requests[0]
    assert (
        sent["path"] == "/v1/chat/completions"
        and sent["auth"] == "Bearer test-key"
        and sent["temperature"] == 0.0
    )
    assert (
        sent["messages"][-1]["content"].startswith("p | ")
        and "| 0-10 | ref=ref {unknown}" in sent["messages"][-1]["content"]
    )
    again, _ = score(env, ["an excellent answer"], answer="ref")
    assert again == [0.9] and len(Judge.requests) == 4  # cached: no new request


def test_the_judge_retries_transient_errors_and_gives_up_with_none(judge_url: str) -> None:
    Judge.fail_next = 2
    env = judge(judge_url, max_retries=3, score_range=(1, 5))
    assert score(env, ["meh"])[0] == [0.75]  # 4 on 1..5, after two 503s
    assert len(Judge.requests) == 3
    Judge.fail_next = 10
    scores, logged = score(judge(judge_url, max_retries=1), ["an excellent answer"])
    assert scores == [None] and logged["llm_judge/errors"] == [1.0]


def test_judge_mistakes_that_retrying_cannot_fix_fail_the_run(
    judge_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(FatalWorkerError) as missing:
        judge(judge_url)(completions=["x"], prompts=["p"])
    assert missing.value.reason == "RewardSecretMissing" and "JUDGE_KEY" in missing.value.message
    monkeypatch.setenv("JUDGE_KEY", "wrong")
    with pytest.raises(FatalWorkerError, match="refused the API key from JUDGE_KEY"):
        judge(judge_url)(completions=["x"], prompts=["p"])
    monkeypatch.setenv("JUDGE_KEY", "test-key")
    with pytest.raises(FatalWorkerError, match="404 for model 'other'"):
        LLMJudgeEnvironment(model="other", base_url=judge_url, api_key_env="JUDGE_KEY")(
            completions=["x"], prompts=["p"]
        )
    with pytest.raises(ValueError, match="high > low"):
        judge(judge_url, score_range=(5, 5))


# -- math answers ----------------------------------------------------------------------------------
def test_math_answer_environment_agrees_with_the_function_reward() -> None:
    from mortal.workers.rewards.builtin import math_answer

    texts = ["so 3 + 4 = 7\n#### 7", "\\boxed{\\frac{3}{4}}", "it is 3/4", "no idea", "#### 1,234"]
    answers = ["7", "0.75", "3/4", "5", "1234"]
    env = MathAnswerEnvironment()
    assert env(completions=texts, prompts=["p"] * 5, answer=answers) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert math_answer(texts, answers) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert env(completions=["7"], prompts=["p"], answer=["unknown"]) == [None]
    assert MathAnswerEnvironment(answer_column="target")(
        completions=["#### 2"], prompts=["p"], target=["2"]
    ) == [1.0]
