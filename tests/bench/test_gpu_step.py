"""bench/gpu_step.py's figures against the physical limit: decode against the HBM floor, and training MFU over
the whole of TRL's step and over its update alone (issue 14 part 4), from the steps' breakdown the actor logs;
and the steps every figure is taken over (steady_steps: a maxStaleness run's last steps overlap nothing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_step  # noqa: E402

PARAMETERS = 500_000_000
PEAK = 989e12


def _steps(train: float, prepare: float | None, update: float | None, n: int = 6) -> list[dict]:
    step = {"tokens": 16_384, "train": train}
    step |= {} if prepare is None else {"prepare": prepare}
    step |= {} if update is None else {"update": update}
    return [dict(step) for _ in range(n)]


def test_mfu_is_six_n_flops_per_trained_token_over_the_train_seconds_against_the_gpus_peak() -> None:
    out = gpu_step.limits(
        "NVIDIA H100 80GB HBM3", PARAMETERS, [1.4], _steps(0.2, None, None), prompt_tokens=832
    )
    flops = 6 * PARAMETERS * (16_384 + 832)
    assert out["model_flops_per_step"] == flops and out["mfu"] == pytest.approx(flops / 0.2 / PEAK)
    assert "update_mfu" not in out  # an actor older than the split: no figure made up


def test_the_updates_mfu_leaves_out_trls_preparation_of_the_batch() -> None:
    out = gpu_step.limits("NVIDIA H200", PARAMETERS, [], _steps(0.2, 0.05, 0.14), prompt_tokens=0)
    assert out["update_seconds"] == 0.14 and out["prepare_seconds"] == 0.05
    assert out["update_mfu"] == pytest.approx(6 * PARAMETERS * 16_384 / 0.14 / PEAK)
    assert out["update_mfu"] > out["mfu"]


def test_a_gpu_outside_the_table_has_no_floor_and_no_mfu() -> None:
    out = gpu_step.limits("NVIDIA A10G", PARAMETERS, [2.0], _steps(0.2, 0.05, 0.14), prompt_tokens=0)
    assert out["mfu"] is None and out["update_mfu"] is None and out["hbm_floor_ms_per_step"] is None


def _timed(seconds: list[float]) -> list[dict]:
    return [{"seconds": s, "tokens": 16_384} for s in seconds]


def test_an_on_policy_runs_median_is_taken_from_its_third_step_on() -> None:
    out = gpu_step.summarize("mortal", _timed([17.0, 3.0, 2.9, 3.1]))
    assert out["median_step_seconds"] == pytest.approx(3.0)


def test_a_max_staleness_runs_last_steps_with_nothing_to_overlap_are_left_out_of_its_median() -> None:
    # 7B full on one H200, maxStaleness 1: steps 2-3 trained beside the next generation, step 4 alone
    out = gpu_step.summarize("mortal", _timed([17.46, 3.62, 3.62, 2.09]), staleness=1)
    assert out["median_step_seconds"] == pytest.approx(3.62)


def test_too_few_steps_to_leave_any_out_keep_what_there_is() -> None:
    assert gpu_step.steady_steps([1, 2, 3], staleness=1) == [3]
    assert gpu_step.steady_steps([1, 2], staleness=1) == []
    assert (
        gpu_step.summarize("mortal", _timed([4.0, 2.0]), staleness=1)["median_step_seconds"] == 3.0
    )  # both, then


def test_the_mfu_of_a_max_staleness_run_is_over_its_steady_steps() -> None:
    steps = _steps(0.5, None, None, n=3) + _steps(0.2, None, None, n=1)  # the last trains alone, faster
    out = gpu_step.limits("NVIDIA H200", PARAMETERS, [], steps, prompt_tokens=0, staleness=1)
    assert out["train_seconds"] == pytest.approx(0.5)


def test_a_recorded_run_is_resummarized_over_its_steady_steps(tmp_path, capsys) -> None:
    recorded = {
        "staleness": 1,
        "mortal_over_trl": 4.81,
        "trl": {"median_step_seconds": 13.82, "steps": _timed([35.3, 12.6, 13.11, 14.53])},
        "mortal": {"median_step_seconds": 2.85, "steps": _timed([17.46, 3.62, 3.62, 2.09])},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(recorded))
    gpu_step.resummarize([path])
    out = capsys.readouterr().out
    assert "mortal (maxStaleness 1) 3.620 s/step" in out and "(recorded: 2.850 s/step)" in out
    assert (
        f"mortal / TRL {13.82 / 3.62:.2f}x (recorded: 4.81x)" in out
    )  # TRL over steps 3-4, mortal over step 3
