"""Rewards on the rollout side: load `spec.rewards`, call them TRL-style, check what they return.

Who calls it: mortal.workers.rollout.loop, once per task (one prompt, `numGenerations` completions), so
scoring scales with rollout replicas. A reward is a TRL reward function referenced by import path
(`module:attr`), or a `RewardEnvironment` subclass (constructed with the entry's `args`). Each is
called exactly as TRL's GRPOTrainer calls it: `f(prompts=..., completions=..., completion_ids=...,
**dataset_columns, trainer_state=..., log_extra=..., log_metric=...)`, and returns one float (or
None: "not applicable") per completion. Per-function scores travel to the actor, which applies the
weights (TRL's reward_weights) and logs `rewards/<name>/mean` as TRL does.
Each call has a deadline (`rewards[].timeoutSeconds`): it runs on a thread of its own
(mortal.workers.deadline says why not a subprocess) and past the deadline is abandoned, its completions
score None (counted as not applicable, the run goes on) and `on_timeout` is told (the rollout records a
Warning event naming the reward, the worker and the seconds). Rewards that give no score at all (no call
returned: each timed out) for REWARD_SILENT_STEPS steps in a row, or since the worker started when its
abandoned calls fill it, fail the run (RewardTimedOut: `silence_failure`): nothing would be trained on.
What it must not do: let a broken reward look like a crash to retry. A wrong path, a function that
raises, or one that returns the wrong length or a non-number is a FatalWorkerError that names the
reward and says what to fix, so the run fails at once with that reason.
Built-in environments (`env: code-execution | llm-judge | math-answer`) are built by
mortal.workers.rewards.environments.factory; RewardEnvironment's execute_* helpers run code through
mortal.workers.rewards.sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import io
import math
import numbers
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mortal.specs.deadlines import DEFAULT_REWARD_TIMEOUT_SECONDS, REWARD_SILENT_STEPS
from mortal.workers import references
from mortal.workers.deadline import Abandoner, CallExited, CallTimedOut, ExitCalled, TooManyAbandonedCalls
from mortal.workers.errors import FatalWorkerError, ServiceOutage
from mortal.workers.messages import reward_names
from mortal.workers.rewards.environment import RewardEnvironment

if TYPE_CHECKING:
    from mortal.specs.rewards import RewardSpec

# Dataset columns TRL never forwards to reward functions (they are passed under their own names).
RESERVED_COLUMNS = ("prompt", "completion", "completion_ids")
REWARD_TIMED_OUT = "RewardTimedOut"  # the fatal reason of rewards that give no score at all


@dataclass(frozen=True)
class RolloutState:
    """What the rollout side knows of TRL's `trainer_state`: the step this batch is for."""

    global_step: int
    max_steps: int


@dataclass
class LoadedReward:
    name: str
    ref: str  # e.g. "spec.rewards[0].function 'pkg.mod:f'", for messages
    func: Callable[..., Any]
    is_async: bool
    # rewards[].timeoutSeconds: past it the call is abandoned
    timeout_seconds: float = DEFAULT_REWARD_TIMEOUT_SECONDS


@dataclass
class RewardReport:
    """One reward's verdict on one completion, for `mortalctl test reward`: its score, or the error a
    training run would fail with, and what the function printed and logged meanwhile."""

    name: str
    score: float | None
    error: str | None
    stdout: str
    stderr: str
    logged: RewardLogs


