"""`python -m mortal.workers.probe`: admission's checks of a spec, made the way a worker would see it.

Who calls it: mortal.controller.admission, in a child process whose working folder is the run's code
snapshot (first on sys.path, as in a worker), with {"spec": ..., "simulated": bool} on stdin; it
prints one JSON list of checks {field, state: ok | failed | deferred, message}. A child process so
the user's modules are imported fresh (a long-lived controller or a MortalTrainer script would reuse
stale ones) and never into the caller. Rewards, tools and environments are resolved with the
workers' own resolvers and their signatures compared with how TRL calls them; the model and the
dataset file are looked for as the workers look for them (nothing is downloaded), and a JSON-lines
dataset's lines are checked as the actor reads them (mortal.workers.data.jsonl_rows).
What it must not do: construct a reward, a tool or an environment (that may load a model), or decide
anything: admission refuses or accepts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import itertools
import json
import os
import sys
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

from mortal.specs.training import TrainingSpec
from mortal.workers import references
from mortal.workers.errors import FatalWorkerError
from mortal.workers.rollout.chat_templates import UnknownChatTemplate, template_file
from mortal.workers.rollout.environment_schema import (
    repeated_tool_name,
    schema_problem,
    tool_name_clash,
    tool_problems,
)

# a tool the model cannot be told of: TRL describes each from its signature, type hints and docstring
SCHEMA_HINT = (
    "TRL cannot describe it to the model (transformers' get_json_schema needs a docstring with an Args: "
    "section and JSON-typed hints)"
)

# What TRL's GRPOTrainer (and mortal's RewardSet) pass a reward function by name, besides dataset columns.
TRL_REWARD_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
REWARD_HINT = "define it as f(completions, prompts=None, completion_ids=None, **kwargs) -> list[float | None]"
REMOTE = ("modal", "ray")


@dataclass(frozen=True)
class Check:
    field: str
    state: str  # ok | failed | deferred
    message: str


def ok(field: str, message: str) -> Check:
    return Check(field, "ok", message)


def failed(field: str, message: str) -> Check:
    return Check(field, "failed", message)


def deferred(field: str, message: str) -> Check:
    """A check only the backend can make, later: said, never skipped silently."""
    return Check(field, "deferred", message)


def _resolve(ref: str) -> tuple[Any, str | None]:
    """The object, or None and why it cannot be imported (what the worker would fail with)."""
    module = ref.partition(":")[0]
    try:
        return references.resolve(ref), None
    except references.MissingAttribute as exc:
        return None, str(exc)
    except ModuleNotFoundError as exc:
        if exc.name is not None and not _names_module(exc.name, module):
            return None, _missing_dependency(module, exc.name, exc)
        return None, (
            f"cannot import module {module!r} ({exc}): it is neither in the folder you applied "
            "from nor installed where mortal runs"
        )
    except BaseException as exc:  # noqa: BLE001 - what the user's module raises on import is the finding
        return None, f"importing module {module!r} failed: {type(exc).__name__}: {exc}"


def _names_module(missing: str, module: str) -> bool:
    """Whether the module Python could not find is `module` itself or a package holding it."""
    return module == missing or module.startswith(missing + ".")


def _shown_path(path: str) -> tuple[str, bool]:
    """A file as its path in the snapshot (the working folder, a copy of the folder applied from) when it
    is one of its files, else as it is; and whether it is."""
    relative = os.path.relpath(path)
    return (path, False) if relative.startswith(os.pardir) else (relative, True)


def _missing_dependency(module: str, missing: str, exc: ModuleNotFoundError) -> str:
    """Why `module`, which was found, failed to import: something it imports is not there. Says where the
    module is and which import statement failed, when they are known."""
    try:
        spec = importlib.util.find_spec(module)
    except BaseException:  # noqa: BLE001 - a package above it that fails again: its place stays unsaid
        spec = None
    failed = f"importing module {module!r} failed"
    if spec is not None and spec.origin:
        path, applied = _shown_path(spec.origin)
        where = f"{path}, in the folder you applied from" if applied else path
        failed = f"module {module!r} was found ({where}) but importing it failed"
    lines = [(f.f_code.co_filename, n) for f, n in traceback.walk_tb(exc.__traceback__)]
    files = [(name, line) for name, line in lines if not name.startswith("<")]  # not importlib's own
    importer = f"{_shown_path(files[-1][0])[0]}:{files[-1][1]}" if files else "it"
    return (
        f"{failed}: {importer} imports {missing!r}, "
        "which is neither in the folder you applied from nor installed where mortal runs"
    )


def _signature(obj: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: nothing certain to say
        return None


def _takes_trl_call(func: Any, args: dict[str, Any]) -> str | None:
    """Why TRL's keyword call cannot reach `func` (None when it can)."""
    sig = _signature(func)
    if sig is None:
        return None
    try:
        sig.bind_partial(**args, **dict.fromkeys(TRL_REWARD_KWARGS))
    except TypeError as exc:
        return f"its signature {sig} does not take TRL's reward call ({exc}); {REWARD_HINT}"
    return None


