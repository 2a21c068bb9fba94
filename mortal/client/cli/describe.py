"""`mortalctl describe run NAME`: one run in detail, the way `kubectl describe` shows a pod.

Sections: identity, a summary of the spec, status, conditions, workers, checkpoints, the ledger of
prompts (mortal.controller.ledger) and recent events. Only reads the store; formats with rich (plain
text when not a terminal).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

import typer

from mortal.client.cli import events
from mortal.client.cli.context import run_document, state
from mortal.client.cli.output import age, console, fmt_float, print_renderable, table
from mortal.client.cli.text import plain
from mortal.controller.ledger import run_ledger

if TYPE_CHECKING:
    from mortal.specs import TrainingRun, TrainingSpec
    from mortal.state import RunRow, Store

EVENT_LINES = 15  # the newest event lines shown (repeats of a reason in a row are one)

HELP = """Show details of a run: spec summary, status, conditions, workers, checkpoints and recent events.

\b
Examples:
  mortalctl describe run quickstart
"""


def _pairs(values: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(values.items())) or "<none>"


def _when(moment) -> str:
    return f"{moment.isoformat(timespec='seconds')} ({age(moment)} ago)" if moment else "<none>"


def spec_lines(spec: TrainingSpec) -> list[tuple[str, str]]:
    """The spec as a few readable lines."""
    m, d, a, g = spec.model, spec.dataset, spec.algorithm, spec.generation
    model = f"{m.name} (dtype {m.dtype}"
    model += f", LoRA r={m.lora.r} alpha={m.lora.alpha:g}" if m.lora else ", full fine-tuning"
    model += ", gradient checkpointing)" if m.gradient_checkpointing else ")"
    dataset = f"{d.name} (split {d.split}, column {d.prompt_column}"
    dataset += f", first {d.max_samples} rows)" if d.max_samples else ")"
    algorithm = (
        f"{a.loss_type}: {a.prompts_per_step} prompts x {a.num_generations} generations = {a.batch_size} "
        f"completions/step, {a.max_steps} steps, lr {a.learning_rate:g}, beta {a.beta:g}, "
        f"epsilon {a.epsilon:g}, "
        f"scaleRewards {a.scale_rewards}, maxStaleness {a.max_staleness}, seed {a.seed}"
    )
    if a.num_epochs is not None:
        algorithm += f", numEpochs {a.num_epochs:g}"
    generation = (
        f"maxTokens {g.max_tokens}, temperature {g.temperature:g}, topP {g.top_p:g}, engine {g.engine}"
    )
    if g.top_k:
        generation += f", topK {g.top_k}"
    defaults = spec.seed_defaults()
    lines = [
        ("Model", model),
        ("Dataset", dataset),
        ("Algorithm", algorithm),
        ("Generation", generation),
        ("Actor", f"{spec.actor.count} x gpu {spec.actor.gpu}"),
        ("Rollout", f"{spec.rollout.replicas} x gpu {spec.rollout.gpu}"),
        ("Sync", f"{spec.sync.method}, every {spec.sync.every} step(s)"),
        ("Checkpoint", f"every {spec.checkpoint.every} steps, keep {spec.checkpoint.keep}"),
        (
            "Restart policy",
            f"maxRestarts {spec.restart_policy.max_restarts}, "
            f"backoff {spec.restart_policy.backoff_seconds:g}s",
        ),
        ("Limits", limits_line(spec)),
        ("Backend", spec.backend),
        ("Suspend", str(spec.suspend).lower()),
        ("Secrets", ", ".join(spec.secrets) or "<none>"),
    ]
    if defaults:
        lines.insert(
            2,
            (
                "Defaults",
                f"{' and '.join(defaults)} not given: the seeds' code execution in the sandbox "
                "on builtin:mbpp-mini",
            ),
        )
    return lines


def limits_line(spec: TrainingSpec) -> str:
    from mortal.specs import format_duration

    limits = spec.limits
    parts = (
        [f"maxDuration {format_duration(limits.max_duration)}"] if limits.max_duration is not None else []
    ) + ([f"maxGPUHours {limits.max_gpu_hours:g}"] if limits.max_gpu_hours is not None else [])
    return ", ".join(parts) or "<none>"


def usage_lines(run: TrainingRun, now: datetime | None = None) -> list[tuple[str, str]]:
    """Active time (what limits.maxDuration counts) and GPU-hours (limits.maxGPUHours), with their limits."""
    from mortal.specs import Phase, format_duration

    s, limits = run.status, run.spec.limits
    active = s.active_time(now or datetime.now(UTC))
    minutes, secs = divmod(int(active), 60)
    hours, minutes = divmod(minutes, 60)
    shown = (
        f"{hours}h{minutes:02d}m{secs:02d}s"
        if hours
        else f"{minutes}m{secs:02d}s"
        if minutes
        else f"{active:.1f}s"
    )
    if limits.max_duration is not None:
        shown += f" of maxDuration {format_duration(limits.max_duration)}"
    if s.phase == Phase.SUSPENDED:
        shown += " (the clock stops while Suspended)"
    gpu = f"{s.gpu_hours or 0.0:.2f}"
    if limits.max_gpu_hours is not None:
        gpu += f" of maxGPUHours {limits.max_gpu_hours:g}"
    return [("Active time", shown), ("GPU-hours", gpu)]


def effective_lines(run: TrainingRun) -> list[tuple[str, str]]:
    """What the controller runs instead of the spec's memory settings (mortal.controller.heal), when it
    chose."""
    chosen, spec = run.status.effective, run.spec
    if chosen is None:
        return []
    lines = []
    if chosen.micro_batch_size is not None:
        lines.append(
            (
                "Micro batch",
                f"{chosen.micro_batch_size} (spec: {chosen.spec_micro_batch_size}; "
                f"{spec.algorithm.batch_size // chosen.micro_batch_size} passes a step, "
                "chosen by the controller)",
            )
        )
    if chosen.rollout_gpu_memory_utilization is not None:
        lines.append(
            (
                "Rollout GPU share",
                f"{chosen.rollout_gpu_memory_utilization:g} (spec: "
                f"{chosen.spec_rollout_gpu_memory_utilization}; chosen by the controller)",
            )
        )
    if lines and chosen.reason:
        lines.append(("Memory", chosen.reason))
    return lines


def reward_rows(spec: TrainingSpec) -> list[tuple[str, ...]]:
    return [
        (r.display_name(), f"function {r.function}" if r.function else f"env {r.env}", f"{r.weight:g}")
        for r in spec.rewards
    ]


def status_lines(run: TrainingRun) -> list[tuple[str, str]]:
    s = run.status
    ckpt = f"step {s.last_checkpoint.step} at {s.last_checkpoint.path}" if s.last_checkpoint else "<none>"
    return [
        ("Phase", str(s.phase)),
        ("Step", f"{s.step}/{run.spec.algorithm.max_steps}"),
        ("Weight version", str(s.weight_version)),
        ("Reward", fmt_float(s.reward)),
        (
            "Replicas",
            f"actor {s.replicas.actor.ready}/{s.replicas.actor.desired} ready, "
            f"rollout {s.replicas.rollout.ready}/{s.replicas.rollout.desired} ready",
        ),
        ("Restarts", str(s.restarts)),
        *usage_lines(run),
        *effective_lines(run),
        ("Last checkpoint", ckpt),
        (
            "Last step",
            _when(s.last_step_time)
            + (f", steps take {s.step_seconds:.3g}s (median)" if s.step_seconds is not None else ""),
        ),
        ("Started", _when(s.start_time)),
        ("Completed", _when(s.completion_time)),
        ("Message", s.message or "<none>"),
    ]


def print_fields(title: str | None, fields: list[tuple[str, str]], indent: int = 0) -> None:
    out = console()
    if title:
        out.print(f"{' ' * indent}{title}:", markup=False)
        indent += 2
    width = max(len(k) for k, _ in fields) + 2
    for key, value in fields:
        out.print(f"{' ' * indent}{key + ':':<{width}}{plain(value)}", markup=False)


def print_section(title: str, headers: tuple[str, ...], rows: list, empty: str = "<none>") -> None:
    out = console()
    if not rows:
        out.print(f"{title}:  {empty}", markup=False)
        return
    out.print(f"{title}:", markup=False)
    print_renderable(table(headers, rows), indent=len(title) - len(title.lstrip()) + 2)


def describe_run(store: Store, row: RunRow) -> None:
    run = run_document(row)
    identity = [
        ("Name", row.name),
        ("Labels", _pairs(row.labels)),
        ("Annotations", _pairs(row.annotations)),
        ("UID", row.uid),
        ("Generation", f"{row.generation} (observed {run.status.observed_generation})"),
        ("Resource version", str(row.resource_version)),
        ("Created", _when(row.created_at)),
    ]
    if row.forked_from is not None:
        identity.append(("Forked from", f"{row.forked_from} at step {row.forked_from_step}"))
    if row.deleted_at:
        identity.append(
            ("Deleting", _when(row.deleted_at) + (", purging checkpoints" if row.purge_requested else ""))
        )
    print_fields(None, identity)
    print_fields("Spec", spec_lines(run.spec))
    print_section("  Rewards", ("NAME", "SOURCE", "WEIGHT"), reward_rows(run.spec))
    print_fields("Status", status_lines(run))
    conditions = [
        (c.type, c.status, c.reason, age(c.last_transition_time), c.message) for c in run.status.conditions
    ]
    print_section("Conditions", ("TYPE", "STATUS", "REASON", "AGE", "MESSAGE"), conditions)
    workers = store.list_workers(row.name)[-10:]
    print_section(
        "Workers",
        (
            "ROLE",
            "REPLICA",
            "INCARNATION",
            "STATE",
            "STEP",
            "WEIGHTS",
            "HEARTBEAT",
            "DOING",
            "EXIT",
            "GPUS",
            "HANDLE",
            "AGE",
        ),
        [
            (
                w.role,
                w.replica,
                w.incarnation,
                w.state,
                _dash(w.step),
                _dash(w.weight_version),
                age(w.heartbeat_at) if w.heartbeat_at else "-",
                f"{w.activity} for {age(w.activity_since)}" if w.activity and w.ended_at is None else "-",
                _dash(w.exit_code),
                w.gpus,
                _dash(w.handle),
                age(w.started_at),
            )
            for w in workers
        ],
    )
    checkpoints = store.list_checkpoints(row.name)
    print_section(
        "Checkpoints",
        ("STEP", "WEIGHTS", "GEN", "PROMPTS", "AGE", "PATH"),
        [(c.step, c.weight_version, *_drawn(c.provenance), age(c.created_at), c.path) for c in checkpoints],
    )
    if checkpoints and checkpoints[-1].provenance:
        print_fields(
            f"Made by (step {checkpoints[-1].step})", provenance_lines(checkpoints[-1].provenance), indent=2
        )
    print_fields("Ledger", run_ledger(store, row).lines())
    lines = events.newest_lines(store, row.name, EVENT_LINES)
    print_section(
        "Events",
        ("TYPE", "REASON", "AGE", "MESSAGE"),
        [(e.type, e.reason, e.last_seen(), e.shown_message) for e in lines],
    )


def _drawn(record: dict | None) -> tuple[str, str]:
    """GEN and PROMPTS of a checkpoint's provenance (mortal.workers.actor.provenance's camelCase JSON);
    dashes for a checkpoint written before it was kept."""
    position = (record or {}).get("position") or {}
    return _dash((record or {}).get("specGeneration")), _dash(position.get("consumed"))


def provenance_lines(record: dict) -> list[tuple[str, str]]:
    """What made a checkpoint, as describe's fields; the hashes shortened to 12 hex digits."""
    position, dataset = record.get("position") or {}, record.get("dataset") or {}
    rewards = ", ".join(
        f"{name} {str(digest)[:12]}" for name, digest in (record.get("rewards") or {}).items()
    )
    lines = [("Spec generation", _dash(record.get("specGeneration")))]
    if position:
        lines.append(
            (
                "Data position",
                f"prompt {position['consumed']} drawn (pass {position['epoch']}, index "
                f"{position['index']}), seed {position['seed']}, "
                f"{position['promptsPerStep']} prompts per step",
            )
        )
    lines.append(
        (
            "Dataset",
            f"{dataset.get('name', '?')}: {dataset.get('rows', '?')} rows, sha256 "
            f"{str(dataset.get('sha256', ''))[:12]}",
        )
    )
    lines.append(
        ("Reward code", f"{str(record.get('rewardCode', ''))[:12]}" + (f" ({rewards})" if rewards else ""))
    )
    return lines


def _dash(value) -> str:
    return "-" if value is None else str(value)


def describe_runs(
    ctx: typer.Context,
    names: list[str] = typer.Argument(..., metavar="NAME", help="Runs to describe."),
) -> None:
    """Show details of runs (aliases: runs, trainingrun, tr)."""
    store = state(ctx).store
    rows = [store.get_run(name) for name in names]
    for i, row in enumerate(rows):
        if i:
            typer.echo("")
        describe_run(store, row)


def register(app: typer.Typer) -> None:
    describe_app = typer.Typer(
        help=HELP, short_help="Show the details of a run", no_args_is_help=True, rich_markup_mode=None
    )
    for i, alias in enumerate(("run", "runs", "trainingrun", "trainingruns", "tr")):
        describe_app.command(alias, hidden=i > 0)(describe_runs)
    app.add_typer(describe_app, name="describe")
