"""Tool-calling rollouts (mortal.workers.rollout.multiturn, mortal.workers.rollout.tools)
against TRL's own tool loop.

The central test runs TRL 1.16's `GRPOTrainer._tool_call_loop` (unbound, on a stand-in that holds only
what it reads) and mortal's `MultiTurn` on the same scripted model turns, with SmolLM2's tokenizer and
TRL's qwen2_5 template, and requires the same completion ids, tool masks, logprobs and tool counts:
multi-call turns, unknown tools, tools that raise, the iteration limit and the token budget included.
The scripted "model" answers from the conversation's text, so both loops see exactly what they build.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rollout_helpers import assets_available
from tool_helpers import MAX_MODEL_LEN, SCRIPTS, ArithScript, ScriptedEngine, smollm2_tokenizer, tool_call

from mortal.specs.training import RolloutSpec
from mortal.workers.deadline import Abandoner, CallTimedOut, TooManyAbandonedCalls
from mortal.workers.messages import RolloutRequest
from mortal.workers.rollout.builtin_tools import ArithEnvironment, CalculatorError, calculator
from mortal.workers.rollout.engines import GenerationParams
from mortal.workers.rollout.multiturn import MultiTurn, ToolTemplateError, tool_suffix_ids
from mortal.workers.rollout.tools import EnvironmentReward, Toolbox, ToolLoadError, run_with_timeout

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


def _trl_loop(
    tokenizer: Any,
    engine: ScriptedEngine,
    prompts: list[list[dict[str, Any]]],
    tools: list[Any],
    max_tokens: int,
    max_iterations: int,
) -> tuple[Any, ...]:
    """TRL's own tool loop on the scripted turns: first turn as GRPOTrainer._generate makes it, then
    GRPOTrainer._tool_call_loop, unbound, on a stand-in trainer holding what it reads."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response

    prompt_ids = [
        tokenizer.apply_chat_template(
            p, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in prompts
    ]
    first = [engine.turn(ids, max_tokens) for ids in prompt_ids]
    completion_ids = [ids for ids, _ in first]
    logprobs = [lps for _, lps in first]
    completions = [
        [parse_response(tokenizer, ids, prefix=prompt_ids[i], tools=tools)]
        for i, ids in enumerate(completion_ids)
    ]

    def single_turn(histories: list[list[int]], *args: Any, **kwargs: Any) -> tuple[list, list]:
        outs = [engine.turn(h, max_tokens) for h in histories]
        return [ids for ids, _ in outs], [lps for _, lps in outs]

    stand_in = SimpleNamespace(
        processing_class=tokenizer,
        _tokenizer=tokenizer,
        chat_template=None,
        chat_template_kwargs={},
        _is_vlm=False,
        use_vllm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=MAX_MODEL_LEN)),
        max_completion_length=max_tokens,
        max_tool_calling_iterations=max_iterations,
        tools=tools,
        environment_factories=None,
        _generate_single_turn=single_turn,
        _sync_tool_dicts=[{t.__name__: t for t in tools} for _ in prompts],
        _async_tool_dicts=[{} for _ in prompts],
    )
    stand_in._get_tool_suffix_ids = functools.partial(GRPOTrainer._get_tool_suffix_ids, stand_in)
    return GRPOTrainer._tool_call_loop(
        stand_in, [list(p) for p in prompts], prompt_ids, completion_ids, completions, logprobs, None, {}
    )


@pytest.mark.parametrize("continuous", [False, True], ids=["lock-step", "continuous"])
@pytest.mark.parametrize(("max_tokens", "max_iterations"), [(160, 5), (160, 1), (40, 5)])
def test_masks_ids_and_logprobs_equal_trls_tool_loop(
    max_tokens: int, max_iterations: int, continuous: bool
) -> None:
    """Both paths of the loop: lock-step rounds of engine calls, and conversations the engine continues
    (each rollout's turns handed over one by one, its tools run on a pool)."""
    tokenizer = smollm2_tokenizer()
    mortal_engine = ScriptedEngine(tokenizer)
    multiturn = MultiTurn(
        mortal_engine,
        tokenizer,
        Toolbox(tools=[calculator], max_iterations=max_iterations),
        GenerationParams(max_tokens=max_tokens),
        chat_template="qwen2_5",
        continuous=continuous,
    )
    requests = [
        RolloutRequest(
            prompt=[{"role": "user", "content": f"Task: {task}."}], row={}, num_generations=2, seed=i
        )
        for i, task in enumerate(SCRIPTS)
    ]
    groups = multiturn.rollouts(requests)
    ours = [r for group in groups for r in group]

    prompts = [r.prompt for r in requests for _ in range(2)]
    mask, completions, ids, logprobs, calls, failures, _ = _trl_loop(
        tokenizer, ScriptedEngine(tokenizer), prompts, [calculator], max_tokens, max_iterations
    )

    assert [r.completion_ids for r in ours] == ids
    assert [r.mask for r in ours] == mask
    assert [r.logprobs for r in ours] == logprobs
    assert sum(r.tool_calls for r in ours) == calls
    assert sum(r.tool_failures for r in ours) == failures
    assert [r.messages for r in ours] == completions
    if max_tokens < 60:  # no tool result fits: each is dropped, its call still counted (TRL's rollback)
        assert calls > 0 and not any(0 in m for m in mask) and all(len(i) <= max_tokens for i in ids)
    else:
        assert any(0 in m for m in mask), (
            "no tool result was appended: the scripts no longer exercise the loop"
        )
    if max_tokens >= 160 and max_iterations > 1:
        chain = ours[2]
        assert chain.turns == 3 and chain.tool_calls == 2 and chain.mask.count(0) > 0
        assert ours[4].tool_failures == 2  # an unknown tool and a calculator that raised
    if continuous:
        assert mortal_engine.calls == [], "conversations, never a generate per turn"
        return
    # each turn is one engine call over the task's rollouts still in the loop
    assert mortal_engine.calls[0] == (len(SCRIPTS), 2)
    assert all(n == 1 for _, n in mortal_engine.calls[1:])


