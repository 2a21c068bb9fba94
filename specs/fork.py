"""A forked run's document: the parent's, with overrides merged over it, and what a fork may not change.

Called by mortal.controller.fork (for `mortalctl fork` and `MortalTrainer.train(resume_from_checkpoint=...)`)
and by tests. Pure: no I/O but what the caller hands in; it never talks to the store or the disk.

    doc = forked_document(parent_doc, "child", fragment={"spec": {...}},
                          sets=["spec.algorithm.learningRate=1e-6"])
    problems = carry_over_problems(parent.spec, child.spec, step=20)   # [] when the checkpoint fits

Overrides follow JSON Merge Patch (RFC 7386): mappings merge key by key, any other value (a list
included) replaces, and null removes the key (its default applies again). A fragment is rooted at the
document (`spec:` and/or `metadata:` with labels and annotations); `--set PATH=VALUE` names one key by
its dotted camelCase path as the YAML spells it (`spec.rewards.0.weight` or `spec.rewards[0].weight`),
its VALUE read as a YAML scalar (`1e-6`, `true`, `null`, `[a, b]`). Every problem is a SpecIssue that
names the path and the value given.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from pydantic import ValidationError

from mortal.specs import epochs, parse_limits
from mortal.specs.diagnostics import issues_from_errors
from mortal.specs.errors import SpecError, SpecIssue
from mortal.specs.loader import _plain
from mortal.specs.run import TrainingRun
from mortal.specs.training import TrainingSpec

SET_SOURCE = "--set"
ROOTS = ("spec", "metadata")
METADATA_KEYS = ("labels", "annotations")
_INDEX = re.compile(r"\[(\d+)\]")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: `patch` merged over `target` (neither is changed; a new value is returned)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def load_fragment(text: str, source: str) -> tuple[Any, dict[tuple, int]]:
    """An overrides file's text as plain data, with the line of each key (for errors that point at it)."""
    docs = parse_limits.load_documents(text, source)
    if len(docs) > 1:
        several = "must be one YAML document (found several, split by '---')"
        raise SpecError([SpecIssue(source, None, "", several)])
    lines: dict[tuple, int] = {}
    return _plain(docs[0] if docs else None, (), lines), lines


def parse_set(assignment: str) -> tuple[list[str | int], Any]:
    """'spec.rewards[0].weight=0.5' -> (['spec', 'rewards', 0, 'weight'], 0.5). SpecError when malformed."""
    path_text, sep, raw = assignment.partition("=")
    path_text = path_text.strip()
    if not sep or not path_text:
        raise _error(
            assignment, "", f"expected PATH=VALUE, e.g. spec.algorithm.learningRate=1e-6 (got {assignment!r})"
        )
    parts: list[str | int] = []
    for piece in _INDEX.sub(r".\1", path_text).split("."):
        if not piece:
            raise _error(
                assignment,
                path_text,
                "has an empty segment; write dotted camelCase keys such as spec.algorithm.learningRate",
            )
        parts.append(int(piece) if piece.isdigit() else piece)
    if parts[0] not in ROOTS:
        raise _error(assignment, path_text, f"must start with spec. or metadata. (got {parts[0]!r})")
    if parts[0] == "metadata" and (len(parts) != 3 or parts[1] not in METADATA_KEYS):
        raise _error(
            assignment,
            path_text,
            "only metadata.labels.KEY and metadata.annotations.KEY can be "
            "set (the name is the fork's NEW argument)",
        )
    try:
        docs = parse_limits.load_documents(raw, SET_SOURCE, typ="safe") if raw.strip() else [""]
    except SpecError as exc:
        why = exc.issues[0].message
        raise _error(assignment, path_text, f"the value {raw!r} is not a YAML value: {why}") from None
    if len(docs) != 1:
        raise _error(assignment, path_text, f"the value {raw!r} is not one YAML value")
    value = docs[0]
    return parts, value


def set_path(doc: dict[str, Any], parts: list[str | int], value: Any, shown: str) -> None:
    """Set (or with None, remove) the key at `parts` in `doc`, creating mappings on the way."""
    node: Any = doc
    for i, part in enumerate(parts[:-1]):
        where = _dotted(parts[: i + 1])
        nxt = parts[i + 1]
        if isinstance(node, list):
            if not isinstance(part, int) or not 0 <= part < len(node):
                raise _error(shown, where, f"no item {part!r} in a list of {len(node)}")
            node = node[part]
            continue
        if not isinstance(node, dict) or isinstance(part, int):
            raise _error(shown, _dotted(parts[:i]), "is not a mapping or a list; cannot set a key below it")
        if node.get(part) is None:
            if value is None:
                return  # removing below something absent: nothing to remove
            node[part] = [] if isinstance(nxt, int) else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or not 0 <= last < len(node):
            raise _error(shown, _dotted(parts), f"no item {last!r} in a list of {len(node)}")
        if value is None:
            del node[last]
        else:
            node[last] = value
    elif isinstance(node, dict) and not isinstance(last, int):
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    else:
        raise _error(shown, _dotted(parts[:-1]), "is not a mapping or a list; cannot set a key below it")


