"""Admission's probe imports the user's modules in a child process: that process gets what a worker would of
the applying environment (controller/backends/base.py `inheritable`, the spec's secrets), never the admin
token nor the store's database URL (a watched folder's probe runs in the controller)."""

from __future__ import annotations

import json
from pathlib import Path

from mortal.controller.admission import _probe
from mortal.specs import TrainingRun

SPY = """
import json, os
with open({seen!r}, "w") as out:
    json.dump({{k: os.environ.get(k) for k in ("MORTAL_STATE_TOKEN", "MORTAL_STORE_BACKING_URL", "HF_TOKEN",
                                              "MY_API_KEY", "TOKENIZERS_PARALLELISM")}}, out)


def score(completions, prompts=None, **kwargs):
    return [1.0 for _ in completions]
"""


def test_the_probe_gets_a_worker_s_environment_without_credentials(tmp_path: Path, monkeypatch) -> None:
    seen = tmp_path / "seen.json"
    (tmp_path / "spy_rewards.py").write_text(SPY.format(seen=str(seen)))
    for name, value in (
        ("MORTAL_STATE_TOKEN", "admin-secret"),
        ("MORTAL_STORE_BACKING_URL", "postgresql://u:pw@h/db"),
        ("HF_TOKEN", "hf-secret"),
        ("MY_API_KEY", "named-secret"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        monkeypatch.setenv(name, value)
    run = TrainingRun.model_validate(
        {
            "metadata": {"name": "r"},
            "spec": {
                "model": {"name": "simulated"},
                "dataset": {"name": "builtin:arith"},
                "secrets": ["MY_API_KEY"],
                "rewards": [{"function": "spy_rewards:score"}],
            },
        }
    )
    _probe(run, tmp_path)
    assert json.loads(seen.read_text()) == {
        "MORTAL_STATE_TOKEN": None,
        "MORTAL_STORE_BACKING_URL": None,
        "HF_TOKEN": None,
        "MY_API_KEY": "named-secret",
        "TOKENIZERS_PARALLELISM": "false",
    }
