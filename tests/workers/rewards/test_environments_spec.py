"""Built-in environments from a spec: `env:` entries through load_reward, mistakes named by field,
the seed's imports and RewardEnvironment helpers, the code-execution example, and a rollout worker
scoring with the sandbox end to end (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mortal.rewards import SandboxConfig
from mortal.specs import load_file
from mortal.specs.rewards import RewardSpec
from mortal.workers.data import load_rows
from mortal.workers.errors import FatalWorkerError
from mortal.workers.rewards import RewardEnvironment, RewardSet, confinement

REPO = Path(__file__).resolve().parents[3]
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
ROW = {
    "prompt": "Write add(a, b).",
    "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"],
    "answer": "4",
}


@pytest.fixture(autouse=True)
def _sandbox_works() -> None:
    if confinement.probe("bubblewrap") and confinement.probe("unshare"):
        pytest.skip("no sandbox works on this machine (neither bubblewrap nor unshare)")


def reward_set(*entries: dict, run_dir: Path | None = None) -> RewardSet:
    return RewardSet.from_spec([RewardSpec.model_validate(e) for e in entries], max_steps=4, run_dir=run_dir)


def test_env_entries_load_with_args_and_sandbox_and_score(tmp_path: Path) -> None:
    rewards = reward_set(
        {
            "env": "code-execution",
            "name": "tests_passed",
            "args": {"partial_credit": True, "cache": "sqlite"},
            "sandbox": {"timeoutSeconds": 3, "memoryMB": 256},
        },
        {"env": "math-answer", "args": {"answer_column": "answer"}},
        run_dir=tmp_path,
    )
    env = rewards.rewards[0].func
    assert (env.sandbox_config.timeout, env.sandbox_config.memory_mb, env.partial_credit) == (3, 256, True)
    scores = rewards.score(
        ROW["prompt"], [RIGHT, "```python\ndef add(a, b):\n    return 4\n```"], [[1], [2]], ROW
    )
    assert scores == {"tests_passed": [1.0, 0.5], "math-answer": [0.0, 1.0]}
    assert rewards.logs.metrics["code_execution/executions"] == [2.0]
    assert (tmp_path / "rewards.cache.sqlite").is_file()  # cache: sqlite lives in the run's folder


@pytest.mark.parametrize(
    ("entry", "reason", "message"),
    [
        (
            {"env": "code-execution", "args": {"tests_colum": "t"}},
            "RewardBadArgs",
            "spec.rewards[1].args.tests_colum: env code-execution takes no argument 'tests_colum'; "
            "did you mean 'tests_column'?",
        ),
        (
            {"env": "code-execution", "args": {"timeout": 3}},
            "RewardBadArgs",
            "the limits go under `sandbox:`",
        ),
        (
            {"env": "code-execution", "args": {"cache": "disk"}},
            "RewardBadArgs",
            "spec.rewards[1].args: env code-execution: cache must be one of off, memory, sqlite",
        ),
        (
            {"env": "math-answer", "model": "gpt-4o-mini"},
            "RewardBadArgs",
            "spec.rewards[1].model: only env llm-judge reads it",
        ),
        (
            {"env": "llm-judge"},
            "RewardBadArgs",
            "spec.rewards[1].model: env llm-judge needs the judge's model name",
        ),
        (
            {"env": "llm-judge", "model": "m", "apiKeyEnv": "MORTAL_TEST_NO_SUCH_KEY"},
            "RewardSecretMissing",
            "spec.rewards[1].apiKeyEnv: environment variable MORTAL_TEST_NO_SUCH_KEY",
        ),
        ({"env": "llm-judge", "model": "m", "args": {"score_range": [3, 1]}}, "RewardBadArgs", "high > low"),
    ],
)
def test_env_mistakes_are_fatal_and_name_the_field(
    entry: dict, reason: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "set")
    with pytest.raises(FatalWorkerError) as caught:
        reward_set({"env": "math-answer"}, entry)
    assert caught.value.reason == reason and message in caught.value.message
    if reason == "RewardSecretMissing":
        assert "spec.secrets" in caught.value.message


def test_no_sandbox_fails_the_run_when_the_rewards_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(confinement, "_probed", {})
    monkeypatch.setattr(confinement, "bundled_bwrap", lambda: None)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FatalWorkerError) as caught:
        reward_set({"env": "code-execution"})
    assert caught.value.reason == "SandboxUnavailable" and caught.value.message.startswith(
        "spec.rewards[0] (env code-execution)"
    )
    assert reward_set({"env": "code-execution", "args": {"allow_unconfined": True}}).score(
        "p", [RIGHT], [[1]], ROW
    ) == {"code-execution": [1.0]}


class NumpyTestEnv(RewardEnvironment):
    """The seed's custom-sandbox example, with every execution helper."""

    name = "NumpyTest"
    sandbox_config = SandboxConfig(image="debian_slim + numpy (a modal.Image on Modal)", timeout=60)

    def score(self, completion: str, prompt: str, **kwargs) -> float:
        from mortal.rewards.examples import extract_code

        return 1.0 if self.execute_in_sandbox(extract_code(completion)).success else 0.0


