"""`mortalctl test reward` and `mortalctl test rollout`: one part of a run tried from its YAML file,
nothing written to the store, every reward's verdict shown (a broken one exits 1 and says why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rollout_helpers import assets_available

HERE = Path(__file__).parent
NOISY = "test_cli_components:noisy_reward"
BROKEN = "test_cli_components:broken_reward"


def noisy_reward(completions, answer, log_extra, **_):
    print(f"checking against {answer[0]}")
    log_extra("seen", [len(completions)])
    return [0.5 for _ in completions]


def broken_reward(completions, **_):
    print("about to fail")
    raise ValueError("no idea how to score this")


UNCACHED = {"name": "example-org/not-on-this-machine"}  # its tokenizer is absent: completion_ids is [] (fast)


@pytest.fixture
def reward_spec(spec_file):
    rewards = [
        {"function": "mortal.workers.rewards.builtin:correct_answer", "weight": 1.0},
        {"function": NOISY, "weight": 0.5},
    ]
    return spec_file("scored", **{"spec.rewards": rewards, "spec.model": UNCACHED})


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_test_reward_shows_each_score_the_weighted_sum_and_what_each_function_printed(
    cli, reward_spec
) -> None:
    result = cli(
        "test",
        "reward",
        "-f",
        str(reward_spec),
        "--completion",
        "27",
        "--row",
        '{"prompt": "What is 13 + 14?", "answer": "27"}',
        "-o",
        "json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["note"].startswith("completion_ids is [] (the model's tokenizer is not on this machine")
    assert [(r["name"], r["score"], r["error"]) for r in doc["rewards"]] == [
        ("correct_answer", 1.0, None),
        ("noisy_reward", 0.5, None),
    ]
    assert doc["weightedSum"] == 1.25
    assert doc["rewards"][1]["stdout"] == "checking against 27\n" and doc["rewards"][1]["logExtra"] == {
        "seen": [1]
    }
    assert cli("get", "runs").output.startswith("No resources found")  # nothing applied


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_test_reward_reports_a_reward_that_raises_and_exits_1(cli, spec_file) -> None:
    path = spec_file(
        "broken", **{"spec.rewards": [{"function": BROKEN}, {"function": NOISY}], "spec.model": UNCACHED}
    )
    result = cli("test", "reward", "-f", str(path), "--completion", "x", "--row", '{"answer": "1"}')
    assert result.exit_code == 1
    assert "raised ValueError: no idea how to score this" in result.output
    assert "--- broken_reward stdout ---\nabout to fail" in result.output
    assert "noisy_reward" in result.output and "0.5" in result.output  # the others still ran


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_test_reward_imports_the_run_s_module_from_this_folder_and_reports_its_sys_exit(
    cli, spec_file, tmp_path, monkeypatch
) -> None:
    """As apply does, `test reward` takes the run's modules from the folder it runs in; a reward that calls
    sys.exit(0) is an error of that reward (exit 1), not a silent success."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "leaving_rewards.py").write_text(
        "import sys\n\ndef stays(completions, **kw):\n    return [1.0]\n\n"
        "def leaves(completions, **kw):\n    sys.exit(0)\n"
    )
    monkeypatch.chdir(project)
    rewards = [{"function": "leaving_rewards:stays"}, {"function": "leaving_rewards:leaves"}]
    path = spec_file("here", **{"spec.rewards": rewards, "spec.model": UNCACHED})
    result = cli("test", "reward", "-f", str(path), "--completion", "27", "-o", "json")
    assert result.exit_code == 1, result.output
    stays, leaves = json.loads(result.stdout)["rewards"]
    assert (stays["score"], stays["error"]) == (1.0, None)
    assert "reward 'leaves'" in leaves["error"] and "raised SystemExit: 0" in leaves["error"]


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--row", "{not json"], "--row: not JSON"),
        (["--row", "[1, 2]"], "--row: a JSON object of dataset columns is needed (got a list)"),
        (["--row", "5000"], "--row 5000: builtin:arith has rows 0..1999"),
        (["--name", "other"], "--name other: "),
    ],
)
def test_test_reward_bad_flags_name_the_flag(cli, reward_spec, args, message) -> None:
    result = cli("test", "reward", "-f", str(reward_spec), "--completion", "x", *args)
    assert result.exit_code == 1 and message in result.output, result.output


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_test_reward_takes_a_dataset_row_by_index_with_its_system_prompt(cli, spec_file) -> None:
    path = spec_file(
        "coder",
        **{
            "spec.dataset": {"name": "builtin:mbpp-mini", "systemPrompt": "Code only."},
            "spec.rewards": [{"env": "code-execution", "name": "tests_passed"}],
            "spec.model": UNCACHED,
        },
    )
    rows = [
        json.loads(line)
        for line in (HERE.parents[2] / "workers" / "builtin_data" / "mbpp-mini.jsonl")
        .read_text()
        .splitlines()
    ]
    right = f"```python\n{rows[0]['solution']}```"
    result = cli("test", "reward", "-f", str(path), "--row", "0", "--completion", right, "-o", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rewards"][0]["score"] == 1.0
    wrong = cli(
        "test", "reward", "-f", str(path), "--row", "0", "--completion", "```python\npass\n```", "-o", "json"
    )
    assert json.loads(wrong.stdout)["rewards"][0]["score"] == 0.0


needs_assets = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


@needs_assets
@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_test_rollout_samples_n_completions_of_a_dataset_row_and_scores_them(
    cli, spec_file, tiny_model
) -> None:
    path = spec_file(
        "tiny",
        **{"spec.model": {"name": str(tiny_model), "dtype": "float32"}, "spec.generation.maxTokens": 5},
    )
    result = cli("test", "rollout", "-f", str(path), "--row", "0", "-n", "3", "-o", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["device"] == "cpu" and len(doc["completions"]) == 3
    assert set(doc["rewards"]) == {"correct_answer", "short_answer"} and len(doc["weightedSums"]) == 3
    again = json.loads(cli("test", "rollout", "-f", str(path), "--row", "0", "-n", "3", "-o", "json").stdout)
    assert again["completions"] == doc["completions"]  # same seed, same completions on CPU
    text = cli("test", "rollout", "-f", str(path), "--prompt", "Say hi.", "-n", "1", "--max-tokens", "3")
    assert text.exit_code == 0 and "--- completion 0 ---" in text.output


@needs_assets
@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_test_rollout_refuses_a_prompt_longer_than_the_model_takes_as_the_run_would(
    cli, spec_file, tiny_model
) -> None:
    path = spec_file("tiny", **{"spec.model": {"name": str(tiny_model), "dtype": "float32"}})
    long_prompt = "hello " * 600  # past the tiny model's positions
    result = cli("test", "rollout", "-f", str(path), "--prompt", long_prompt, "-n", "1", "--max-tokens", "3")
    assert result.exit_code == 1, result.output
    assert "PromptTooLong" in result.output and "exceed the 512 tokens the model takes" in result.output


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give exactly one of --prompt TEXT and --row K"),
        (["--row", "0", "--prompt", "x"], "give exactly one of --prompt TEXT and --row K"),
        (["--row", "0", "-n", "0"], "-n 0: must be at least 1"),
        (["--row", "0", "--device", "tpu"], "--device tpu: choose auto, cpu or cuda"),
    ],
)
def test_test_rollout_bad_flags_name_the_flag(cli, spec_file, args, message) -> None:
    result = cli("test", "rollout", "-f", str(spec_file()), *args)
    assert result.exit_code == 1 and message in result.output, result.output