class _ShapeRecorder(ScriptedEngine):
    """The scripted model, noting the prompt width and rows each engine call asks for."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.widths: list[int] = []
        self.rows: list[int] = []

    def generate(self, prompts, n, seeds, params):
        self.widths.append(params.min_prompt_width)
        self.rows.append(params.min_rows)
        return super().generate(prompts, n, seeds, params)


def test_a_tool_answer_longer_than_the_room_left_is_dropped_as_trl_drops_it_without_being_rendered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tool may answer megabytes: more characters than the budget's tokens could hold is dropped before the
    template renders it and the tokenizer encodes it (memory and seconds), with TRL's outcome."""
    from mortal.workers.rollout import multiturn as module

    def huge(expression: str) -> str:
        return "7" * 200_000

    huge.__name__, huge.__doc__ = "calculator", calculator.__doc__
    rendered: list[int] = []

    def measured(tokenizer: Any, template: Any, messages: list[dict[str, Any]]) -> list[int]:
        rendered.append(max(len(m["content"]) for m in messages))
        return tool_suffix_ids(tokenizer, template, messages)

    monkeypatch.setattr(module, "tool_suffix_ids", measured)
    tokenizer = smollm2_tokenizer()
    multiturn = MultiTurn(
        ScriptedEngine(tokenizer),
        tokenizer,
        Toolbox(tools=[huge], max_iterations=5),
        GenerationParams(max_tokens=160),
        chat_template="qwen2_5",
        continuous=False,
    )
    requests = [
        RolloutRequest(prompt=[{"role": "user", "content": f"Task: {t}."}], row={}, num_generations=2, seed=i)
        for i, t in enumerate(SCRIPTS)
    ]
    ours = [r for group in multiturn.rollouts(requests) for r in group]
    prompts = [r.prompt for r in requests for _ in range(2)]
    mask, completions, ids, _, calls, _, _ = _trl_loop(
        tokenizer, ScriptedEngine(tokenizer), prompts, [huge], 160, 5
    )
    assert [r.completion_ids for r in ours] == ids and [r.mask for r in ours] == mask
    assert calls > 0 and sum(r.tool_calls for r in ours) == calls
    assert all(length < 200_000 for length in rendered)  # never rendered


def test_every_turn_of_a_task_asks_for_one_shape_that_every_history_and_rollout_fits_in() -> None:
    """So that the GPU decoder replays one captured shape for all turns (GenerationParams.min_prompt_width
    and min_rows): the longest prompt + maxTokens, and the first turn's rollouts."""
    tokenizer = smollm2_tokenizer()
    engine = _ShapeRecorder(tokenizer)
    multiturn = MultiTurn(
        engine,
        tokenizer,
        Toolbox(tools=[calculator], max_iterations=5),
        GenerationParams(max_tokens=160),
        chat_template="qwen2_5",
    )
    requests = [
        RolloutRequest(
            prompt=[{"role": "user", "content": f"Task: {task}."}], row={}, num_generations=2, seed=i
        )
        for i, task in enumerate(SCRIPTS)
    ]
    rollouts = [r for group in multiturn.rollouts(requests) for r in group]
    assert len(engine.widths) > 1, "the scripts call tools: more than one turn"
    assert set(engine.widths) == {max(len(r.prompt_ids) for r in rollouts) + 160}
    assert all(len(r.prompt_ids) + len(r.completion_ids) <= engine.widths[0] for r in rollouts)
    assert set(engine.rows) == {len(rollouts)}


def test_tool_suffix_equals_trls() -> None:
    from trl import GRPOTrainer

    tokenizer = smollm2_tokenizer()
    MultiTurn(
        ScriptedEngine(tokenizer), tokenizer, Toolbox(tools=[calculator]), GenerationParams(), "qwen2_5"
    )
    stand_in = SimpleNamespace(
        processing_class=tokenizer,
        _tokenizer=tokenizer,
        chat_template=None,
        chat_template_kwargs={},
        _is_vlm=False,
    )
    for messages in (
        [{"role": "tool", "name": "calculator", "content": "5"}],
        [
            {"role": "tool", "name": "a", "content": "{'error': 'x'}"},
            {"role": "tool", "name": "b", "content": "line\nbreak"},
        ],
    ):
        assert tool_suffix_ids(tokenizer, None, messages) == GRPOTrainer._get_tool_suffix_ids(
            stand_in, messages
        )


