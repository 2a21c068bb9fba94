"""Rewards: TRL-style calls, None and NaN, weights by name, RewardEnvironment, every error path."""

from __future__ import annotations

from pathlib import Path

import pytest
import reward_fixtures

from mortal.specs.rewards import RewardSpec
from mortal.workers.deadline import Abandoner, TooManyAbandonedCalls
from mortal.workers.errors import FatalWorkerError, ServiceOutage
from mortal.workers.rewards import RewardEnvironment, RewardSet, Silence, silence_failure
from mortal.workers.rewards import builtin as br

CHAT = [{"role": "user", "content": "What is 1 + 2?"}]
ROW = {"prompt": CHAT, "answer": "3", "level": 1}


def reward_set(*entries: dict, max_steps: int = 10) -> RewardSet:
    return RewardSet.from_spec([RewardSpec.model_validate(e) for e in entries], max_steps=max_steps)


def chat(texts: list[str]) -> list[list[dict]]:
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_functions_are_called_like_trl() -> None:
    reward_fixtures.CALLS.clear()
    rewards = reward_set({"function": "reward_fixtures:record_kwargs"})
    scores = rewards.score(CHAT, chat(["3", "4"]), [[18, 2], [19, 2]], ROW, step=4)
    assert scores == {"record_kwargs": [1.0, 1.0]}
    [call] = reward_fixtures.CALLS
    assert call["prompts"] == [CHAT, CHAT]
    assert call["completions"] == chat(["3", "4"])
    assert call["completion_ids"] == [[18, 2], [19, 2]]
    assert call["answer"] == ["3", "3"] and call["level"] == [1, 1]  # columns repeated per completion
    assert "prompt" not in call  # TRL passes the prompt only as `prompts`
    assert call["trainer_state"].global_step == 4 and call["trainer_state"].max_steps == 10


def test_several_rewards_named_as_the_actor_names_them() -> None:
    rewards = reward_set(
        {"function": "reward_fixtures:length_of_answer"},
        {"function": "reward_fixtures:only_first", "weight": 0.5},
        {"function": "reward_fixtures:only_first", "name": "again"},
        {"function": "reward_fixtures:only_first"},
    )
    scores = rewards.score("What is 1 + 2?", ["3", "x", "y"], [[1], [2], [3]], {"answer": "10"})
    assert list(scores) == ["length_of_answer", "only_first", "again", "only_first_2"]
    assert scores["length_of_answer"] == [2.0, 2.0, 2.0]
    assert scores["only_first"] == [0.5, None, None]  # None = not applicable, as in TRL


def test_nan_becomes_none_and_numpy_results_are_accepted() -> None:
    rewards = reward_set(
        {"function": "reward_fixtures:nan_scores"}, {"function": "reward_fixtures:numpy_scores"}
    )
    assert rewards.score("p", ["a", "b"], [[1], [2]], {}) == {
        "nan_scores": [None, None],
        "numpy_scores": [0.0, 1.0],
    }


def test_args_async_trainer_state_and_logging() -> None:
    rewards = reward_set(
        {"function": "reward_fixtures:scaled", "args": {"scale": 0.25}},
        {"function": "reward_fixtures:async_reward"},
        {"function": "reward_fixtures:step_aware"},
        {"function": "reward_fixtures:logs_things"},
        max_steps=8,
    )
    scores = rewards.score("p", ["a", "b"], [[1], [2]], {}, step=2)
    assert scores == {
        "scaled": [0.25, 0.25],
        "async_reward": [2.0, 2.0],
        "step_aware": [0.25, 0.25],
        "logs_things": [0.0, 0.0],
    }
    assert rewards.logs.metrics == {"my_metric": [3.0]} and rewards.logs.extra == {"my_column": ["x", "x"]}


def test_reward_environment_classes_are_built_with_args() -> None:
    rewards = reward_set(
        {"function": "reward_fixtures:ContainsWord", "args": {"word": "42"}},
        {"function": "reward_fixtures:AnswerInPrompt"},
    )
    scores = rewards.score(CHAT, chat(["it is 42", "no"]), [[1], [2]], ROW)
    assert scores == {"ContainsWord": [1.0, 0.0], "AnswerInPrompt": [1.0, 1.0]}


def test_a_reward_environment_instance_is_a_trl_reward_function() -> None:
    env = reward_fixtures.ContainsWord(word="yes")
    assert env(completions=chat(["yes!", "nope"]), prompts=[CHAT, CHAT], answer=["1", "2"]) == [1.0, 0.0]
    with pytest.raises(NotImplementedError, match="must override score"):
        RewardEnvironment()(completions=["a"], prompts=["p"])


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"function": "no_such_module_xyz:f"}, "cannot import module 'no_such_module_xyz'"),
        ({"function": "reward_fixtures:missing"}, "module reward_fixtures has no attribute missing"),
        ({"function": "reward_fixtures:NOT_CALLABLE"}, "is not callable"),
        ({"function": "reward_fixtures:ContainsWord", "args": {"bad": 1}}, "constructing it with args"),
        ({"env": "code-execution", "args": {"bogus": 1}}, "env code-execution takes no argument 'bogus'"),
    ],
)
def test_loading_errors_are_fatal_and_name_the_entry(entry: dict, message: str) -> None:
    with pytest.raises(FatalWorkerError) as caught:
        reward_set({"function": "reward_fixtures:record_kwargs"}, entry)
    assert message in caught.value.message
    assert "spec.rewards[1]" in caught.value.message


