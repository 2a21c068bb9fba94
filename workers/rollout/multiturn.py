"""Multi-turn, tool-calling rollouts: TRL's tool loop (GRPOTrainer, 1.16), run by the rollout worker.

Who calls it: mortal.workers.rollout.loop, once per task when spec.rollout has tools or an environment
(`MultiTurn.rollouts`); it drives the worker's Engine through the same `generate` call single-turn rollouts
use, so every engine serves it. For a task: each rollout gets its environment (`reset(**row)`), each prompt
is rendered with its tools by the tool chat template, turn 1 is one engine call for the whole task; then,
while rollouts called tools and fewer than maxToolCallingIterations rounds ran, their calls run (Toolbox),
the tool messages are appended with loss mask 0, and one engine call generates every live rollout's next
turn (a seed per rollout and turn: schedule.turn_seed). A completion is everything after the prompt, one
mask entry per token (TRL's tool_mask). Every engine call of a task asks for one prompt width and row count,
so the GPU decoder replays one captured shape for all turns.
Where the engine continues conversations (Engine.converse: the transformers and vLLM engines), the rounds are
not in lock-step: a rollout whose turn ends runs steps 4-6 on its own (a pool thread: parse, call, append)
while the engine decodes the others, and its next turn rejoins the running batch with its KV cache kept;
each rollout samples from its own seed (schedule.turn_seed(seed, g, 0)), so its tokens do not depend on
when its tools answered.
Every choice follows TRL's `_tool_call_loop`; tests/workers/rollout/test_multiturn.py runs TRL's own loop
on the same scripted turns and compares ids, masks and logprobs.
What it must not do: batch rollouts of different tasks, decide anything from the clock rather than tokens
and seeds (exact resume), retry a tool, or swallow a broken environment (FatalWorkerError).
"""

from __future__ import annotations

import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from mortal.workers import schedule
from mortal.workers.deadline import CallTimedOut, TooManyAbandonedCalls
from mortal.workers.errors import FatalWorkerError, ServiceOutage
from mortal.workers.messages import RolloutRequest
from mortal.workers.rollout.chat_templates import UnknownChatTemplate, template_file
from mortal.workers.rollout.engines import Engine, GenerationParams
from mortal.workers.rollout.environment_proxy import EnvironmentProxy, raised_kind
from mortal.workers.rollout.remembered import Remembered, tool_functions
from mortal.workers.rollout.tools import CONCURRENT_ROLLOUTS, Toolbox, ToolOutcome, tokenizable
from mortal.workers.rollout.turn_parser import TurnParser

SUFFIXES_KEPT = 4096  # rendered tool answers remembered (MultiTurn._suffix); past it, forgotten at once
PARSES_KEPT = 4096  # parsed turns remembered (turn_parser.TurnParser), likewise
PROMPTS_KEPT = 4096  # rendered prompts remembered (MultiTurn._rendered), likewise


class ToolTemplateError(FatalWorkerError):
    """The chat template cannot render or parse tool calls (the run fails with the fix)."""

    def __init__(self, message: str) -> None:
        super().__init__("ToolTemplateUnusable", message)


@dataclass
class Rollout:
    """One rollout's conversation as it grows: what the result, the loss mask and the metrics need."""

    prompt: list[dict[str, Any]]  # the prompt messages after reset
    prompt_ids: list[int]
    tools: list[Any]
    environment: Any = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: the model's token (trained), 0: a tool result's
    messages: list[dict[str, Any]] = field(default_factory=list)  # assistant / tool messages, in order
    turns: int = 0  # model generations
    tool_calls: int = 0
    tool_failures: int = 0
    pending: list[dict[str, Any]] = field(default_factory=list)  # tool calls of the newest assistant turn

    @property
    def history_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


ROW_SHOWN_CHARS = 80  # of a prompt quoted in an error, which should say which row and not fill a screen


def row_named(request: RolloutRequest) -> str:
    """Which dataset row a request holds, for an error about it: its prompt's last message (the request has no
    row number: rows come shuffled) and its columns."""
    last = request.prompt if isinstance(request.prompt, str) else (request.prompt or [{}])[-1].get("content")
    text = " ".join(str(last or "").split())
    quoted = text if len(text) <= ROW_SHOWN_CHARS else text[: ROW_SHOWN_CHARS - 3] + "..."
    columns = ", ".join(sorted(map(str, request.row))) or "none"
    return f"whose prompt's last message is {quoted!r}, columns {columns}"