def test_a_model_template_without_tools_is_refused_with_the_fix() -> None:
    tokenizer = smollm2_tokenizer()  # SmolLM2's own template drops tool calls
    with pytest.raises(ToolTemplateError, match="chatTemplate"):
        MultiTurn(ScriptedEngine(tokenizer), tokenizer, Toolbox(tools=[calculator]), GenerationParams())
    with pytest.raises(ToolTemplateError, match="neither a .jinja file nor a TRL template"):
        MultiTurn(
            ScriptedEngine(tokenizer), tokenizer, Toolbox(tools=[calculator]), GenerationParams(), "nope"
        )


# -- tools: errors, timeouts, parsing ------------------------------------------------------------------
def _sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def test_a_tool_that_hangs_answers_with_a_timeout_and_the_rollout_goes_on() -> None:
    box = Toolbox(tools=[_sleepy, calculator], timeout_seconds=0.2)
    started = time.monotonic()
    outcome = box.call(
        box.tools, {"type": "function", "function": {"name": "_sleepy", "arguments": {"seconds": 5}}}
    )
    assert time.monotonic() - started < 2
    assert outcome.failed and "timed out after 0.2 s" in outcome.content
    ok = box.call(
        box.tools,
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}},
    )
    assert (ok.content, ok.failed) == ("42", False)


def test_a_hung_tool_is_told_to_the_rollout_once_a_minute_and_too_many_hung_calls_relaunch_the_worker() -> (
    None
):
    told: list[str] = []
    box = Toolbox(tools=[_sleepy], timeout_seconds=0.05, abandoner=Abandoner(limit=2), on_timeout=told.append)
    hang = {"type": "function", "function": {"name": "_sleepy", "arguments": {"seconds": 30}}}
    for _ in range(2):
        assert box.call(box.tools, hang).failed
    assert told == [
        "tool _sleepy did not return within rollout.toolTimeoutSeconds (0.05 s); the model was told it "
        "timed out and the rollout went on; its stacks are in the worker's log"
    ]
    with pytest.raises(
        TooManyAbandonedCalls
    ):  # two hung calls still running: the worker asks to be relaunched
        box.call(box.tools, hang)


class _Meeting:
    """An environment whose `meet` returns only once two instances are in it at the same time."""

    barrier = threading.Barrier(2, timeout=5)

    def reset(self, **row: Any) -> None:
        pass

    def meet(self, who: str) -> str:
        """Wait until another rollout meets too.

        Args:
            who: Who meets.
        """
        self.barrier.wait()
        return who


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_different_rollouts_tools_run_at_once_and_one_rollouts_calls_in_order() -> None:
    box = Toolbox(environments={None: _Meeting}, timeout_seconds=10)
    first, second = (_Meeting(), _Meeting())
    outcomes = box.call_each(
        [
            (box.tools_for(first), [_call("meet", who="a"), _call("meet", who="b")]),
            (box.tools_for(second), [_call("meet", who="c"), _call("meet", who="d")]),
        ]
    )
    # one after the other, each rollout's first call would wait for the other's forever (the barrier's 5 s)
    assert [[o.content for o in rollout] for rollout in outcomes] == [["a", "b"], ["c", "d"]]
    assert not any(o.failed for rollout in outcomes for o in rollout)


