"""Where spec.rollout.chatTemplate leads: a .jinja file of the user's, or the name of one of TRL's templates.

Who calls it: the apply-time probe (mortal.workers.probe.check_chat_template) and the rollout worker
(mortal.workers.rollout.multiturn.resolve_chat_template), so that apply refuses exactly the names the
worker could not resolve. TRL is imported here only when a name must be looked up among its templates.
"""

from __future__ import annotations

import os
from pathlib import Path


class UnknownChatTemplate(ValueError):
    """The name is neither an existing .jinja file nor one of TRL's templates (the message lists them)."""


def trl_template_names() -> list[str]:
    """The templates TRL ships (trl/chat_templates/*.jinja), by name."""
    from trl.chat_template_utils import _CHAT_TEMPLATES_DIR

    return sorted(path.stem for path in _CHAT_TEMPLATES_DIR.glob("*.jinja"))


def template_file(name: str) -> Path:
    """The file `name` renders with: itself when it ends in .jinja (~ expanded), else TRL's template."""
    if name.endswith(".jinja"):
        path = Path(os.path.expanduser(name))
        if not path.is_file():
            raise UnknownChatTemplate(f"{name!r}: no such file")
        return path
    from trl.chat_template_utils import _CHAT_TEMPLATES_DIR

    if name not in (known := trl_template_names()):
        raise UnknownChatTemplate(f"{name!r}: neither a .jinja file nor a TRL template ({', '.join(known)})")
    return _CHAT_TEMPLATES_DIR / f"{name}.jinja"
