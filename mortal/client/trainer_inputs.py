"""What MortalTrainer turns into spec fields: reward callables -> "module:attr", datasets -> files.

Called by mortal.client.trainer while it builds a TrainingRun. A reward must be importable by a
worker process, so each is checked by importing its path back and comparing identity; an
in-memory dataset is written once to $MORTAL_HOME/datasets/<name>-<hash>.jsonl. It must not
import torch or datasets (a datasets.Dataset is recognized by duck typing).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mortal.workers import references

BUILTIN_ENV_NAMES = {
    "sandbox": "code-execution",
    "code-execution": "code-execution",
    "llm-judge": "llm-judge",
    "math-answer": "math-answer",
}
"""String reward_funcs that name a built-in environment ('sandbox' is the seed's name)."""


class TrainerError(ValueError):
    """MortalTrainer was given arguments it cannot turn into a TrainingRun."""


class RewardNotImportable(TrainerError):
    """A reward function that the worker processes could not import by its 'module:attr' path."""


# -- rewards ---------------------------------------------------------------------------------------
def reward_entry(reward: Any, weight: float | None = None) -> dict[str, Any]:
    """One spec.rewards entry for a callable, a RewardEnvironment class or instance, or a string."""
    entry: dict[str, Any]
    builtin = getattr(reward, "spec_entry", None) if _is_reward_environment(reward) else None
    if isinstance(reward, str):
        entry = {"env": BUILTIN_ENV_NAMES[reward]} if reward in BUILTIN_ENV_NAMES else {"function": reward}
    elif isinstance(reward, type):
        env = reward.__dict__.get("ENV")  # a built-in environment class itself (not a subclass): its env name
        entry = (
            {"env": env} if isinstance(env, str) and env != "llm-judge" else {"function": import_path(reward)}
        )
    elif builtin is not None and builtin() is not None:  # a built-in environment instance: env + args
        entry = builtin()
    elif _is_reward_environment(reward):
        entry = {"function": import_path(type(reward)), "args": instance_args(reward)}
    elif callable(reward):
        entry = {"function": import_path(reward)}
    else:
        raise TrainerError(
            f"reward_funcs entries must be callables, RewardEnvironment classes or instances, "
            f"or 'module:attr' strings (got {reward!r})"
        )
    if weight is not None:
        entry["weight"] = float(weight)
    return entry


def _is_reward_environment(obj: Any) -> bool:
    rewards = sys.modules.get("mortal.workers.rewards")  # an instance exists only if it was imported
    return rewards is not None and isinstance(obj, rewards.RewardEnvironment)


def import_path(obj: Any, kind: str = "reward") -> str:
    """'module:qualname' of a function or class, checked by importing it back (identity, not name);
    `kind` names it in the error (reward, tool, environment)."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    what = getattr(obj, "__name__", None) or repr(obj)
    fix = "define it at the top level of a module (e.g. my_rewards.py) and import it from there"
    if module is None or qualname is None:
        raise RewardNotImportable(
            f"{kind} {what} has no importable name (a functools.partial or a callable object?); {fix}; "
            "for parameters, subclass RewardEnvironment and take them in __init__"
        )
    if qualname == "<lambda>" or "<lambda>" in qualname:
        raise RewardNotImportable(f"{kind} {what} is a lambda, which worker processes cannot import; {fix}")
    if "<locals>" in qualname:
        raise RewardNotImportable(
            f"{kind} {qualname} is defined inside a function, which worker processes cannot import; {fix}"
        )
    if module == "__main__":
        raise RewardNotImportable(
            f"{kind} {qualname} is defined in the script being run (__main__), which "
            f"worker processes cannot import; {fix}"
        )
    ref = f"{module}:{qualname}"
    try:
        found = references.resolve(ref)
    except (ImportError, AttributeError) as exc:
        raise RewardNotImportable(f"{kind} {ref} cannot be imported back ({exc}); {fix}") from None
    if found is not obj:
        raise RewardNotImportable(f"importing {ref} gives a different object than the {kind} passed; {fix}")
    return ref


def instance_args(env: Any) -> dict[str, Any]:
    """The constructor kwargs of a RewardEnvironment instance, read back from same-named attributes.

    The worker rebuilds the instance as `Class(**args)`, so each __init__ parameter must be stored
    on the instance under its own name (as dataclasses do) unless it kept its default.
    """
    params = list(inspect.signature(type(env).__init__).parameters.values())[1:]
    attrs = vars(env) if hasattr(env, "__dict__") else {}
    args: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in attrs:
            value = attrs[p.name]
            if p.default is not p.empty and value == p.default:
                continue
            try:
                json.dumps(value)
            except TypeError:
                raise TrainerError(
                    f"{type(env).__name__}.{p.name} = {value!r} is not JSON-serializable, so it "
                    "cannot travel in a spec; pass plain values (str, numbers, lists, dicts)"
                ) from None
            args[p.name] = value
        elif p.default is p.empty:
            raise TrainerError(
                f"cannot tell which {p.name!r} this {type(env).__name__} was built with: store it as "
                f"self.{p.name} in __init__ (the worker rebuilds it as {type(env).__name__}(**args))"
            )
    return args


def is_code_execution(reward_funcs: Any) -> bool:
    """reward_funcs that ask for code execution only: 'sandbox' (the seed's name), 'code-execution',
    or the CodeExecutionEnvironment (class or instance), alone or in a list."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]

    def one(reward: Any) -> bool:
        if isinstance(reward, str):
            return BUILTIN_ENV_NAMES.get(reward) == "code-execution"
        cls = reward if isinstance(reward, type) else type(reward)
        return cls.__dict__.get("ENV") == "code-execution"

    return bool(funcs) and all(one(f) for f in funcs)


def reward_entries(reward_funcs: Any, reward_weights: list[float] | None) -> list[dict[str, Any]]:
    funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise TrainerError(
            f"reward_weights has {len(reward_weights)} entries for {len(funcs)} reward_funcs; "
            "give one weight per reward (or none for equal weights)"
        )
    weights = reward_weights if reward_weights is not None else [None] * len(funcs)
    return [reward_entry(f, w) for f, w in zip(funcs, weights, strict=True)]


# -- tools and environments ------------------------------------------------------------------------
def tool_fields(
    tools: Any,
    environment_factory: Any,
    max_tool_calling_iterations: int | None,
    tool_timeout_seconds: float | None,
    chat_template: str | None,
) -> dict[str, Any]:
    """TRL's `tools=` / `environment_factory=` / `max_tool_calling_iterations=` as spec.rollout fields."""
    fields: dict[str, Any] = {}
    if tools:
        if not isinstance(tools, list | tuple) or not all(callable(t) or isinstance(t, str) for t in tools):
            raise TrainerError("tools must be a list of functions (or 'module:function' strings)")
        fields["tools"] = [t if isinstance(t, str) else import_path(t, "tool") for t in tools]
    if environment_factory is not None:
        if isinstance(environment_factory, dict):
            fields["environment"] = {str(k): _environment_ref(v) for k, v in environment_factory.items()}
        else:
            fields["environment"] = _environment_ref(environment_factory)
    return fields | {
        k: v
        for k, v in (
            ("max_tool_calling_iterations", max_tool_calling_iterations),
            ("tool_timeout_seconds", tool_timeout_seconds),
            ("chat_template", chat_template),
        )
        if v is not None
    }


def _environment_ref(factory: Any) -> str:
    if isinstance(factory, str):
        return factory
    if not isinstance(factory, type):
        raise TrainerError(
            f"environment_factory must be a class (or a dict of classes) that workers can import and "
            f"build with no arguments, as TRL calls it (got {factory!r})"
        )
    return import_path(factory, "environment")


def environment_rewards(environment_factory: Any) -> list[dict[str, Any]]:
    """TRL's extra reward per environment class that defines get_reward: named after the class, weight 1."""
    if environment_factory is None:
        return []
    factories = (
        environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    )
    classes = list(
        dict.fromkeys(
            f for f in factories if isinstance(f, type) and callable(getattr(f, "get_reward", None))
        )
    )
    return [
        {"env": "environment", "name": cls.__name__, "args": {"class": import_path(cls, "environment")}}
        for cls in classes
    ]


# -- datasets --------------------------------------------------------------------------------------
def dataset_rows(dataset: Any) -> list[dict[str, Any]] | None:
    """Rows of an in-memory dataset (a datasets.Dataset / DatasetDict, or a list of dicts); None for a
    name."""
    if isinstance(dataset, str | Path):
        return None
    if hasattr(dataset, "keys") and hasattr(dataset, "__getitem__") and "train" in dataset:
        dataset = dataset["train"]  # a DatasetDict
    if hasattr(dataset, "to_list"):
        return list(dataset.to_list())
    if isinstance(dataset, list | tuple) and all(isinstance(row, dict) for row in dataset):
        return list(dataset)
    raise TrainerError(
        "train_dataset must be a datasets.Dataset, a list of dicts, or a name/path string "
        f"(got {type(dataset).__name__})"
    )


@dataclass(frozen=True)
class DatasetFile:
    """In-memory rows as the file workers will read: where it goes and what it holds (written only once the
    run it belongs to validated, so a refused construction writes nothing)."""

    path: Path
    text: str

    def write(self) -> Path:
        """Write the file unless it exists (same rows, same name), atomically."""
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{uuid.uuid4().hex[:6]}")
            tmp.write_text(self.text, encoding="utf-8")
            tmp.replace(self.path)
        return self.path


def dataset_file(rows: list[dict[str, Any]], name: str, prompt_column: str, home: Path) -> DatasetFile:
    """rows -> $MORTAL_HOME/datasets/<name>-<hash>.jsonl (same rows, same file), where workers read it; a
    name that would lead out of that folder is refused here too, whatever validates it later."""
    if not rows:
        raise TrainerError("train_dataset is empty")
    lacking = next((i for i, row in enumerate(rows) if prompt_column not in row), None)
    if lacking == 0:
        raise TrainerError(
            f"train_dataset has no {prompt_column!r} column (columns: {', '.join(map(str, rows[0]))}); "
            "rename it or pass prompt_column=..."
        )
    if lacking is not None:  # a list of dicts need not have the same keys in every row, as a Dataset does
        raise TrainerError(
            f"train_dataset row {lacking} has no {prompt_column!r} (its keys: "
            f"{', '.join(map(str, rows[lacking])) or 'none'}); every row needs its prompt"
        )
    try:
        text = "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows)
    except TypeError as exc:
        raise TrainerError(f"train_dataset rows must be JSON-serializable ({exc})") from None
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    folder = home / "datasets"
    path = folder / f"{name}-{digest}.jsonl"
    if path.parent != folder or name in ("", ".", ".."):
        raise TrainerError(f"name {name!r}: a run name holds no '/' (it names the dataset file it writes)")
    return DatasetFile(path, text)


def dataset_name(dataset: str | Path) -> str:
    """A local file becomes an absolute path (workers may run elsewhere); hub ids and builtin: stay."""
    path = Path(dataset).expanduser()
    return str(path.resolve()) if path.exists() else str(dataset)


def default_run_name(model: str) -> str:
    """kubectl generateName style: '<model slug>-<5 random chars>', a DNS-1123 label."""
    slug = (
        re.sub(r"[^a-z0-9]+", "-", Path(model).name.lower().removesuffix(".gguf")).strip("-")[:50].strip("-")
    )
    return f"{slug or 'run'}-{uuid.uuid4().hex[:5]}"
