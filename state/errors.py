"""Typed errors raised by every Store implementation.

Callers branch on these types (never on message text): the CLI maps them to exit code 1, the
controller requeues on `Conflict`, a worker exits when it is `Fenced`.
"""


class StoreError(Exception):
    """Base class of everything the state store raises on purpose."""


class NotFound(StoreError):
    """The named object does not exist (or was deleted)."""


class AlreadyExists(StoreError):
    """A create found the object already there."""


class Conflict(StoreError):
    """A write carried a stale resource_version (or precondition): someone else wrote first.

    Never retried silently by the store; the caller re-reads and decides.
    """


class ChangeRefused(Conflict):
    """A spec change the run cannot take, whoever writes it (state.spec_changes): a finished run's, or a
    maxSteps below the step the run reached. Not a race: re-reading does not help (HTTP 409)."""


class StaleDocument(Conflict):
    """An applied document carries the generation or uid it was read at (`get -o yaml`), and the run has
    moved on since: its spec changed (a scale, a suspend, another apply) or it is another run of that name.
    Applying it would undo those changes silently; re-reading does not help: the user gets it again."""


class Fenced(StoreError):
    """A write came from a superseded incarnation (a zombie worker) or a leader that lost its lease."""


class Unavailable(StoreError):
    """The store could not answer: unreachable, timed out, or failed inside (an HTTP store's 5xx).

    Retrying may help; the caller cannot know whether a write that raised this was applied.
    """


class ConnectionLost(Unavailable):
    """The database connection broke before the transaction's COMMIT was sent: nothing was applied.

    SqlStore makes such a call again once, on a new connection; a second break is raised.
    """


class Unauthorized(StoreError):
    """The HTTP store refused the request's bearer token (MORTAL_STATE_TOKEN)."""


class Forbidden(StoreError):
    """The HTTP store knows who is asking (a worker's scoped token) and that token may not make this call:
    another run's data, another worker's slot, or an admin operation (mortal.state.auth)."""


class InvalidValue(StoreError, ValueError):
    """The call carried a value the store cannot hold (the database refused it: a NUL in a text, a number
    out of range). Bad input, never retried: HTTP 422."""


class InvalidName(InvalidValue):
    """A name the store refuses to record (mortal.state.names): a run name, a role, a label or annotation
    key that is not what the spec allows. Names later become folders and process names, so the store checks
    them itself, whoever the client. HTTP 422."""
