"""spec.limits: durations as "90s", "30m", "2h", "1d" or seconds, GPU-hours, and the errors a user reads."""

from __future__ import annotations

import pytest

from mortal.specs import SpecError, TrainingRun, format_duration, load_text, parse_duration

HEAD = """\
apiVersion: mortal/v1
kind: TrainingRun
metadata:
  name: demo
spec:
  model: {name: tiny}
  limits:
"""


def load(limits: str) -> TrainingRun:
    return load_text(HEAD + "".join(f"    {line}\n" for line in limits.splitlines()), source="run.yaml")[0]


@pytest.mark.parametrize(
    ("written", "seconds", "normal"),
    [
        ("90s", 90, "90s"),
        ("30m", 1800, "30m"),
        ("2h", 7200, "2h"),
        ("1d", 86400, "1d"),
        ("1.5h", 5400, "90m"),
        ("120m", 7200, "2h"),
        ("45", 45, "45s"),
        ("3600", 3600, "1h"),
        ("0.5", 0.5, "0.5s"),
        ("'10 m'", 600, "10m"),
    ],
)
def test_max_duration_accepts_units_and_plain_seconds_and_stores_a_normal_form(written, seconds, normal):
    run = load(f"maxDuration: {written}")
    assert run.spec.limits.max_duration == seconds
    assert run.spec_dict()["limits"] == {"maxDuration": normal, "maxGPUHours": None}
    again = TrainingRun.model_validate({"metadata": {"name": "demo"}, "spec": run.spec_dict()})
    assert again.spec_dict() == run.spec_dict()  # the stored form reads back as the same spec


def test_limits_are_optional_and_absent_by_default():
    run = load_text(HEAD.removesuffix("  limits:\n"), source="run.yaml")[0]
    assert (run.spec.limits.max_duration, run.spec.limits.max_gpu_hours) == (None, None)
    run = load("maxGPUHours: 40")
    assert (run.spec.limits.max_duration, run.spec.limits.max_gpu_hours) == (None, 40.0)


@pytest.mark.parametrize(
    ("limits", "path", "fragment"),
    [
        (
            "maxDuration: 2x",
            "spec.limits.maxDuration",
            "must be a duration such as 90s, 30m, 2h or 1d, or seconds",
        ),
        ("maxDuration: two hours", "spec.limits.maxDuration", "(got 'two hours')"),
        ("maxDuration: 0", "spec.limits.maxDuration", "must be a positive duration"),
        ("maxDuration: -5m", "spec.limits.maxDuration", "must be a duration such as"),
        ("maxDuration: true", "spec.limits.maxDuration", "must be a duration such as"),
        ("maxGPUHours: 0", "spec.limits.maxGPUHours", "must be > 0 (got 0)"),
        ("maxGPUHours: lots", "spec.limits.maxGPUHours", "number"),
    ],
)
def test_bad_limits_name_the_field_and_line(limits, path, fragment):
    with pytest.raises(SpecError) as caught:
        load(limits)
    [issue] = caught.value.issues
    assert (issue.source, issue.line, issue.path) == ("run.yaml", 8, path)
    assert fragment in issue.message


def test_a_misspelt_limit_gets_a_hint():
    with pytest.raises(SpecError) as caught:
        load("maxDurations: 2h")
    assert "did you mean 'maxDuration'" in str(caught.value)


def test_parse_and_format_round_trip():
    for seconds in (1, 59, 60, 61, 3600, 5400, 86400, 90000, 2.5):
        assert parse_duration(format_duration(seconds)) == seconds