def _reward_environment_class() -> type:
    from mortal.workers.rewards import RewardEnvironment

    return RewardEnvironment


def check_reward(field: str, ref: str, args: dict[str, Any]) -> Check:
    obj, why = _resolve(ref)
    if why is not None:
        return failed(field, f"{ref!r}: {why}")
    if inspect.isclass(obj):
        sig = _signature(obj)
        if sig is not None:
            try:
                sig.bind(**args)
            except TypeError as exc:
                return failed(
                    field,
                    f"{ref!r}: the class cannot be built as {obj.__name__}(**args) with args {args} ({exc})",
                )
        base = _reward_environment_class()
        if issubclass(obj, base):
            if obj.score is base.score and obj.score_batch is base.score_batch:
                return failed(
                    field,
                    f"{ref!r}: RewardEnvironment {obj.__name__} overrides neither score() nor score_batch()",
                )
            return ok(field, f"{ref!r}: RewardEnvironment {obj.__name__}")
        if "__call__" not in {name for klass in obj.__mro__[:-1] for name in vars(klass)}:
            return failed(
                field,
                f"{ref!r}: class {obj.__name__} is neither a RewardEnvironment nor "
                "callable; subclass mortal.RewardEnvironment and override score()",
            )
        problem = _takes_trl_call(obj.__call__, {"self": None})
        return (
            failed(field, f"{ref!r}: {obj.__name__}.__call__: {problem}")
            if problem
            else ok(field, f"{ref!r}: callable class {obj.__name__}")
        )
    if not callable(obj):
        return failed(field, f"{ref!r}: is not callable (it is a {type(obj).__name__}); {REWARD_HINT}")
    problem = _takes_trl_call(obj, args)
    if problem:
        return failed(field, f"{ref!r}: {problem}")
    return ok(field, f"{ref!r}: a function taking TRL's reward call")


def check_tool(field: str, ref: str) -> Check:
    obj, why = _resolve(ref)
    if why is not None:
        return failed(field, f"{ref!r}: {why}")
    if not callable(obj) or inspect.isclass(obj):
        return failed(field, f"{ref!r}: a tool must be a function (it is a {type(obj).__name__})")
    if (problem := schema_problem(obj)) is not None:
        return failed(field, f"{ref!r}: {SCHEMA_HINT}: {problem}")
    return ok(field, f"{ref!r}: a function" if inspect.isfunction(obj) else f"{ref!r}: a callable")