def test_on_the_continuous_path_two_rollouts_tools_run_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The continuous path hands each ended turn to a pool: two rollouts' calls of a tool that returns only
    when both are in it at once both succeed (one after the other, the first would time out)."""
    import tool_helpers

    monkeypatch.setitem(tool_helpers.SCRIPTS, "meeting", [tool_call("meet", who="a"), "Met."])
    tokenizer = smollm2_tokenizer()
    multiturn = MultiTurn(
        ScriptedEngine(tokenizer),
        tokenizer,
        Toolbox(environments={None: _Meeting}, timeout_seconds=10),
        GenerationParams(max_tokens=160),
        chat_template="qwen2_5",
        continuous=True,
    )
    request = RolloutRequest(
        prompt=[{"role": "user", "content": "Task: meeting."}], row={}, num_generations=2, seed=0
    )
    [group] = multiturn.rollouts([request])
    assert [(r.tool_calls, r.tool_failures, r.turns) for r in group] == [(1, 0, 2), (1, 0, 2)]


def test_standalone_tools_shared_by_every_rollout_never_run_at_once() -> None:
    running, most = [0], [0]
    lock = threading.Lock()

    def shared(n: int) -> int:
        """A tool that counts how many of its calls overlap.

        Args:
            n: Anything.
        """
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return n

    box = Toolbox(tools=[shared])
    outcomes = box.call_each([(box.tools, [_call("shared", n=i)]) for i in range(8)])
    assert [o.content for [o] in outcomes] == [str(i) for i in range(8)] and most[0] == 1


def test_tool_errors_become_the_answer() -> None:
    box = Toolbox(tools=[calculator])
    raised = box.call(
        box.tools,
        {
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "__import__('os')"}},
        },
    )
    assert raised.failed and raised.content.startswith("{'error': ") and "not arithmetic" in raised.content
    unknown = box.call(box.tools, {"type": "function", "function": {"name": "rm", "arguments": {}}})
    assert unknown.failed and unknown.content == "{'error': 'Tool rm not found.'}"
    odd = box.call(box.tools, {"type": "code", "name": "x"})
    assert odd.failed and "Unsupported tool call type" in odd.content
    assert run_with_timeout(calculator, {"expression": "1/0"}, 1.0) == (None, "division by zero")


def test_a_tool_that_calls_sys_exit_or_raises_keyboard_interrupt_gives_the_model_an_error() -> None:
    """None ends the rollout (os._exit ended the process at once): the model reads what the tool did, as
    for any other exception."""

    def leaves(code: int) -> None:
        sys.exit(code)

    def ends_the_process() -> None:
        os._exit(1)

    def interrupted() -> None:
        raise KeyboardInterrupt("stop")

    assert run_with_timeout(leaves, {"code": 0}, 1.0) == (None, "tool leaves raised SystemExit: 0")
    assert run_with_timeout(interrupted, {}, 1.0) == (None, "tool interrupted raised KeyboardInterrupt: stop")
    assert run_with_timeout(ends_the_process, {}, 1.0) == (None, "tool ends_the_process called os._exit(1)")


class _Unprintable:
    def __str__(self) -> str:
        raise ValueError("__str__ exploded")


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise ValueError("__str__ exploded")


def unprintable_result(n: int) -> _Unprintable:
    """A tool whose result's str() raises.

    Args:
        n: anything
    """
    return _Unprintable()


def unprintable_error(n: int) -> None:
    """A tool that raises an exception whose str() raises.

    Args:
        n: anything
    """
    raise _UnprintableError()


def test_a_tool_whose_result_or_exception_cannot_be_made_text_gives_the_model_an_error() -> None:
    """The user's __str__ runs as the answer is made: its failure is the model's error, not the worker's."""
    box = Toolbox(tools=[unprintable_result, unprintable_error])
    result = box.call(box.tools, _call("unprintable_result", n=1))
    assert result.failed and "returned a _Unprintable that str() fails on: __str__ exploded" in result.content
    error = box.call(box.tools, _call("unprintable_error", n=1))
    assert error.failed and "_UnprintableError (its message could not be made" in error.content


def undecodable_output(n: int) -> str:
    """A tool answering with a program's output decoded as os.fsdecode does (a lone surrogate per bad byte).

    Args:
        n: anything
    """
    return b"bad \xff byte".decode("utf-8", "surrogateescape")


def test_a_tool_answer_holding_a_lone_surrogate_reaches_the_model_escaped() -> None:
    """The tokenizer refuses a lone surrogate outright (a TypeError that ended the worker); the answer keeps
    everything else and shows the bad byte as its escape."""
    box = Toolbox(tools=[undecodable_output])
    outcome = box.call(box.tools, _call("undecodable_output", n=1))
    assert not outcome.failed and outcome.content == "bad \\udcff byte"
    outcome.content.encode("utf-8")  # what the tokenizer needs


def test_a_tool_trl_cannot_describe_or_an_environment_method_named_as_a_tool_fails_the_worker_at_start() -> (
    None
):
    """Refused before any rollout (naming the field), not when the chat template first needs the schema."""
    with pytest.raises(ToolLoadError, match=r"spec.rollout.tools\[0\]: .*TRL cannot describe it"):
        Toolbox.from_spec(RolloutSpec(tools=["test_multiturn:undescribed_tool"]))
    clash = RolloutSpec(tools=["test_multiturn:meet"], environment="test_multiturn:_Meeting")
    with pytest.raises(ToolLoadError, match="method meet has the name of a tool of spec.rollout.tools"):
        Toolbox.from_spec(clash)
    alias = RolloutSpec(tools=["test_multiturn:meet_again", "test_multiturn:meet"])
    with pytest.raises(ToolLoadError, match="'test_multiturn:meet_again' and 'test_multiturn:meet' are both"):
        Toolbox.from_spec(alias)


def undescribed_tool(x: int) -> int:
    return x


def meet(n: int) -> int:
    """A standalone tool of the name of an environment's method.

    Args:
        n: anything
    """
    return n


meet_again = meet  # an alias: the model would see two tools named meet


def test_calculator_parses_and_never_evaluates_code() -> None:
    assert calculator("13 + 14") == "27"
    assert calculator("(2 + 3) * 4 / 8") == "2.5"
    for bad in ("__import__('os').system('true')", "2 ** 100000", "x + 1", "10**13 * 10"):
        with pytest.raises(CalculatorError):
            calculator(bad)


