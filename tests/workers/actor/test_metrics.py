"""mortal.workers.actor.metrics: per-step values to the store, and to W&B when configured
(a fake wandb here)."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from actor_helpers import create_run, worker_context

from mortal.specs.training import WandbSpec
from mortal.workers.actor.metrics import MetricsReporter, finite_values, open_wandb, wandb_mode
from mortal.workers.errors import FatalWorkerError

SPEC = {
    "model": {"name": "/nonexistent/model"},
    "dataset": {"name": "builtin:arith"},
    "rewards": [{"function": "mortal.workers.rewards.builtin:correct_answer"}],
}


class FakeWandb(types.ModuleType):
    """The slice of wandb's API metrics.py uses, recording the calls."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict[str, Any]] = []
        self.logged: list[dict[str, float]] = []
        self.finished = False
        self.metrics: list[tuple[str, str | None]] = []

    def init(self, **kwargs: Any) -> FakeWandb:
        self.inits.append(kwargs)
        return self

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.metrics.append((name, step_metric))

    def log(self, values: dict[str, float]) -> None:
        self.logged.append(values)

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> FakeWandb:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def test_auto_is_online_with_a_key_offline_without_and_the_env_can_disable_it() -> None:
    assert wandb_mode("auto", {"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode("auto", {}) == "offline"
    assert wandb_mode("online", {"WANDB_MODE": "disabled"}) is None
    assert wandb_mode("disabled", {"WANDB_API_KEY": "k"}) is None
    assert wandb_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"


def test_only_finite_numbers_are_reported() -> None:
    values = {
        "loss": 0.5,
        "kl": math.nan,
        "reward": 1,
        "flag": True,
        "name": "x",
        "epoch": 0.1,
        "x": None,
        "inf": math.inf,
    }
    assert finite_values(values) == {"loss": 0.5, "reward": 1.0}


def test_metrics_go_to_the_store_and_to_wandb_with_a_step_axis(
    store, fake_wandb: FakeWandb, tmp_path: Path
) -> None:
    run = create_run(store, "m", SPEC)
    ctx = worker_context(store, run, "actor")
    wb = open_wandb(WandbSpec(project="p", mode="auto"), "m", "uid1", tmp_path / "run", {"a": 1}, environ={})
    reporter = MetricsReporter(ctx.store, ctx.worker, wb)
    reporter.report(1, {"loss": 0.25, "kl": math.nan, "reward": 2.0})
    reporter.report(1, {"loss": 0.5})  # a step trained again after a resume: the latest value stands
    reporter.close()
    assert fake_wandb.inits == [
        {
            "project": "p",
            "entity": None,
            "name": "m",
            "id": "m-uid1",
            "resume": "allow",
            "mode": "offline",
            "dir": str(tmp_path / "run"),
            "config": {"a": 1},
        }
    ]
    assert fake_wandb.logged[0] == {"train/step": 1, "loss": 0.25, "reward": 2.0}
    assert ("*", "train/step") in fake_wandb.metrics and fake_wandb.finished
    stored = {(r.step, r.name): r.value for r in store.list_metrics("m")}
    assert stored == {(1, "loss"): 0.5, (1, "reward"): 2.0}


def test_disabled_wandb_is_never_imported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would raise
    assert (
        open_wandb(WandbSpec(mode="online"), "m", None, tmp_path, {}, environ={"WANDB_MODE": "disabled"})
        is None
    )


def test_a_missing_wandb_is_fatal_only_when_asked_for_explicitly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert open_wandb(WandbSpec(mode="auto"), "m", None, tmp_path, {}, environ={}) is None
    with pytest.raises(FatalWorkerError, match="not installed"):
        open_wandb(WandbSpec(mode="offline"), "m", None, tmp_path, {}, environ={})


def test_a_step_says_what_fraction_of_its_samples_each_reward_scored() -> None:
    from mortal.workers.actor.feed import StepBatch

    batch = StepBatch(
        rewards=[
            {"acc": 1.0, "fmt": None},
            {"acc": 0.0, "fmt": None},
            {"acc": None, "fmt": None},
            {"acc": 1.0, "fmt": None},
        ],
        weight_versions=[3, 3, 3, 3],
        completion_ids=[[1]] * 4,
    )
    values = batch.metrics(step=3, weights_step=lambda v: v)
    assert (values["rewards/acc/scored"], values["rewards/fmt/scored"]) == (0.75, 0.0)
