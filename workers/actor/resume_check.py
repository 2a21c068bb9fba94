"""Verified resume: before the actor trains on from a checkpoint, check that doing so redoes and skips
nothing.

Who calls it: the actor, once, when it found a checkpoint to resume from (`verify`); tests call
`judge` with hand-made facts. A resume that would silently redo or skip work is refused: the actor
raises FatalWorkerError("ResumeRefused", ...), the run fails with that reason, and the checkpoint is
left as it was. A change the user made on purpose (spec.dataset, the seed or the batch changed by an
apply or a fork, a reward module edited) is allowed with a Warning event saying what it does.

The checks, in order:
0. The ranks: a checkpoint written by another actor count (mortal.json's "ranks") resumes with its model
   and optimizer resharded, but without its RNG states: a warning, the run goes on but not bit for bit.
1. The step: the row's, mortal.json's and trainer_state.json's global_step agree (a checkpoint folder
   copied or renamed by hand would otherwise start TRL at one step and mortal's data at another).
2. Optimizer and scheduler: AdamW's step counters and the scheduler's last_epoch equal that step (a
   checkpoint whose optimizer state belongs to another step would train with the wrong moments and
   learning rate).
3. The dataset: the rows' fingerprint equals the checkpoint's, unless spec.dataset itself changed.
   A file rewritten under the same name is refused: the data position would index different rows.
4. The data position: with numEpochs, a checkpoint that already drew every epoch's prompts cannot train
   further without repeating them (maxSteps raised past the data) and is refused.
5. Seed and promptsPerStep changed, reward code changed, or no provenance recorded: warnings.
What it must not do: write anything (the actor records events), or load the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mortal.workers.actor.checkpoint import DCP_DIR
from mortal.workers.actor.provenance import Provenance, short

REFUSED = "ResumeRefused"


@dataclass(frozen=True)
class Finding:
    """One result of the checks: `refuse` ends the resume; otherwise the actor records a Warning event."""

    reason: str  # CamelCase, the event's reason
    message: str
    refuse: bool = False


@dataclass(frozen=True)
class CheckpointFacts:
    """What a checkpoint's own files say of its progress (None: the file does not say)."""

    path: str
    marker_step: int | None
    trainer_step: int | None
    scheduler_step: int | None
    optimizer_steps: frozenset[int] = field(default_factory=frozenset)
    optimizer_has_state: bool = True
    marker_provenance: dict[str, Any] | None = None
    ranks: int = 1  # the actor ranks that wrote it (mortal.json's "ranks"; an unsharded actor's: 1)

    @classmethod
    def read(cls, path: str | Path) -> CheckpointFacts:
        import torch  # the actor has it loaded already; keeps judge() importable without it

        folder = Path(path)
        marker = _json(folder / "mortal.json")
        trainer_state = _json(folder / "trainer_state.json")
        scheduler = torch.load(folder / "scheduler.pt", map_location="cpu", weights_only=True)
        if (folder / DCP_DIR).is_dir():  # a sharded actor's (mortal.workers.actor.sharded)
            counters = _sharded_step_counters(folder / DCP_DIR)
            has_state = bool(counters)
        else:
            # mmap: the moments of a large model are not read, only the small step counters are touched
            optimizer = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True, mmap=True)
            counters = {
                int(s["step"])
                for s in optimizer.get("state", {}).values()
                if isinstance(s, dict) and "step" in s
            }
            has_state = bool(optimizer.get("state"))
        return cls(
            path=str(folder),
            marker_step=marker.get("step"),
            trainer_step=trainer_state.get("global_step"),
            scheduler_step=scheduler.get("last_epoch") if isinstance(scheduler, dict) else None,
            optimizer_steps=frozenset(counters),
            optimizer_has_state=has_state,
            marker_provenance=marker.get("provenance"),
            ranks=int(marker.get("ranks", 1)),
        )


def _sharded_step_counters(dcp_dir: Path) -> set[int]:
    """AdamW's step counters in a torch.distributed.checkpoint folder: only those entries are read,
    in this one process (no process group), never the moments."""
    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(dcp_dir))
    names = [
        k
        for k in reader.read_metadata().state_dict_metadata
        if k.startswith("optimizer.state.") and k.endswith(".step")
    ]
    if not names:
        return set()
    counters = {name: torch.zeros(()) for name in names}
    dcp.load(counters, storage_reader=reader, no_dist=True)
    return {int(value) for value in counters.values()}


def verify(
    path: str | Path,
    step: int,
    recorded: dict[str, Any] | None,
    now: Provenance,
    num_epochs: float | None,
    max_steps: int,
    actor_count: int = 1,
) -> list[Finding]:
    """The findings for resuming at `step` from the checkpoint at `path`, whose row recorded `recorded`."""
    facts = CheckpointFacts.read(path)
    record = recorded if recorded is not None else facts.marker_provenance
    return judge(step, facts, Provenance.read(record), now, num_epochs, max_steps, actor_count)


def judge(
    step: int,
    facts: CheckpointFacts,
    recorded: Provenance | None,
    now: Provenance,
    num_epochs: float | None,
    max_steps: int,
    actor_count: int = 1,
) -> list[Finding]:
    """The checks of the module docstring, on facts already read. `now` is the actor's provenance at `step`
    (its spec's generation, rewards and rows, and the position it would resume at); `actor_count` the
    resuming actor's ranks (spec.actor.count). Pure."""
    findings = (
        _ranks_findings(step, facts, actor_count)
        + _step_findings(step, facts)
        + _optimizer_findings(step, facts)
    )
    if recorded is None:
        findings.append(
            Finding(
                "ProvenanceUnknown",
                f"the checkpoint of step {step} at {facts.path} records no "
                "provenance (written before mortal kept it): its dataset and reward code are not verified",
            )
        )
    else:
        findings += (
            _dataset_findings(step, recorded, now)
            + _order_findings(step, recorded, now)
            + _reward_findings(recorded, now)
        )
    findings += _exhausted_findings(step, now, num_epochs, max_steps)
    return findings


