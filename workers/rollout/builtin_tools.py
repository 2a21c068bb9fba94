"""Tools shipped with mortal, for the examples: a calculator for builtin:arith, and an arithmetic environment.

A spec names them like any user tool (`rollout.tools: ["mortal.workers.rollout.builtin_tools:calculator"]`,
`rollout.environment: "mortal.workers.rollout.builtin_tools:ArithEnvironment"`); the rollout worker calls them
(mortal.workers.rollout.tools). Their docstrings are their schemas (transformers reads the Args section).
They must stay pure: no I/O, and no eval of the model's text (an expression is parsed, never run).
"""

from __future__ import annotations

import ast
import operator
from typing import Any

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_MAGNITUDE = 10**12


class CalculatorError(ValueError):
    """The expression is not plain arithmetic on numbers (the model is told why)."""


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if max(abs(left), abs(right)) > MAX_MAGNITUDE:
            raise CalculatorError("numbers above 10**12 are not supported")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise CalculatorError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers combined with + - * / // % and parentheses, e.g. "13 + 14".
    """
    try:
        tree = ast.parse(str(expression).strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}: {exc.msg}") from None
    value = _evaluate(tree)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class ArithEnvironment:
    """An environment for builtin:arith (TRL's environment_factory shape): `reset` keeps the row's answer,
    `add` computes, `submit` records the model's answer, `get_reward` is 1.0 when it was right."""

    def __init__(self) -> None:
        self.answer: str | None = None
        self.submitted: str | None = None

    def reset(self, answer: Any = None, **row: Any) -> None:
        self.answer, self.submitted = None if answer is None else str(answer), None

    def add(self, a: float, b: float) -> str:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return calculator(f"{float(a)!r} + {float(b)!r}")

    def submit(self, answer: str) -> str:
        """Submit the final answer.

        Args:
            answer: The answer, as a number.
        """
        self.submitted = str(answer).strip()
        return "submitted"

    def get_reward(self) -> float:
        if self.submitted is None or self.answer is None:
            return 0.0
        try:
            return float(float(self.submitted) == float(self.answer))
        except ValueError:
            return 0.0


class CodeAgentEnvironment:
    """A code agent for builtin:mbpp-mini (TRL's environment_factory shape): its one tool, `run_tests`, runs
    the model's code against the row's asserts in the reward sandbox (confined: no network, time and memory
    limits; mortal.workers.rewards.sandbox) and answers with the failure, so the model can fix it and try
    again; `get_reward` is 1.0 once a run passed every test. Model-written code never runs in the worker."""

    def __init__(self) -> None:
        self.tests: list[str] = []
        self.passed = False
        self._sandbox: Any = None

    def reset(self, tests: Any = None, **row: Any) -> None:
        from mortal.workers.rewards.environments.code_execution import as_tests

        self.tests, self.passed = as_tests(tests or []), False

    def run_tests(self, code: str) -> str:
        """Run Python code against the task's tests.

        Args:
            code: The complete Python code (the function definitions), without the tests.
        """
        import secrets

        if self._sandbox is None:
            from mortal.workers.rewards import RewardEnvironment

            self._sandbox = RewardEnvironment()  # only for its execute_in_sandbox
        token = secrets.token_hex(8)  # printed after the asserts; the model never sees it, so cannot fake it
        program = f"{code}\n\n" + "\n".join(self.tests) + f"\nprint({token!r})\n"
        result = self._sandbox.execute_in_sandbox(program)
        if result.success and token in result.stdout:
            self.passed = True
            return "All tests passed."
        if result.ran_out_of_time:  # the wall clock or the CPU-seconds limit, whichever ended it first
            return "Failed: the code timed out."
        detail = (result.error or result.stderr or result.stdout).strip()
        return "Failed:\n" + detail[-800:]

    def get_reward(self) -> float:
        return 1.0 if self.passed else 0.0