def test_parsed_tool_calls_are_typed_by_the_tools_schema() -> None:
    from trl.chat_template_utils import parse_response

    tokenizer = smollm2_tokenizer()
    MultiTurn(
        ScriptedEngine(tokenizer), tokenizer, Toolbox(tools=[calculator]), GenerationParams(), "qwen2_5"
    )
    env = ArithEnvironment()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tools=[env.add],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    ids = tokenizer(tool_call("add", a="2", b=3) + "<|im_end|>", add_special_tokens=False)["input_ids"]
    message = parse_response(tokenizer, ids, prefix=prompt, tools=[env.add])
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    broken = tokenizer("<tool_call>\n{nope</tool_call><|im_end|>", add_special_tokens=False)["input_ids"]
    assert "tool_calls" not in parse_response(tokenizer, broken, prefix=prompt, tools=[env.add])
    # the loop parses with the tools' schemas, computed once a function: the same typed arguments
    multiturn = MultiTurn(
        ScriptedEngine(tokenizer), tokenizer, Toolbox(tools=[calculator]), GenerationParams(), "qwen2_5"
    )
    for instance in (env, ArithEnvironment()):
        assert multiturn._parsed(ids, prompt, [instance.add]) == message


def test_a_requests_rollouts_render_their_prompt_once_and_other_prompts_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rendering a prompt with its tools is most of the loop's own host work: a request's rollouts share
    one render; a prompt an environment's observation changed is rendered on its own; the ids are what the
    chat template gives the functions themselves."""
    tokenizer = smollm2_tokenizer()
    renders = []
    render = tokenizer.apply_chat_template

    def counted(messages, **kwargs):  # noqa: ANN001, ANN003, ANN202
        renders.append(messages[-1]["content"])
        return render(messages, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", counted)
    box = Toolbox(tools=[calculator], environments={None: _Counter}, max_iterations=0)
    params = GenerationParams(max_tokens=8)
    multiturn = MultiTurn(ScriptedEngine(tokenizer), tokenizer, box, params, "qwen2_5")
    renders.clear()  # the template's own checks, as the loop is made
    requests = [
        RolloutRequest(
            prompt=[{"role": "user", "content": "Task: plain."}], row={"i": i}, num_generations=3, seed=i
        )
        for i in (7, 8)
    ]
    groups = multiturn.rollouts(requests)
    assert renders == ["Task: plain. (row 7)", "Task: plain. (row 8)"]
    for group in groups:
        rollout = group[0]
        expected = render(
            rollout.prompt,
            tools=rollout.tools,
            chat_template=multiturn.template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        assert [r.prompt_ids for r in group] == [list(expected)] * 3


# -- environments ------------------------------------------------------------------------------------
class _Counter:
    def __init__(self) -> None:
        self.resets = 0

    def reset(self, **row: Any) -> str:
        self.resets += 1
        return f" (row {row['i']})"

    def peek(self) -> str:
        """Look."""
        return "x"


def test_environments_are_pooled_reset_per_generation_and_their_methods_are_tools() -> None:
    tokenizer = smollm2_tokenizer()
    box = Toolbox(environments={None: _Counter}, max_iterations=0)
    box._pool[None] = [_Counter()]
    multiturn = MultiTurn(
        ScriptedEngine(tokenizer), tokenizer, box, GenerationParams(max_tokens=8), "qwen2_5"
    )
    request = RolloutRequest(
        prompt=[{"role": "user", "content": "Task: plain."}], row={"i": 7}, num_generations=3, seed=0
    )
    for _ in range(2):
        group = multiturn.rollouts([request, request])[0]
    assert (
        len(box._pool[None]) == 6 and [e.resets for e in box._pool[None]] == [2] * 6
    )  # one per rollout of the task
    assert group[0].prompt[-1]["content"] == "Task: plain. (row 7)"
    assert [t.__name__ for t in group[0].tools] == ["peek"] and group[0].tools[0].__self__ is group[
        0
    ].environment


def test_environment_reward_is_get_reward_of_each_rollouts_environment() -> None:
    envs = [ArithEnvironment(), ArithEnvironment(), None]
    for env in envs[:2]:
        env.reset(answer="27", prompt="x")
    envs[0].submit("27")
    reward = EnvironmentReward("ArithEnvironment", "mortal.workers.rollout.builtin_tools:ArithEnvironment")
    assert reward(completions=[[], [], []], environments=envs) == [1.0, 0.0, None]


def test_a_dict_of_environments_is_picked_by_the_rows_environment_column() -> None:
    from mortal.workers.errors import FatalWorkerError

    box = Toolbox(environments={"arith": ArithEnvironment, "count": _Counter})
    assert box.environment_name({"environment": "count"}) == "count"
    with pytest.raises(FatalWorkerError, match="not among"):
        box.environment_name({"environment": "other"})


def test_spec_and_trainer_map_tools_and_environments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mortal import MortalTrainer

    monkeypatch.setenv("MORTAL_HOME", str(tmp_path))
    trainer = MortalTrainer(
        model="m",
        train_dataset="builtin:arith",
        reward_funcs=None,
        tools=[calculator],
        environment_factory=ArithEnvironment,
        max_tool_calling_iterations=3,
        chat_template="qwen2_5",
        name="calc",
    )
    rollout = trainer.run.spec.rollout
    assert rollout.tools == ["mortal.workers.rollout.builtin_tools:calculator"]
    assert rollout.environment == "mortal.workers.rollout.builtin_tools:ArithEnvironment"
    assert rollout.max_tool_calling_iterations == 3 and rollout.chat_template == "qwen2_5"
    [reward] = trainer.run.spec.rewards  # get_reward is the only reward, named after the class as in TRL
    assert (reward.env, reward.name, reward.args) == (
        "environment",
        "ArithEnvironment",
        {"class": "mortal.workers.rollout.builtin_tools:ArithEnvironment"},
    )
    assert "maxToolCallingIterations: 3" in trainer.to_yaml()


# -- whole runs on CPU -------------------------------------------------------------------------------
def _tool_spec(
    model_dir: str, max_tokens: int = 96, rollout: dict[str, Any] | None = None, **overrides: Any
) -> dict[str, Any]:
    from actor_helpers import actor_spec

    return actor_spec(
        model_dir,
        generation={"maxTokens": max_tokens, "engine": "transformers"},
        rollout={
            "replicas": 1,
            "tools": ["mortal.workers.rollout.builtin_tools:calculator"],
            "chatTemplate": "qwen2_5",
            "maxToolCallingIterations": 2,
            **(rollout or {}),
        },
        algorithm={"numGenerations": 4, "batchSize": 8, "maxSteps": 2, "learningRate": 1e-2},
        checkpoint={"every": 2, "keep": 1},
        **overrides,
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_helpers import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("multiturn") / "model")


def _metrics(store: Any, run: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for row in store.list_metrics(run):
        out.setdefault(row.step, {})[row.name] = row.value
    return out


def test_a_tool_run_trains_end_to_end_with_tool_results_masked(
    sqlite_store: Any, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path on CPU: spec -> rollout worker (tool loop, calculator) -> queue -> actor -> TRL's loss
    with the tool tokens masked -> metrics and stored completions that show the turns."""
    from actor_helpers import create_run, run_actor_with_rollout
    from rollout_helpers import task_results

    from mortal.workers.rollout import loop as rollout
    from mortal.workers.runtime import EXIT_SUCCEEDED

    monkeypatch.setattr(rollout, "select_engine", lambda *args, **kwargs: ArithScript)
    run = create_run(sqlite_store, "calc", _tool_spec(str(tiny_dir)))
    assert run_actor_with_rollout(sqlite_store, run) == EXIT_SUCCEEDED
    metrics = _metrics(sqlite_store, "calc")
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        assert (
            metrics[step]["tools/call_frequency"] == 1.0 and metrics[step]["tools/failure_frequency"] == 0.0
        )
        assert metrics[step]["tools/turns"] == 2.0
        assert metrics[step]["rewards/correct_answer/mean"] == 1.0  # the calculator's sums are right
    # TRL counts only the model's tokens (mask 1): the call and the answer, never the tool's result
    results = [r for task in sqlite_store.step_results("calc", 0) for r in task_results(task)]
    masks = [m for r in results for m in r.tool_masks]
    assert len(masks) == 8 and all(0 in m for m in masks)
    model_tokens = sum(map(sum, masks)) / len(masks)
    all_tokens = sum(len(ids) for r in results for ids in r.completion_ids) / len(masks)
    assert metrics[1]["completions/mean_length"] == pytest.approx(model_tokens) and model_tokens < all_tokens
    [sample, *_] = sqlite_store.list_completions("calc", step=2)
    assert (sample.extra["turns"], sample.extra["tool_calls"], sample.extra["tool_failures"]) == (2, 1, 0)
    assert "-> calculator(expression=" in sample.completion and "tool calculator: " in sample.completion