@dataclass
class RewardLogs:
    """What reward functions logged through TRL's `log_metric` / `log_extra` during one call."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list[Any]] = field(default_factory=dict)


def _import_attr(ref: str, where: str) -> Any:
    module_name = ref.partition(":")[0]
    try:
        return references.resolve(ref)
    except references.MissingAttribute as exc:
        raise FatalWorkerError("RewardNotFound", f"{where}: {exc}") from None
    except ModuleNotFoundError as exc:
        raise FatalWorkerError(
            "RewardNotFound",
            f"{where}: cannot import module {module_name!r} ({exc}); is it installed, or on PYTHONPATH of "
            "the workers?",
        ) from exc
    except Exception as exc:
        raise FatalWorkerError(
            "RewardNotFound", f"{where}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _is_async(func: Any) -> bool:
    target = func.func if isinstance(func, functools.partial) else func
    if inspect.iscoroutinefunction(target):
        return True
    return (
        callable(target) and not inspect.isfunction(target) and inspect.iscoroutinefunction(target.__call__)
    )


def _apply_sandbox_spec(env: RewardEnvironment, entry: RewardSpec) -> None:
    """Limits the spec sets away from their defaults win over the class's sandbox_config.

    (A stored spec always carries the defaults, so "was it written?" cannot be told from the entry.)
    """
    default = type(entry.sandbox)()
    changes = {}
    if entry.sandbox.timeout_seconds != default.timeout_seconds:
        changes["timeout"] = entry.sandbox.timeout_seconds
    if entry.sandbox.memory_mb != default.memory_mb:
        changes["memory_mb"] = entry.sandbox.memory_mb
    if entry.sandbox.backend != default.backend:
        changes["backend"] = entry.sandbox.backend
    if changes:
        env.sandbox_config = replace(env.sandbox_config, **changes)


def load_reward(
    entry: RewardSpec,
    index: int,
    name: str,
    run_dir: Path | None = None,
    environment_classes_importable: bool = True,
) -> LoadedReward:
    """One spec entry -> a callable reward (a class is constructed with `args`, an env by the factory).

    `environment_classes_importable` False: rollout.environment is served over http, so `env: environment`'s
    args.class is matched by reference rather than imported here."""
    if entry.env == "environment":
        from mortal.workers.rollout.tools import EnvironmentReward

        reward = EnvironmentReward(name, entry.args.get("class"), environment_classes_importable)
        return LoadedReward(
            name=name,
            ref=f"spec.rewards[{index}].env 'environment'",
            func=reward,
            is_async=False,
            timeout_seconds=entry.timeout_seconds,
        )
    if entry.env is not None:
        from mortal.workers.rewards.environments.factory import build_environment  # it imports this module

        env = build_environment(entry, index, run_dir)
        return LoadedReward(
            name=name,
            ref=f"spec.rewards[{index}].env {entry.env!r}",
            func=env,
            is_async=False,
            timeout_seconds=entry.timeout_seconds,
        )
    where = f"spec.rewards[{index}].function {entry.function!r}"
    obj = _import_attr(entry.function, where)
    if inspect.isclass(obj):
        try:
            obj = obj(**entry.args)
        except FatalWorkerError:
            raise
        except Exception as exc:
            raise FatalWorkerError(
                "RewardNotFound",
                f"{where}: constructing it with args {entry.args} failed: {type(exc).__name__}: {exc}",
            ) from exc
        if isinstance(obj, RewardEnvironment):
            _apply_sandbox_spec(obj, entry)
    elif entry.args:
        obj = functools.partial(obj, **entry.args) if callable(obj) else obj
    if not callable(obj):
        raise FatalWorkerError("RewardNotFound", f"{where}: is not callable (it is a {type(obj).__name__})")
    return LoadedReward(
        name=name, ref=where, func=obj, is_async=_is_async(obj), timeout_seconds=entry.timeout_seconds
    )


def _shown(filename: str) -> str:
    """A file of the run's code as its author knows it: relative to the working folder (a worker's is the
    run's code snapshot, the copy of the folder the run was applied from); elsewhere as it is."""
    path = Path(filename)
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else filename


def _fatal_raise(reward: LoadedReward, exc: BaseException) -> FatalWorkerError:
    if isinstance(exc, CallExited):  # the reward's own sys.exit, os._exit or KeyboardInterrupt
        exc = exc.raised
    frames = traceback.extract_tb(exc.__traceback__)
    said = f"raised {type(exc).__name__}: {exc}"
    if isinstance(exc, ExitCalled):  # the last frame is the guard's; the one before called os._exit
        frames, said = frames[:-1], f"called {exc}"
    at = f" at {_shown(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return FatalWorkerError("RewardFailed", f"reward {reward.name!r} ({reward.ref}) {said}{at}")


def check_scores(reward: LoadedReward, scores: Any, expected: int) -> list[float | None]:
    """One float or None per completion, JSON-safe (NaN -> None, as TRL reads both as 'not applicable')."""
    bad = f"reward {reward.name!r} ({reward.ref})"
    if hasattr(scores, "tolist") and not isinstance(scores, list):
        scores = scores.tolist()  # numpy array / torch tensor
    if not isinstance(scores, Sequence) or isinstance(scores, str | bytes):
        raise FatalWorkerError(
            "RewardBadOutput",
            f"{bad} returned a {type(scores).__name__}; return a list with one float per completion",
        )
    if len(scores) != expected:
        raise FatalWorkerError(
            "RewardBadOutput",
            f"{bad} returned {len(scores)} scores for {expected} completions; "
            "return exactly one per completion",
        )
    out: list[float | None] = []
    for i, value in enumerate(scores):
        if value is None:
            out.append(None)
            continue
        if not isinstance(value, numbers.Real):
            raise FatalWorkerError(
                "RewardBadOutput",
                f"{bad} returned {value!r} ({type(value).__name__}) at position {i}; "
                "return a float, or None when the reward does not apply",
            )
        try:
            number = float(value)
        except OverflowError:  # a Python int beyond any float
            number = math.inf
        if math.isinf(number):
            raise FatalWorkerError(
                "RewardBadOutput", f"{bad} returned {number} at position {i}; rewards must be finite"
            )
        out.append(None if math.isnan(number) else number)
    return out


