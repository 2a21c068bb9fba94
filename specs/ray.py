"""`spec.ray`: where a `backend: ray` run's workers go on a Ray cluster, and what each asks Ray for.

    backend: ray
    ray:
      address: 10.0.0.5:6379            # absent: $RAY_ADDRESS of the controller
      sharedFilesystem: false           # no shared MORTAL_HOME: needs checkpoint.uri
      actor:   {cpus: 4, memoryGB: 32}
      rollout: {cpus: 2, resources: {rollout_node: 1}}

Read by the controller (the Ray backend turns each role's block into the actor's resource request;
GPUs come from actor.gpu / rollout.gpu as everywhere). Pure: no I/O, no ray import, nothing of mortal
outside mortal.specs.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from mortal.specs.base import SpecModel, rule_error


class RayWorkerSpec(SpecModel):
    """What one worker of a role asks the Ray scheduler for, besides its GPUs (actor.gpu / rollout.gpu)."""

    cpus: float = Field(
        1.0,
        ge=0,
        description="CPUs the worker's Ray actor reserves (Ray's num_cpus; logical, as Ray counts them).",
    )
    memory_gb: float | None = Field(
        None,
        alias="memoryGB",
        gt=0,
        description="Memory the worker's Ray actor reserves, in GiB (Ray's memory); absent = none reserved.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources the worker needs, e.g. {trainer_node: 1} to place it on nodes "
        "started with --resources '{\"trainer_node\": 1}'. Names of Ray's own resources (CPU, GPU, memory) "
        "go in cpus, the role's gpu and memoryGB instead.",
    )

    @field_validator("resources")
    @classmethod
    def _custom_names_only(cls, value: dict[str, float]) -> dict[str, float]:
        own = {
            "CPU": "cpus",
            "GPU": "the role's gpu and count",
            "memory": "memoryGB",
            "object_store_memory": None,
        }
        for name, amount in value.items():
            if name in own:
                where = f": use {own[name]}" if own[name] else ""
                raise rule_error(f"{name!r} is one of Ray's own resources, not a custom one{where}")
            if amount < 0:
                raise rule_error(f"resource {name!r} must be >= 0 (got {amount})")
        return value


class RaySpec(SpecModel):
    """The Ray cluster a `backend: ray` run uses, and each role's resource request there."""

    shared_filesystem: bool = Field(
        True,
        alias="sharedFilesystem",
        description="true: every node and the controller mount one MORTAL_HOME (NFS, a ReadWriteMany "
        "volume). false: each worker uses its node's own MORTAL_HOME, so checkpoints go to checkpoint.uri "
        "(required) and weights through Ray's object store (sync auto or ray).",
    )
    address: str | None = Field(
        None,
        min_length=1,
        description="The Ray cluster's address as `ray.init` takes it: host:port of the head's GCS (e.g. "
        "10.0.0.5:6379), 'auto' for the cluster this machine belongs to, or ray://host:10001 (Ray Client). "
        "Absent: $RAY_ADDRESS of the controller. One controller drives one Ray cluster.",
    )
    actor: RayWorkerSpec = Field(default_factory=RayWorkerSpec, description="The trainer's resource request.")
    rollout: RayWorkerSpec = Field(
        default_factory=RayWorkerSpec,
        description="Each rollout replica's resource request; replicas are spread over the cluster's nodes.",
    )
