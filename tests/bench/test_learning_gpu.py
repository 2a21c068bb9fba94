"""bench/learning_gpu.py's report: the figures issue 14.1 is judged on, from the JSONs of several invocations.

Synthetic curves with known answers: TRL's final reward and spread over every seed, times only from runs that
had their GPU alone (a run with "shares_gpu" counts for its rewards, never its seconds), and when each side's
mean over its seeds first reaches TRL's final (`pooled`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import learning_gpu  # noqa: E402

STEPS = 200


def _write(
    folder: Path,
    name: str,
    side: str,
    seed: int,
    rewards: list[float],
    seconds_a_step: float,
    shares_gpu: bool,
    staleness: int = 0,
    tf32: bool = False,
) -> Path:
    curve = [
        {"step": s, "seconds": 10.0 + s * seconds_a_step, "reward": r} for s, r in enumerate(rewards, start=1)
    ]
    path = folder / f"{name}.json"
    path.write_text(
        json.dumps(
            {
                "seed": seed,
                "staleness": staleness,
                "shares_gpu": shares_gpu,
                "tf32": tf32,
                side: {"curve": curve, "wall_seconds": curve[-1]["seconds"]},
            }
        )
    )
    return path


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    """TRL: two seeds flat at 0.4 and 0.6 (final 0.5, spread 0.2), seed 1 on a shared GPU (its 1 s a step must
    not count). mortal on-policy: two seeds at 0 until step 100 and 1 after; seed 1 on a shared GPU with
    absurd seconds that must not count either."""
    step_up = [0.0] * 99 + [1.0] * (STEPS - 99)
    return [
        _write(tmp_path, "trl_s0", "trl", 0, [0.4] * STEPS, 4.0, shares_gpu=False),
        _write(tmp_path, "trl_s1", "trl", 1, [0.6] * STEPS, 1.0, shares_gpu=True),
        _write(tmp_path, "mortal_s0", "mortal", 0, step_up, 0.5, shares_gpu=False),
        _write(tmp_path, "mortal_s1", "mortal", 1, step_up, 100.0, shares_gpu=True),
    ]


def test_trls_final_and_spread_are_over_every_seed_and_its_wall_time_over_the_timed_ones(runs) -> None:
    out = learning_gpu.report(runs, plot=None)
    assert out["trl_final_reward"] == pytest.approx(0.5) and out["trl_seed_spread"] == pytest.approx(0.2)
    assert out["trl_wall_seconds"] == pytest.approx(10 + STEPS * 4.0)


def test_a_run_that_shared_its_gpu_counts_for_its_reward_not_its_seconds(runs) -> None:
    entries = {e["seed"]: e for e in learning_gpu.report(runs, plot=None)["mortal"]}
    assert entries[0]["seconds_to_trl_final"] == pytest.approx(10 + 109 * 0.5)  # 10 ones of 20 at step 109
    assert entries[1]["seconds_to_trl_final"] is None and entries[1]["wall_seconds"] is None
    assert entries[0]["final_reward"] == entries[1]["final_reward"] == 1.0


def test_pooled_is_when_the_seeds_mean_reaches_trls_final_timed_by_the_runs_that_had_a_gpu_alone(
    runs,
) -> None:
    pooled = learning_gpu.report(runs, plot=None)["pooled"]
    mortal = pooled["mortal maxStaleness 0"]
    assert (mortal["seeds"], mortal["timed_runs"], mortal["step"]) == (2, 1, 109)
    assert mortal["seconds"] == pytest.approx(10 + 109 * 0.5)
    assert mortal["fraction_of_trl_wall"] == pytest.approx((10 + 109 * 0.5) / (10 + STEPS * 4.0))
    assert pooled["trl"]["step"] == learning_gpu.WINDOW  # flat at its mean from the first full window


def test_a_side_whose_mean_never_gets_there_has_no_step_and_no_seconds(tmp_path: Path) -> None:
    paths = [
        _write(tmp_path, "trl", "trl", 0, [0.5] * STEPS, 4.0, shares_gpu=False),
        _write(tmp_path, "mortal", "mortal", 0, [0.2] * STEPS, 0.5, shares_gpu=False),
    ]
    mortal = learning_gpu.report(paths, plot=None)["pooled"]["mortal maxStaleness 0"]
    assert mortal["step"] is None and mortal["seconds"] is None and mortal["fraction_of_trl_wall"] is None


def test_a_report_without_a_trl_run_that_had_its_gpu_alone_is_refused(tmp_path: Path) -> None:
    paths = [_write(tmp_path, "trl", "trl", 0, [0.5] * STEPS, 4.0, shares_gpu=True)]
    with pytest.raises(SystemExit, match="had its GPU alone"):
        learning_gpu.report(paths, plot=None)


def test_runs_with_and_without_tf32_are_not_pooled(tmp_path: Path) -> None:
    paths = [
        _write(tmp_path, "trl", "trl", 0, [0.5] * STEPS, 4.0, shares_gpu=False),
        _write(tmp_path, "mortal_tf32", "mortal", 0, [0.6] * STEPS, 0.5, shares_gpu=False, tf32=True),
    ]
    with pytest.raises(SystemExit, match=r"mixes runs with --tf32 \(mortal_tf32.json\)"):
        learning_gpu.report(paths, plot=None)


def test_the_start_timeline_is_each_milestones_first_log_line_in_seconds_from_the_apply(
    tmp_path: Path,
) -> None:
    from datetime import datetime

    launched = datetime(2026, 11, 28, 18, 39, 15).timestamp()
    (tmp_path / "controller.log").write_text(
        "2026-11-28 18:39:15,500 INFO MainThread mortal.controller: controller "
        "vm:1 started on SqlStore(...)\n"
    )
    (tmp_path / "rollout-0-2.log").write_text(
        "2026-11-28 18:39:16,250 INFO rollout-0#2 mortal.worker: "
        "starting (pid 9, CUDA_VISIBLE_DEVICES='0', 1.1 s after exec)\n"
        "2026-11-28 18:39:20,250 INFO rollout-0#2 mortal.worker: "
        "workload mortal.workers.rollout imported in 3.5 s "
        "(store and context took 0.5 s)\n"
        "Loading weights: 100%|##########| 272/272\n"
        "2026-11-28 18:39:22,000 INFO rollout-0#2 mortal.worker: "
        "engine transformers on cuda in float32 ready in 0.3 s\n"
        "2026-11-28 18:39:31,750 INFO rollout-0#2 mortal.worker: "
        "decode shape 64 rows x 128+96 tokens prepared in 9.6 s\n"
        "2026-11-28 18:39:32,000 INFO rollout-0#2 mortal.worker: task 0.0: 8 prompts, 2000 tokens in 10.0 s\n"
        "2026-11-28 18:39:33,000 INFO rollout-0#2 mortal.worker: task 0.1: 8 prompts, 2000 tokens in 0.3 s\n"
    )
    (tmp_path / "actor-0-1.log").write_text(
        "2026-11-28 18:39:16,500 INFO actor-0#1 mortal.worker: starting (pid 8, CUDA_VISIBLE_DEVICES='0')\n"
        "2026-11-28 18:39:24,000 INFO actor-0#1 mortal.worker: training from step 0 to 200\n"
    )
    logs = learning_gpu.log_lines(
        [
            tmp_path / "controller.log",
            tmp_path / "actor-0-1.log",
            tmp_path / "rollout-0-2.log",
            tmp_path / "rollout-1-3.log",
        ]
    )  # the last: none
    assert learning_gpu.start_timeline(logs, launched) == {
        "controller started": 0.5,
        "actor process started": 1.5,
        "actor built its trainer": 9.0,
        "rollout process started": 1.25,
        "rollout imported its workload": 5.25,
        "rollout engine ready": 7.0,
        "rollout prepared its decode step": 16.75,
        "rollout answered step 1's first task": 17.0,
    }  # no queue-ahead nor actor import line: left out, not guessed


def test_an_earlier_invocations_seeds_count_for_rewards_when_a_seed_rerun_here_replays_step_for_step(
    tmp_path: Path,
) -> None:
    here, earlier = tmp_path / "here", tmp_path / "earlier"
    here.mkdir(), earlier.mkdir()
    paths = [
        _write(here, "trl_s0", "trl", 0, [0.4] * STEPS, 4.0, shares_gpu=False),
        _write(here, "mortal_s0", "mortal", 0, [0.5] * STEPS, 0.5, shares_gpu=False),
    ]
    before = [
        _write(earlier, "trl_s0", "trl", 0, [0.4] * STEPS, 2.0, shares_gpu=False),  # the replayed seed
        _write(earlier, "trl_s1", "trl", 1, [0.6] * STEPS, 1.0, shares_gpu=False),
    ]
    out = learning_gpu.report(paths, plot=None, rewards_only=before)
    assert out["trl_final_reward"] == pytest.approx(0.5)  # seeds 0 (once, not twice) and 1
    assert out["trl_wall_seconds"] == pytest.approx(10 + STEPS * 4.0)  # this invocation's seed 0 only
    assert out["pooled"]["trl"]["seeds"] == 2 and out["pooled"]["trl"]["timed_runs"] == 1


def test_an_earlier_invocations_seeds_are_refused_when_no_seed_replays(tmp_path: Path) -> None:
    here, earlier = tmp_path / "here", tmp_path / "earlier"
    here.mkdir(), earlier.mkdir()
    paths = [_write(here, "trl_s0", "trl", 0, [0.4] * STEPS, 4.0, shares_gpu=False)]
    drifted = [0.4] * (STEPS - 1) + [0.45]
    before = [
        _write(earlier, "trl_s0", "trl", 0, drifted, 4.0, shares_gpu=False),
        _write(earlier, "trl_s1", "trl", 1, [0.6] * STEPS, 4.0, shares_gpu=False),
    ]
    with pytest.raises(
        SystemExit, match=r"--rewards-only trl_s0.json: no trl seed of this invocation replays"
    ):
        learning_gpu.report(paths, plot=None, rewards_only=before)