@needs_assets
def test_test_reward_as_a_user_runs_it(mortal_home, spec_file, tiny_model) -> None:
    path = spec_file("tiny", **{"spec.model": {"name": str(tiny_model)}})
    env = {
        **os.environ,
        "MORTAL_HOME": str(mortal_home),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    args = [
        sys.executable,
        "-m",
        "mortal.client.cli.main",
        "test",
        "reward",
        "-f",
        str(path),
        "--completion",
        "27",
        "--row",
        '{"answer": "27"}',
    ]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:3] == [
        "REWARD           WEIGHT   SCORE   ERROR",
        "correct_answer   1        1            ",
        "short_answer     0.2      1            ",
    ]
    assert (
        "weighted sum: 1.2" in done.stdout and "note" not in done.stdout
    )  # the tiny model's tokenizer is here


@needs_assets
def test_test_rollout_as_a_user_runs_it(mortal_home, spec_file, tiny_model) -> None:
    path = spec_file("tiny", **{"spec.model": {"name": str(tiny_model), "dtype": "float32"}})
    env = {**os.environ, "MORTAL_HOME": str(mortal_home)}
    args = [
        sys.executable,
        "-m",
        "mortal.client.cli.main",
        "test",
        "rollout",
        "-f",
        str(path),
        "--row",
        "1",
        "-n",
        "2",
        "--max-tokens",
        "4",
    ]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("prompt (transformers on cpu): ")
    assert done.stdout.count("--- completion ") == 2 and "correct_answer" in done.stdout


@needs_assets
@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_test_rollout_shows_each_turn_of_a_tool_calling_rollout(cli, scripted_calculator) -> None:
    """The scripted model (conftest.scripted_calculator) calls the calculator, then answers its result."""
    path = scripted_calculator
    doc = json.loads(cli("test", "rollout", "-f", str(path), "--row", "0", "-n", "2", "-o", "json").stdout)
    assert doc["turns"] == [2, 2] and doc["toolCalls"] == [1, 1] and doc["toolFailures"] == [0, 0]
    assert doc["rewards"] == {"correct_answer": [1.0, 1.0]}
    assert [m["role"] for m in doc["messages"][0]] == ["assistant", "tool", "assistant"]
    text = cli("test", "rollout", "-f", str(path), "--row", "0", "-n", "1").output
    assert "[2 turns, 1 tool calls, 0 failed]" in text
    assert "  -> calculator(expression='13 + 14')" in text and "tool calculator: 27" in text


def test_test_rollout_gives_rewards_each_rollouts_own_prompt_as_the_worker_does(cli, calculator_spec) -> None:
    """With an environment, a reward receives each rollout's prompt after its environment's reset appended
    what it returned (the worker's and TRL's contract), not the dataset row's prompt."""
    path = calculator_spec(
        "hinted",
        **{
            "spec.rewards": [{"function": "tool_helpers:saw_the_hint"}],
            "spec.rollout.environment": "tool_helpers:HintingArith",
        },
    )
    doc = json.loads(cli("test", "rollout", "-f", str(path), "--row", "0", "-n", "2", "-o", "json").stdout)
    assert doc["rewards"] == {"saw_the_hint": [1.0, 1.0]}
