"""`env: code-execution`: does the completion's Python pass its row's tests, run in the sandbox?

    from mortal.rewards.examples import CodeExecutionEnvironment
    env = CodeExecutionEnvironment(tests_column="tests", partial_credit=True)
    env(completions=["```python\\ndef add(a, b):\\n    return a + b\\n```"], prompts=["..."],
        tests=[["assert add(1, 2) == 3", "assert add(0, 0) == 0"]])          # -> [1.0]

Who calls it: RewardSet (a spec's `env: code-execution`, args -> these kwargs, sandbox -> the
limits), or TRL directly. The code is the last ```python block of the completion (an unclosed
block, cut by maxTokens, counts), else the whole text. The row's tests are assert statements (a
list, or one string with one per line). Each completion is one execution: a small harness loads
the code as a module named `__solution__` (so `if __name__ == "__main__":` demos do not run),
then runs every test in its namespace, each in its own try, and reports each verdict on stdout
behind a random token it read from stdin; the code's own prints go to /dev/null. Score: 1.0 when
every test passed (with partial_credit, the fraction that passed), 0.0 without code, None for a
row without tests. A timeout keeps the verdicts reported before it (partial credit) and is not cached.
Limits of the harness: the code shares the test's process, so exiting early or printing fake
verdicts scores 0, but code that inspects the harness's frames or returns objects that equal
everything can still fool `assert`; a run that must resist that should run tests out of process.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, ClassVar

from mortal.workers.rewards.environments.base import BuiltinEnvironment, Item, Log, Outcome, column
from mortal.workers.rewards.sandbox import Job, SandboxConfig

FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)
OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*)$", re.S | re.I)
PYTHON_TAGS = ("python", "python3", "py", "")

HARNESS = r"""
import json, os, sys

STOP_AT_FAILURE = __STOP__

def _run():
    token = sys.stdin.readline().strip()
    with open("tests.json", encoding="utf-8") as handle:
        tests = json.load(handle)
    with open("solution.py", encoding="utf-8") as handle:
        source = handle.read()
    out = sys.stdout
    quiet = open(os.devnull, "w")

    def verdict(index, passed, why=""):
        out.write("%s %d %s %s\n" % (token, index, "pass" if passed else "fail", json.dumps(why[:300])))
        out.flush()

    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    sys.stdout = sys.stderr = quiet
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:  # SystemExit too: leaving early is not passing
        verdict(-1, False, "solution: %s: %s" % (type(exc).__name__, exc))
        return
    for index, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d" % index, "exec"), namespace)
        except BaseException as exc:
            verdict(index, False, "%s: %s" % (type(exc).__name__, exc))
            if STOP_AT_FAILURE:
                return
        else:
            verdict(index, True)

_run()
"""


def extract_code(completion: str) -> str:
    """The last ```python (or untagged) block; an unclosed one at the end; else the whole text."""
    blocks = FENCE.findall(completion)
    python = [code for tag, code in blocks if tag.lower() in PYTHON_TAGS]
    if python:
        return python[-1].strip()
    tail = OPEN_FENCE.search(completion)
    if tail is not None and "```" not in tail.group(1):
        return tail.group(1).strip()
    if blocks:  # only blocks in other languages: there is no Python here
        return ""
    return completion.strip()


def as_tests(value: Any) -> list[str]:
    """A row's tests: a list of statements, or one string (one per line)."""
    if isinstance(value, str):
        return [line for line in value.splitlines() if line.strip()]
    if isinstance(value, list | tuple) and all(isinstance(t, str) for t in value):
        return [t for t in value if t.strip()]
    raise ValueError(
        f"code-execution: tests must be a list of assert strings or one string (got {type(value).__name__})"
    )


def _passed(stdout: str, token: str, count: int) -> tuple[set[int], bool]:
    """Test indexes reported as passed, and whether the solution itself failed to load."""
    passed: set[int] = set()
    broken = False
    for line in stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == token:
            index, verdict = int(parts[1]), parts[2]
            if index == -1:
                broken = True
            elif verdict == "pass" and 0 <= index < count:
                passed.add(index)
    return passed, broken