def forked_document(
    parent: dict[str, Any],
    name: str,
    fragment: dict[str, Any] | None = None,
    sets: list[str] | None = None,
    fragment_source: str = "<overrides>",
    fragment_lines: dict[tuple, int] | None = None,
) -> TrainingRun:
    """The NEW run: `parent` (a document dict: metadata with labels/annotations, and spec) renamed to
    `name`, `fragment` merged over it, then each `--set`. SpecError names the bad path and value."""
    doc: dict[str, Any] = {
        "apiVersion": parent.get("apiVersion", "mortal/v1"),
        "kind": parent.get("kind", "TrainingRun"),
        "metadata": {
            "name": name,
            **{k: dict(parent.get("metadata", {}).get(k) or {}) for k in METADATA_KEYS},
        },
        "spec": copy.deepcopy(parent["spec"]),
    }
    if fragment:
        if not isinstance(fragment, dict):
            raise SpecError(
                [SpecIssue(fragment_source, None, "", "must be a mapping with spec: and/or metadata:")]
            )
        stray = [key for key in fragment if key not in ROOTS]
        if stray:
            raise SpecError(
                [
                    SpecIssue(
                        fragment_source,
                        (fragment_lines or {}).get((stray[0],)),
                        str(stray[0]),
                        "an override is rooted at the document: write spec: {...} and/or "
                        "metadata: {labels: ..., annotations: ...}",
                    )
                ]
            )
        meta = fragment.get("metadata") or {}
        stray_meta = (
            [key for key in meta if key not in METADATA_KEYS] if isinstance(meta, dict) else ["metadata"]
        )
        if stray_meta:
            raise SpecError(
                [
                    SpecIssue(
                        fragment_source,
                        None,
                        f"metadata.{stray_meta[0]}",
                        "only labels and annotations can be overridden (the name is NEW)",
                    )
                ]
            )
        doc = merge_patch(doc, fragment)
        doc["metadata"]["name"] = name
        _validate(doc, fragment_source, fragment_lines or {})
    for assignment in sets or []:
        parts, value = parse_set(assignment)
        set_path(doc, parts, value, assignment)
    return _validate(doc, SET_SOURCE if sets else fragment_source, {})


def _validate(doc: dict[str, Any], source: str, lines: dict[tuple, int]) -> TrainingRun:
    try:
        run = TrainingRun.model_validate(doc)
    except ValidationError as exc:
        raise SpecError(issues_from_errors(exc.errors(), TrainingRun, doc, lines, source)) from None
    try:
        epochs.resolve(run.spec)
    except epochs.RowsUncountable as exc:
        raise SpecError([SpecIssue(source, None, "spec.algorithm.numEpochs", str(exc))]) from None
    return run


def carry_over_problems(parent: TrainingSpec, child: TrainingSpec, step: int) -> list[str]:
    """Why the checkpoint of `step` cannot start `child` ([] when it can). Refused, and why:

    - model.name: the checkpoint holds that model's weights (another model's shapes and names differ);
    - model.lora on/off, lora.r, lora.targetModules: a LoRA checkpoint holds adapter matrices of that
      rank on those modules, a full one the whole weights: neither loads into the other shape;
    - model.lora.alpha: the adapter's effect is alpha / r times B @ A, so another alpha would start
      from other weights than the checkpoint's;
    - backend: the checkpoint lies where the parent's backend keeps files (this machine, or Modal's
      volume), and a fork copies it on this machine only;
    - algorithm.maxSteps <= step: the fork would have nothing to train.
    Everything else may change (learning rate, loss, batch, data, rewards, seed, dtype, workers, ...):
    the optimizer and scheduler state load whatever those are, and the spec's learningRate replaces the
    checkpoint's on resume.
    """
    problems: list[str] = []
    pm, cm = parent.model, child.model
    if pm.name != cm.name:
        problems.append(f"spec.model.name: the checkpoint holds weights of {pm.name!r}, not {cm.name!r}")
    if (pm.lora is None) != (cm.lora is None):
        had = "LoRA adapters" if pm.lora else "full weights"
        problems.append(
            f"spec.model.lora: the checkpoint holds {had}; LoRA cannot be turned "
            f"{'off' if pm.lora else 'on'} in a fork"
        )
    elif pm.lora is not None and cm.lora is not None:
        for field, label in (("r", "r"), ("target_modules", "targetModules"), ("alpha", "alpha")):
            before, after = getattr(pm.lora, field), getattr(cm.lora, field)
            if before != after:
                problems.append(
                    f"spec.model.lora.{label}: the checkpoint's adapters were trained with "
                    f"{label} {before!r}, not {after!r}"
                )
    if parent.backend != child.backend:
        problems.append(
            f"spec.backend: the checkpoint lies where backend {parent.backend!r} keeps files; a "
            f"fork keeps the parent's backend (got {child.backend!r})"
        )
    if child.algorithm.max_steps <= step:
        problems.append(
            f"spec.algorithm.maxSteps: {child.algorithm.max_steps} leaves nothing to train after "
            f"step {step}; set it above {step}"
        )
    return problems


def _dotted(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _error(assignment: str, path: str, message: str) -> SpecError:
    return SpecError([SpecIssue(f"{SET_SOURCE} {assignment}", None, path, message)])
