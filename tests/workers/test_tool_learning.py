"""The two tool examples learn on CPU: GRPO through mortal's tool loop raises the reward of a model that takes
the rewarded course only some of the time (the calculator: call it; the code agent: fix the code after a
failed run). tests/workers/tool_learning.py says how those models are made, and why not SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rollout_helpers import assets_available

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")

CALCULATOR_STEPS = 16
CODE_STEPS = 8
CODE_TASKS = 6


@pytest.fixture(scope="module")
def calculator_dir(built_once: Any) -> Path:
    """Made once for the session: two tests use it, and pytest-xdist may run them on different workers."""
    from tool_learning import calculator_model

    return built_once("calculator-model", lambda folder: calculator_model(folder / "model"))


def _per_step(store: Any, run: str, name: str) -> list[float]:
    values = {row.step: row.value for row in store.list_metrics(run) if row.name == name}
    return [values[step] for step in sorted(values)]


def _calculator_spec(model: Path, **algorithm: Any) -> dict[str, Any]:
    """The calculator example's tool, template and reward (specs/examples/calculator-tools.yaml) on `model`,
    learning rate 1e-3, sampled at temperature 1 (the default), checkpointed only at the end."""
    from actor_helpers import actor_spec
    from tool_learning import CALCULATOR_PROMPT

    return actor_spec(
        str(model),
        dataset={"name": "builtin:arith", "systemPrompt": CALCULATOR_PROMPT},
        generation={"maxTokens": 48, "engine": "transformers", "temperature": 1.0},
        rollout={
            "replicas": 1,
            "tools": ["mortal.workers.rollout.builtin_tools:calculator"],
            "chatTemplate": "qwen2_5",
            "maxToolCallingIterations": 2,
        },
        rewards=[{"function": "mortal.workers.rewards.builtin:math_answer"}],
        algorithm={"learningRate": 1e-3, **algorithm},
        checkpoint={"every": algorithm["maxSteps"], "keep": 1},
    )


def _train(
    store: Any, name: str, spec: dict[str, Any], reward: str, calls: str
) -> tuple[list[float], list[float], str]:
    """Run the actor and an in-process rollout to maxSteps; the two metrics by step, and both as a message."""
    from actor_helpers import create_run, run_actor_with_rollout

    from mortal.workers.runtime import EXIT_SUCCEEDED

    assert run_actor_with_rollout(store, create_run(store, name, spec)) == EXIT_SUCCEEDED
    rewards, tool_calls = _per_step(store, name, reward), _per_step(store, name, calls)
    shown = f"{reward} by step {[round(r, 2) for r in rewards]}, {calls} {[round(c, 2) for c in tool_calls]}"
    assert len(rewards) == spec["algorithm"]["maxSteps"], shown
    return rewards, tool_calls, shown


def test_grpo_raises_the_calculator_examples_reward_by_calling_the_tool_more(
    sqlite_store: Any, calculator_dir: Path
) -> None:
    """The example's tool, template and reward on the shipped arith data, through the real actor and rollout
    worker: a model that calls the calculator half the time learns to call it nearly always."""
    spec = _calculator_spec(calculator_dir, numGenerations=8, batchSize=64, maxSteps=CALCULATOR_STEPS)
    reward, calls, shown = _train(
        sqlite_store, "calculator", spec, "rewards/math_answer/mean", "tools/call_rate"
    )
    # Step 1 samples the warm start itself. Learning rate 1e-9 (sampling alone, seed 0): reward 0.50 at step 1
    # and 0.51 over the last three steps (three-step means within 0.49-0.62), call rate 0.53 -> 0.49.
    # Warm starts of seeds 0, 1 and 2 learning, step 1 -> the last three: reward 0.50 -> 0.85, 0.48 -> 0.91,
    # 0.47 -> 0.90; call rate 0.53 -> 0.86, 0.52 -> 0.92, 0.50 -> 0.93.
    assert calls[0] < 0.7 and reward[0] < 0.7, f"the warm start already solves it: {shown}"
    assert sum(calls[-3:]) / 3 > max(0.75, calls[0] + 0.2), f"the tool is not called more often: {shown}"
    assert sum(reward[-3:]) / 3 > max(0.75, reward[0] + 0.2), f"the reward did not rise: {shown}"


def test_a_stale_tool_run_is_importance_corrected_over_the_tool_masked_tokens(
    sqlite_store: Any, calculator_dir: Path
) -> None:
    """maxStaleness 1 with tool calls: steps train on rollouts of the version before, and TRL's importance
    ratio is taken over the model's tokens only (tool results carry logprob 0.0 and mask 0)."""
    from actor_helpers import create_run, run_actor_with_rollout

    from mortal.workers.runtime import EXIT_SUCCEEDED

    spec = _calculator_spec(calculator_dir, numGenerations=4, batchSize=16, maxSteps=4, maxStaleness=1)
    run = create_run(sqlite_store, "stale-calculator", spec)
    assert run_actor_with_rollout(sqlite_store, run) == EXIT_SUCCEEDED
    steps = sorted({row.step for row in sqlite_store.list_metrics("stale-calculator")})
    metric = {(row.step, row.name): row.value for row in sqlite_store.list_metrics("stale-calculator")}
    assert steps == [1, 2, 3, 4]
    assert max(metric[s, "staleness/max"] for s in steps) == 1
    assert all(metric[s, "tools/call_rate"] > 0 for s in steps)
    ratios = [metric[s, "sampling/importance_sampling_ratio/mean"] for s in steps]
    # were tool results counted (sampling logprob 0.0, so a ratio of exp(the actor's logprob)), the mean would
    # be well below 0.9
    assert all(0.9 < r < 1.1 for r in ratios), ratios