def test_an_environment_run_stopped_and_resumed_ends_bit_for_bit(
    sqlite_store: Any, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """environment_factory through a whole run: one ArithEnvironment per rollout, reset per generation, its
    `submit` a tool, its get_reward a reward; a run stopped after step 1 and resumed from its checkpoint ends
    with the same weights as one never stopped (nothing of an environment outlives its rollout)."""
    from actor_helpers import create_run, final_weights_hash, run_actor_with_rollout

    from mortal.workers.rollout import loop as rollout
    from mortal.workers.runtime import EXIT_SUCCEEDED

    monkeypatch.setattr(rollout, "select_engine", lambda *args, **kwargs: ArithScript)
    env_ref = "mortal.workers.rollout.builtin_tools:ArithEnvironment"
    spec = _tool_spec(
        str(tiny_dir),
        max_tokens=160,
        rollout={"environment": env_ref},
        rewards=[
            {"function": "actor_helpers:parity_reward"},
            {"env": "environment", "name": "ArithEnvironment", "args": {"class": env_ref}},
        ],
    )
    straight = create_run(sqlite_store, "straight", spec)
    assert run_actor_with_rollout(sqlite_store, straight) == EXIT_SUCCEEDED
    metrics = _metrics(sqlite_store, "straight")
    assert metrics[2]["rewards/ArithEnvironment/mean"] == 1.0  # every rollout submitted the calculator's sum
    assert metrics[2]["tools/turns"] == 3.0 and metrics[2]["tools/call_frequency"] == 2.0

    stopped = create_run(sqlite_store, "stopped", spec)
    assert run_actor_with_rollout(sqlite_store, stopped, stop_after_step=1) == EXIT_SUCCEEDED
    assert [c.step for c in sqlite_store.list_checkpoints("stopped")] == [1]
    assert run_actor_with_rollout(sqlite_store, stopped) == EXIT_SUCCEEDED
    assert final_weights_hash(sqlite_store, "stopped") == final_weights_hash(sqlite_store, "straight")


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "lock-step"])
def test_the_real_engine_runs_the_loop_and_repeats_its_trajectories(tiny_dir: Path, continuous: bool) -> None:
    """A random tiny model through the transformers engine on the CPU, both paths: the loop runs, and the
    same weights and seeds give the same trajectories (what exact resume needs). The continuous path is the
    CPU's default; on the lock-step path turn 1 is the single-turn path's tokens."""
    from mortal.specs.training import ModelSpec
    from mortal.workers.models import load_tokenizer
    from mortal.workers.rollout.engines.transformers_engine import TransformersEngine

    spec = ModelSpec(name=str(tiny_dir), dtype="float32")
    requests = [
        RolloutRequest(
            prompt=[{"role": "user", "content": f"What is {i} + 2?"}],
            row={"answer": str(i + 2)},
            num_generations=3,
            seed=100 + i,
        )
        for i in range(2)
    ]
    runs = []
    for _ in range(2):
        tokenizer = load_tokenizer(spec)
        engine = TransformersEngine.create(spec, tokenizer, device="cpu")
        multiturn = MultiTurn(
            engine,
            tokenizer,
            Toolbox(tools=[calculator]),
            GenerationParams(max_tokens=12),
            "qwen2_5",
            continuous=None if continuous else False,
        )
        assert multiturn.continuous is continuous
        runs.append(
            [
                [(r.completion_ids, r.logprobs, r.mask) for r in group]
                for group in multiturn.rollouts(requests)
            ]
        )
    assert runs[0] == runs[1]
    if continuous:
        return
    prompt_ids = multiturn._start(requests[0], None, [None] * 3)[0].prompt_ids
    single = engine.generate([prompt_ids], 3, [100], GenerationParams(max_tokens=12))
    assert [c.ids for c in single[0]] == [ids for ids, _, _ in runs[0][0]]