def check_environment(field: str, ref: str) -> Check:
    obj, why = _resolve(ref)
    if why is not None:
        return failed(field, f"{ref!r}: {why}")
    if not inspect.isclass(obj):
        return failed(
            field,
            f"{ref!r}: an environment must be a class, built with no arguments "
            f"(it is a {type(obj).__name__})",
        )
    sig = _signature(obj)
    if sig is not None:
        try:
            sig.bind()
        except TypeError as exc:
            return failed(
                field, f"{ref!r}: TRL builds it with no arguments, and {obj.__name__}{sig} needs some ({exc})"
            )
    if not callable(getattr(obj, "reset", None)):
        return failed(
            field,
            f"{ref!r}: has no reset() method; TRL's environment_factory needs one (it is "
            "called before each generation)",
        )
    if problems := tool_problems(obj):
        named = "; ".join(f"{obj.__name__}.{name}: {problem}" for name, problem in problems)
        return failed(field, f"{ref!r}: {SCHEMA_HINT}: {named}")
    return ok(field, f"{ref!r}: a class built with no arguments, with reset()")


def check_tool_names(tools: list[str], environments: dict[str, str]) -> list[Check]:
    """The model calls a tool by its name: two standalone tools must not share one (an alias of a function
    included), nor an environment's method a standalone tool's (the worker refuses both at its start:
    mortal.workers.rollout.tools). References that do not resolve are the other checks' to report."""
    resolved = []
    for ref in tools:
        obj, why = _resolve(ref)
        if why is None and callable(obj):
            resolved.append((ref, obj))
    found = []
    if (clash := repeated_tool_name(resolved)) is not None:
        found.append(failed("spec.rollout.tools", clash))
    names = {getattr(tool, "__name__", "") for _, tool in resolved}
    for key, ref in environments.items():
        cls, why = _resolve(ref)
        if why is None and inspect.isclass(cls) and (clash := tool_name_clash(cls, names)):
            found.append(failed("spec.rollout.environment" + (f".{key}" if key else ""), f"{ref!r}: {clash}"))
    return found


def check_model(spec: TrainingSpec, simulated: bool) -> Check:
    field, name = "spec.model.name", spec.model.name
    if simulated:
        return ok(field, f"{name!r}: not loaded (simulated workload)")
    if spec.backend in REMOTE:
        return deferred(field, f"{name!r}: looked for where the {spec.backend} backend runs the workers")
    from mortal.workers.models import resolve_model_source

    try:
        source = resolve_model_source(name)
    except FatalWorkerError as exc:
        return failed(field, exc.message)
    if source.kind != "hub":
        return ok(field, f"{name!r}: {source.kind} at {source.location}")
    return _hub_model(field, name)


def _hub_model(field: str, name: str) -> Check:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return deferred(
            field, f"{name!r}: a hub id, and huggingface_hub is not installed here to look in the cache"
        )
    try:
        cached = try_to_load_from_cache(name, "config.json")
    except Exception as exc:  # noqa: BLE001 - a malformed id: the hub library says why
        return failed(field, f"{name!r}: not a model folder or .gguf here, nor a hub id ({exc})")
    if isinstance(cached, str):
        return ok(field, f"{name!r}: in the Hugging Face cache")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return failed(
            field,
            f"{name!r}: not a model folder or .gguf here, and not in the Hugging Face "
            "cache while HF_HUB_OFFLINE is set; download it first (hf download "
            f"{name}) or fix the name",
        )
    return deferred(
        field,
        f"{name!r}: not in the Hugging Face cache; the workers download it from the hub when they start",
    )


ADMISSION_READ_BYTES = 64 << 20
"""How much of a local JSON-lines dataset admission reads, every line checked as the actor would check it: any
prompt set written by hand or by a script is read whole in about a second. Of a larger file the lines past it
are checked by the actor as it reads them, and the check says so."""


def check_dataset(spec: TrainingSpec) -> Check:
    field, dataset = "spec.dataset.name", spec.dataset
    from mortal.workers.data import FILE_SUFFIXES, builtin_names

    if dataset.name.startswith("builtin:"):
        name = dataset.name.removeprefix("builtin:")
        if name not in builtin_names():
            return failed(
                field,
                f"{dataset.name!r}: no built-in dataset {name!r}; built-in: {', '.join(builtin_names())}",
            )
        return ok(field, f"{dataset.name!r}: built in")
    path = os.path.expanduser(dataset.name)
    if os.path.splitext(path)[1] in FILE_SUFFIXES or os.path.exists(path):
        if not os.path.isfile(path):
            return failed(
                field,
                f"{dataset.name!r}: no such file (relative names are read from the folder you applied from)",
            )
        if not path.endswith(".jsonl"):
            return ok(field, f"{dataset.name!r}: a local file")
        problem, note = jsonl_problem(path, dataset.prompt_column, dataset.max_samples)
        if problem is not None:
            return failed(field, f"{dataset.name!r}: {problem}")
        return ok(field, f"{dataset.name!r}: a local file{note}")
    return deferred(field, f"{dataset.name!r}: a hub dataset, read by the actor when it starts")


