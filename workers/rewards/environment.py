"""The base class of structured rewards: a user's (or a built-in environment's) TRL reward function.

Who uses it: reward modules that subclass it (a spec references the class), the built-in environments
(mortal.workers.rewards.environments) and mortal.workers.rewards, which calls an instance as TRL would.
Its execute_* helpers run code through mortal.workers.rewards.sandbox.
"""

from __future__ import annotations

from typing import Any

from mortal.workers.rewards.builtin import completion_text
from mortal.workers.rewards.sandbox import (
    ExecutionResult,
    Executor,
    FunctionConfig,
    Job,
    SandboxConfig,
    make_executor,
)


def prompt_text(prompt: Any) -> str:
    """A prompt as text: itself, or the content of the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    chosen = users[-1] if users else (prompt[-1] if prompt else {})
    return str(chosen.get("content", "")) if isinstance(chosen, dict) else str(chosen)


class RewardEnvironment:
    """A structured reward: override `score` (one completion) or `score_batch` (all of them).

    Reference the class from a spec (`function: my_module:MyEnv`, with constructor kwargs under
    `args`), or pass an instance to TRL directly: an instance is a TRL reward function. `score`
    sees text: the completion's content and the prompt (the last user message of a chat), plus
    this completion's dataset columns as keyword arguments. To run code, use the execute_* helpers:
    `execute_in_sandbox` for model-written code (confined, limits from the `sandbox_config` class
    attribute), `execute_in_function` for your own trusted code (a plain subprocess, timeout only).
    """

    name: str | None = None
    sandbox_config: SandboxConfig = SandboxConfig()
    function_config: FunctionConfig = FunctionConfig()

    def score(self, completion: str, prompt: str, **kwargs: Any) -> float | None:
        raise NotImplementedError(f"{type(self).__name__} must override score() or score_batch()")

    def score_batch(self, completions: list[str], prompts: list[str], **kwargs: Any) -> list[float | None]:
        """Default: `score` per item; list-valued kwargs of matching length are split per item."""
        n = len(completions)
        per_item = {k: v for k, v in kwargs.items() if isinstance(v, list) and len(v) == n}
        shared = {k: v for k, v in kwargs.items() if k not in per_item}
        return [
            self.score(c, p, **shared, **{k: v[i] for k, v in per_item.items()})
            for i, (c, p) in enumerate(zip(completions, prompts, strict=True))
        ]

    def __call__(
        self, completions: list[Any], prompts: list[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        prompts = prompts if prompts is not None else [""] * len(completions)
        kwargs.pop("completion_ids", None)
        return self.score_batch(
            [completion_text(c) for c in completions], [prompt_text(p) for p in prompts], **kwargs
        )

    # -- execution helpers (the seed's "Remote Execution Tools") -------------------------------------
    # sandbox: untrusted code, confined, under `sandbox_config` (mortal.workers.rewards.sandbox);
    # function: trusted code (yours), a plain subprocess with `function_config.timeout` and no confinement.
    def _executor(self, trusted: bool) -> Executor:
        attr = "_function_executor" if trusted else "_sandbox_executor"
        config = self.function_config.as_sandbox() if trusted else self.sandbox_config
        current = self.__dict__.get(attr)
        if current is None or current.config != config:  # built on first use; rebuilt if the config changed
            current = make_executor(config, trusted=trusted)
            self.__dict__[attr] = current
        return current

    def execute_in_sandbox(
        self, code: str, stdin: str = "", files: dict[str, str] | None = None
    ) -> ExecutionResult:
        return self._executor(trusted=False).run(code, stdin, files)

    def execute_batch_in_sandbox(self, codes: list[str | Job]) -> list[ExecutionResult]:
        return self._executor(trusted=False).run_batch(codes)

    def execute_in_function(
        self, code: str, stdin: str = "", files: dict[str, str] | None = None
    ) -> ExecutionResult:
        return self._executor(trusted=True).run(code, stdin, files)

    def execute_batch_in_function(self, codes: list[str | Job]) -> list[ExecutionResult]:
        return self._executor(trusted=True).run_batch(codes)
