"""'module:attr.sub' references to user code (reward functions, tools, environments), resolved in a worker.

Called by mortal.workers.rewards (spec.rewards[].function) and mortal.workers.rollout.tools
(spec.rollout.tools, rollout.environment); each turns the failures into its own typed error, naming its spec
field. What it must not do: catch anything: what the module raises while being imported is the caller's to
report.
"""

from __future__ import annotations

import importlib
from typing import Any

from mortal.workers.deadline import guard_process_exit


class MissingAttribute(AttributeError):
    """The module imported, but has no such attribute (not an AttributeError raised while importing it)."""

    def __init__(self, module: str, attr_path: str) -> None:
        super().__init__(f"module {module} has no attribute {attr_path}")
        self.module, self.attr_path = module, attr_path


def resolve(ref: str) -> Any:
    """The object `ref` names: its module imported, then each dotted attribute in turn. The guard on os._exit
    goes in first, so a module that binds it at import (`from os import _exit`) binds the guarded one."""
    guard_process_exit()
    module_name, _, attr_path = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise MissingAttribute(module_name, attr_path)
        obj = getattr(obj, part)
    return obj
