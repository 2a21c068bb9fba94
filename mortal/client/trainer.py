"""`MortalTrainer`: the TRL-style Python way in. It builds a TrainingRun, applies it and follows it.

    from mortal import MortalTrainer, SingleNode
    trainer = MortalTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[my_rewards.correct],
                            train_dataset=ds, mode=SingleNode(gpu="A100"), max_steps=50)
    status = trainer.train()       # applies, starts a controller if none runs, shows progress

The run is the one `mortalctl apply -f` would create: reward functions become "module:attr" references
workers can import, an in-memory dataset a .jsonl file (both in trainer_inputs.py), `mode` fills the
actor/rollout/sync blocks (modes.py), and train() admits the run as apply does, snapshotting the
reward modules of this folder with it. Like the CLI it is a client: it writes desired state and reads
status; it never trains in this process and never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mortal.client.modes import Distributed, GPUConfig, SingleNode
from mortal.client.trainer_inputs import (
    RewardNotImportable,
    TrainerError,
    dataset_file,
    dataset_name,
    dataset_rows,
    default_run_name,
    environment_rewards,
    is_code_execution,
    reward_entries,
    tool_fields,
)
from mortal.controller.errors import ControllerStartFailed
from mortal.specs import RunStatus, TrainingRun, epochs, to_yaml
from mortal.specs.base import blamed
from mortal.specs.training import CODE_DATASET, CODE_SYSTEM_PROMPT

if TYPE_CHECKING:
    from mortal.state import RunRow, Store

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"

__all__ = [
    "ControllerStartFailed",
    "Distributed",
    "GPUConfig",
    "MortalTrainer",
    "RewardNotImportable",
    "SingleNode",
    "TrainerError",
    "TrainingFailed",
]


class TrainingFailed(RuntimeError):
    """The run ended Failed; `status` is its final status (status.message says why)."""

    def __init__(self, name: str, status: RunStatus) -> None:
        self.name, self.status = name, status
        super().__init__(
            f"trainingrun {name!r} failed: {status.message or 'see `mortalctl describe run ' + name + '`'}"
        )


# -- the trainer -----------------------------------------------------------------------------------
def _checkpoint_source(value: str | bool | None) -> tuple[str, int | None] | None:
    """resume_from_checkpoint -> (run, step or None); None for None/True (a run resumes by itself)."""
    from pathlib import Path

    from mortal.client.fork import parse_source

    if value is None or value is True or value is False:
        return None
    text = str(value)
    parts = Path(text).parts
    if (
        len(parts) >= 4
        and parts[-4] == "runs"
        and parts[-2] == "checkpoints"
        and parts[-1].startswith("step-")
    ):
        text = f"{parts[-3]}:{parts[-1]}"
    try:
        return parse_source(text)
    except Exception as exc:
        raise TrainerError(f"resume_from_checkpoint: {exc}") from None


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _validation_error(exc: Exception) -> TrainerError:
    """A pydantic ValidationError as one readable TrainerError (field path: message, per problem);
    a spec rule's path ends at the field it blames (spec.sync.method, not spec), as in a YAML error."""
    problems = [f"{'.'.join(str(p) for p in blamed(e))}: {e['msg']}" for e in exc.errors()]  # type: ignore[attr-defined]
    return TrainerError("the arguments do not make a valid TrainingRun:\n  " + "\n  ".join(problems))


