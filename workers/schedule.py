"""Which dataset rows make up each optimizer step, and the sampling seed of each rollout task.

Called by the actor (to enqueue the tasks of steps s..s+maxStaleness) and by tests. The data
position of a run is its step: everything here is a pure function of (run seed, step, slot), so a
resumed actor needs nothing but the step it resumes at, tasks can be enqueued for future steps,
and the same spec and seed give the same batches on any machine and Python version.
It must not look at TRL's sampler or dataloader (their order is irrelevant to mortal) and must
not keep state beyond a cache of computed permutations.

Order: the rows are visited in epochs; epoch e is a permutation of all rows keyed by
sha256(seed, e, row), so an epoch never repeats a row and consecutive steps may straddle two
epochs (the position of slot j of step s is s * prompts_per_step + j).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache


def _digest(*parts: int) -> int:
    """A 64-bit integer from sha256 of the parts: stable across processes, machines and versions."""
    text = ":".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


@lru_cache(maxsize=4)
def epoch_order(seed: int, epoch: int, n_rows: int) -> tuple[int, ...]:
    """The rows of one epoch in visiting order (a permutation of range(n_rows))."""
    if n_rows < 1:
        raise ValueError("the dataset has no rows")
    return tuple(sorted(range(n_rows), key=lambda row: (_digest(seed, epoch, row), row)))


def prompt_slots(seed: int, step: int, prompts_per_step: int, n_rows: int) -> list[int]:
    """Row indices of step `step`'s prompts, slot by slot."""
    if step < 0 or prompts_per_step < 1 or n_rows < 1:
        raise ValueError(f"bad step {step}, prompts_per_step {prompts_per_step} or row count {n_rows}")
    rows = []
    for slot in range(prompts_per_step):
        position = step * prompts_per_step + slot
        epoch, index = divmod(position, n_rows)
        rows.append(epoch_order(seed, epoch, n_rows)[index])
    return rows


def task_chunks(prompts_per_step: int, prompts_per_task: int) -> list[range]:
    """The slots each rollout task of a step holds: consecutive runs of `prompts_per_task` (the last may
    be shorter). A chunk is one engine batch on a GPU, so it depends on the spec alone, never on timing."""
    if prompts_per_task < 1:
        raise ValueError(f"bad prompts_per_task {prompts_per_task}")
    return [
        range(start, min(start + prompts_per_task, prompts_per_step))
        for start in range(0, prompts_per_step, prompts_per_task)
    ]


def task_seed(seed: int, step: int, slot: int) -> int:
    """Sampling seed of a task: independent of which worker runs it or when (63 bits, torch-safe)."""
    return _digest(seed, step, slot) >> 1


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """Sampling seed of turn `turn` (>= 1) of a tool-calling rollout: sample `sample` of the prompt whose
    task seed is `seed`; like task_seed, it depends only on what the spec, step and tokens decide."""
    return _digest(seed, sample, turn) >> 1


def steps_to_enqueue(step: int, max_staleness: int, max_steps: int) -> range:
    """The steps whose tasks should exist while the actor trains `step`: step .. step + k (< max_steps)."""
    return range(step, min(step + max_staleness, max_steps - 1) + 1)
