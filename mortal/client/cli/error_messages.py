"""The paragraph mortalctl prints for an error a user can cause (kubectl style: `error: ...`).

Who calls it: main.py's root command for what a verb raises, and apply.py for each run it refused while
applying the others. Types decide the wording (errors are types here, never matched by their text).
"""

from __future__ import annotations

import os

from mortal.client.errors import ClientError

NO_CONTROLLER_YET = (
    "What this command wrote stays in the store (an applied run stays applied), but no controller acts on "
    "it until one runs: fix what the log says, then run this command again, or start one in the "
    "foreground with `mortalctl controller`."
)
"""What a failed controller start leaves: said after it, by every verb that starts one."""


def error_message(exc: BaseException, debug: bool = False) -> str:
    """The paragraph a user sees for `exc` (kubectl style: 'error: ...')."""
    from mortal.controller.errors import ControllerStartFailed
    from mortal.specs import SpecError
    from mortal.state import ChangeRefused, Conflict, Fenced, NotFound, StaleDocument, StoreError
    from mortal.state.paths import shown_url
    from mortal.workers.errors import FatalWorkerError, ServiceOutage

    if isinstance(exc, SpecError):
        if len(exc.issues) == 1:
            return f"error: {exc.issues[0]}"
        listed = "\n".join(f"  {issue}" for issue in exc.issues)
        return f"error: {len(exc.issues)} problems in the TrainingRun documents:\n{listed}"
    if isinstance(exc, NotFound | ChangeRefused | StaleDocument):
        return f"error: {exc}"
    if isinstance(exc, Conflict):
        return f"error: conflict: {exc}; read the run again and retry"
    if isinstance(exc, Fenced):
        return f"error: refused: {exc}"
    if isinstance(exc, ControllerStartFailed):
        return f"error: {exc}\n{NO_CONTROLLER_YET}"
    if isinstance(exc, (StoreError, ClientError)):
        return f"error: {exc}"
    if isinstance(exc, FatalWorkerError | ServiceOutage):  # what would end a worker (`test rollout` runs a
        return f"error: {exc}"  # worker's code here): its message says what to fix or what is down
    if type(exc).__module__.startswith("sqlalchemy"):
        url = os.environ.get("MORTAL_STATE_URL")
        where = shown_url(url) if url else "the default SQLite store"
        return f"error: cannot use the state store ({where}): {_first_line(exc)}"
    hint = "" if debug else " (run again with --debug for the traceback)"
    return f"error: unexpected {type(exc).__name__}: {_first_line(exc)}{hint}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
