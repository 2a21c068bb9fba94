"""A reward module that binds os._exit by its own name when imported (`from os import _exit`): imported only
through a spec reference (mortal.workers.references.resolve), never by a test module, since the guard on
os._exit must be in place before it is imported (tests/workers/rewards/test_rewards.py)."""

from os import _exit


def exits(completions, **kwargs):
    _exit(4)