def test_a_reward_module_that_bound_os_exit_at_import_is_named_when_it_calls_it() -> None:
    rewards = reward_set({"function": "reward_binds_exit:exits"})
    with pytest.raises(FatalWorkerError, match=r"reward_binds_exit:exits'\) called os._exit\(4\) at .*:9$"):
        rewards.score("p", ["a", "b"], [[1], [2]], {})


@pytest.mark.parametrize(
    ("function", "reason", "message"),
    [
        (
            "raises",
            "RewardFailed",
            "reward 'raises' (spec.rewards[0].function 'reward_fixtures:raises') raised "
            "ValueError: boom: cannot score this at ",
        ),
        ("wrong_length", "RewardBadOutput", "returned 1 scores for 2 completions"),
        ("not_a_list", "RewardBadOutput", "returned a float; return a list"),
        ("strings", "RewardBadOutput", "returned 'good' (str) at position 0"),
        ("infinite", "RewardBadOutput", "returned inf at position 0; rewards must be finite"),
        ("too_big", "RewardBadOutput", "returned inf at position 0; rewards must be finite"),
        # A reward's own sys.exit(0) once ended the rollout as if it had finished: relaunched in a loop.
        (
            "exits",
            "RewardFailed",
            "reward 'exits' (spec.rewards[0].function 'reward_fixtures:exits') raised SystemExit: 0 at ",
        ),
        ("interrupts", "RewardFailed", "raised KeyboardInterrupt: user ctrl-c at "),
        # os._exit ended the rollout at once, nothing naming the reward
        (
            "exits_at_once",
            "RewardFailed",
            "(spec.rewards[0].function 'reward_fixtures:exits_at_once') called os._exit(3) at "
            # relative to the working folder (a worker's is the run's code snapshot): the author's own path
            f"{Path(reward_fixtures.__file__).relative_to(Path.cwd())}:",
        ),
    ],
)
def test_scoring_errors_are_fatal_with_a_clear_reason(function: str, reason: str, message: str) -> None:
    rewards = reward_set({"function": f"reward_fixtures:{function}"})
    with pytest.raises(FatalWorkerError) as caught:
        rewards.score("p", ["a", "b"], [[1], [2]], {})
    assert caught.value.reason == reason
    assert message in caught.value.message


def test_a_service_outage_in_a_reward_relaunches_the_worker_instead_of_failing_the_run() -> None:
    """A server down is not the reward's fault: ServiceOutage passes through as itself (the worker ends as a
    crash, its task redone), where whatever else a reward raises is fatal."""
    rewards = reward_set({"function": "reward_fixtures:server_down"})
    with pytest.raises(ServiceOutage, match="is unreachable") as caught:
        rewards.score("p", ["a", "b"], [[1], [2]], {})
    assert not isinstance(caught.value, FatalWorkerError)


def test_an_empty_reward_list_is_fatal() -> None:
    with pytest.raises(FatalWorkerError, match="spec.rewards is empty"):
        RewardSet.from_spec([])


def test_builtin_rewards_match_the_anchor() -> None:
    completions = chat(["21", " 21 apples", "I think 20", "twenty-one", "-3"])
    answers = ["21", "21", "21", "21", "-3"]
    assert br.correct_answer(completions, answers) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert br.short_answer(completions) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert br.format_number(completions) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert br.correct_answer(["1,200 it is"], ["1200"]) == [1.0]


def test_math_answer_reads_hash_boxed_or_last_number() -> None:
    texts = ["3 + 4 = 7\n#### 7", "so \\boxed{12}.", "first 3 then 5", "no number", "#### 1,234"]
    assert br.math_answer(texts, ["7", "12", "5", "1", "1234"]) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert br.final_number("#### 7 and later 9") == 7.0


def test_a_spec_stored_with_the_old_builtin_path_still_loads() -> None:
    old = RewardSet.from_spec([RewardSpec(function="mortal.workers.builtin_rewards:correct_answer")])
    assert old.rewards[0].func is br.correct_answer


