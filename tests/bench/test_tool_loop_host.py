"""bench/tool_loop_host.py: the calculator example's tool loop over an engine that answers at once with a
warm-started model's turns (a calculator call, a submit call, the answer), new prompts each task (a smoke
test of the script: its seconds mean nothing here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "workers"))
from rollout_helpers import assets_available, assets_dir  # noqa: E402

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


def test_every_rollout_says_its_three_turns_and_calls_both_tools(monkeypatch, tmp_path: Path) -> None:
    import tool_loop_host

    out = tmp_path / "out.json"
    argv = ["tool_loop_host.py", "--tokenizer", str(assets_dir() / "smollm2-tok"), "--prompts", "2"]
    argv += ["--gens", "3", "--tasks", "2", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    tool_loop_host.main()
    result = json.loads(out.read_text())
    assert result["rollouts"] == 6 and len(result["tasks"]) == 2
    assert result["turns_a_task"] == 18 and result["tool_calls_a_task"] == 12
    assert result["lowest"] <= result["median"]