def test_the_seed_imports_and_execution_helpers() -> None:
    import mortal
    from mortal.rewards import FunctionConfig
    from mortal.rewards import RewardEnvironment as Facade
    from mortal.rewards.examples import CodeExecutionEnvironment, LLMJudgeEnvironment, MathAnswerEnvironment
    from mortal.workers.rewards import environments

    assert Facade is RewardEnvironment is mortal.RewardEnvironment
    assert CodeExecutionEnvironment is environments.CodeExecutionEnvironment
    assert {LLMJudgeEnvironment.ENV, MathAnswerEnvironment.ENV} == {"llm-judge", "math-answer"}
    env = NumpyTestEnv()
    assert env(
        completions=[
            "```python\nimport numpy\nassert numpy.arange(3).sum() == 3\n```",
            "```python\n1/0\n```",
        ],
        prompts=["p", "p"],
    ) == [1.0, 0.0]
    batch = env.execute_batch_in_sandbox(["print(1)", "print(2)"])
    assert [r.stdout for r in batch] == ["1\n", "2\n"] and batch[0].confinement != "none"
    trusted = env.execute_in_function("print('trusted')")
    assert trusted.stdout == "trusted\n" and trusted.confinement == "none"
    assert [r.success for r in env.execute_batch_in_function(["pass", "raise SystemExit(2)"])] == [
        True,
        False,
    ]
    env.function_config = FunctionConfig(timeout=0.5)
    assert env.execute_in_function("import time\ntime.sleep(5)").timed_out
    assert SandboxConfig().timeout == 10.0


def test_a_function_environment_keeps_its_sandbox_config_unless_the_spec_changes_it() -> None:
    kept = reward_set({"function": "test_environments_spec:NumpyTestEnv"}).rewards[0].func
    assert kept.sandbox_config.timeout == 60
    changed = (
        reward_set({"function": "test_environments_spec:NumpyTestEnv", "sandbox": {"timeoutSeconds": 2}})
        .rewards[0]
        .func
    )
    assert (changed.sandbox_config.timeout, changed.sandbox_config.memory_mb) == (2, 512)
    assert changed.sandbox_config.image == NumpyTestEnv.sandbox_config.image


def test_the_code_execution_example_loads_its_rewards_and_dataset(mortal_home: Path) -> None:
    [run] = load_file(REPO / "specs" / "examples" / "code-execution.yaml")
    rows = load_rows(run.spec.dataset)
    assert len(rows) >= 40 and run.spec.dataset.name == "builtin:mbpp-mini"
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Answer with one Python code block."}
    rewards = RewardSet.from_spec(run.spec.rewards, run_dir=mortal_home / "runs" / run.name)
    for row in rows[:3]:
        right = f"```python\n{row['solution']}```"
        scores = rewards.score(row["prompt"], [[{"role": "assistant", "content": right}]], [[1]], row)
        assert scores["tests_passed"] == [1.0]


@pytest.mark.slow
def test_a_rollout_worker_scores_with_the_sandbox(sqlite_store, mortal_home: Path, tmp_path: Path) -> None:
    """spec -> load_reward -> sandbox -> score, inside a real rollout worker with a tiny model."""
    from rollout_helpers import (
        arith_task,
        assets_available,
        create_run,
        make_tiny_model,
        new_worker,
        only_result,
        training_spec,
    )
    from rollout_serving import Serving, wait_done

    from mortal.workers.rewards.environments import CodeExecutionEnvironment, extract_code

    if not assets_available():
        pytest.skip("SmolLM2 tokenizer/config assets not found")
    model = make_tiny_model(tmp_path / "tiny")
    rewards = [
        {
            "env": "code-execution",
            "name": "tests_passed",
            "args": {"partial_credit": True, "cache": "sqlite"},
            "sandbox": {"timeoutSeconds": 5},
        }
    ]
    spec = training_spec(
        str(model), rewards=rewards, dataset={"name": "builtin:mbpp-mini"}, generation={"maxTokens": 24}
    )
    run = create_run(sqlite_store, "code", spec)
    rows = load_rows(run.spec.dataset)[:2]
    store = sqlite_store
    store.enqueue_tasks(
        new_worker(store, run, "actor"), [arith_task(1, slot, row) for slot, row in enumerate(rows)]
    )
    with Serving(store, run):
        done = wait_done(store, "code", 1, 2)
    reference = CodeExecutionEnvironment(partial_credit=True, cache="off")
    for task, row in zip(done, rows, strict=True):
        result = only_result(task)
        texts = [c[0]["content"] for c in result.completions]
        assert result.rewards["tests_passed"] == reference(
            completions=texts, prompts=["p"] * 4, tests=[row["tests"]] * 4
        )
        distinct = {extract_code(t) for t in texts} - {""}
        assert result.logged_metrics["code_execution/executions"] == [
            float(len(distinct))
        ]  # one run per distinct code
        assert json.dumps(result.rewards)  # JSON-safe as it travels to the actor
    assert (mortal_home / "runs" / "code" / "rewards.cache.sqlite").is_file()