class PromptTooLong(FatalWorkerError):
    """A prompt that, with generation.maxTokens, is longer than the model takes: the run fails naming the row,
    since no spec field asks for prompts to be cut (generating past the model's positions trains on noise)."""

    def __init__(self, message: str) -> None:
        super().__init__("PromptTooLong", message)


def fitting(
    request: RolloutRequest, prompt_ids: list[int], max_tokens: int, max_model_len: int | None
) -> list[int]:
    """`prompt_ids`, when they and `max_tokens` fit in `max_model_len` (None: no known limit); else
    PromptTooLong with the numbers and the row."""
    if max_model_len is None or len(prompt_ids) + max_tokens <= max_model_len:
        return prompt_ids
    fix = "lower generation.maxTokens, or " if len(prompt_ids) < max_model_len else ""
    raise PromptTooLong(
        f"a prompt of {len(prompt_ids)} tokens and generation.maxTokens {max_tokens} exceed the "
        f"{max_model_len} tokens the model takes (the dataset row {row_named(request)}); {fix}shorten "
        "or drop the row"
    )


def resolve_chat_template(tokenizer: Any, name: str | None) -> str | None:
    """Make `tokenizer` render and parse tool calls; returns the template to render with (None: its own).

    `name`: spec.rollout.chatTemplate (a TRL template name or a .jinja file), None for the model's own."""
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    if name is not None:
        try:
            path = template_file(name)
        except UnknownChatTemplate as exc:
            raise ToolTemplateError(f"spec.rollout.chatTemplate {exc}") from exc
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    if not supports_tool_calling(tokenizer):
        raise ToolTemplateError(
            f"the chat template of {tokenizer.name_or_path!r} cannot render tool calls and tool messages; "
            "set spec.rollout.chatTemplate to one that can (e.g. qwen2_5 for ChatML models such as SmolLM2)"
        )
    if (
        getattr(tokenizer, "response_template", None) is None
        and getattr(tokenizer, "response_schema", None) is None
    ):
        try:
            add_response_schema(tokenizer)
        except ValueError as exc:
            raise ToolTemplateError(
                f"cannot parse tool calls with the chat template of {tokenizer.name_or_path!r} "
                f"({exc}); set spec.rollout.chatTemplate to a TRL template, e.g. qwen2_5"
            ) from exc
    if not is_chat_template_prefix_preserving(tokenizer):
        return get_training_chat_template(tokenizer)
    return None


def tool_suffix_ids(tokenizer: Any, template: str | None, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The tokens that follow an assistant turn's end-of-turn token when `tool_messages` answer it, up to the
    next assistant turn's generation prompt: a one-call conversation rendered with and without them, the
    shorter cut after its last EOS (templates differ in what follows it), the difference taken."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    before = tokenizer.apply_chat_template(
        head, add_generation_prompt=False, tokenize=True, chat_template=template, return_dict=False
    )
    after = tokenizer.apply_chat_template(
        head + tool_messages,
        add_generation_prompt=True,
        tokenize=True,
        chat_template=template,
        return_dict=False,
    )
    eos = [i for i, token in enumerate(before) if token == tokenizer.eos_token_id]
    if eos:
        before = before[: eos[-1] + 1]
    if after[: len(before)] != before:
        raise ToolTemplateError(
            "the chat template renders an assistant turn differently once tool messages follow "
            "it, so tool results cannot be appended token by token; use a prefix-preserving "
            "template (spec.rollout.chatTemplate)"
        )
    return list(after[len(before) :])


