"""Limits on what one spec text may make the YAML reader build: alias uses, what they repeat, nesting,
values and comment lengths.

Who calls it: mortal.specs.loader (every `apply -f` input, the watched folder, JSON included, which is
YAML) and mortal.specs.fork (override fragments and `--set` values). ruamel.yaml shares an aliased
node instead of copying it, so a few hundred bytes of nested aliases ("billion laughs") stand for
billions of nodes, which turning them into plain data would build. The limits are checked while
the text is composed, event by event, before anything is expanded; a spec needs few or no aliases.
The reader is pure Python and slow for each value it composes, so a text within MAX_TEXT_CHARS made of
tiny values (`[{},{},...]`) is refused by their count before the rest of it is read.
What it must not do: expand an alias to measure it (sizes are memoized per node, so counting is linear).
"""

from __future__ import annotations

import re
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.composer import Composer, MaxDepthExceededError
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import AliasEvent
from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode
from ruamel.yaml.scanner import Scanner

from mortal.specs.errors import SpecError, SpecIssue

MAX_ALIASES = 32  # alias uses (*name, <<: *name) in one text, all its documents together
MAX_ALIASED_SIZE = 100_000  # nodes plus scalar characters that those aliases repeat, in total
MAX_DEPTH = 64  # mappings and lists nested in one another
MAX_NODES = 50_000  # mappings, lists, keys and scalars in one text, all its documents together
MAX_COMMENT_CHARS = 64 * 1024  # characters in one comment
# What one text may hold at all: a spec file is a few kilobytes (Kubernetes caps an object near this size),
# and without a bound a file of millions of documents or keys takes minutes and gigabytes to refuse.
MAX_TEXT_CHARS = 2 * 1024 * 1024
MAX_DOCUMENTS = 1000  # documents ('---') in one text


class ParseLimitExceeded(MarkedYAMLError):
    """A text asked for more than a limit allows; `limit` names the constant."""

    def __init__(self, limit: str, message: str, mark: Any) -> None:
        super().__init__(problem=message, problem_mark=mark)
        self.limit = limit


