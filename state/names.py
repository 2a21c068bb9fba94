"""The names the store records, checked where they are stored, whoever the client (CLI, HTTP, a script).

Called by SqlStore at the calls that create a name (apply_run, fork_run, create_worker), so a name the
store holds is safe to use as a folder (mortal.state.paths), a process name and a URL path segment. The
rules are the spec's (mortal.specs.metadata), one set for both. Reads are not checked: a row stored before
these checks must stay readable and deletable.
"""

from __future__ import annotations

from mortal.specs.metadata import dns1123_label_problem, labels_problem
from mortal.state.errors import InvalidName


def check_run_name(name: str) -> str:
    problem = dns1123_label_problem(name)
    if problem:
        raise InvalidName(f"trainingrun name {problem}")
    return name


def check_role(role: str) -> str:
    problem = dns1123_label_problem(role)
    if problem:
        raise InvalidName(f"worker role {problem}")
    return role


def check_metadata(labels: dict[str, str], annotations: dict[str, str]) -> None:
    """Label keys and values, annotation keys (annotation values are free text)."""
    problem = labels_problem(labels)
    if problem:
        raise InvalidName(f"label {problem}")
    problem = labels_problem(annotations, values=False)
    if problem:
        raise InvalidName(f"annotation {problem}")