class CodeExecutionEnvironment(BuiltinEnvironment):
    """Score = tests passed by the completion's code (see the module docstring)."""

    ENV = "code-execution"
    name = "code_execution"
    SPEC_ARGS: ClassVar[tuple[str, ...]] = (
        "tests_column",
        "partial_credit",
        "max_processes",
        "workers",
        "confinement",
        "allow_unconfined",
        *BuiltinEnvironment.SPEC_ARGS,
    )

    def __init__(
        self,
        tests_column: str = "tests",
        partial_credit: bool = False,
        timeout: float | None = None,
        memory_mb: int | None = None,
        max_processes: int | None = None,
        workers: int | None = None,
        confinement: str = "auto",
        allow_unconfined: bool = False,
        cache: str | None = None,
        cache_size: int = 4096,
        cache_path: str | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(cache, cache_size, cache_path)
        self.tests_column, self.partial_credit = tests_column, partial_credit
        self.timeout, self.memory_mb, self.max_processes, self.workers = (
            timeout,
            memory_mb,
            max_processes,
            workers,
        )
        self.confinement, self.allow_unconfined = confinement, allow_unconfined
        base = type(self).sandbox_config
        overrides = {
            "timeout": timeout,
            "memory_mb": memory_mb,
            "max_processes": max_processes,
            "workers": workers,
            "backend": backend,
        }
        self.sandbox_config = SandboxConfig(
            **{
                **base.__dict__,
                **{k: v for k, v in overrides.items() if v is not None},
                "confinement": confinement,
                "allow_unconfined": allow_unconfined,
            }
        )

    def check(self) -> None:
        """Fail now (SandboxUnavailable) if no sandbox works, before a model is loaded."""
        self._executor(trusted=False).check()

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "tests_column": self.tests_column,
            "partial_credit": self.partial_credit,
            "sandbox": self.sandbox_config.limits(),
        }

    def spec_entry(self) -> dict[str, Any] | None:
        entry = super().spec_entry()
        if entry is not None and (self.timeout is not None or self.memory_mb is not None):
            entry["sandbox"] = {
                k: v
                for k, v in (("timeout_seconds", self.timeout), ("memory_mb", self.memory_mb))
                if v is not None
            }
        return entry

    def _job(self, code: str, tests: list[str], token: str) -> Job:
        harness = HARNESS.replace("__STOP__", str(not self.partial_credit))
        return Job(harness, stdin=token + "\n", files={"solution.py": code, "tests.json": json.dumps(tests)})

    def score_items(self, items: list[Item], log: Log) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(items)
        jobs, where, tokens, counts = [], [], [], []
        for i, item in enumerate(items):
            tests = as_tests(column(item, self.tests_column, "code-execution"))
            code = extract_code(item.completion)
            if not tests:
                outcomes[i] = Outcome(None)
            elif not code:
                outcomes[i] = Outcome(0.0)
            else:
                token = secrets.token_hex(16)
                jobs.append(self._job(code, tests, token))
                where.append(i)
                tokens.append(token)
                counts.append(len(tests))
        results = self.execute_batch_in_sandbox(jobs) if jobs else []
        timeouts = 0
        for i, token, count, result in zip(where, tokens, counts, results, strict=True):
            passed, broken = _passed(result.stdout, token, count)
            timeouts += result.ran_out_of_time
            if self.partial_credit:
                score = 0.0 if broken else len(passed) / count
            else:
                score = 1.0 if len(passed) == count and not broken else 0.0
            outcomes[i] = Outcome(score, cacheable=not result.ran_out_of_time and result.error is None)
        log(f"{self.name}/timeouts", float(timeouts))
        log(f"{self.name}/executions", float(len(jobs)))
        return [o if o is not None else Outcome(None) for o in outcomes]