def test_the_code_agent_runs_the_models_code_in_the_sandbox_and_reports_failures() -> None:
    from mortal.specs.training import DatasetSpec
    from mortal.workers.data import load_rows
    from mortal.workers.rollout.builtin_tools import CodeAgentEnvironment
    from mortal.workers.rollout.tools import environment_methods

    row = load_rows(DatasetSpec(name="builtin:mbpp-mini"))[0]
    env = CodeAgentEnvironment()
    assert [t.__name__ for t in environment_methods(env)] == ["run_tests"]  # reset / get_reward are not tools
    env.reset(**row)
    name = row["tests"][0].split("assert ")[1].split("(")[0]
    failed = env.run_tests(f"def {name}(*args):\n    return None\n")
    assert failed.startswith("Failed:") and "AssertionError" in failed and env.get_reward() == 0.0
    early = env.run_tests("raise SystemExit(0)")
    assert early.startswith("Failed:") and env.get_reward() == 0.0  # exiting before the asserts never passes
    assert env.run_tests(row["solution"]) == "All tests passed." and env.get_reward() == 1.0
    env.reset(**row)
    assert env.get_reward() == 0.0


@pytest.mark.parametrize("timed_out,signal", [(True, "SIGKILL"), (False, "SIGXCPU")])
def test_the_code_agent_reports_a_timeout_whichever_limit_ended_the_code(timed_out, signal) -> None:
    """The CPU-seconds limit defaults to the wall-clock timeout, so a spinning loop is ended by either:
    the model is told "timed out" both ways, not SIGXCPU's empty stderr."""
    from mortal.workers.rewards.sandbox import ExecutionResult
    from mortal.workers.rollout.builtin_tools import CodeAgentEnvironment

    class Ended:
        def execute_in_sandbox(self, program: str) -> ExecutionResult:
            return ExecutionResult(
                success=False,
                exit_code=None,
                stdout="",
                stderr="",
                timed_out=timed_out,
                duration_seconds=1.0,
                signal=signal,
            )

    env = CodeAgentEnvironment()
    env.reset(tests=["assert f() == 1"])
    env._sandbox = Ended()
    assert env.run_tests("def f():\n    while True: pass\n") == "Failed: the code timed out."
    assert env.get_reward() == 0.0


class _BrokenReset:
    def reset(self, **row: Any) -> None:
        raise KeyError("no such column")


def test_an_environment_whose_reset_raises_fails_the_run_with_the_reason() -> None:
    from mortal.workers.errors import FatalWorkerError

    tokenizer = smollm2_tokenizer()
    multiturn = MultiTurn(
        ScriptedEngine(tokenizer),
        tokenizer,
        Toolbox(environments={None: _BrokenReset}),
        GenerationParams(max_tokens=8),
        "qwen2_5",
    )
    request = RolloutRequest(
        prompt=[{"role": "user", "content": "Task: plain.\n" + "x" * 200}],
        row={"task": "plain", "level": 2},
        num_generations=1,
        seed=0,
    )
    with pytest.raises(FatalWorkerError, match="_BrokenReset.reset.*KeyError") as caught:
        multiturn.rollouts([request])
    assert caught.value.reason == "EnvironmentFailed"
    # which row: its prompt, on one line and cut short, and its columns
    assert "(the row whose prompt's last message is 'Task: plain. xxx" in str(caught.value)
    assert "...', columns level, task)" in str(caught.value)