class LimitedComposer(Composer):
    """ruamel's Composer, counting alias uses and the size of what they stand for as it meets them."""

    def __init__(self, loader: Any = None) -> None:
        super().__init__(loader)
        self.aliases_used = 0
        self.nodes = 0
        self.aliased_size = 0
        self._sizes: dict[int, int] = {}
        self._open: set[str] = set()  # anchors whose node is being composed: an alias to one is a cycle

    def compose_document(self) -> Any:
        self._sizes = {}  # keyed by id(): the nodes of an earlier document may be gone and their ids reused
        return super().compose_document()

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.parser.peek_event()
        self._count_node(event)
        if isinstance(event, AliasEvent):
            self._count_alias(event)
            return super().compose_node(parent, index)
        if event.anchor is None:
            return super().compose_node(parent, index)
        self._open.add(event.anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.discard(event.anchor)

    def _count_node(self, event: Any) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ParseLimitExceeded(
                "MAX_NODES",
                f"more than {MAX_NODES} values (mappings, lists, keys, scalars); a spec holds a few hundred",
                event.start_mark,
            )

    def _count_alias(self, event: AliasEvent) -> None:
        self.aliases_used += 1
        if self.aliases_used > MAX_ALIASES:
            raise ParseLimitExceeded(
                "MAX_ALIASES",
                f"more than {MAX_ALIASES} alias uses (*name); a spec needs few or none: write the values out",
                event.start_mark,
            )
        if event.anchor in self._open:
            raise ParseLimitExceeded(
                "MAX_ALIASES",
                f"alias *{event.anchor} is inside the node it names (a cycle)",
                event.start_mark,
            )
        node = self.anchors.get(event.anchor)
        if node is None:
            return  # ruamel raises its own 'undefined alias' error
        self.aliased_size += self._size(node)
        if self.aliased_size > MAX_ALIASED_SIZE:
            raise ParseLimitExceeded(
                "MAX_ALIASED_SIZE",
                f"the aliases repeat more than {MAX_ALIASED_SIZE} nodes and characters; write the values out",
                event.start_mark,
            )

    def _size(self, node: Any) -> int:
        """Nodes plus scalar characters `node` stands for, expanded; memoized, so a shared node costs once."""
        known = self._sizes.get(id(node))
        if known is not None:
            return known
        if isinstance(node, ScalarNode):
            size = 1 + len(node.value)
        elif isinstance(node, SequenceNode):
            size = 1 + sum(self._size(item) for item in node.value)
        elif isinstance(node, MappingNode):
            size = 1 + sum(self._size(key) + self._size(value) for key, value in node.value)
        else:
            size = 1
        self._sizes[id(node)] = min(size, MAX_ALIASED_SIZE + 1)  # capped: a huge count needs no big int
        return self._sizes[id(node)]


# What the scanner skips before its next token (blanks, line breaks), then a comment past MAX_COMMENT_CHARS.
_LONG_COMMENT = re.compile(rf"[ \t\r\n\x85\u2028\u2029]*(#[^\r\n\0\x85\u2028\u2029]{{{MAX_COMMENT_CHARS}}})")


class ScannerLimits(Scanner):
    """Mixed in before the reader's own Scanner: refuses the flow collection ('[' or '{') that opens past
    MAX_DEPTH, and a comment longer than MAX_COMMENT_CHARS.

    Why in the scanner: it looks ahead for a possible mapping key at every open bracket, work that
    grows with the open brackets, before the composer (which checks block nesting) sees a node; and the
    round-trip scanner builds a comment one character at a time, in time quadratic in its length, with
    no setting to bound it. Hand-written for want of one: a look at the text where the scanner is about
    to skip to its next token, with a regular expression that stops after MAX_COMMENT_CHARS.
    """

    def scan_to_next_token(self) -> Any:
        reader = self.reader
        long_comment = _LONG_COMMENT.match(reader.buffer, reader.pointer)
        if long_comment is not None:
            reader.forward(long_comment.start(1) - reader.pointer)
            mark = reader.get_mark()
            message = f"a comment longer than {MAX_COMMENT_CHARS} characters"
            raise ParseLimitExceeded("MAX_COMMENT_CHARS", message, mark)
        return super().scan_to_next_token()

    def fetch_flow_collection_start(self, TokenClass: Any, to_push: str) -> None:
        if self.flow_level >= MAX_DEPTH:
            mark = self.reader.get_mark()
            raise ParseLimitExceeded("MAX_DEPTH", f"nested deeper than {MAX_DEPTH} levels", mark)
        super().fetch_flow_collection_start(TokenClass, to_push)


def limited_yaml(typ: str = "rt") -> YAML:
    """A ruamel YAML reader of type `typ` that enforces the limits above, all but the text's size and
    documents (load_documents checks those)."""
    yaml = YAML(typ=typ, pure=True)
    scanner = yaml.Scanner or Scanner  # 'safe' leaves it None until the first load
    yaml.Scanner = type("LimitedScanner", (ScannerLimits, scanner), {})
    yaml.Composer = LimitedComposer
    yaml.max_depth = MAX_DEPTH
    return yaml


def load_documents(text: str, source: str, typ: str = "rt") -> list[Any]:
    """Every YAML document in `text`, within the limits; SpecError naming `source`, the line and the limit."""
    if len(text) > MAX_TEXT_CHARS:
        raise SpecError(
            [
                SpecIssue(
                    source, None, "", f"larger than {MAX_TEXT_CHARS} characters (MAX_TEXT_CHARS): not a spec"
                )
            ]
        )
    try:
        documents: list[Any] = []
        for document in limited_yaml(typ).load_all(text):
            if len(documents) == MAX_DOCUMENTS:
                raise SpecError(
                    [SpecIssue(source, None, "", f"more than {MAX_DOCUMENTS} documents (MAX_DOCUMENTS)")]
                )
            documents.append(document)
        return documents
    except ParseLimitExceeded as exc:
        raise SpecError([_issue(source, exc, f"{exc.problem} ({exc.limit})")]) from None
    except MaxDepthExceededError as exc:
        raise SpecError([_issue(source, exc, f"nested deeper than {MAX_DEPTH} levels (MAX_DEPTH)")]) from None
    except MarkedYAMLError as exc:
        raise SpecError([_syntax_issue(source, exc)]) from None
    except YAMLError as exc:
        raise SpecError([SpecIssue(source, None, "", f"invalid YAML: {exc}")]) from None


# Mistakes the YAML reader notices only on a later line than the one holding them (an unclosed quote or
# bracket, a key without its colon): the context is the token that began there, and its line is the one
# to fix. A block's context ("while parsing a block mapping") is where the block began, not the mistake.
_CONTEXTS_HOLDING_THE_MISTAKE = ("while scanning", "while parsing a flow")


def _syntax_issue(source: str, exc: MarkedYAMLError) -> SpecIssue:
    problem, context = exc.problem or exc.context, exc.context or ""
    began, noticed = exc.context_mark, exc.problem_mark
    same_line = began is None or noticed is None or began.line == noticed.line
    if same_line or not context.startswith(_CONTEXTS_HOLDING_THE_MISTAKE):
        return _issue(source, exc, f"invalid YAML: {problem}")
    thing = context.removeprefix("while scanning ").removeprefix("while parsing ")
    where = f"in {thing} that starts on this line; seen on line {noticed.line + 1}"
    return SpecIssue(source, began.line + 1, "", f"invalid YAML: {problem} ({where})")


def _issue(source: str, exc: MarkedYAMLError, message: str) -> SpecIssue:
    mark = exc.problem_mark or exc.context_mark
    return SpecIssue(source, mark.line + 1 if mark is not None else None, "", message)