def jsonl_problem(path: str, prompt_column: str, max_rows: int | None) -> tuple[str | None, str]:
    """The first bad line of a JSON-lines file, as the actor would name it (None: none), and a note when
    lines past ADMISSION_READ_BYTES were left to the actor. Reading stops after `max_rows` rows (maxSamples),
    where the actor stops."""
    from mortal.workers.data import RowProblem, jsonl_rows

    cut: list[int] = []

    def lines(handle: BinaryIO) -> Iterator[bytes]:
        left = ADMISSION_READ_BYTES
        for number in itertools.count(1):
            line = handle.readline(left + 1)
            if len(line) > left:
                cut.append(number)  # this line runs past the budget: neither it nor the rest is read
                return
            if not line:
                return
            left -= len(line)
            yield line

    with open(path, "rb") as handle:
        try:
            rows = sum(1 for _ in itertools.islice(jsonl_rows(lines(handle), prompt_column), max_rows))
        except RowProblem as exc:
            return str(exc), ""
    if cut:
        checked = f"lines 1-{cut[0] - 1}" if cut[0] > 1 else "no line"
        return None, (
            f"; {checked} checked, the rest (past {ADMISSION_READ_BYTES >> 20} MiB, ADMISSION_READ_BYTES) "
            "is checked by the actor as it reads it"
        )
    return ("the file has no rows", "") if rows == 0 else (None, "")


def check_chat_template(spec: TrainingSpec) -> list[Check]:
    """A .jinja file must exist; another name must be one of TRL's templates (where TRL is installed: the
    rollout worker resolves it so, mortal.workers.rollout.multiturn.resolve_chat_template)."""
    template = spec.rollout.chat_template
    if not template:
        return []
    field = "spec.rollout.chatTemplate"
    try:
        template_file(template)
    except ImportError:  # TRL is not installed where apply runs: the worker checks the name at its start
        return []
    except UnknownChatTemplate as exc:
        return [failed(field, str(exc))]
    kind = "a local file" if template.endswith(".jinja") else "TRL's template"
    return [ok(field, f"{template!r}: {kind}")]


def checks(spec: TrainingSpec, simulated: bool) -> list[Check]:
    found = [check_model(spec, simulated), check_dataset(spec)]
    for i, entry in enumerate(spec.rewards):
        if entry.function:
            found.append(check_reward(f"spec.rewards[{i}].function", entry.function, dict(entry.args)))
        elif entry.env == "environment" and entry.args.get("class"):
            found.append(check_environment(f"spec.rewards[{i}].args.class", str(entry.args["class"])))
    found += [check_tool(f"spec.rollout.tools[{i}]", ref) for i, ref in enumerate(spec.rollout.tools)]
    environment = spec.rollout.environment
    named = {"": environment} if isinstance(environment, str) else dict(environment or {})
    found += [
        check_environment("spec.rollout.environment" + (f".{k}" if k else ""), ref)
        for k, ref in named.items()
    ]
    found += check_tool_names(list(spec.rollout.tools), named)
    found += check_chat_template(spec)
    return found


def main() -> None:
    request = json.loads(sys.stdin.read())
    spec = TrainingSpec.model_validate(request["spec"])
    sys.path.insert(0, os.getcwd())  # the snapshot, first, as a worker has it
    with contextlib.redirect_stdout(sys.stderr):  # what user modules print must not garble the answer
        result = [asdict(c) for c in checks(spec, bool(request.get("simulated")))]
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
