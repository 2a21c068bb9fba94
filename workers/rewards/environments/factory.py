"""A spec's `env:` entry -> a built-in environment instance, with every mistake named by its field.

Who calls it: mortal.workers.rewards.load_reward, once per `env:` entry when a rollout worker
starts. `args` become constructor kwargs (only the environment's SPEC_ARGS: anything else is
spec.rewards[i].args.KEY with a hint); `sandbox` becomes the code-execution limits; `model`,
`baseURL`, `apiKeyEnv` configure llm-judge and are refused elsewhere; `cache: sqlite` stores the
cache in the run's folder. The sandbox is probed here, so a machine that cannot confine code fails
the run before a model is loaded.
What it must not do: construct user code (function: entries are load_reward's).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mortal.workers.errors import FatalWorkerError
from mortal.workers.rewards.environments import ENVIRONMENTS
from mortal.workers.rewards.environments.base import BuiltinEnvironment, sqlite_cache_path

if TYPE_CHECKING:
    from mortal.specs.rewards import RewardSpec

JUDGE_FIELDS = (("model", "model"), ("base_url", "baseURL"), ("api_key_env", "apiKeyEnv"))


def _bad(where: str, message: str) -> FatalWorkerError:
    return FatalWorkerError("RewardBadArgs", f"{where}: {message}")


def _check_args(entry: RewardSpec, index: int, cls: type[BuiltinEnvironment]) -> None:
    for key in entry.args:
        if key not in cls.SPEC_ARGS:
            close = difflib.get_close_matches(key, cls.SPEC_ARGS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            extra = (
                " (the limits go under `sandbox:`: timeoutSeconds, memoryMB)"
                if key in ("timeout", "memory_mb") and entry.env == "code-execution"
                else ""
            )
            raise _bad(
                f"spec.rewards[{index}].args.{key}",
                f"env {entry.env} takes no argument {key!r}{hint}{extra}; "
                f"it takes: {', '.join(cls.SPEC_ARGS)}",
            )


def _judge_kwargs(entry: RewardSpec, index: int) -> dict[str, Any]:
    if not entry.model:
        raise _bad(
            f"spec.rewards[{index}].model",
            "env llm-judge needs the judge's model name, e.g. model: gpt-4o-mini",
        )
    key_env = entry.api_key_env or "OPENAI_API_KEY"
    if not os.environ.get(key_env):
        raise FatalWorkerError(
            "RewardSecretMissing",
            f"spec.rewards[{index}].apiKeyEnv: environment variable {key_env} (the judge's API key) is not "
            "set in this worker; export it where the controller runs and list it in spec.secrets: "
            f"[{key_env}]",
        )
    return {"model": entry.model, "base_url": entry.base_url, "api_key_env": key_env}


def build_environment(entry: RewardSpec, index: int, run_dir: Path | None = None) -> BuiltinEnvironment:
    """The environment `entry.env` configured from the entry; FatalWorkerError naming the field at fault."""
    cls = ENVIRONMENTS[str(entry.env)]
    _check_args(entry, index, cls)
    kwargs: dict[str, Any] = dict(entry.args)
    if entry.env == "llm-judge":
        kwargs.update(_judge_kwargs(entry, index))
    else:
        for field, yaml_key in JUDGE_FIELDS:
            if getattr(entry, field) is not None:
                raise _bad(
                    f"spec.rewards[{index}].{yaml_key}", f"only env llm-judge reads it (this is {entry.env})"
                )
    if entry.env == "code-execution":
        kwargs.update(
            timeout=entry.sandbox.timeout_seconds,
            memory_mb=entry.sandbox.memory_mb,
            backend=entry.sandbox.backend,
        )
    if kwargs.get("cache") == "sqlite" and not kwargs.get("cache_path"):
        if run_dir is None:
            raise _bad(
                f"spec.rewards[{index}].args.cache", "'sqlite' needs a run folder (or args.cache_path)"
            )
        kwargs["cache_path"] = sqlite_cache_path(run_dir)
    try:
        env = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise _bad(f"spec.rewards[{index}].args", f"env {entry.env}: {exc}") from exc
    check = getattr(env, "check", None)
    try:
        if check is not None:
            check()
    except FatalWorkerError as exc:
        raise FatalWorkerError(exc.reason, f"spec.rewards[{index}] (env {entry.env}): {exc.message}") from exc
    return env