@pytest.fixture(scope="module")
def code_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first CODE_TASKS rows of builtin:mbpp-mini as a dataset file (the model
    memorises their solutions)."""
    from tool_learning import builtin_rows

    path = tmp_path_factory.mktemp("mbpp") / "mbpp-first.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in builtin_rows("mbpp-mini")[:CODE_TASKS]))
    return path


def test_grpo_teaches_the_code_agent_to_fix_its_code_after_a_failed_run(
    sqlite_store: Any, code_tasks: Path, tmp_path: Path
) -> None:
    """The code-agent example's environment (run_tests in the reward sandbox) and reward, through the real
    actor and rollout worker: a model that fixes its code after the first failure half the time, and gives up
    the other half, learns to fix it."""
    from actor_helpers import actor_spec
    from tool_learning import CODE_AGENT_PROMPT, code_agent_model

    rows = [json.loads(line) for line in code_tasks.read_text().splitlines()]
    model = code_agent_model(tmp_path / "model", rows)
    env = "mortal.workers.rollout.builtin_tools:CodeAgentEnvironment"
    spec = actor_spec(
        str(model),
        dataset={"name": str(code_tasks), "systemPrompt": CODE_AGENT_PROMPT},
        generation={"maxTokens": 384, "engine": "transformers", "temperature": 1.0},
        rollout={
            "replicas": 1,
            "environment": env,
            "chatTemplate": "qwen2_5",
            "maxToolCallingIterations": 3,
            "toolTimeoutSeconds": 30,
        },
        rewards=[{"env": "environment", "name": "CodeAgentEnvironment", "args": {"class": env}}],
        algorithm={"numGenerations": 8, "batchSize": 16, "maxSteps": CODE_STEPS, "learningRate": 5e-4},
        checkpoint={"every": CODE_STEPS, "keep": 1},
    )
    reward, calls, shown = _train(
        sqlite_store, "code-agent", spec, "rewards/CodeAgentEnvironment/mean", "tools/call_frequency"
    )
    # Learning rate 1e-9 (sampling alone): the last four steps' mean reward 0.58, tool calls 1.58 a rollout.
    # Warm starts of seeds 0, 1 and 2 learning: reward 0.38 -> 0.86, 0.50 -> 0.95, 0.56 -> 0.84 (first step ->
    # last four), tool calls 1.38-1.56 -> 2.0-2.46. Above 3e-3 one step of AdamW wipes what the warm start
    # memorised (reward 0 from step 2).
    last = slice(-4, None)
    assert sum(calls[last]) / 4 > 1.85, f"it does not run its code again after a failure more often: {shown}"
    assert sum(reward[last]) / 4 > max(0.75, reward[0] + 0.2), f"the reward did not rise: {shown}"
