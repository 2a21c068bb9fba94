"""Per-step training metrics: always to the state store, and to Weights & Biases when configured.

Called by the actor once per optimizer step with TRL's logged values (reward, reward_std,
rewards/<name>/mean and /std, loss, kl, entropy, clip ratios, completions/mean_length, ...) plus its own
(staleness, tokens_per_second, step_seconds, weight_version, rewards/<name>/scored: the controller's
RewardHealthy condition reads /std and /scored). Non-finite values are dropped (a
store column cannot hold NaN; TRL logs NaN for a reward no completion was scored by).

W&B (`spec.logging.wandb.mode`): `auto` = online when WANDB_API_KEY is set, offline otherwise
(files under the run's folder, `wandb sync` later); `disabled`, or WANDB_MODE=disabled in the
environment (the tests), = off. wandb is imported only when used; `auto` without the package
installed is off with a log line, an explicit online/offline without it is a fatal spec error.
A resumed actor logs into the same W&B run (id from the run's uid) and may log a step again.
A step's sampled completions (mortal.workers.actor.samples) go the same two ways: to the store, and to
W&B as a wandb.Table under COMPLETIONS_KEY, with TRL's columns (step, prompt, completion, each
reward, advantage, the log_extra columns) plus the sample's position and weight version.
It must not compute metrics (TRL and the actor do) nor decide when to report.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mortal.state.store import NewCompletion, Store, WorkerRef
from mortal.workers.errors import FatalWorkerError

log = logging.getLogger("mortal.metrics")
DROPPED = frozenset({"epoch"})
STEP_KEY = "train/step"
COMPLETIONS_KEY = "completions"


def finite_values(values: Mapping[str, Any]) -> dict[str, float]:
    """The numeric, finite entries (bools and None dropped)."""
    out = {}
    for name, value in values.items():
        if name in DROPPED or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[name] = float(value)
    return out


def wandb_mode(spec_mode: str, environ: Mapping[str, str]) -> str | None:
    """The W&B mode to run in, or None for off."""
    if environ.get("WANDB_MODE") == "disabled" or spec_mode == "disabled":
        return None
    if spec_mode == "auto":
        return "online" if environ.get("WANDB_API_KEY") else "offline"
    return spec_mode


def open_wandb(
    wandb_spec: Any,
    run_name: str,
    run_uid: str | None,
    run_dir: Path,
    config: dict[str, Any],
    environ: Mapping[str, str] | None = None,
) -> Any:
    """A W&B run per spec.logging.wandb, or None when off."""
    env = os.environ if environ is None else environ
    mode = wandb_mode(wandb_spec.mode, env)
    if mode is None:
        return None
    try:
        wandb = importlib.import_module("wandb")
    except ImportError as exc:
        if wandb_spec.mode == "auto":
            log.info("wandb is not installed: metrics go to the state store only")
            return None
        raise FatalWorkerError(
            "WandbUnavailable",
            f"spec.logging.wandb.mode is {wandb_spec.mode!r} but the wandb package is not installed: "
            "pip install 'mortal[cloud]', or set mode: disabled",
        ) from exc
    run_dir.mkdir(parents=True, exist_ok=True)
    wb = wandb.init(
        project=wandb_spec.project,
        entity=wandb_spec.entity,
        name=run_name,
        id=f"{run_name}-{run_uid}" if run_uid else run_name,
        resume="allow",
        mode=mode,
        dir=str(run_dir),
        config=config,
    )
    wb.define_metric(STEP_KEY)
    wb.define_metric("*", step_metric=STEP_KEY)
    return wb


def _columns(names: Sequence[str], taken: list[str]) -> list[str]:
    """`names` as table columns: one already taken (a reward named 'prompt') gets a prefix."""
    return [name if name not in taken else f"extra/{name}" for name in names]


def completions_table(step: int, completions: Sequence[NewCompletion]) -> Any:
    """One step's samples as a wandb.Table: a row per completion, a column per reward and extra column."""
    wandb = importlib.import_module("wandb")
    rewards = list(dict.fromkeys(name for c in completions for name in c.rewards))
    extra = list(dict.fromkeys(name for c in completions for name in c.extra))
    fixed = ["step", "sample", "prompt", "completion", "reward"]
    columns = fixed + _columns(rewards, fixed) + ["advantage", "weight_version"]
    columns += _columns(extra, columns)
    data = [
        [
            step,
            c.sample,
            c.prompt,
            c.completion,
            c.reward,
            *(c.rewards.get(r) for r in rewards),
            c.advantage,
            c.weight_version,
            *(c.extra.get(e) for e in extra),
        ]
        for c in completions
    ]
    return wandb.Table(columns=columns, data=data)


class MetricsReporter:
    """One actor's metric sink: the store (fenced writes) and, optionally, a W&B run."""

    def __init__(self, store: Store, worker: WorkerRef, wandb_run: Any = None) -> None:
        self.store = store
        self.worker = worker
        self.wandb_run = wandb_run

    def report(self, step: int, values: Mapping[str, Any]) -> dict[str, float]:
        """Record one step's values; returns what was recorded."""
        clean = finite_values(values)
        if clean:
            self.store.add_metrics(self.worker, step, clean)
            if self.wandb_run is not None:
                self.wandb_run.log({STEP_KEY: step, **clean})
        return clean

    def report_completions(self, step: int, completions: Sequence[NewCompletion]) -> None:
        """Record one step's sampled completions (none: nothing is written)."""
        if not completions:
            return
        self.store.add_completions(self.worker, step, list(completions))
        if self.wandb_run is not None:
            self.wandb_run.log({STEP_KEY: step, COMPLETIONS_KEY: completions_table(step, completions)})

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
