"""Following a run to its end: the live view of `apply --follow` and of `MortalTrainer.train()`.

Reads the store once a second (run status, new events, new reward metrics) and shows it: a rich
live panel (progress bar of step/maxSteps, phase, reward, recent events) on a terminal, one line
per step (`step 3/30  reward 0.420  ...`) otherwise, nothing when quiet. When the run is Succeeded
or Failed it prints where the final checkpoint is and how to load it. It only reads the store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from mortal.client.cli.context import TERMINAL_PHASES, CliError, run_document
from mortal.client.cli.output import age, console, fmt_float, say
from mortal.client.cli.text import cell, plain

if TYPE_CHECKING:
    from rich.console import Console

    from mortal.specs import RunStatus
    from mortal.state import EventRow, Store

REWARD = "reward"
"""Metric holding a step's mean total reward (TRL's name, stored by mortal.workers.actor.metrics)."""
LINE_METRICS = (
    ("loss", "loss {:.4f}"),
    ("kl", "kl {:.4f}"),
    ("weight_version", "weights v{:.0f}"),
    ("step_seconds", "{:.1f}s/step"),
)
"""Per-step metrics shown after the reward on a progress line, when the actor logged them."""
ADAPTER_CONFIG = "adapter_config.json"
"""Present in a LoRA checkpoint (mortal.workers.actor.checkpoint): the folder holds a peft adapter."""

StepMetrics = tuple[int, dict[str, float]]


@dataclass
class Snapshot:
    """What the follower knows about a run after one poll."""

    name: str
    status: RunStatus
    max_steps: int
    new_events: list[EventRow] = field(default_factory=list)
    new_steps: list[StepMetrics] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return str(self.status.phase) in TERMINAL_PHASES


class Follower:
    """Polls one run; each `poll()` returns the status plus the events and finished steps not seen before."""

    def __init__(self, store: Store, name: str) -> None:
        self.store, self.name = store, name
        self.last_event_id = 0
        self.last_step = 0
        self.events: list[EventRow] = []
        self.steps: list[StepMetrics] = []

    def poll(self) -> Snapshot:
        from mortal.state import NotFound

        try:
            run = run_document(self.store.get_run(self.name))
        except NotFound:
            raise CliError(f"trainingrun {self.name!r} was deleted while being followed") from None
        events = [e for e in self.store.list_events(self.name, limit=20) if (e.id or 0) > self.last_event_id]
        if events:
            self.last_event_id = max(e.id or 0 for e in events)
            self.events = (self.events + events)[-5:]
        steps = self._new_steps() or self._status_step(run.status)
        self.steps += steps
        return Snapshot(self.name, run.status, run.spec.algorithm.max_steps, events, steps)

    def _new_steps(self) -> list[StepMetrics]:
        """Steps the actor logged metrics for since the last poll, each with all its metrics."""
        by_step: dict[int, dict[str, float]] = {}
        for row in self.store.list_metrics(self.name, since_step=self.last_step + 1):
            if row.step > self.last_step:
                by_step.setdefault(row.step, {})[row.name] = row.value
        if by_step:
            self.last_step = max(by_step)
        return sorted(by_step.items())

    def _status_step(self, status: RunStatus) -> list[StepMetrics]:
        """Without metrics, the status' step and reward stand in (steps between polls are skipped)."""
        if status.step <= self.last_step or status.reward is None:
            return []
        self.last_step = status.step
        return [(status.step, {REWARD: status.reward, "weight_version": float(status.weight_version)})]

    def rewards(self) -> list[float]:
        return [m[REWARD] for _, m in self.steps if REWARD in m]


def follow_runs(store: Store, names: list[str], quiet: bool = False, timeout: float | None = None) -> bool:
    """Follow each run in turn until it is Succeeded or Failed; True when every one Succeeded."""
    deadline = None if timeout is None else time.monotonic() + timeout
    ok = True
    for name in names:
        status = follow_run(store, name, quiet=quiet, deadline=deadline)
        ok = ok and str(status.phase) == "Succeeded"
    return ok


def follow_run(
    store: Store, name: str, quiet: bool = False, deadline: float | None = None, poll_seconds: float = 1.0
) -> RunStatus:
    """Block until the run is terminal (showing progress unless quiet); print the outcome; return the
    status."""
    follower = Follower(store, name)
    out = console()
    if quiet:
        snap = _loop(follower, deadline, poll_seconds, lambda snap: None)
    elif out.is_terminal:
        with Live(console=out, auto_refresh=False, transient=False) as live:
            snap = _loop(
                follower, deadline, poll_seconds, lambda s: live.update(render(s, follower), refresh=True)
            )
    else:
        snap = _loop(follower, deadline, poll_seconds, lambda s: print_lines(out, s))
    print_outcome(store, snap, quiet)
    return snap.status