class MultiTurn:
    """The tool loop over one engine, tokenizer and toolbox (module docstring: the steps)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        toolbox: Toolbox,
        params: GenerationParams,
        chat_template: str | None = None,
        continuous: bool | None = None,
    ) -> None:
        """`continuous`: run the task's conversations through Engine.converse (each turn rejoins a running
        batch, nothing re-prefilled); None: wherever the engine can, False: the lock-step rounds."""
        self.engine, self.tokenizer, self.toolbox, self.params = engine, tokenizer, toolbox, params
        self.continuous = engine.continues_turns() if continuous is None else continuous
        self._suffixes = Remembered(SUFFIXES_KEPT)
        self._turns = TurnParser(tokenizer, self._schemas, PARSES_KEPT)
        self._prompts = Remembered(PROMPTS_KEPT)
        self._token_chars: int | None = None  # _longest_token's, computed at the first tool answer
        self._tool_schemas: dict[Any, dict[str, Any]] = {}  # by function: a run has a handful
        self.template = resolve_chat_template(tokenizer, chat_template)
        self.max_model_len = engine.max_model_len()
        limit = toolbox.max_iterations
        self.max_iterations = limit if limit is not None else float("inf")

    def rollouts(self, requests: list[RolloutRequest]) -> list[list[Rollout]]:
        """numGenerations rollouts of each request, in order, each run to its end."""
        names = [self.toolbox.environment_name(r.row) for r in requests]
        environments = iter(
            self.toolbox.environments_for(
                [n for n, r in zip(names, requests, strict=True) for _ in range(r.num_generations)]
            )
        )
        groups = [
            self._start(request, name, [next(environments) for _ in range(request.num_generations)])
            # steps 1-2: one instance per rollout
            for request, name in zip(requests, names, strict=True)
        ]
        flat = [r for group in groups for r in group]
        if self.continuous:
            self._converse(requests, flat)
            return groups
        # every turn's history fits in the longest prompt + maxTokens, and every turn's rollouts in the
        # first's rows: padded to both, all turns share one shape
        params = replace(
            self.params,
            min_prompt_width=max(len(r.prompt_ids) for r in flat) + self.params.max_tokens,
            min_rows=len(flat),
        )
        self._first_turn(requests, groups, params)  # step 3
        seeds = [(request.seed, g) for request in requests for g in range(request.num_generations)]
        iteration = 0
        active = [i for i, r in enumerate(flat) if r.pending]
        while active and iteration < self.max_iterations:
            outcomes = self.toolbox.call_each([(flat[i].tools, flat[i].pending) for i in active])  # step 5
            active = [
                i
                for i, answered in zip(active, outcomes, strict=True)
                if self._answer_tools(flat[i], answered)
            ]
            if not active:
                break
            # step 6
            self._next_turn([flat[i] for i in active], [seeds[i] for i in active], iteration + 1, params)
            active = [i for i in active if flat[i].pending]
            iteration += 1
        return groups

    def _converse(self, requests: list[RolloutRequest], flat: list[Rollout]) -> None:
        """The continuous path: every rollout one conversation of the engine (Engine.converse); when its
        turn ends, the turn is parsed, its tool calls run and their results checked against the budget on a
        pool (steps 4-6 for this rollout alone), while the engine decodes the others. A rollout's own turns
        and calls stay in order: it has one turn or one round of calls at a time."""
        seeds = [
            schedule.turn_seed(request.seed, g, 0)
            for request in requests
            for g in range(request.num_generations)
        ]
        rounds = [0] * len(flat)
        # a fast tokenizer is not safe to use from threads at once (its padding settings are shared state);
        # the tools themselves run outside the lock
        tokenizer_lock = threading.Lock()

        def after_turn(i: int, ids: list[int], logprobs: list[float]) -> list[int] | None:
            rollout = flat[i]
            with tokenizer_lock:
                self._append_turn(rollout, ids, logprobs)
            if not rollout.pending or rounds[i] >= self.max_iterations:
                return None
            rounds[i] += 1
            outcomes = [self.toolbox.call(rollout.tools, call) for call in rollout.pending]
            before = len(rollout.completion_ids)
            with tokenizer_lock:
                if not self._answer_tools(rollout, outcomes):
                    return None
            return rollout.completion_ids[before:]

        with ThreadPoolExecutor(
            max_workers=min(len(flat), CONCURRENT_ROLLOUTS), thread_name_prefix="mortal-turns"
        ) as pool:
            self.engine.converse(
                [r.prompt_ids for r in flat],
                seeds,
                self.params,
                lambda i, ids, logprobs: pool.submit(after_turn, i, ids, logprobs),
            )

    # -- steps ---------------------------------------------------------------------------------------
    def _start(self, request: RolloutRequest, name: str | None, environments: list[Any]) -> list[Rollout]:
        """A request's rollouts: each environment reset with the row, each prompt rendered with its tools."""
        if isinstance(request.prompt, str):
            raise FatalWorkerError(
                "PromptUnencodable",
                "tool-calling rollouts need chat prompts (a list of "
                "messages), as TRL's tool loop does; the dataset's prompt is text",
            )
        reset_row = (
            {k: v for k, v in request.row.items() if k != "environment"} if name is not None else request.row
        )
        group = []
        for environment in environments:
            prompt = copy.deepcopy(request.prompt)
            if environment is not None:
                try:
                    observation = self.toolbox.reset(environment, reset_row)
                except (ServiceOutage, TooManyAbandonedCalls):  # a server down, hung calls piled up: relaunch
                    raise
                except CallTimedOut as exc:
                    left = (
                        "its process was killed"
                        if isinstance(environment, EnvironmentProxy)
                        else "its thread was abandoned, its stacks are in the worker's log"
                    )
                    raise FatalWorkerError(
                        "EnvironmentTimedOut",
                        f"{type(environment).__name__}.reset(**row) did not return within "
                        f"rollout.environmentService.resetTimeoutSeconds ({exc.seconds:g} s) for the row "
                        f"{row_named(request)}; {left}",
                    ) from exc
                except Exception as exc:  # the user's environment is broken: fail the run with its reason
                    raise FatalWorkerError(
                        "EnvironmentFailed",
                        f"{type(environment).__name__}.reset(**row) raised {raised_kind(exc)}: {exc} "
                        f"(the row {row_named(request)})",
                    ) from exc
                if isinstance(observation, str) and prompt:
                    prompt = [
                        *prompt[:-1],
                        {**prompt[-1], "content": str(prompt[-1]["content"]) + tokenizable(observation)},
                    ]
            tools = self.toolbox.tools_for(environment)
            group.append(
                Rollout(
                    prompt=prompt,
                    prompt_ids=fitting(
                        request, self._rendered(prompt, tools), self.params.max_tokens, self.max_model_len
                    ),
                    tools=tools,
                    environment=environment,
                )
            )
        return group

    def _first_turn(
        self, requests: list[RolloutRequest], groups: list[list[Rollout]], params: GenerationParams
    ) -> None:
        alike = all(all(r.prompt_ids == group[0].prompt_ids for r in group) for group in groups)
        if alike:  # the single-turn call: each prompt once, n completions, the task's seeds
            outs = self.engine.generate(
                [g[0].prompt_ids for g in groups],
                requests[0].num_generations,
                [r.seed for r in requests],
                params,
            )
            completions = [c for group in outs for c in group]
        else:
            flat = [
                (r, request.seed, g)
                for request, group in zip(requests, groups, strict=True)
                for g, r in enumerate(group)
            ]
            outs = self.engine.generate(
                [r.prompt_ids for r, _, _ in flat],
                1,
                [schedule.turn_seed(seed, g, 0) for _, seed, g in flat],
                params,
            )
            completions = [group[0] for group in outs]
        for rollout, completion in zip([r for g in groups for r in g], completions, strict=True):
            self._append_turn(rollout, completion.ids, completion.logprobs)

    def _answer_tools(self, rollout: Rollout, outcomes: list[ToolOutcome]) -> bool:
        """Append the outcomes of the rollout's pending tool calls; False when they would not fit (step 5)."""
        rollout.pending = []
        rollout.tool_calls += len(outcomes)
        rollout.tool_failures += sum(o.failed for o in outcomes)
        tool_messages = [{"role": "tool", "name": o.name, "content": o.content} for o in outcomes]
        room = self.params.max_tokens - len(rollout.completion_ids)
        if sum(len(o.content) for o in outcomes) > room * self._longest_token():
            return False  # more characters than `room` tokens can hold: not rendered, not tokenized
        suffix = self._suffix(tool_messages)
        length = len(rollout.completion_ids) + len(suffix)
        if length > self.params.max_tokens or (
            self.max_model_len is not None and len(rollout.prompt_ids) + length >= self.max_model_len
        ):
            return False
        rollout.messages.extend(tool_messages)
        rollout.completion_ids += suffix
        rollout.logprobs += [0.0] * len(suffix)
        rollout.mask += [0] * len(suffix)
        return True

    def _longest_token(self) -> int:
        """The most characters one token of the vocabulary stands for (its string's length: a byte-level or
        SentencePiece token's string has a character per byte or more), so a text of n characters needs at
        least n / this many tokens. Why: a tool may answer megabytes, which the template would render and
        the tokenizer encode only for the answer to be dropped as too long (memory and seconds)."""
        if self._token_chars is None:
            self._token_chars = max((len(token) for token in self.tokenizer.get_vocab()), default=1) or 1
        return self._token_chars

    def _rendered(self, prompt: list[dict[str, Any]], tools: list[Any]) -> list[int]:
        """The prompt's ids with its tools (the chat template's generation prompt after), remembered by the
        messages and the tools' functions: a request's rollouts mostly share them, and each render runs the
        template and tokenizes the whole prompt, the largest part of the tool loop's own host work
        (bench/tool_loop_host.py). Messages that are not JSON are rendered every time."""

        def render() -> list[int]:
            return list(
                self.tokenizer.apply_chat_template(
                    prompt,
                    tools=self._schemas(tools) or None,
                    chat_template=self.template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            )

        try:
            messages = json.dumps(prompt, sort_keys=True)
        except (TypeError, ValueError):
            return render()
        return list(self._prompts.get((messages, tool_functions(tools)), render))

    def _schemas(self, tools: list[Any]) -> list[dict[str, Any]]:
        """The tools' JSON schemas (transformers' get_json_schema, what the chat template and the turn parser
        would compute from the functions on every call), remembered by function (tool_functions)."""
        from transformers.utils import get_json_schema

        schemas = []
        for tool, function in zip(tools, tool_functions(tools), strict=True):
            if function not in self._tool_schemas:
                self._tool_schemas[function] = get_json_schema(tool)
            schemas.append(self._tool_schemas[function])
        return schemas

    def _parsed(self, ids: list[int], history: list[int], tools: list[Any]) -> dict[str, Any]:
        """TRL's parse_response of a turn after `history` (turn_parser.TurnParser: remembered, the history cut
        to the turn's message). A copy is returned (the caller keeps it)."""
        return self._turns.parse(ids, history, tools)

    def _suffix(self, tool_messages: list[dict[str, str]]) -> list[int]:
        """tool_suffix_ids, remembered by the messages' names and contents: a task's rollouts of one prompt
        mostly get the same answers, and each render costs two chat-template passes."""
        key = tuple((m["name"], m["content"]) for m in tool_messages)
        return list(
            self._suffixes.get(key, lambda: tool_suffix_ids(self.tokenizer, self.template, tool_messages))
        )

    def _next_turn(
        self, rollouts: list[Rollout], seeds: list[tuple[int, int]], turn: int, params: GenerationParams
    ) -> None:
        # maxTokens for every turn, then cut to each rollout's budget (as TRL does): one decode length, so the
        # batched CUDA path keeps its captured shapes instead of capturing one per remaining budget
        outs = self.engine.generate(
            [r.history_ids for r in rollouts],
            1,
            [schedule.turn_seed(seed, g, turn) for seed, g in seeds],
            params,
        )
        for rollout, [completion] in zip(rollouts, outs, strict=True):
            room = self.params.max_tokens - len(rollout.completion_ids)
            self._append_turn(rollout, completion.ids[:room], completion.logprobs[:room])

    def _append_turn(self, rollout: Rollout, ids: list[int], logprobs: list[float]) -> None:
        """A model turn: its tokens (mask 1), its parsed message and the tool calls it asks for (step 4)."""
        if not ids:  # a turn cut to nothing by the budget: no message (TRL appends none either)
            return
        rollout.turns += 1
        message = self._parsed(ids, rollout.history_ids, rollout.tools)
        rollout.completion_ids += list(ids)
        rollout.logprobs += list(logprobs)
        rollout.mask += [1] * len(ids)
        rollout.messages.append(message)
        rollout.pending = list(message.get("tool_calls") or [])
