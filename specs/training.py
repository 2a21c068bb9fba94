"""`spec:` of a TrainingRun: what to train, on what, with which algorithm, on which hardware.

Every field is documented once here (its `description` feeds `mortalctl schema` and the docs).
Cross-field rules live in the model that owns both fields (TRL style: the message says the fix).
Read by the controller (layout, scaling, restarts) and the workers (model, data, algorithm); it
must not import torch, transformers or anything of mortal outside `mortal.specs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from mortal.specs.base import SpecModel, rule_error
from mortal.specs.deadlines import DeadlinesSpec
from mortal.specs.limits import LimitsSpec
from mortal.specs.ray import RaySpec
from mortal.specs.rewards import ENV_VAR, RewardSpec
from mortal.specs.tools import EnvironmentServiceSpec, check_environment, check_tools

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo")
# The first API's weight_sync_method names (MortalTrainer's), accepted in spec.sync.method: what each becomes.
SYNC_ALIASES = {
    "reload": (
        "volume",
        "reload has rollouts load each version from the shared volume in place; "
        "mortal's volume does that for every engine",
    ),
    "checkpoint": (
        "volume",
        "checkpoint has rollouts reload from saved weights on the volume, which is mortal's volume",
    ),
    "direct": (
        "ipc",
        "direct is an in-memory transfer with no disk, which is mortal's ipc (same host, GPUs)",
    ),
}
# The smallest run names only a model: it trains with sandboxed code execution on a coding set.
CODE_DATASET = "builtin:mbpp-mini"
VLLM_SHARE = 0.85  # vLLM's gpu_memory_utilization on a GPU of its own (vLLM's default)
COLOCATED_VLLM_SHARE = 0.3  # beside the actor on one GPU: TRL's vllm_gpu_memory_utilization default
CODE_SYSTEM_PROMPT = "Answer with one Python code block."


class LoraSpec(SpecModel):
    """LoRA adapters (peft): train low-rank adapters instead of all weights."""

    r: int = Field(16, ge=1, description="Rank of the adapter matrices.")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input, in [0, 1).")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get adapters: 'all-linear' or a list of module names. "
        "lm_head is refused: the loss reads its weight directly, so an adapter there would not train.",
    )

    @field_validator("target_modules")
    @classmethod
    def _not_lm_head(cls, value: str | list[str]) -> str | list[str]:
        names = [value] if isinstance(value, str) else value
        if any(name == "lm_head" or name.endswith(".lm_head") for name in names):
            raise rule_error(
                "lm_head cannot take a LoRA adapter: the loss computes log-probabilities from lm_head's "
                "weight in chunks (TRL's fused LM head), so the adapter would never train. Remove it from "
                "targetModules"
            )
        return value


class ModelSpec(SpecModel):
    """The policy model to train."""

    name: str = Field(
        min_length=1,
        description="Hub id, local directory, .gguf file, or 'package:MODULE/FILE' for a file shipped in an "
        "installed Python package.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weight dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16.",
    )
    lora: LoraSpec | None = Field(
        None,
        description="LoRA adapter settings; absent = full fine-tuning. Weight versions then carry only "
        "the adapters, which rollouts apply onto their base weights.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    tf32: bool = Field(
        False,
        description="Run float32 matmuls on TF32 tensor cores (Ampere and later GPUs) in the actor and the "
        "rollouts (TRL's tf32): faster, at a 10-bit mantissa inside each matmul. Needs dtype float32; "
        "ignored on the CPU.",
    )

    @field_validator("name")
    @classmethod
    def _package_reference_has_a_file(cls, value: str) -> str:
        if value.startswith("package:") and "/" not in value.removeprefix("package:"):
            raise rule_error(f"a package model must look like 'package:MODULE/FILE' (got {value!r})")
        return value


class DatasetSpec(SpecModel):
    """The prompts to train on."""

    name: str = Field(
        min_length=1,
        description="Hub id, local .jsonl/.parquet file, or 'builtin:NAME' (e.g. builtin:arith).",
    )
    config: str | None = Field(
        None, min_length=1, description="Hub dataset configuration (subset), e.g. 'main' for openai/gsm8k."
    )
    split: str = Field("train", min_length=1, description="Dataset split to read.")
    prompt_column: str = Field(
        "prompt", min_length=1, description="Column holding the prompt (text or chat)."
    )
    max_samples: int | None = Field(None, ge=1, description="Use only the first N rows; absent = all rows.")
    system_prompt: str | None = Field(None, description="System message prepended to every prompt.")


class AlgorithmSpec(SpecModel):
    """GRPO-family loss and optimizer settings (names follow TRL's GRPOConfig)."""

    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"] = Field(
        "dapo", description="Loss variant: grpo, dapo, dr_grpo, bnpo, cispo or sapo (TRL's loss_type)."
    )
    num_generations: int = Field(4, ge=2, description="Completions sampled per prompt (the GRPO group size).")
    batch_size: int = Field(
        8,
        ge=2,
        description="Completions per optimizer step (TRL's generation batch); a multiple of numGenerations. "
        "Prompts per step = batchSize / numGenerations.",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Completions per forward and backward pass; the gradients of batchSize / microBatchSize "
        "passes add up before one optimizer step (TRL's per_device_train_batch_size). Lower it when the "
        "actor runs out of GPU memory. A divisor of batchSize; absent = batchSize (one pass).",
    )
    learning_rate: float = Field(5e-6, gt=0, description="AdamW learning rate.")
    beta: float = Field(0.0, ge=0, description="KL penalty coefficient; 0 = no reference model.")
    epsilon: float = Field(0.2, gt=0, description="Lower clipping range of the importance ratio.")
    epsilon_high: float | None = Field(
        None,
        gt=0,
        description="Upper clipping range; absent = epsilon (DAPO suggests 0.28). With lossType "
        "cispo it is the cap of the importance weights (TRL recommends 5.0 there).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage scaling: by the group's std, the batch's std, or none."
    )
    max_steps: int = Field(
        100,
        ge=1,
        description="Optimizer steps to train; the run Succeeds after the last. Absent with "
        "numEpochs: computed from it when the spec is applied.",
    )
    num_epochs: float | None = Field(
        None,
        gt=0,
        description="Passes over the dataset. When maxSteps is absent, `apply` sets maxSteps = "
        "ceil(numEpochs x rows / prompts per step); builtin and local file datasets only (a hub dataset "
        "cannot be counted without downloading it).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="How many weight versions rollouts may lag the actor; 0 = on-policy (exactly "
        "reproducible on CPU). 1 generates step s+1 while the actor trains step s (importance-corrected): "
        "for rollouts on GPUs of their own, as a colocated rollout contends with the actor for its GPU "
        "(docs/benchmarks.md).",
    )
    seed: int = Field(0, ge=0, description="Seed of data order, sampling and initialization.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables clipping.")

    @model_validator(mode="after")
    def _batch_holds_whole_groups(self) -> AlgorithmSpec:
        if self.batch_size % self.num_generations:
            n = self.num_generations
            lower, upper = (self.batch_size // n) * n, (self.batch_size // n + 1) * n
            choices = f"{lower} or {upper}" if lower else str(upper)
            raise rule_error(
                f"batchSize ({self.batch_size}) must be divisible by numGenerations ({n}): try {choices}",
                field="batchSize",
            )
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            divisors = [d for d in range(1, self.batch_size + 1) if self.batch_size % d == 0]
            below = max(d for d in divisors if d <= self.micro_batch_size) if self.micro_batch_size > 1 else 1
            raise rule_error(
                f"microBatchSize ({self.micro_batch_size}) must divide batchSize ({self.batch_size}): "
                f"try {below}",
                field="microBatchSize",
            )
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise rule_error(
                f"epsilonHigh ({self.epsilon_high}) must be >= epsilon ({self.epsilon}); omit it to use "
                "epsilon",
                field="epsilonHigh",
            )
        return self

    @property
    def accumulation_steps(self) -> int:
        """Forward and backward passes per optimizer step (batchSize / microBatchSize)."""
        return self.batch_size // (self.micro_batch_size or self.batch_size)

    @property
    def prompts_per_step(self) -> int:
        """Distinct prompts in one optimizer step."""
        return self.batch_size // self.num_generations


class GenerationSpec(SpecModel):
    """Sampling settings of the rollout workers."""

    max_tokens: int = Field(256, ge=1, description="Maximum completion length in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (> 0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass, in (0, 1]; 1 = off.")
    top_k: int | None = Field(None, ge=1, description="Top-k sampling; absent = off.")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="Generation engine: auto (vllm where installed on GPU, else transformers)."
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        description="Most sequences a rollout decodes at once (vLLM's max_num_seqs); a row refills as soon "
        "as its sequence ends. Absent: 256 on the transformers engine, vLLM's default on vllm. Part of what "
        "a seed reproduces on a GPU.",
    )
    compile_scope: Literal["auto", "model", "layer"] = Field(
        "auto",
        description="What the transformers engine compiles for its CUDA-graph decode step: layer (one "
        "decoder layer, whose graph serves all of them: quicker to prepare), model (the whole forward) or "
        "auto (layer where the model lists its decoder layers, else model). Part of what a seed reproduces "
        "on a GPU; vLLM ignores it.",
    )


class ActorSpec(SpecModel):
    """The trainer worker."""

    gpu: str = Field("none", min_length=1, description="GPU type (e.g. H100, A100, A10G); 'none' = CPU.")
    count: int = Field(
        1,
        ge=1,
        description="Ranks of the actor, processes of one host: > 1 shards the model with FSDP2, or "
        "replicates it with strategy ddp; each rank trains batchSize / count of each step. With a GPU each "
        "rank has its own, joined over NCCL, and colocated rollouts spread over them (docs/fsdp.md).",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep a sharded actor's parameter shards, gradients and AdamW state in host memory, "
        "moving each layer to its GPU only for its forward and backward (FSDP2's CPUOffloadPolicy): for "
        "shards that do not fit the GPUs, at the cost of host-device copies every step. Needs count > 1 and "
        "a GPU.",
    )
    strategy: Literal["fsdp", "ddp"] = Field(
        "fsdp",
        description="How an actor of count > 1 splits the work: fsdp shards weights, gradients and AdamW "
        "state over the ranks (a model too large for one GPU); ddp gives every rank the whole model and "
        "averages the gradients (DistributedDataParallel), for a model that fits one GPU (docs/fsdp.md).",
    )
    reshard_after_forward: bool = Field(
        True,
        description="With count > 1, free each layer's gathered weights after its forward and gather them "
        "again for its backward (FSDP2's reshard_after_forward, ZeRO-3). false keeps them until the backward "
        "(ZeRO-2): half the all-gathers, at the price of a whole copy of the model on every GPU during the "
        "step (docs/fsdp.md).",
    )
    mixed_precision: bool = Field(
        False,
        description="Keep weights, gradients and AdamW state in float32 and compute forward and backward in "
        "bfloat16: one actor autocasts (TRL's bf16 over float32 weights); with count > 1 FSDP2's "
        "MixedPrecisionPolicy over float32 shards (TRL's FSDP with bf16). Rollouts generate in bfloat16. "
        "Needs model.dtype float32. Where bfloat16 weights would lose small updates (an AdamW step below "
        "their precision), float32 weights keep them.",
    )
    compile: bool = Field(
        False,
        description="Compile the model the actor trains with torch.compile (TRL's torch_compile), once, with "
        "dynamic shapes: faster steps after a slow first one, worth it for runs of several hundred steps "
        "(docs/benchmarks.md).",
    )
    compile_scope: Literal["model", "layer"] = Field(
        "layer",
        description="What actor.compile compiles: layer (each decoder layer, the first's compiled code "
        "serving all of them: accelerate's regional compilation) or model (the whole model as one graph, a "
        "much longer first compile).",
    )
    liger: bool = Field(
        False,
        description="Fused Triton kernels from Liger (RMSNorm, rotary embedding, SwiGLU MLP) in the model "
        "the actor trains: less GPU time and memory a step (docs/benchmarks.md). Needs a GPU, `pip install "
        "'mortal[liger]'` and an architecture Liger patches (Llama, Qwen2, Qwen3, Mistral, Gemma, Phi3, "
        "...).",
    )


class RolloutSpec(SpecModel):
    """The generation workers; scale them with `mortalctl scale RUN rollout=N`."""

    gpu: str = Field("none", min_length=1, description="GPU type per rollout replica; 'none' = CPU.")
    replicas: int = Field(
        1,
        ge=0,
        description="Rollout workers; 0 pauses generation (the actor waits) without stopping the run.",
    )
    colocate: bool = Field(
        False,
        description="Share the actor's GPU instead of taking GPUs of their own (TRL's vllm_mode='colocate'); "
        "rollout.gpu must equal actor.gpu. On Modal every worker has a container of its own, so each rollout "
        "still gets a GPU.",
    )
    colocated_replicas: int | None = Field(
        None,
        ge=1,
        description="Colocate only the first N replicas (rollout-0 .. N-1) on the actor's GPU; the others "
        "take GPUs of their own, and rollout.gpuMemoryUtilization caps the colocated ones only. Not with "
        "colocate: true or sync nccl.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Fraction of its GPU's memory one rollout may hold for weights, KV cache and workspace "
        "(vLLM's gpu_memory_utilization); the transformers engine caps its allocator at it. Absent: vLLM "
        "takes 0.85 of a GPU of its own and 0.3 of a shared one; the transformers engine is not capped.",
    )
    prompts_per_task: int | None = Field(
        None,
        ge=1,
        description="Prompts in one rollout task, generated together in one batch on a GPU. Absent: a step's "
        "prompts split evenly over the replicas on a GPU, 1 on the CPU.",
    )

    tools: list[str] = Field(
        default_factory=list,
        description="Tools the model may call, as 'module:function' references (TRL's tools); each "
        "function's name, type hints and docstring become its schema. Tools run in the rollout worker under "
        "toolTimeoutSeconds, and tool-result tokens are masked out of the loss.",
    )
    environment: str | dict[str, str] | None = Field(
        None,
        description="TRL's environment_factory: a class 'module:Class' built once per rollout, whose "
        "reset(**row) runs before each generation and whose public methods are tools. A dict {name: "
        "'module:Class'} lets the dataset's environment column pick one per row.",
    )
    environment_service: EnvironmentServiceSpec = Field(
        default_factory=EnvironmentServiceSpec,
        description="Where environment instances run: in the rollout worker (inProcess, the default), in "
        "child processes that are replaced when they die or hang (processPool), or on an environment server "
        "(http).",
    )
    max_tool_calling_iterations: int | None = Field(
        None,
        ge=0,
        description="Most rounds of tool calls per completion (TRL's max_tool_calling_iterations); absent = "
        "limited only by generation.maxTokens, which counts model and tool tokens.",
    )
    tool_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="Wall-clock limit of one tool call, in seconds; past it the model is told the tool timed "
        "out.",
    )
    chat_template: str | None = Field(
        None,
        min_length=1,
        description="Chat template for tool conversations: a TRL template name (e.g. qwen2_5) or a .jinja "
        "file. Absent: the model's own, which must render tool calls and tool messages.",
    )

    @field_validator("tools")
    @classmethod
    def _tools_are_references(cls, value: list[str]) -> list[str]:
        return check_tools(value)

    @field_validator("environment")
    @classmethod
    def _environment_is_a_reference(cls, value: str | dict[str, str] | None) -> str | dict[str, str] | None:
        return check_environment(value)

    def colocated(self, replica: int) -> bool:
        """Whether rollout-`replica` shares the actor's GPU (colocate: all; colocatedReplicas: first N)."""
        return self.colocate or replica < (self.colocated_replicas or 0)

    @property
    def shares_actor_gpu(self) -> bool:
        """Some replicas are (or, scaled up, would be) colocated with the actor."""
        return self.colocate or self.colocated_replicas is not None

    @property
    def colocated_count(self) -> int:
        """Replicas on the actor's GPU(s) now."""
        return self.replicas if self.colocate else min(self.colocated_replicas or 0, self.replicas)

    @property
    def uses_tools(self) -> bool:
        """Rollouts are multi-turn: tools or an environment are set."""
        return bool(self.tools) or self.environment is not None

    def task_size(self, prompts_per_step: int) -> int:
        """Prompts per rollout task: the spec's value, else one chunk per replica on GPU, 1 on CPU."""
        if self.prompts_per_task is not None:
            return min(self.prompts_per_task, prompts_per_step)
        if self.gpu == "none":
            return 1
        return -(-prompts_per_step // max(self.replicas, 1))


class SyncSpec(SpecModel):
    """How new weights travel from the actor to the rollout workers."""

    method: Literal["auto", "volume", "ipc", "nccl", "ray", "reload", "direct", "checkpoint"] = Field(
        "auto",
        description="How weights travel: volume (safetensors on the shared volume), ray (the same through "
        "Ray's object store), ipc (copied from the actor's GPU over CUDA IPC, same host), nccl (sent over "
        "NCCL to rollouts on GPUs of their own, same host), or auto (ipc where possible, ray on Ray nodes "
        "without a shared filesystem, else volume). The older names reload and checkpoint are stored as "
        "volume, direct as ipc.",
    )
    every: int = Field(1, ge=1, description="Publish weights every N optimizer steps.")
    keep_versions: int = Field(
        3,
        ge=2,
        le=8,
        description="Weight versions the actor keeps: a ring of whole-model snapshots on its GPU with ipc "
        "and nccl (the adapters alone with LoRA), version directories with volume and ray. A smaller ring "
        "saves GPU memory but makes a rollout's read likelier to be overwritten and redone "
        "(docs/architecture.md).",
    )
    _alias: str | None = PrivateAttr(None)  # the older name the spec used, for `notes()`

    @model_validator(mode="wrap")
    @classmethod
    def _seed_names(cls, data: Any, handler: Any) -> SyncSpec:
        alias = data.get("method") if isinstance(data, dict) else None
        if alias in SYNC_ALIASES:
            data = {**data, "method": SYNC_ALIASES[alias][0]}
        spec = handler(data)
        spec._alias = alias if alias in SYNC_ALIASES else None
        return spec

    def notes(self) -> list[str]:
        """What an older method name became, said once when the spec is applied."""
        if self._alias is None:
            return []
        method, why = SYNC_ALIASES[self._alias]
        return [f"spec.sync.method: {self._alias!r} is stored as {method!r}: {why}"]


class CheckpointSpec(SpecModel):
    """Checkpoints the run resumes from after a failure."""

    every: int = Field(10, ge=1, description="Write a complete checkpoint every N optimizer steps.")
    keep: int = Field(3, ge=1, description="Keep the newest N complete checkpoints; older ones are deleted.")
    uri: str | None = Field(
        None,
        min_length=1,
        description="fsspec URL every checkpoint is uploaded to, as <uri>/<run>/step-<N>/ "
        "(s3://bucket/prefix, gs://..., file:///path; the protocol's package must be installed where the "
        "actor runs). Absent: checkpoints stay under MORTAL_HOME. Required with ray.sharedFilesystem false.",
    )

    @field_validator("uri")
    @classmethod
    def _uri_is_storage_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        protocol, sep, rest = value.partition("://")
        if not sep or not protocol or not rest.strip("/"):
            raise rule_error(
                "must be a storage URL with a protocol and a path, such as s3://bucket/prefix "
                f"or file:///mnt/bucket/prefix (got {value!r})"
            )
        from fsspec.registry import known_implementations, registry  # the names only: no backend is imported

        if protocol not in known_implementations and protocol not in registry:
            raise rule_error(
                f"unknown storage protocol {protocol!r} in {value!r}: use one fsspec knows, "
                "such as s3, gs, az, hdfs or file"
            )
        return value.rstrip("/")


class RestartPolicy(SpecModel):
    """What the controller does when a worker dies."""

    max_restarts: int = Field(10, ge=0, description="Relaunches allowed before the run is Failed.")
    backoff_seconds: float = Field(
        5.0, ge=0, description="Base of the exponential backoff between relaunches, in seconds."
    )
    same_failure_limit: int = Field(
        3,
        ge=0,
        description="Failures in a row of one worker with the same error, each within 2 minutes of its "
        "launch, that fail the run at once (reason CrashLoop) instead of spending maxRestarts. Losses "
        "(preemption, a killed process) never count; 0 = off.",
    )


class WandbSpec(SpecModel):
    """Weights & Biases logging."""

    project: str = Field("mortal", min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); absent = your default.")
    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto",
        description="auto: online when WANDB_API_KEY is set (list it in secrets), else offline "
        "(files under the run folder). WANDB_MODE=disabled turns it off.",
    )