def _loop(follower: Follower, deadline: float | None, poll_seconds: float, show) -> Snapshot:
    while True:
        snap = follower.poll()
        show(snap)
        if snap.done:
            return snap
        if deadline is not None and time.monotonic() >= deadline:
            raise CliError(
                f"timed out waiting for trainingrun/{snap.name} (phase {snap.status.phase}, "
                f"step {snap.status.step}/{snap.max_steps}); "
                f"it keeps running: `mortalctl get runs {snap.name}`"
            )
        time.sleep(poll_seconds)


def step_line(step: int, max_steps: int, metrics: dict[str, float]) -> str:
    """The plain progress line of one finished step: `step 3/30  reward 0.420  loss 0.0123  ...`."""
    parts = [f"step {step}/{max_steps}", f"reward {fmt_float(metrics.get(REWARD))}"]
    parts += [fmt.format(metrics[name]) for name, fmt in LINE_METRICS if name in metrics]
    return "  ".join(parts)


def print_lines(out: Console, snap: Snapshot) -> None:
    """Plain output: each new event, then one line per newly finished step."""
    for event in snap.new_events:
        out.print(plain(f"{event.type:<8} {event.reason:<20} {event.message}"), markup=False)
    for step, metrics in snap.new_steps:
        out.print(step_line(step, snap.max_steps, metrics), markup=False)
    out.file.flush()


def render(snap: Snapshot, follower: Follower) -> Group:
    """The terminal view: a progress bar, a status line and the latest events."""
    s = snap.status
    rewards = follower.rewards()
    reward = rewards[-1] if rewards else s.reward
    head = Table.grid(padding=(0, 2))
    head.add_row(
        Text(plain(f"trainingrun/{snap.name}"), style="bold"),
        ProgressBar(total=max(snap.max_steps, 1), completed=s.step, width=40),
        Text(f"step {s.step}/{snap.max_steps}"),
    )
    info = Text(
        f"phase {s.phase}   reward {fmt_float(reward)}   weights v{s.weight_version}   "
        f"rollout {s.replicas.rollout.ready}/{s.replicas.rollout.desired}   restarts {s.restarts}"
    )
    trend = Text("reward by step: " + "  ".join(f"{r:.2f}" for r in rewards[-12:]), style="dim")
    events = Table(box=None, show_header=False, pad_edge=False)
    for event in follower.events:
        events.add_row(age(event.time), cell(event.type), cell(event.reason), cell(event.message))
    return Group(head, info, trend, events)


def final_checkpoint(store: Store, name: str, status: RunStatus) -> str | None:
    """Path of the newest complete checkpoint (status first, else the checkpoints table)."""
    if status.last_checkpoint is not None:
        return status.last_checkpoint.path
    latest = store.latest_checkpoint(name)
    return latest.path if latest else None


def load_snippet(checkpoint: str) -> str:
    """Three lines of Python that load the trained model (a checkpoint folder is a save_pretrained folder)."""
    if (Path(checkpoint) / ADAPTER_CONFIG).is_file():
        return (
            "from peft import AutoPeftModelForCausalLM\n"
            f"model = AutoPeftModelForCausalLM.from_pretrained({checkpoint!r})  # base model + LoRA adapter\n"
            "model = model.merge_and_unload()"
        )
    return (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({checkpoint!r})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({checkpoint!r})"
    )


def print_outcome(store: Store, snap: Snapshot, quiet: bool) -> None:
    """Succeeded: where the final checkpoint is and how to load it. Failed: the reason, on stderr.

    Each is one line, store text escaped as events show it: a message a user's reward raised can hold a
    newline, and a script reading the last line must not be handed a line that code wrote."""
    s = snap.status
    if str(s.phase) == "Failed":
        reason = plain(s.message) if s.message else f"see `mortalctl describe run {snap.name}`"
        say(f"trainingrun/{snap.name} Failed: {reason}", stderr=True)
        return
    out = console()
    out.print(
        f"trainingrun/{snap.name} Succeeded: {s.step}/{snap.max_steps} steps, reward {fmt_float(s.reward)}",
        markup=False,
    )
    checkpoint = final_checkpoint(store, snap.name, s)
    if checkpoint and not quiet:
        say(f"final checkpoint: {plain(checkpoint)}")
        out.print("load it in Python:", markup=False)
        say("\n".join("    " + line for line in load_snippet(checkpoint).splitlines()))