class MortalTrainer:
    """Train with GRPO like TRL's GRPOTrainer, run the way `mortalctl apply` runs a TrainingRun.

    Arguments follow the seed's MortalTrainer and TRL's GRPOConfig; a None keeps the spec default
    (see `mortalctl schema`). Notable ones:
      mode            SingleNode(...) | Distributed(...) | None (the spec's default: CPU on this machine)
      reward_funcs    TRL-style functions, RewardEnvironment classes/instances, 'module:attr' strings, or
                      a built-in env name ('code-execution' / 'sandbox', 'llm-judge', 'math-answer');
                      'sandbox' alone without train_dataset trains on builtin:mbpp-mini, and None with a
                      train_dataset means 'sandbox' (the seed's default): the rows need a `tests` column
      train_dataset   datasets.Dataset, list of dicts, or a hub id / .jsonl / .parquet path / 'builtin:NAME'
      batch_size      completions per optimizer step, as in the spec (prompts per step = batch_size /
                      num_generations)
      micro_batch_size completions per forward/backward pass (gradient accumulation up to batch_size;
                      TRL's per_device_train_batch_size): lower it when the actor runs out of GPU memory
      max_steps       optimizer steps; None (or 0 or less, TRL's -1) with num_epochs: computed from the
                      dataset's rows (an in-memory, builtin or local-file dataset); without: the default
      tools, environment_factory, max_tool_calling_iterations
                      as in TRL's GRPOTrainer: multi-turn, tool-calling rollouts (spec.rollout.tools /
                      environment / maxToolCallingIterations); functions and classes must be importable, as
                      rewards; an environment class with get_reward() adds a reward named after the class.
                      chat_template names the template that renders tool calls (spec.rollout.chatTemplate)
      torch_compile, use_liger_kernel
                      TRL's names for spec.actor.compile and spec.actor.liger (Liger's layer kernels)
      detach          train() returns right after applying; the controller keeps training
      name            the run's name (default: '<model>-<5 random chars>')
      labels, annotations
                      the run's metadata, as a TrainingRun document's (`get runs -l`, `describe`)
    Without reward_funcs and train_dataset, the seeds' default: sandboxed code execution on
    builtin:mbpp-mini (as a spec that names only its model).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        mode: SingleNode | Distributed | None = None,
        reward_funcs: Any = None,
        reward_weights: list[float] | None = None,
        train_dataset: Any = None,
        *,
        num_generations: int | None = None,
        batch_size: int | None = None,
        micro_batch_size: int | None = None,
        learning_rate: float | None = None,
        max_steps: int | None = None,
        num_epochs: float | None = None,
        loss_type: str | None = None,
        beta: float | None = None,
        epsilon: float | None = None,
        epsilon_high: float | None = None,
        scale_rewards: str | None = None,
        max_completion_length: int | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        use_lora: bool = False,
        lora_r: int | None = None,
        lora_alpha: float | None = None,
        lora_dropout: float | None = None,
        lora_target_modules: str | list[str] | None = None,
        gradient_checkpointing: bool | None = None,
        torch_compile: bool | None = None,
        use_liger_kernel: bool | None = None,
        dtype: str | None = None,
        seed: int | None = None,
        max_staleness: int | None = None,
        max_grad_norm: float | None = None,
        prompt_column: str | None = None,
        system_prompt: str | None = None,
        max_samples: int | None = None,
        tools: list[Any] | None = None,
        environment_factory: Any = None,
        max_tool_calling_iterations: int | None = None,
        tool_timeout_seconds: float | None = None,
        chat_template: str | None = None,
        checkpoint_every: int | None = None,
        checkpoint_keep: int | None = None,
        max_restarts: int | None = None,
        secrets: list[str] | None = None,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        wandb_project: str | None = None,
        name: str | None = None,
        backend: str | None = None,
        detach: bool = False,
        quiet: bool = False,
        start_controller: bool = True,
        state_url: str | None = None,
    ) -> None:
        from mortal.state import paths

        self.detach, self.quiet, self.start_controller, self.state_url = (
            detach,
            quiet,
            start_controller,
            state_url,
        )
        name = name or default_run_name(model)
        env_rewards = environment_rewards(environment_factory)
        if reward_funcs is None and not env_rewards:
            reward_funcs = "sandbox"  # the seeds' default: code execution with the rows' tests
        code_only = reward_funcs is not None and is_code_execution(reward_funcs)
        if train_dataset is None and not code_only:
            raise TrainerError(
                "train_dataset is required when reward_funcs is given (leave both out, or give "
                "reward_funcs='sandbox' alone, to train with code execution on builtin:mbpp-mini)"
            )
        column = prompt_column or "prompt"
        rows = dataset_rows(train_dataset) if train_dataset is not None else None
        written = None
        if rows is not None:
            funcs = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
            needed = (
                {getattr(f, "tests_column", "tests") for f in funcs if not isinstance(f, type)}
                if code_only
                else set()
            )
            missing = sorted(needed - set(rows[0] if rows else needed))
            if missing:
                raise TrainerError(
                    f"code-execution rewards ('sandbox') run each row's {missing[0]!r} column (a list "
                    "of assert statements), and train_dataset has none; add it, or pass reward_funcs"
                )
            written = dataset_file(rows, name, column, paths.mortal_home())
            dataset = str(written.path)
        elif train_dataset is not None:
            dataset = dataset_name(train_dataset)
        else:
            dataset, system_prompt = CODE_DATASET, system_prompt or CODE_SYSTEM_PROMPT
        rewards = (
            reward_entries(reward_funcs, reward_weights) if reward_funcs is not None else []
        ) + env_rewards
        # the judge's key travels as a secret
        judge_keys = [r["api_key_env"] for r in rewards if r.get("api_key_env")]
        secrets = list(dict.fromkeys([*(secrets or []), *judge_keys])) or None
        if (
            max_completion_length is not None
            and max_tokens is not None
            and max_completion_length != max_tokens
        ):
            raise TrainerError("max_completion_length and max_tokens mean the same here; give one")
        lora = (
            _drop_none(
                {
                    "r": lora_r,
                    "alpha": lora_alpha,
                    "dropout": lora_dropout,
                    "target_modules": lora_target_modules,
                }
            )
            if use_lora
            else None
        )
        algorithm = _drop_none(
            {
                "loss_type": loss_type,
                "num_generations": num_generations,
                "batch_size": batch_size,
                "micro_batch_size": micro_batch_size,
                "learning_rate": learning_rate,
                "beta": beta,
                "epsilon": epsilon,
                "epsilon_high": epsilon_high,
                "scale_rewards": scale_rewards,
                "max_staleness": max_staleness,
                "seed": seed,
                "max_grad_norm": max_grad_norm,
            }
        )
        spec: dict[str, Any] = {
            "model": _drop_none(
                {
                    "name": model,
                    "dtype": dtype,
                    "lora": lora,
                    "gradient_checkpointing": gradient_checkpointing,
                }
            ),
            "dataset": _drop_none(
                {
                    "name": dataset,
                    "prompt_column": prompt_column,
                    "system_prompt": system_prompt,
                    "max_samples": max_samples,
                }
            ),
            "algorithm": algorithm,
            "generation": _drop_none(
                {
                    "max_tokens": max_completion_length or max_tokens,
                    "temperature": temperature,
                    "top_p": top_p,
                    "top_k": top_k,
                }
            ),
            "rewards": rewards,
            "actor": _drop_none({"compile": torch_compile, "liger": use_liger_kernel}),
            "rollout": tool_fields(
                tools, environment_factory, max_tool_calling_iterations, tool_timeout_seconds, chat_template
            ),
            **_drop_none({"backend": backend, "secrets": secrets}),
            "checkpoint": _drop_none({"every": checkpoint_every, "keep": checkpoint_keep}),
            "restart_policy": _drop_none({"max_restarts": max_restarts}),
        }
        if wandb_project:
            spec["logging"] = {"wandb": {"project": wandb_project}}
        if mode is not None and not isinstance(mode, SingleNode | Distributed):
            raise TrainerError(
                "mode: expected mortal's SingleNode(...) or Distributed(...), "
                f"got {type(mode).__name__} {mode!r}"
            )
        for block, values in (mode.spec_fields() if mode is not None else {}).items():
            spec[block] = {**spec.get(block, {}), **values}
        self.run = self._validate(
            {"name": name, "labels": labels or {}, "annotations": annotations or {}}, spec
        )
        self._set_max_steps(max_steps, num_epochs, rows)
        if written is not None:  # only now: a refused construction leaves no file behind
            written.write()

    @staticmethod
    def _validate(metadata: dict[str, Any], spec: dict[str, Any]) -> TrainingRun:
        from pydantic import ValidationError

        try:
            return TrainingRun.model_validate({"metadata": metadata, "spec": spec})
        except ValidationError as exc:
            raise _validation_error(exc) from None

    def _set_max_steps(self, max_steps: int | None, num_epochs: float | None, rows: list | None) -> None:
        """max_steps as given; else num_epochs over the dataset's rows (specs/epochs.py); else the default."""
        algorithm = self.run.spec.algorithm
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)):
            raise TrainerError(f"max_steps: expected an int, got {type(max_steps).__name__} {max_steps!r}")
        try:
            if num_epochs is not None:
                algorithm.num_epochs = num_epochs
            if max_steps is not None and max_steps > 0:
                algorithm.max_steps = max_steps
            elif num_epochs is not None and rows is not None:  # written to a .jsonl above: count its rows
                n = min(len(rows), self.run.spec.dataset.max_samples or len(rows))
                algorithm.max_steps = epochs.steps_for(num_epochs, n, algorithm.prompts_per_step)
            else:
                epochs.resolve(self.run.spec)
        except epochs.RowsUncountable as exc:
            raise TrainerError(f"num_epochs: {exc}") from None
        except ValueError as exc:
            raise _validation_error(exc) from None

    @property
    def name(self) -> str:
        return self.run.name

    def to_yaml(self) -> str:
        """The TrainingRun this trainer applies, as YAML for `mortalctl apply -f`."""
        return to_yaml(self.run, include_status=False)

    def status(self) -> RunStatus:
        """The run's current status in the store (NotFound before train())."""
        from mortal.state import open_store

        store = open_store(self.state_url)
        try:
            return RunStatus.model_validate(store.get_run(self.name).status)
        finally:
            store.close()

    def _write(self, store: Store, existing: RunRow | None, source: tuple[str, int | None] | None) -> str:
        """Create or update the run in the store: forked from `source`'s checkpoint when it does not exist
        yet, else applied. The outcome's words, as `mortalctl apply` prints them."""
        from mortal.client.fork import RunExists, fork_run
        from mortal.state.apply_document import apply_document

        if source is not None and existing is None:
            forked = fork_run(store, source[0], source[1], self.name, document=self.run)
            return f"created, forked from {forked.parent} at step {forked.step}"
        if source is not None and existing is not None and existing.forked_from != source[0]:
            raise RunExists(
                f"trainingrun {self.name!r} already exists and was not forked from "
                f"{source[0]!r}; pick another name"
            )
        _, outcome = apply_document(store, self.run)
        return str(outcome)

    def train(self, resume_from_checkpoint: str | bool | None = None) -> RunStatus:
        """Apply the run, make sure a controller runs, and follow it to the end (unless detach).

        `resume_from_checkpoint`, as in TRL's `Trainer.train`: "RUN" or "RUN:step-N" (or the folder of
        such a checkpoint, $MORTAL_HOME/runs/RUN/checkpoints/step-N) starts this run from another run's
        checkpoint (the newest complete one for "RUN"): weights, optimizer, scheduler, RNG and data
        position, so the first step trained is N+1, with this trainer's arguments (its learning rate
        replaces the checkpoint's). This is `mortalctl fork` with this trainer's spec in place of
        overrides; what cannot change (the model, LoRA on/off, rank, alpha, target modules) raises
        `CannotCarryOver`. Calling it again once the run exists just applies it. True or None: a run
        always resumes from its own newest checkpoint, so nothing more is done.

        Returns the final status (the current one with detach); raises TrainingFailed when the run
        fails, ControllerStartFailed when the background controller it started exits while starting
        (the run stays applied; its log's last lines say why). Ctrl-C stops following only: the run keeps
        training under the controller.
        """
        from pathlib import Path

        from mortal.client.apply import wait_until_deleted
        from mortal.client.cli import follow
        from mortal.client.local_controller import ensure_controller, finish_deletion, wake_controller
        from mortal.controller.admission import admit_runs
        from mortal.controller.snapshot import importing_folders
        from mortal.state import NotFound, open_store

        store = open_store(self.state_url)
        try:
            # before the snapshot is installed in the run's folder, which a deleted run's purge sets aside
            wait_until_deleted(
                store,
                self.name,
                on_wait=lambda: finish_deletion(
                    self.state_url, not self.start_controller, self.name, announce=not self.quiet
                ),
            )
            with admit_runs(
                [(self.run, f"MortalTrainer({self.name})")], importing_folders(self.run.spec, Path.cwd())
            ) as admitted:
                # admitted (else AdmissionRefused named the field): the snapshot is installed
                admission = admitted[0]
                for check in admission.deferred:
                    self._say(f"note: {check.line(self.name)}")
        except BaseException:
            store.close()
            raise
        try:
            try:
                existing = store.get_run(self.name)
            except NotFound:
                existing = None
            try:
                outcome = self._write(store, existing, _checkpoint_source(resume_from_checkpoint))
            except BaseException:
                admission.withdraw(store)  # a run never created leaves no code folder under its name
                raise
            self._say(f"trainingrun/{self.name} {outcome}")
            if outcome != "unchanged":
                wake_controller(self.name)
            ensure_controller(self.state_url, not self.start_controller, announce=not self.quiet)
            if self.detach:
                self._say(f"detached; follow it with `mortalctl get runs {self.name} -w`")
                return RunStatus.model_validate(store.get_run(self.name).status)
            try:
                status = follow.follow_run(store, self.name, quiet=self.quiet)
            except KeyboardInterrupt:
                self._say(
                    f"stopped following; the run keeps training (`mortalctl delete run {self.name}` stops it)"
                )
                raise
            if str(status.phase) == "Failed":
                raise TrainingFailed(self.name, status)
            return status
        finally:
            store.close()

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)