class LoggingSpec(SpecModel):
    """Where metrics go besides the state store (always written there), and how many samples are kept."""

    wandb: WandbSpec = Field(default_factory=WandbSpec, description="Weights & Biases settings.")
    completions_per_step: int = Field(
        64,
        ge=0,
        description="Completions the actor records per optimizer step (prompt, completion, rewards, "
        "advantage, weight version): the first N of the step's batch, whole groups. `mortalctl get "
        "completions` reads them; with W&B on, also a wandb.Table per step. 0 = none.",
    )


class TrainingSpec(SpecModel):
    """The desired state of a TrainingRun; the controller makes the world match it."""

    model: ModelSpec = Field(description="The policy model to train.")
    dataset: DatasetSpec = Field(
        default_factory=lambda: DatasetSpec(name=CODE_DATASET, system_prompt=CODE_SYSTEM_PROMPT),
        description=f"The prompts to train on. Absent: the default, {CODE_DATASET} (small Python "
        "tasks whose rows carry assert tests), with the system prompt '" + CODE_SYSTEM_PROMPT + "'.",
    )
    algorithm: AlgorithmSpec = Field(
        default_factory=AlgorithmSpec, description="Loss and optimizer settings."
    )
    generation: GenerationSpec = Field(default_factory=GenerationSpec, description="Sampling settings.")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(env="code-execution")],
        min_length=1,
        description="Reward signals, summed with their weights. Absent: the default, env "
        "code-execution (each completion's code run in the sandbox against its row's tests).",
    )
    actor: ActorSpec = Field(default_factory=ActorSpec, description="The trainer worker.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="The generation workers.")
    sync: SyncSpec = Field(default_factory=SyncSpec, description="Weight sync from actor to rollouts.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing.")
    restart_policy: RestartPolicy = Field(
        default_factory=RestartPolicy, description="Worker relaunch policy (YAML key restartPolicy)."
    )
    limits: LimitsSpec = Field(
        default_factory=LimitsSpec,
        description="Budgets: maxDuration (active time) and maxGPUHours. Reaching one writes a final "
        "checkpoint and ends the run Failed (DeadlineExceeded, BudgetExceeded).",
    )
    deadlines: DeadlinesSpec = Field(
        default_factory=DeadlinesSpec,
        description="How long a task, a step, a weight load and a collective may take; past one the worker's "
        "stacks are logged and it is relaunched (docs/deadlines.md).",
    )
    backend: Literal["local", "modal", "ray"] = Field(
        "local",
        description="Where workers run: local (processes on this machine), modal (Modal function "
        "calls) or ray (actors on a Ray cluster: see ray).",
    )
    ray: RaySpec = Field(
        default_factory=RaySpec,
        description="With backend ray: the cluster's address and each role's CPUs, memory and custom "
        "resources.",
    )
    suspend: bool = Field(False, description="true stops all workers and keeps the run (resume sets false).")
    secrets: list[str] = Field(
        default_factory=list,
        description="Environment variable NAMES handed to the workers (values never stored).",
    )
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="Metrics logging.")
    _notes: list[str] = PrivateAttr(default_factory=list)  # what admission changed (specs/epochs.py)

    def seed_defaults(self) -> list[str]:
        """The blocks (dataset, rewards) that hold the default: `describe` says so."""
        fields = type(self).model_fields
        return [
            name
            for name in ("dataset", "rewards")
            if getattr(self, name) == fields[name].get_default(call_default_factory=True)
        ]

    def notes(self) -> list[str]:
        """What applying this spec changed from what it says (an older name mapped, maxSteps computed):
        `apply` prints them, as kubectl prints warnings."""
        return [*self.sync.notes(), *self._notes]

    @field_validator("secrets")
    @classmethod
    def _secrets_are_names(cls, value: list[str]) -> list[str]:
        bad = [name for name in value if not ENV_VAR.match(name)]
        if bad:
            raise rule_error(
                f"must list environment variable NAMES such as HF_TOKEN (got {bad[0]!r}); values are read "
                "from the controller's environment, never written in a spec"
            )
        return value

    @model_validator(mode="after")
    def _ray_block_needs_ray(self) -> TrainingSpec:
        if self.backend != "ray" and "ray" in self.model_fields_set and self.ray != RaySpec():
            raise rule_error(
                "ray settings apply only to backend ray (this run's backend is "
                f"{self.backend!r}): set backend: ray, or remove the ray block",
                "ray",
            )
        if self.backend == "ray" and self.rollout.shares_actor_gpu:
            raise rule_error(
                "colocated rollouts share the actor's GPU within one machine's processes, which "
                "the ray backend does not build: give rollouts GPUs of their own (drop "
                "colocate)",
                "rollout.colocate" if self.rollout.colocate else "rollout.colocatedReplicas",
            )
        return self

    @model_validator(mode="after")
    def _colocation_is_possible(self) -> TrainingSpec:
        if not self.rollout.shares_actor_gpu:
            return self
        field = "rollout.colocate" if self.rollout.colocate else "rollout.colocatedReplicas"
        if self.rollout.colocate and self.rollout.colocated_replicas is not None:
            raise rule_error(
                "colocate: true already puts every replica on the actor's GPU: drop colocate to "
                f"colocate only the first {self.rollout.colocated_replicas}, or drop "
                "colocatedReplicas",
                "rollout.colocatedReplicas",
            )
        if self.actor.gpu == "none" or self.rollout.gpu != self.actor.gpu:
            raise rule_error(
                "colocated rollouts share the actor's GPU: set rollout.gpu to actor.gpu "
                f"({self.actor.gpu!r}), and both to a GPU type (on the CPU there is nothing to share: drop "
                f"{field.split('.')[1]})",
                field,
            )
        return self

    def ipc_possible(self) -> bool:
        """CUDA IPC reaches processes of the same host that see the actor's GPU: the local backend's
        GPU rollouts (colocated, or on GPUs of their own and shown the actor's too), with the
        transformers engine (vLLM keeps its model in a process of its own)."""
        return (
            self.backend == "local"
            and self.generation.engine == "transformers"
            and self.actor.gpu != "none"
            and self.rollout.gpu != "none"
        )

    def rollout_model(self) -> ModelSpec:
        """The model as rollouts load it: spec.model, except under actor.mixedPrecision, where the actor keeps
        float32 master weights but computes in bfloat16 and the rollouts generate in bfloat16 too (as vLLM
        does beside TRL's FSDP actor in bf16): half the memory and the decode time of float32. The actor then
        publishes its weights cast to bfloat16 (mortal.workers.actor.sharded.publish_dtype)."""
        if self.actor.mixed_precision:
            return self.model.model_copy(update={"dtype": "bfloat16"})
        return self.model

    def sync_method(self) -> str:
        """The weight-sync method this run uses (`auto` resolved): `ipc` where it is possible, a LoRA run
        included (its ring holds the adapters' factors alone, which rollouts merge into their base weights:
        mortal.workers.sync.weights), else `ray` for Ray nodes that share no disk, else `volume`."""
        if self.sync.method == "auto":
            if self.ipc_possible():
                return "ipc"
            return "ray" if self.backend == "ray" and not self.ray.shared_filesystem else "volume"
        return self.sync.method

    @model_validator(mode="after")
    def _tf32_needs_float32(self) -> TrainingSpec:
        if self.model.tf32 and self.model.dtype != "float32":
            raise rule_error(
                f"tf32 speeds up float32 matmuls; this model's dtype is {self.model.dtype!r} "
                "(auto is bfloat16 on a GPU): set model.dtype: float32, or drop "
                "model.tf32",
                "model.tf32",
            )
        return self

    @model_validator(mode="after")
    def _memory_share_is_possible(self) -> TrainingSpec:
        share = self.rollout.gpu_memory_utilization
        if share is None:
            return self
        if self.rollout.gpu == "none":
            raise rule_error(
                "rollout.gpuMemoryUtilization shares a GPU's memory: set rollout.gpu to a GPU "
                "type, or drop it on the CPU",
                "rollout.gpuMemoryUtilization",
            )
        per_gpu = self.colocated_per_gpu()
        if per_gpu and per_gpu * share >= 1:
            raise rule_error(
                f"{per_gpu} colocated rollouts x {share} of the GPU each leave nothing for the "
                "actor's training on the same GPU: lower rollout.gpuMemoryUtilization below "
                f"{1 / per_gpu:.2f} (TRL's colocate default is 0.3), or fewer replicas",
                "rollout.gpuMemoryUtilization",
            )
        return self

    def colocated_per_gpu(self) -> int:
        """Colocated rollouts on the busiest of the actor's GPUs: replica r shares the actor's GPU r % count
        (one after the other), so ceil(replicas / count); 0 when the rollouts have GPUs of their own."""
        return -(-self.rollout.colocated_count // self.actor.count)

    def rollout_memory_share(self, engine: str, replica: int = 0) -> float | None:
        """The share of its GPU rollout-`replica` of `engine` (the one it resolved: "vllm" or "transformers")
        holds: rollout.gpuMemoryUtilization (with colocatedReplicas, for the colocated ones only), else vLLM's
        default (0.85 alone, TRL's 0.3 colocated); None for the transformers engine by default (uncapped) and
        on the CPU."""
        if self.rollout.gpu == "none":
            return None
        colocated = self.rollout.colocated(replica)
        share = self.rollout.gpu_memory_utilization
        if share is not None and (colocated or self.rollout.colocated_replicas is None):
            return share
        if engine == "vllm":
            return COLOCATED_VLLM_SHARE if colocated else VLLM_SHARE
        return None

    @model_validator(mode="after")
    def _no_shared_filesystem(self) -> TrainingSpec:
        """ray.sharedFilesystem false: nothing a node writes under its MORTAL_HOME is seen by another, so
        checkpoints need a storage URL and weights go through Ray's object store."""
        if self.sync.method == "ray" and self.backend != "ray":
            raise rule_error(
                "sync ray sends weights through Ray's object store: it needs backend ray (this "
                f"run's backend is {self.backend!r}); use 'auto' or 'volume'",
                "sync.method",
            )
        if self.backend != "ray" or self.ray.shared_filesystem:
            return self
        if self.checkpoint.uri is None:
            raise rule_error(
                "ray.sharedFilesystem is false, so a checkpoint written on one node cannot be "
                "read on another: set checkpoint.uri to storage every node reaches "
                "(s3://bucket/prefix, gs://..., file:///mounted/path)",
                "ray.sharedFilesystem",
            )
        if self.sync.method not in ("auto", "ray"):
            raise rule_error(
                "ray.sharedFilesystem is false: weights cannot travel through a volume "
                f"({self.sync.method!r}); use 'auto' or 'ray' (Ray's object "
                "store)",
                "sync.method",
            )
        return self

    @model_validator(mode="after")
    def _ipc_is_possible(self) -> TrainingSpec:
        if self.sync.method == "ipc" and not self.ipc_possible():
            said = f"{self.sync._alias!r} is ipc here, which " if self.sync._alias else "sync ipc "
            raise rule_error(
                f"{said}shares the actor's GPU memory with rollouts on the same host: it needs backend "
                "local, GPUs for actor and rollout, and generation.engine transformers; use 'auto' or "
                "'volume' otherwise",
                "sync.method",
            )
        return self

    @model_validator(mode="after")
    def _nccl_is_possible(self) -> TrainingSpec:
        if self.sync.method != "nccl":
            return self
        if not self.ipc_possible():
            raise rule_error(
                "sync nccl sends weights from the actor's GPU to rollout GPUs of the same host: it needs "
                "backend local, GPUs for actor and rollout, and generation.engine transformers; use 'auto' "
                "or 'volume' otherwise",
                "sync.method",
            )
        if self.rollout.shares_actor_gpu:
            raise rule_error(
                "sync nccl needs each rollout on a GPU of its own (NCCL joins distinct GPUs); colocated "
                "rollouts share the actor's GPU: use 'ipc' (or 'auto')",
                "sync.method",
            )
        return self

    @model_validator(mode="after")
    def _sharding_is_possible(self) -> TrainingSpec:
        """actor.count > 1 (mortal.workers.actor.sharded): what a sharded actor cannot do, how it splits
        a batch."""
        count = self.actor.count
        if self.actor.mixed_precision and self.model.dtype != "float32":
            raise rule_error(
                "mixedPrecision keeps float32 master weights and computes in bfloat16; this "
                f"model's dtype is {self.model.dtype!r}: set model.dtype: "
                "float32",
                "actor.mixedPrecision",
            )
        if not self.actor.reshard_after_forward and count == 1:
            raise rule_error(
                "reshardAfterForward is FSDP2's choice for a sharded actor: an actor of one "
                "rank keeps its whole model anyway; set actor.count > 1, or drop "
                "it",
                "actor.reshardAfterForward",
            )
        if self.actor.strategy == "ddp" and count == 1:
            raise rule_error(
                "strategy ddp replicates the actor over its ranks: set actor.count > 1, or drop it",
                "actor.strategy",
            )
        if self.actor.strategy == "ddp":
            for name, chosen in (
                ("mixedPrecision", self.actor.mixed_precision),
                ("cpuOffload", self.actor.cpu_offload),
                ("reshardAfterForward", not self.actor.reshard_after_forward),
            ):
                if chosen:
                    raise rule_error(
                        f"{name} is FSDP2's: with strategy ddp every rank holds the whole model "
                        "as model.dtype has it; drop it, or set actor.strategy: "
                        "fsdp",
                        f"actor.{name}",
                    )
        if self.actor.liger and self.actor.gpu == "none":
            raise rule_error(
                "liger's kernels are Triton kernels for GPUs: set actor.gpu to a GPU type, or drop it",
                "actor.liger",
            )
        if self.actor.liger and count > 1 and self.actor.strategy == "fsdp":
            raise rule_error(
                "liger's kernels are not used under FSDP2 sharding (its weights are sharded "
                "tensors; untested): set actor.strategy: ddp, or drop it",
                "actor.liger",
            )
        if self.actor.cpu_offload and (count == 1 or self.actor.gpu == "none"):
            raise rule_error(
                "cpuOffload moves a sharded actor's shards from its GPUs to host memory: set "
                "actor.count > 1 and actor.gpu to a GPU type, or drop it",
                "actor.cpuOffload",
            )
        if count == 1:
            return self
        if self.model.lora is not None:
            raise rule_error(
                f"an actor of {count} ranks trains the full model: drop model.lora or use count 1",
                "actor.count",
            )
        micro = self.algorithm.batch_size // self.algorithm.accumulation_steps
        if micro % count:
            what = "microBatchSize" if self.algorithm.micro_batch_size else "batchSize"
            raise rule_error(
                f"{what} ({micro}) must divide over the actor's {count} ranks: each rank trains "
                f"{what} / count completions of a pass",
                "actor.count",
            )
        return self

    @model_validator(mode="after")
    def _tool_fields_fit(self) -> TrainingSpec:
        rollout = self.rollout
        for key, value in (
            ("maxToolCallingIterations", rollout.max_tool_calling_iterations),
            ("chatTemplate", rollout.chat_template),
        ):
            if value is not None and not rollout.uses_tools:
                raise rule_error(
                    f"rollout.{key} applies to tool-calling rollouts: set rollout.tools or "
                    "rollout.environment, or drop it",
                    f"rollout.{key}",
                )
        service = rollout.environment_service
        if service.mode != "inProcess" and rollout.environment is None:
            raise rule_error(
                f"rollout.environmentService mode {service.mode} hosts rollout.environment's instances: set "
                "rollout.environment ('module:Class'), or drop environmentService",
                "rollout.environmentService.mode",
            )
        if service.token_env is not None and service.token_env not in self.secrets:
            raise rule_error(
                f"rollout.environmentService.tokenEnv {service.token_env} must be listed in spec.secrets, "
                "so the rollout workers get the token",
                "rollout.environmentService.tokenEnv",
            )
        for i, entry in enumerate(self.rewards):
            if entry.env == "environment" and self.rollout.environment is None:
                raise rule_error(
                    f"rewards[{i}] has env 'environment', which scores with the environment's "
                    "get_reward(): set rollout.environment ('module:Class')",
                    "rewards",
                )
        return self

    @model_validator(mode="after")
    def _reward_names_unique(self) -> TrainingSpec:
        seen: set[str] = set()
        for entry in self.rewards:
            if entry.name is not None and entry.name in seen:
                raise rule_error(
                    f"two rewards are named {entry.name!r}: give each a distinct 'name'", "rewards"
                )
            if entry.name is not None:
                seen.add(entry.name)
        return self
