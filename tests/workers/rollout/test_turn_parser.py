"""TurnParser: a turn parsed after its history cut to the turn's message (after the history's last EOS).

With TRL's templates that render SmolLM2's tool calls, the cut history parses every turn as the whole history
does; a template whose turns parse differently once cut is caught by the first parses, which are made both
ways, and the cut is off from then on; a turn said after the same message header is parsed once."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from tool_helpers import smollm2_tokenizer, tool_call

from mortal.workers.rollout.builtin_tools import ArithEnvironment
from mortal.workers.rollout.multiturn import resolve_chat_template, tool_suffix_ids
from mortal.workers.rollout.turn_parser import VERIFIED_PARSES, TurnParser, default_parse

# TRL's templates that render and parse SmolLM2's tool calls (the others refuse its tokenizer)
TEMPLATES = ["qwen2_5", "qwen3", "qwen3_instruct_2507", "qwen3_5_nothink", "qwen3_5_think", "glm4moe"]


def no_schemas(tools: list[Any]) -> list[dict[str, Any]]:
    return []


def conversation(name: str) -> tuple[Any, list[tuple[list[int], list[int]]]]:
    """(tokenizer, [(turn ids, history before it)]): a tool call, its answer, then a reply."""
    tokenizer = smollm2_tokenizer()
    template = resolve_chat_template(tokenizer, name)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        tools=[ArithEnvironment().add],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        chat_template=template,
    )["input_ids"]
    eos = [tokenizer.eos_token_id]
    call = tokenizer(tool_call("add", a="2", b=3), add_special_tokens=False)["input_ids"] + eos
    answer = tool_suffix_ids(tokenizer, template, [{"role": "tool", "name": "add", "content": "5"}])
    reply = tokenizer("The answer is 5.", add_special_tokens=False)["input_ids"] + eos
    return tokenizer, [(call, prompt), (reply, prompt + call + answer)]


@pytest.mark.parametrize("name", TEMPLATES)
def test_trls_templates_parse_each_turn_alike_after_the_cut_history(name: str) -> None:
    tokenizer, turns = conversation(name)
    parser = TurnParser(tokenizer, no_schemas, kept=16)
    cut = [parser.prefix(history) for _, history in turns]
    assert len(cut[1]) < len(turns[1][1]), "the reply's history holds the call's EOS to cut after"
    for (ids, history), shorter in zip(turns, cut, strict=True):
        assert default_parse(tokenizer, ids, shorter, None) == default_parse(tokenizer, ids, history, None)
    assert [parser.parse(ids, history, []) for ids, history in turns] == [
        default_parse(tokenizer, ids, history, None) for ids, history in turns
    ]
    cuts = sum(len(c) < len(h) for c, (_, h) in zip(cut, turns, strict=True))
    assert parser.cutting and parser.verified == cuts


class CountingParse:
    """A parse whose answer is `of(ids, prefix)`, counting its calls."""

    def __init__(self, of: Any) -> None:
        self.of, self.calls = of, 0

    def __call__(self, tokenizer: Any, ids: list[int], prefix: list[int], tools: Any) -> dict[str, Any]:
        self.calls += 1
        return self.of(ids, prefix)


class Tokenizer:
    eos_token_id = 0


def test_a_template_that_parses_differently_once_cut_turns_the_cut_off(caplog) -> None:
    parse = CountingParse(lambda ids, prefix: {"content": str(len(prefix))})
    parser = TurnParser(Tokenizer(), no_schemas, kept=16, parse=parse)
    with caplog.at_level(logging.WARNING, logger="mortal.worker"):
        assert parser.parse([5], [1, 2, 0, 3], []) == {"content": "4"}, "what the whole history gives"
    assert not parser.cutting and "parsing with the whole history" in caplog.text
    assert parser.parse([6], [1, 0, 3], []) == {"content": "3"}
    assert parser.prefix([1, 0, 3]) == [1, 0, 3]


def test_after_the_verified_parses_a_turn_is_parsed_once_and_a_header_s_turns_are_remembered() -> None:
    parse = CountingParse(lambda ids, prefix: {"content": str(ids)})
    parser = TurnParser(Tokenizer(), no_schemas, kept=64, parse=parse)
    for turn in range(VERIFIED_PARSES):
        parser.parse([turn], [7, 0, 9], [])
    assert parse.calls == 2 * VERIFIED_PARSES
    parser.parse([99], [7, 0, 9], [])
    assert parse.calls == 2 * VERIFIED_PARSES + 1
    # another prompt, the same message header after its last EOS: the turn is remembered
    assert parser.parse([99], [8, 8, 8, 0, 9], []) == {"content": "[99]"}
    assert parse.calls == 2 * VERIFIED_PARSES + 1
    message = parser.parse([99], [7, 0, 9], [])
    message["content"] = "changed by its caller"
    assert parser.parse([99], [7, 0, 9], []) == {"content": "[99]"}, "callers get copies"


def test_a_history_without_an_eos_is_parsed_whole_and_once() -> None:
    parse = CountingParse(lambda ids, prefix: {"content": str(len(prefix))})
    parser = TurnParser(Tokenizer(), no_schemas, kept=16, parse=parse)
    assert parser.parse([5], [1, 2, 3], []) == {"content": "3"}
    assert parse.calls == 1 and parser.verified == 0