class _HungReset:
    """An environment whose reset answers long after a short resetTimeoutSeconds (its thread ends soon)."""

    def reset(self, **row: Any) -> None:
        time.sleep(1)


def test_an_environment_whose_reset_hangs_in_process_fails_the_run_past_its_deadline() -> None:
    from mortal.workers.errors import FatalWorkerError

    tokenizer = smollm2_tokenizer()
    multiturn = MultiTurn(
        ScriptedEngine(tokenizer),
        tokenizer,
        Toolbox(environments={None: _HungReset}, reset_seconds=0.05),
        GenerationParams(max_tokens=8),
        "qwen2_5",
    )
    request = RolloutRequest(
        prompt=[{"role": "user", "content": "Task: plain."}], row={"task": "plain"}, num_generations=1, seed=0
    )
    started = time.monotonic()
    with pytest.raises(FatalWorkerError) as caught:
        multiturn.rollouts([request])
    assert time.monotonic() - started < 1  # the deadline, not the reset, ended it
    assert caught.value.reason == "EnvironmentTimedOut"
    assert str(caught.value) == (
        "EnvironmentTimedOut: _HungReset.reset(**row) did not return within "
        "rollout.environmentService.resetTimeoutSeconds (0.05 s) for the row whose prompt's last message is "
        "'Task: plain.', columns task; its thread was abandoned, its stacks are in the worker's log"
    )


def test_hung_resets_count_as_abandoned_calls_and_too_many_relaunch_the_worker() -> None:
    box = Toolbox(environments={None: _HungReset}, reset_seconds=0.02, abandoner=Abandoner(limit=1))
    with pytest.raises(CallTimedOut, match="_HungReset.reset did not return within 0.02 s"):
        box.reset(_HungReset(), {"task": "plain"})
    with pytest.raises(TooManyAbandonedCalls):
        box.reset(_HungReset(), {"task": "plain"})


def test_the_batched_engine_continues_conversations_and_repeats_them(tiny_dir: Path) -> None:
    """The transformers engine's batched path (eager on the CPU) runs the loop as conversations it keeps in
    its rows; the same weights and seeds give the same trajectories."""
    from mortal.specs.training import ModelSpec
    from mortal.workers.models import load_model, load_tokenizer
    from mortal.workers.rollout.engines.transformers_engine import TransformersEngine

    spec = ModelSpec(name=str(tiny_dir), dtype="float32")
    requests = [
        RolloutRequest(
            prompt=[{"role": "user", "content": f"What is {i} + 2?"}], row={}, num_generations=3, seed=100 + i
        )
        for i in range(2)
    ]
    runs = []
    for _ in range(2):
        tokenizer = load_tokenizer(spec)
        engine = TransformersEngine(load_model(spec, "cpu", for_training=False), tokenizer, compiled=True)
        multiturn = MultiTurn(
            engine, tokenizer, Toolbox(tools=[calculator]), GenerationParams(max_tokens=12), "qwen2_5"
        )
        assert multiturn.continuous
        groups = multiturn.rollouts(requests)
        runs.append([[(r.completion_ids, r.logprobs, r.mask) for r in group] for group in groups])
        assert all(0 < len(r.completion_ids) <= 12 for group in groups for r in group)
        assert engine.generation_stats()["turns"] >= 6
    assert runs[0] == runs[1]


def test_a_prompt_that_leaves_no_room_for_max_tokens_fails_the_run_naming_its_row() -> None:
    """The first turn alone may take maxTokens: a prompt whose tokens and maxTokens exceed what the model
    takes is refused before any engine call (no spec field asks for prompts to be cut)."""
    from mortal.workers.rollout.multiturn import PromptTooLong

    tokenizer = smollm2_tokenizer()
    engine = ScriptedEngine(tokenizer)
    multiturn = MultiTurn(
        engine,
        tokenizer,
        Toolbox(tools=[calculator]),
        GenerationParams(max_tokens=160),
        chat_template="qwen2_5",
    )
    request = RolloutRequest(
        prompt=[{"role": "user", "content": "Add these: " + "1 + " * (MAX_MODEL_LEN // 2)}],
        row={"answer": "1"},
        num_generations=2,
        seed=0,
    )
    with pytest.raises(PromptTooLong) as caught:
        multiturn.rollouts([request])
    assert caught.value.reason == "PromptTooLong"
    assert f"tokens and generation.maxTokens 160 exceed the {MAX_MODEL_LEN} tokens the model takes" in str(
        caught.value
    )
    assert "(the dataset row whose prompt's last message is 'Add these: 1 + 1 + " in str(caught.value)
    assert "columns answer); shorten or drop the row" in str(caught.value)
    assert engine.calls == []