def test_a_reward_past_its_timeout_scores_none_and_is_told_once_a_step() -> None:
    rewards = reward_set(
        {"function": "mortal.workers.simulated:never_returns", "timeoutSeconds": 0.1},
        {"function": "reward_fixtures:length_of_answer"},
    )
    told = []
    rewards.on_timeout = told.append
    for _ in range(2):
        scores = rewards.score("p", ["3", "4"], [[1], [2]], {"answer": "10"}, step=7)
        assert scores == {
            "never_returns": [None, None],
            "length_of_answer": [2.0, 2.0],
        }  # the others still score
    assert [(t.name, t.seconds, t.completions, t.global_step) for t in told] == [("never_returns", 0.1, 2, 7)]
    assert (
        told[0]
        .describe("rollout-0 #4")
        .startswith(
            "rollout-0 #4: reward 'never_returns' did not return within its timeoutSeconds (0.1 s) scoring 2 "
            "completions of step 8; they score None"  # TRL's global_step 7: the eighth step's batch
        )
    )


def _silence(steps: set[int], calls: int, **timeouts: float) -> Silence:
    return Silence(steps, calls, dict(timeouts) or {"judge": 2.0})


@pytest.mark.parametrize(
    "silence, answered, abandoned_full, says",
    [
        (Silence(), False, True, None),  # nothing timed out
        (_silence({0, 1}, 4), False, False, None),  # two steps without a score: the run trains on
        (
            _silence({0, 1, 2}, 5),
            True,
            False,
            "reward 'judge' (2 s) did not return within its timeoutSeconds on any of 5 calls for 3 steps "
            "in a row (steps 1-3): every completion scored None",
        ),
        (
            _silence({4, 5, 6}, 3, a=1.0, b=5.0),
            True,
            False,
            "rewards 'a' (1 s), 'b' (5 s) did not return within their timeoutSeconds on any of 3 calls",
        ),
        (
            _silence({0}, 8),
            False,
            True,
            "on any of 8 calls since this worker started, and its calls past their deadline fill it (a "
            "fresh worker would start the same way) (step 1)",
        ),
        (_silence({3}, 8), True, True, None),  # a reward answered in this worker: a relaunch may heal it
    ],
)
def test_rewards_that_give_no_score_at_all_fail_the_run(silence, answered, abandoned_full, says) -> None:
    failure = silence_failure(silence, answered, abandoned_full, limit=3)
    assert (failure is None) == (says is None)
    if says is not None:
        assert says in failure and failure.endswith("raise rewards[].timeoutSeconds")


def test_a_reward_that_times_out_on_every_call_fails_the_run_after_steps_in_a_row() -> None:
    rewards = reward_set({"function": "reward_fixtures:answers_only_step_0", "timeoutSeconds": 0.02})
    assert rewards.score("p", ["3", "4"], [[1], [2]], ROW, step=0) == {"answers_only_step_0": [1.0, 1.0]}
    for step in (1, 1, 2):  # two tasks of step 2, one of step 3: scored None, the run trains on
        assert rewards.score("p", ["3", "4"], [[1], [2]], ROW, step=step) == {
            "answers_only_step_0": [None, None]
        }
    with pytest.raises(FatalWorkerError) as caught:
        rewards.score("p", ["3", "4"], [[1], [2]], ROW, step=3)
    assert caught.value.reason == "RewardTimedOut"
    assert (
        "reward 'answers_only_step_0' (0.02 s) did not return within its timeoutSeconds on any of 4 "
        in str(caught.value)
    )
    assert "calls for 3 steps in a row (steps 2-4)" in str(caught.value)


def test_a_reward_that_answers_none_or_another_that_scores_keeps_the_run_training() -> None:
    for other in ("reward_fixtures:not_applicable", "reward_fixtures:length_of_answer"):
        rewards = reward_set(
            {"function": "reward_fixtures:answers_only_step_0", "timeoutSeconds": 0.02}, {"function": other}
        )
        for step in range(1, 5):
            scores = rewards.score("p", ["3"], [[1]], ROW, step=step)
            assert scores["answers_only_step_0"] == [None]


def test_abandoned_calls_filling_a_worker_no_reward_call_ever_answered_in_fail_the_run() -> None:
    rewards = reward_set({"function": "reward_fixtures:answers_only_step_0", "timeoutSeconds": 0.02})
    rewards.abandoner = Abandoner(limit=2)
    for step in (1, 2):
        rewards.score("p", ["3"], [[1]], ROW, step=step)
    with pytest.raises(FatalWorkerError, match="since this worker started") as caught:
        rewards.score("p", ["3"], [[1]], ROW, step=2)
    assert caught.value.reason == "RewardTimedOut"


def test_abandoned_calls_filling_a_worker_whose_reward_answered_before_relaunch_it() -> None:
    rewards = reward_set({"function": "reward_fixtures:answers_only_step_0", "timeoutSeconds": 0.02})
    rewards.abandoner = Abandoner(limit=2)
    for step in (0, 1, 2):
        rewards.score("p", ["3"], [[1]], ROW, step=step)
    with pytest.raises(TooManyAbandonedCalls):  # a fresh worker, as for a reward that hangs now and then
        rewards.score("p", ["3"], [[1]], ROW, step=2)
