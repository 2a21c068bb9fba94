"""What the client layer raises for a user's mistake or a refused request, as opposed to a bug.

mortalctl prints such an error as one paragraph and exits 1 (no traceback without --debug);
MortalTrainer lets it through to the caller. Its subclasses say what was refused (fork.ForkError, ...).
"""

from __future__ import annotations


class ClientError(Exception):
    """A user error (bad input, nothing to act on, a precondition that failed): its message says which."""
