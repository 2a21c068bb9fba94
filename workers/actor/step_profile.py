"""torch.profiler around chosen optimizer steps of the actor, on each of its ranks: where a training step's
time goes, asked for from outside the spec because it is a diagnosis, not a setting of the run.

Who uses it: mortal.workers.actor.training.make_trainer adds `from_environment(...)` to every rank's Trainer
callbacks. MORTAL_PROFILE_STEPS (in the worker's environment; the local backend passes the controller's on)
names the optimizer steps, as the store counts them: "4", or "4-5" for a range. For each rank it writes, into
the run's logs folder (`mortalctl logs` does not read them; they sit beside the workers' logs):
  1. profile-actor-rank{R}-steps{A}-{B}.txt: torch's table of the operators that took the most time of
     their own on the device (on the CPU when there is no GPU), and the same sorted by CPU time, for the
     host overhead (hooks, DTensor dispatch, Python) a GPU timeline alone does not name;
  2. profile-actor-rank{R}-steps{A}-{B}.json.gz: the timeline (chrome://tracing, Perfetto).
A step here is TRL's, from on_step_begin to on_step_end: rank 0's includes its wait for rollouts
(mortal.workers.actor.loop), which the table shows as time outside any kernel.

What it must not do: profile a step not asked for (a profiled step runs slower, so a bench must not time it),
or end a run that trains (a profiler that fails is logged, and the steps go on unprofiled). A malformed
MORTAL_PROFILE_STEPS is refused as the actor starts, before any step, with the variable named.
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from mortal.workers.errors import FatalWorkerError

log = logging.getLogger("mortal.profile")
STEPS_ENV = "MORTAL_PROFILE_STEPS"
TABLE_ROWS = 40


def parse_steps(text: str) -> tuple[int, int]:
    """ "4" -> (4, 4); "4-5" -> (4, 5). Steps count from 1; a bad value is fatal (it names the variable)."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    steps = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 1 <= steps[0] <= steps[1]:
        raise FatalWorkerError(
            "BadProfileSteps",
            f"{STEPS_ENV}={text!r}: give an optimizer step (4) or a range of them (4-5), counting from 1",
        )
    return steps


def from_environment(logs: Path, rank: int) -> list[TrainerCallback]:
    """The profiler callback MORTAL_PROFILE_STEPS asks for, or none."""
    text = os.environ.get(STEPS_ENV, "")
    return [StepProfile(logs, rank, *parse_steps(text))] if text else []


@dataclass
class StepProfile(TrainerCallback):
    """Profiles optimizer steps first..last of one rank (the Trainer's global_step counts steps done)."""

    logs: Path
    rank: int
    first: int
    last: int
    _profiler: Any = field(default=None, init=False, repr=False)

    @property
    def stem(self) -> str:
        return f"profile-actor-rank{self.rank}-steps{self.first}-{self.last}"

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 != self.first or self._profiler is not None:
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self._profiler.__enter__()
        except Exception as exc:  # a diagnosis must not end the run
            log.warning("could not start the profiler for steps %d-%d: %s", self.first, self.last, exc)
            self._profiler = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._profiler is None or state.global_step != self.last:
            return
        profiler, self._profiler = self._profiler, None
        try:
            profiler.__exit__(None, None, None)
            self._write(profiler)
        except Exception as exc:
            log.warning("could not write the profile of steps %d-%d: %s", self.first, self.last, exc)

    def _write(self, profiler: Any) -> None:
        import torch

        self.logs.mkdir(parents=True, exist_ok=True)
        events = profiler.key_averages()
        on_gpu = torch.cuda.is_available()
        own = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        text = (
            f"# {self.stem}: the operators by their own {'GPU' if on_gpu else 'CPU'} time\n"
            f"{events.table(sort_by=own, row_limit=TABLE_ROWS)}\n"
            f"# by CPU time, their callees included (host overhead)\n"
            f"{events.table(sort_by='cpu_time_total', row_limit=TABLE_ROWS)}\n"
        )
        (self.logs / f"{self.stem}.txt").write_text(text)
        trace = self.logs / f"{self.stem}.json"
        profiler.export_chrome_trace(str(trace))
        with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
        log.info(
            "profiled steps %d-%d of rank %d: %s",
            self.first,
            self.last,
            self.rank,
            self.logs / f"{self.stem}.txt",
        )
