"""Errors of the spec layer: what a user sees when a TrainingRun document is wrong.

`SpecError` is raised by `mortal.specs.loader` (and by `TrainingRun.from_record` on a stored spec that
no longer validates). It carries every `SpecIssue` found, so one `apply` reports all mistakes at once,
each as `file:line: field.path: message`, the way compilers and kubectl do. This module must not
import pydantic or YAML: callers (the CLI) only format and print these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecIssue:
    """One problem in one document: where it is (file, line, camelCase field path) and how to fix it."""

    source: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class SpecError(ValueError):
    """A TrainingRun document (or several) could not be read; `issues` lists every problem found."""

    def __init__(self, issues: list[SpecIssue]):
        if not issues:
            raise ValueError("SpecError needs at least one issue")
        self.issues = list(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))