def refusal_message(findings: list[Finding]) -> str:
    return " | ".join(f.message for f in findings if f.refuse)


def _ranks_findings(step: int, facts: CheckpointFacts, actor_count: int) -> list[Finding]:
    if facts.ranks == actor_count:
        return []
    return [
        Finding(
            "ActorCountChanged",
            f"the checkpoint of step {step} was written by an actor of {facts.ranks} "
            f"rank(s) and this one has actor.count {actor_count}: its model and optimizer are resharded "
            f"to {actor_count} rank(s); its RNG states belong to the old ranks and are not restored, so the "
            f"run goes on from step {step} but not bit for bit as it would have on {facts.ranks}",
        )
    ]


def _step_findings(step: int, facts: CheckpointFacts) -> list[Finding]:
    said = {"mortal.json": facts.marker_step, "trainer_state.json global_step": facts.trainer_step}
    wrong = {name: value for name, value in said.items() if value is not None and value != step}
    if not wrong:
        return []
    return [
        Finding(
            REFUSED,
            f"the checkpoint recorded as step {step} at {facts.path} is of another step ("
            + ", ".join(f"{name} says {value}" for name, value in wrong.items())
            + "): resuming would redo or skip steps; was the folder copied or renamed by hand?",
            refuse=True,
        )
    ]


def _optimizer_findings(step: int, facts: CheckpointFacts) -> list[Finding]:
    problems = []
    if facts.scheduler_step is not None and facts.scheduler_step != step:
        problems.append(f"scheduler.pt is at step {facts.scheduler_step}")
    if step > 0 and not facts.optimizer_has_state:
        problems.append("optimizer.pt holds no optimizer state (it never took a step)")
    elif facts.optimizer_steps and facts.optimizer_steps != {step}:
        problems.append(f"optimizer.pt's step counters are {sorted(facts.optimizer_steps)}")
    if not problems:
        return []
    return [
        Finding(
            REFUSED,
            f"the checkpoint of step {step} at {facts.path}: "
            + "; ".join(problems)
            + ": the optimizer would resume with another step's moments or learning rate",
            refuse=True,
        )
    ]


def _dataset_findings(step: int, recorded: Provenance, now: Provenance) -> list[Finding]:
    was, new = recorded.dataset, now.dataset
    if was.sha256 == new.sha256:
        return []
    change = (
        f"{was.name!r}: {was.rows} rows (sha256 {short(was.sha256)}) at the checkpoint, {new.rows} rows "
        f"(sha256 {short(new.sha256)}) now"
    )
    if was.spec == new.spec:
        return [
            Finding(
                REFUSED,
                f"the dataset's rows changed since the checkpoint of step {step} while "
                f"spec.dataset did not ({change}): the data position would index other rows, "
                "redoing some and skipping others. Restore the data, or change spec.dataset "
                "(or fork the run) to train on the new rows on purpose",
                refuse=True,
            )
        ]
    message = f"spec.dataset changed since the checkpoint of step {step} ({change})"
    if now.position is not None:
        position = now.position
        message += (
            f"; training goes on at prompt {position.consumed} of the new rows (pass {position.epoch}, "
            f"index {position.index})"
        )
    return [Finding("DatasetChanged", message)]


def _reward_findings(recorded: Provenance, now: Provenance) -> list[Finding]:
    if recorded.reward_code == now.reward_code:
        return []
    names = sorted(set(recorded.rewards) | set(now.rewards))
    changed = [
        f"{n} ({short(recorded.rewards.get(n))} -> {short(now.rewards.get(n))})"
        for n in names
        if recorded.rewards.get(n) != now.rewards.get(n)
    ]
    return [
        Finding(
            "RewardCodeChanged",
            "the rewards changed since the checkpoint (spec entry or code): "
            + ", ".join(changed)
            + "; later steps are scored by the new code",
        )
    ]


def _exhausted_findings(
    step: int, now: Provenance, num_epochs: float | None, max_steps: int
) -> list[Finding]:
    if num_epochs is None or step >= max_steps or now.position is None:
        return []
    available = num_epochs * now.dataset.rows
    if now.position.consumed < available:
        return []
    return [
        Finding(
            REFUSED,
            f"the checkpoint of step {step} has drawn {now.position.consumed} prompts, every one of "
            f"numEpochs {num_epochs:g} x {now.dataset.rows} rows: the data is used up, and training on to "
            f"maxSteps {max_steps} would repeat it. Raise spec.algorithm.numEpochs, or lower maxSteps to "
            f"{step}",
            refuse=True,
        )
    ]


def _order_findings(step: int, recorded: Provenance | None, now: Provenance) -> list[Finding]:
    """The seed or promptsPerStep changed since the checkpoint: the same step now draws other prompts."""
    if recorded is None or recorded.position is None or now.position is None:
        return []
    was, new = recorded.position, now.position
    changes = [
        f"{label} {a} -> {b}"
        for label, a, b in (
            ("seed", was.seed, new.seed),
            ("promptsPerStep", was.prompts_per_step, new.prompts_per_step),
        )
        if a != b
    ]
    if not changes:
        return []
    return [
        Finding(
            "DataOrderChanged",
            f"{', '.join(changes)} since the checkpoint of step {step}: it had drawn "
            f"{was.consumed} prompts; step {step + 1} draws from position {new.consumed} in the new order, "
            "so some prompts may come again and others not at all",
        )
    ]


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