@dataclass(frozen=True)
class RewardTimeout:
    """A reward call abandoned past its deadline: its completions scored None. `global_step` is TRL's: the
    steps trained before the batch, so the batch trains step global_step + 1, the number `get` shows."""

    name: str
    seconds: float
    completions: int
    global_step: int

    def describe(self, worker: str) -> str:
        """The Warning event's message: the worker, what it was doing and for how long."""
        return (
            f"{worker}: reward {self.name!r} did not return within its timeoutSeconds ({self.seconds:g} s) "
            f"scoring {self.completions} completions of step {self.global_step + 1}; they score None "
            "(not applicable), "
            "the run goes on; its stacks are in the worker's log"
        )


@dataclass
class Silence:
    """The reward calls that timed out since one last returned (a score or None: an answer either way)."""

    steps: set[int] = field(default_factory=set)  # TRL's global_step of the tasks they scored
    calls: int = 0
    timeouts: dict[str, float] = field(default_factory=dict)  # reward -> its timeoutSeconds

    def add(self, step: int, timed_out: dict[str, float]) -> None:
        """One task's calls, none of which returned."""
        self.steps.add(step)
        self.calls += len(timed_out)
        self.timeouts.update(timed_out)


def silence_failure(
    silence: Silence, answered: bool, abandoned_full: bool, limit: int = REWARD_SILENT_STEPS
) -> str | None:
    """Why the run fails for rewards that give no score at all, else None: no reward call returned for
    `limit` steps in a row, or none since the worker started and its abandoned calls fill it (a fresh
    worker would begin the same way). `answered`: a reward call returned in this worker. A reward that
    returns None answers: TRL reads it as not applicable, which a reward may say of every row."""
    if not silence.calls:
        return None
    if limit and len(silence.steps) >= limit:
        why = f"for {len(silence.steps)} steps in a row"
    elif abandoned_full and not answered:
        why = (
            "since this worker started, and its calls past their deadline fill it (a fresh worker would "
            "start the same way)"
        )
    else:
        return None
    first, last = min(silence.steps) + 1, max(silence.steps) + 1  # TRL's global_step trains the next step
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    several = len(silence.timeouts) > 1
    named = ", ".join(f"{name!r} ({seconds:g} s)" for name, seconds in silence.timeouts.items())
    return (
        f"{'rewards' if several else 'reward'} {named} did not return within "
        f"{'their' if several else 'its'} timeoutSeconds on any of {silence.calls} calls {why} ({steps}): "
        "every completion scored None, so nothing was trained on; make "
        f"{'them' if several else 'it'} return sooner or raise rewards[].timeoutSeconds"
    )


