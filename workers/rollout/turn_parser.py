"""A model's turn parsed into its message (TRL's parse_response), the history before it cut to the message the
turn is part of.

Who uses it: mortal.workers.rollout.multiturn, for every turn a rollout's model says (under the tool loop's
tokenizer lock, so one parse at a time).
Why the cut: parse_response decodes the whole prefix it is given on every call (the prompt rendered with its
tool schemas, then every turn and tool answer so far), the largest part of the tool loop's own host work
(bench/tool_loop_host.py), yet the parser reads the prefix only for the message the turn belongs to: the
chat template's header, written after the previous message's end. So the prefix is cut after the history's
last end-of-sequence token. TRL's templates parse alike either way (tests/workers/rollout/
test_turn_parser.py), but no template promises it, so the first VERIFIED_PARSES parses are made both ways,
and the first that differs turns the cut off for this parser (a warning in the worker's log); until then a
parse is what the whole history gives.
What it must not do: hand out the dicts it remembers (callers keep and change theirs), or use the cut after
a parse that differed.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from mortal.workers.rollout.remembered import Remembered, tool_functions

log = logging.getLogger("mortal.worker")

VERIFIED_PARSES = 16  # parses made both with the cut prefix and with the whole history
Parse = Callable[..., dict[str, Any]]  # parse_response's signature: (tokenizer, ids, prefix=, tools=)


def default_parse(tokenizer: Any, ids: list[int], prefix: list[int], tools: Any) -> dict[str, Any]:
    from trl.chat_template_utils import parse_response

    return parse_response(tokenizer, ids, prefix=prefix, tools=tools)


class TurnParser:
    """Turns parsed after their history's last EOS, each (cut prefix, turn, tools) remembered: a task's
    rollouts of one prompt often say the same turn after the same message header."""

    def __init__(
        self,
        tokenizer: Any,
        schemas: Callable[[list[Any]], list[dict[str, Any]]],
        kept: int,
        parse: Parse = default_parse,
    ) -> None:
        """`schemas`: the tools' JSON schemas (MultiTurn's, remembered by function); `kept`: how many parses
        are remembered."""
        self.tokenizer, self.schemas, self._parse = tokenizer, schemas, parse
        self.eos_id: int | None = getattr(tokenizer, "eos_token_id", None)
        self.cutting = self.eos_id is not None
        self.verified = 0
        self._parses = Remembered(kept)

    def parse(self, ids: list[int], history: list[int], tools: list[Any]) -> dict[str, Any]:
        """The message `ids` say after `history` (a copy)."""
        prefix = self.prefix(history)
        key = (tuple(prefix), tuple(ids), tool_functions(tools))
        return copy.deepcopy(self._parses.get(key, lambda: self._checked(ids, history, prefix, tools)))

    def prefix(self, history: list[int]) -> list[int]:
        """What the parser is given: `history` after its last EOS while cutting, else all of it."""
        if self.cutting:
            for at in range(len(history) - 1, -1, -1):
                if history[at] == self.eos_id:
                    return history[at + 1 :]
        return history

    def _checked(
        self, ids: list[int], history: list[int], prefix: list[int], tools: list[Any]
    ) -> dict[str, Any]:
        schemas = self.schemas(tools) or None
        parsed = self._parse(self.tokenizer, ids, prefix=prefix, tools=schemas)
        if len(prefix) == len(history) or self.verified >= VERIFIED_PARSES:
            return parsed
        self.verified += 1
        whole = self._parse(self.tokenizer, ids, prefix=history, tools=schemas)
        if whole != parsed:
            self.cutting = False
            log.warning(
                "the chat template's turns parse differently with the history cut after its last "
                "end-of-sequence token; parsing with the whole history from now on (slower)"
            )
        return whole
