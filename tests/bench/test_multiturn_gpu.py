"""bench/multiturn_gpu.py's learning block: TRL's final reward (its last steps' mean) and when each side's
trailing mean first reaches it, in wall seconds from its own launch; its first rollouts, side by side."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import multiturn_gpu  # noqa: E402


def _curve(rewards: list[float], seconds_a_step: float) -> list[dict]:
    return [
        {"step": i + 1, "seconds": (i + 1) * seconds_a_step, multiturn_gpu.CURVE_REWARD: r}
        for i, r in enumerate(rewards)
    ]


def test_each_side_is_timed_to_trls_final_reward_by_its_trailing_mean() -> None:
    trl = _curve([0.0, 0.2, 0.4, 0.6, 0.6, 0.6], seconds_a_step=10.0)  # final (window 2): 0.6, at step 5
    mortal = _curve([0.0, 0.5, 0.7, 0.7, 0.8], seconds_a_step=2.0)  # trailing mean 0.6 at step 3
    block = multiturn_gpu.learning(trl, mortal, window=2)
    assert block["trl_final_reward"] == 0.6 and block["mortal_final_reward"] == 0.75
    assert (block["trl_seconds"], block["mortal_seconds"]) == (50.0, 6.0)
    assert block["seconds_fraction"] == 0.12  # of TRL's time to its final reward
    assert block["of_trl_run"] == 0.1  # of TRL's whole run (60 s)


def test_each_sides_first_rollouts_are_set_beside_the_others_reward_and_tool_calls() -> None:
    """What the speed ratio needs alike: rollouts of (nearly) the warm-started model, on both sides."""
    trl = _curve([2.0, 2.0, 1.0], seconds_a_step=10.0)
    mortal = _curve([1.5, 1.7, 2.0], seconds_a_step=2.0)
    for point, calls in zip(mortal, [1.8, 1.9, 2.0], strict=True):
        point["tools/call_frequency"] = calls
    block = multiturn_gpu.first_rollouts(trl, mortal, window=2)
    assert block["trl"] == {"reward": 2.0, "tool_calls_per_completion": None}
    assert block["mortal"] == {"reward": 1.6, "tool_calls_per_completion": 1.85}


def test_a_side_that_never_reaches_trls_final_reward_has_no_fraction() -> None:
    trl = _curve([0.0, 0.5, 0.9, 0.9], seconds_a_step=10.0)
    mortal = _curve([0.0, 0.1, 0.2, 0.3], seconds_a_step=1.0)
    block = multiturn_gpu.learning(trl, mortal, window=2)
    assert block["mortal_seconds"] is None and block["seconds_fraction"] is None


def test_steps_without_a_logged_reward_are_left_out_and_too_few_say_so() -> None:
    trl = _curve([0.1], seconds_a_step=10.0) + [{"step": 2, "seconds": 20.0}]
    block = multiturn_gpu.learning(trl, _curve([0.1, 0.2], 1.0), window=2)
    assert block == {"window": 2, "too_few_steps": True}


def test_a_side_that_stops_part_way_is_recorded_with_its_steps_and_the_other_side_still_runs(
    monkeypatch, tmp_path: Path
) -> None:
    """TRL's side once stopped on a CUDA assert mid-run: the JSON keeps its steps and the error, mortal's side
    runs after it, and no ratio or learning block compares a finished side with a stopped one."""
    import json

    def trl_stops(model, spec, args, work):
        raise multiturn_gpu.SideFailed(RuntimeError("device-side assert triggered"), _curve([0.5, 0.7], 2.0))

    def mortal_runs(model, spec, args, work):
        return {"curve": _curve([0.5, 0.6, 0.8], 1.0), "wall_seconds": 3.0, "started_at": 0.0}

    monkeypatch.setattr(multiturn_gpu, "run_trl", trl_stops)
    monkeypatch.setattr(multiturn_gpu, "run_mortal", mortal_runs)
    out = tmp_path / "out.json"
    argv = ["multiturn_gpu.py", "--model", str(tmp_path), "--cpu", "--warm-start", "0", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    multiturn_gpu.main()
    result = json.loads(out.read_text())
    assert result["trl"]["error"] == "RuntimeError: device-side assert triggered"
    assert [p["step"] for p in result["trl"]["curve"]] == [1, 2]
    assert [p["step"] for p in result["mortal"]["curve"]] == [1, 2, 3]
    assert "ratio" not in result and "learning" not in result


def test_mortals_generation_is_split_by_its_rollouts_task_lines(tmp_path: Path) -> None:
    logs = tmp_path / "mortal-home" / "runs" / "bench" / "logs"
    logs.mkdir(parents=True)
    lines = [
        f"INFO task {step}.0: 8 prompts, 4288 tokens in {seconds} s (7796.4 tokens/s) [decode rows=64 "
        f"decode_steps={steps} turns=192 appends=5 appended_tokens=900 append_s={append} tool_waits=2 "
        f"tool_wait_s=0.004], rewards in 0.003 s, weights v{step}"
        for step, steps, append, seconds in (
            (1, 200, 3.0, 9.1),
            (2, 104, 0.3, 0.7),
            (3, 96, 0.2, 0.6),
            (4, 88, 0.1, 0.5),
        )
    ]
    (logs / "rollout-0-0.log").write_text("\n".join(["INFO loading weights", *lines]))
    decode = multiturn_gpu.rollout_decode(tmp_path)
    assert [t["step"] for t in decode["tasks"]] == [1, 2, 3, 4]
    assert decode["tasks"][0]["decode_steps"] == 200.0
    # the medians of steps 3 and 4 (the first two carry start-up and compilation)
    assert decode["medians"]["decode_steps"] == 92.0
    assert decode["medians"]["append_s"] == pytest.approx(0.15)
    assert decode["medians"]["generate_s"] == pytest.approx(0.55)


def test_the_training_flags_reach_mortals_actor_and_the_profiler_only_when_asked(
    monkeypatch, tmp_path: Path
) -> None:
    """--actor-compile and --liger set mortal's actor.compile and actor.liger (the spec the controller gets),
    --profile-step N sets MORTAL_PROFILE_STEPS for the controller to pass on; without them neither is on."""
    import os

    specs: list[dict] = []

    def mortal_runs(model, spec, args, work):
        specs.append({**spec["actor"], "profile": os.environ.get("MORTAL_PROFILE_STEPS")})
        return {"curve": _curve([0.5, 0.6, 0.8], 1.0), "wall_seconds": 3.0, "started_at": 0.0}

    monkeypatch.setattr(multiturn_gpu, "run_mortal", mortal_runs)
    monkeypatch.setenv("MORTAL_PROFILE_STEPS", "")  # restored (unset) after the test: main() sets it
    monkeypatch.delenv("MORTAL_PROFILE_STEPS")
    base = ["multiturn_gpu.py", "--model", str(tmp_path), "--cpu", "--warm-start", "0", "--only", "mortal"]
    for extra in ([], ["--actor-compile", "--liger", "--profile-step", "6"]):
        monkeypatch.setattr(sys, "argv", base + extra)
        multiturn_gpu.main()
    plain, asked = [{k: s[k] for k in ("compile", "liger", "profile")} for s in specs]
    assert plain == {"compile": False, "liger": False, "profile": None}
    assert asked == {"compile": True, "liger": True, "profile": "6"}
