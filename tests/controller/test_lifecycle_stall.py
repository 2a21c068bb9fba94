"""No silent stall: real worker processes (the simulated workload) that block forever are healed.

A reward function that never returns scores None past its timeout and the run trains on the others; rewards
none of whose calls return fail the run; a rollout stuck in a
task is relaunched (its stacks in its log) and its task given to the next; an actor stuck in a step is
relaunched from its checkpoint; the same stall on every launch ends the run Failed with the stall as its
reason. Deadlines of seconds, so each test takes seconds. On SQLite only: the watchdog is the controller's
(tests/store_kinds.py)."""

from __future__ import annotations

import re

from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.state import paths
from mortal.workers.simulated import simulated_run

pytestmark = sqlite_only

STACKS = "--- stacks of every thread"
TIMED_OUT = (
    "rollout-0 #2: reward 'never_returns' did not return within its timeoutSeconds (0.5 s) scoring 2 "
    "completions of step "
)


def condition(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def log_of(name: str, role: str, incarnation: int) -> str:
    path = paths.worker_log(name, role, 0, incarnation)
    return path.read_text() if path.exists() else ""


def test_a_reward_that_never_returns_scores_none_and_the_run_trains_on(harness):  # noqa: F811
    h = harness
    h.apply(
        simulated_run(
            "judge",
            max_steps=3,
            rollout_replicas=1,
            annotations={"mortal.dev/rewards": "call"},
            spec={
                "rewards": [
                    {"function": "mortal.workers.simulated:never_returns", "timeoutSeconds": 0.5},
                    {"function": "mortal.workers.rewards.builtin:format_number"},
                ]
            },
        )
    )
    h.start()
    final = h.wait_phase("judge", "Succeeded", timeout=90)
    assert final["restarts"] == 0
    events = sorted(e.message for e in h.store.list_events("judge", limit=200) if e.reason == "RewardTimeout")
    assert [e.type for e in h.store.list_events("judge", limit=200) if e.reason == "RewardTimeout"] == [
        "Warning"
    ] * 3
    assert [m[: len(TIMED_OUT) + 1] for m in events] == [
        f"{TIMED_OUT}{s}" for s in (1, 2, 3)
    ]  # one a step, not a call
    rollout = [w for w in h.store.list_workers("judge") if w.role == "rollout"][0]
    assert STACKS in log_of("judge", "rollout", rollout.incarnation)
    assert "never_returns" in log_of("judge", "rollout", rollout.incarnation)  # the stuck frame is named


def test_rewards_none_of_whose_calls_return_fail_the_run_with_the_reason(harness):  # noqa: F811
    h = harness
    h.apply(
        simulated_run(
            "silent",
            max_steps=6,
            rollout_replicas=1,
            annotations={"mortal.dev/rewards": "call"},
            spec={"rewards": [{"function": "mortal.workers.simulated:never_returns", "timeoutSeconds": 0.2}]},
        )
    )
    h.start()
    final = h.wait_phase("silent", "Failed", timeout=90)
    failed = condition(final, "Failed")
    assert re.match(
        r"rollout-0 failed: RewardTimedOut: reward 'never_returns' \(0.2 s\) did not return within its "
        r"timeoutSeconds on any of \d+ calls for 3 steps in a row \(steps \d+-\d+\): every completion "
        "scored None",
        failed["message"],
    )
    reward = condition(final, "RewardHealthy")
    assert (reward["status"], reward["reason"]) == ("False", "RewardTimedOut")
    assert final["restarts"] == 0  # relaunching would not make it answer


def test_a_rollout_stuck_in_a_task_is_relaunched_and_the_run_completes(harness):  # noqa: F811
    h = harness
    h.apply(
        simulated_run(
            "stuck",
            max_steps=4,
            rollout_replicas=1,
            annotations={"mortal.dev/stall": "task", "mortal.dev/stall-step": "2"},
            spec={"deadlines": {"taskSeconds": 2}, "restartPolicy": {"backoffSeconds": 0.2}},
        )
    )
    h.start()
    final = h.wait_phase("stuck", "Succeeded", timeout=90)
    assert final["restarts"] == 1
    rollouts = [w for w in h.store.list_workers("stuck") if w.role == "rollout"]
    stalled = rollouts[0]
    assert stalled.state == "Failed"
    assert stalled.message.startswith("TaskDeadlineExceeded: task 2.")
    assert "past its deadline of 2 s" in stalled.message
    events = h.store.list_events("stuck", limit=200)
    [warned] = [e for e in events if e.reason == "TaskDeadlineExceeded" and e.message.startswith("rollout-0")]
    assert warned.type == "Warning" and warned.message.startswith(
        f"rollout-0 #{stalled.incarnation}: task 2."
    )
    assert "its stacks are in its log; relaunching it" in warned.message
    [healed] = [e for e in events if e.reason == "Healed"]  # DeadlinesMet True again once a step ended after
    assert healed.type == "Normal" and healed.message.startswith("DeadlinesMet is True: rollout-0 #")
    assert condition(final, "DeadlinesMet")["status"] == "True"
    # faulthandler's answer to the controller's SIGUSR1: every thread's stack, the stuck frame named
    wait_for(
        lambda: "(most recent call first)" in log_of("stuck", "rollout", stalled.incarnation),
        10,
        "the stacks in the log",
    )
    assert "in stall_here" in log_of("stuck", "rollout", stalled.incarnation)


def test_an_actor_stuck_in_a_step_is_relaunched_from_its_checkpoint(harness):  # noqa: F811
    h = harness
    h.apply(
        simulated_run(
            "frozen",
            max_steps=4,
            rollout_replicas=1,
            annotations={"mortal.dev/stall": "step", "mortal.dev/stall-step": "3"},
            spec={"deadlines": {"stepSeconds": 2}, "restartPolicy": {"backoffSeconds": 0.2}},
        )
    )
    h.start()
    final = h.wait_phase("frozen", "Succeeded", timeout=90)
    assert final["restarts"] == 1
    actors = [w for w in h.store.list_workers("frozen") if w.role == "actor"]
    assert actors[0].message.startswith("StepDeadlineExceeded: step 3 has run ")
    assert h.resumed_from("frozen", actors[1].incarnation) == 2


def test_the_same_stall_on_every_launch_fails_the_run_with_the_reason(harness):  # noqa: F811
    h = harness
    h.apply(
        simulated_run(
            "hopeless",
            max_steps=4,
            rollout_replicas=1,
            annotations={
                "mortal.dev/stall": "task",
                "mortal.dev/stall-step": "1",
                "mortal.dev/stall-times": "0",
            },
            spec={
                "deadlines": {"taskSeconds": 1},
                "restartPolicy": {"backoffSeconds": 0.2, "sameFailureLimit": 2},
            },
        )
    )
    h.start()
    final = h.wait_phase("hopeless", "Failed", timeout=90)
    failed = condition(final, "Failed")
    assert failed["reason"] == "TaskDeadlineExceeded"
    assert failed["message"].startswith("rollout-0 stalled 2 times in a row: task 1.")
    met = condition(final, "DeadlinesMet")
    assert (met["status"], met["reason"]) == ("False", "TaskDeadlineExceeded")
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to be stopped")
