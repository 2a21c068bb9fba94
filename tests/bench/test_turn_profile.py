"""bench/turn_profile.py on the CPU: the calculator example's rollouts through the rollout's own engine and
tool loop, one side per read-back interval and thread switch interval, each task's decode figures recorded
(a smoke test of the script: a tiny random model, so no figure here means anything)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "workers"))
from rollout_helpers import assets_available, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


def test_each_read_back_interval_is_a_side_with_its_tasks_decode_figures(monkeypatch, tmp_path: Path) -> None:
    import turn_profile

    # the calculator example's prompt (its tools' schemas) and its conversation budget take more positions
    # than TINY's: a model that cannot hold them is refused (PromptTooLong)
    model = make_tiny_model(tmp_path / "model", max_position_embeddings=1024)
    out = tmp_path / "out.json"
    argv = ["turn_profile.py", "--model", str(model), "--cpu", "--warm-start", "0", "--tasks", "1"]
    argv += [
        "--prompts",
        "1",
        "--gens",
        "2",
        "--sync-every",
        "2",
        "8",
        "--switch-interval",
        "0.005",
        "0.0005",
        "--dtype",
        "float32",
        "--json",
        str(out),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    turn_profile.main()
    result = json.loads(out.read_text())
    assert sorted(result["sides"]) == [
        "sync_every_2_switch_0.0005",
        "sync_every_2_switch_0.005",
        "sync_every_8_switch_0.0005",
        "sync_every_8_switch_0.005",
    ]
    assert sys.getswitchinterval() == 0.005, "Python's own interval is put back"
    for side in result["sides"].values():
        assert len(side["tasks"]) == 1
        assert all(task["decode_steps"] > 0 and task["seconds"] > 0 for task in side["tasks"])
        assert side["medians"]["rows"] == 2


def test_a_profiles_timeline_is_written_as_gzipped_chrome_trace_json(tmp_path: Path) -> None:
    import gzip

    import torch
    import turn_profile
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    turn_profile.write_trace(prof, tmp_path / "trace.json.gz")
    events = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))["traceEvents"]
    assert any("mm" in event.get("name", "") for event in events)