class RewardSet:
    """The spec's rewards, loaded once per worker and called for every task."""

    def __init__(
        self, rewards: list[LoadedReward], max_steps: int = 0, abandoner: Abandoner | None = None
    ) -> None:
        self.rewards = rewards
        self.max_steps = max_steps
        self.logs = RewardLogs()
        self.abandoner = abandoner or Abandoner()
        self.on_timeout: Callable[[RewardTimeout], None] | None = None  # the rollout records an event
        self._told: set[tuple[str, int]] = set()  # (reward, step) timeouts already told: one event each
        self.silence = Silence()  # calls timed out since a reward call last returned
        self.answered = False  # a reward call returned in this worker

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    @classmethod
    def from_spec(
        cls,
        entries: list[RewardSpec],
        max_steps: int = 0,
        run_dir: Path | None = None,
        environment_classes_importable: bool = True,
    ) -> RewardSet:
        """`run_dir`: the run's folder, where `cache: sqlite` keeps rewards.cache.sqlite;
        `environment_classes_importable`: load_reward's."""
        if not entries:
            raise FatalWorkerError("RewardNotFound", "spec.rewards is empty; GRPO needs at least one reward")
        names = reward_names(entries)
        return cls(
            [
                load_reward(e, i, n, run_dir, environment_classes_importable)
                for i, (e, n) in enumerate(zip(entries, names, strict=True))
            ],
            max_steps,
        )

    def _kwargs(
        self,
        prompt: Any,
        completions: list[Any],
        completion_ids: list[list[int]],
        row: dict[str, Any],
        step: int,
    ) -> dict[str, Any]:
        n = len(completions)
        columns = {k: [v] * n for k, v in row.items() if k not in RESERVED_COLUMNS}
        return {
            "prompts": [prompt] * n,
            "completions": completions,
            "completion_ids": completion_ids,
            **columns,
            "trainer_state": RolloutState(global_step=step, max_steps=self.max_steps),
            "log_extra": lambda column, values: self.logs.extra.setdefault(column, []).extend(values),
            "log_metric": lambda name, value: self.logs.metrics.setdefault(name, []).append(float(value)),
        }

    def _call(self, reward: LoadedReward, kwargs: dict[str, Any]) -> Any:
        """The reward's return value; CallTimedOut past its timeoutSeconds; what it raised, as a fatal
        error."""

        def invoke() -> Any:
            return asyncio.run(reward.func(**kwargs)) if reward.is_async else reward.func(**kwargs)

        try:
            return self.abandoner.call(invoke, reward.timeout_seconds, f"reward {reward.name}")
        except (FatalWorkerError, CallTimedOut, TooManyAbandonedCalls, ServiceOutage):
            raise
        except Exception as exc:
            raise _fatal_raise(reward, exc) from exc

    def _scores(
        self, reward: LoadedReward, kwargs: dict[str, Any], expected: int, global_step: int
    ) -> tuple[list[float | None], float | None]:
        """One reward's checked scores and None, or None for each completion and the deadline when its call
        ran past it. The worker's abandoned calls filling it while no reward call ever returned here fail
        the run (`silence_failure`) rather than relaunch it."""
        try:
            return check_scores(reward, self._call(reward, kwargs), expected), None
        except CallTimedOut as exc:
            if self.on_timeout is not None and (reward.name, global_step) not in self._told:
                self._told.add((reward.name, global_step))
                self.on_timeout(RewardTimeout(reward.name, exc.seconds, expected, global_step))
            return [None] * expected, exc.seconds
        except TooManyAbandonedCalls:
            failure = silence_failure(self.silence, self.answered, abandoned_full=True)
            if failure is not None:
                raise FatalWorkerError(REWARD_TIMED_OUT, failure) from None
            raise

    def _heard(self, global_step: int, timed_out: dict[str, float], answered: bool) -> None:
        """Count a task whose reward calls all timed out (none answered); fail the run once
        `silence_failure` says so."""
        if answered:
            self.answered, self.silence = True, Silence()
            return
        if not timed_out:
            return
        self.silence.add(global_step, timed_out)
        failure = silence_failure(self.silence, self.answered, abandoned_full=False)
        if failure is not None:
            raise FatalWorkerError(REWARD_TIMED_OUT, failure)

    def report(
        self, prompt: Any, completion: Any, completion_ids: list[int], row: dict[str, Any]
    ) -> list[RewardReport]:
        """Each reward on one completion on its own, output captured: where `score` stops at the first
        broken reward (as a run must), this says what every one of them did."""
        kwargs = self._kwargs(prompt, [completion], [completion_ids], row, step=0)
        # wurlitzer captures the file descriptors, where a child process or C code writes: Python's own
        # redirection alone let them print over the report (and into `-o json`'s document). Imported here:
        # only the CLI's `test reward` reports, and workers need not carry it.
        from wurlitzer import pipes

        reports = []
        for reward in self.rewards:
            self.logs = RewardLogs()
            out, err = io.StringIO(), io.StringIO()
            score, error = None, None
            with (
                pipes() as (fd_out, fd_err),
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(err),
            ):
                try:
                    [score] = check_scores(reward, self._call(reward, kwargs), 1)
                except (FatalWorkerError, CallTimedOut) as exc:
                    error = str(exc)
            stdout, stderr = out.getvalue() + fd_out.read(), err.getvalue() + fd_err.read()
            reports.append(RewardReport(reward.name, score, error, stdout, stderr, self.logs))
        return reports

    def score(
        self,
        prompt: Any,
        completions: list[Any],
        completion_ids: list[list[int]],
        row: dict[str, Any],
        step: int = 0,
        environments: list[Any] | None = None,
        prompts: list[Any] | None = None,
    ) -> dict[str, list[float | None]]:
        """Every reward's scores for one prompt's completions: {name: [score or None, ...]}. `step` is TRL's
        trainer_state.global_step (the steps trained before this batch, 0 for the first). Tool-calling runs
        with spec.rollout.environment pass, as TRL does, `environments` (one per completion) and `prompts`
        (each completion's prompt after its environment's reset appended what it returned)."""
        self.logs = RewardLogs()
        kwargs = self._kwargs(prompt, completions, completion_ids, row, step)
        if environments is not None:
            kwargs["environments"] = environments
        if prompts is not None:
            kwargs["prompts"] = prompts
        scores: dict[str, list[float | None]] = {}
        timed_out: dict[str, float] = {}
        for reward in self.rewards:
            scores[reward.name], seconds = self._scores(reward, kwargs, len(completions), step)
            if seconds is not None:
                timed_out[reward.name] = seconds
        self._heard(step, timed_out, answered=len(timed_out) < len(self.rewards))
        return scores
