"""mortal.specs: the TrainingRun schema, its YAML loader and dumper, and its JSON Schema.

The lowest layer of mortal: it imports nothing else of mortal and no ML library, so the CLI, the
store and the workers can all depend on it cheaply.

    from mortal.specs import load_path, SpecError
    try:
        runs = load_path("specs/examples/quickstart.yaml")
    except SpecError as err:
        print(err)            # quickstart.yaml:12: spec.algorithm.numGenerations: must be >= 2 (got 1)
    runs[0].spec.algorithm.num_generations, runs[0].spec_dict()
"""

from pathlib import Path

from mortal.specs.dump import dump_runs, to_yaml
from mortal.specs.errors import SpecError, SpecIssue
from mortal.specs.limits import Duration, LimitsSpec, format_duration, parse_duration
from mortal.specs.loader import load_file, load_path, load_text
from mortal.specs.metadata import Metadata, is_dns1123_label
from mortal.specs.ray import RaySpec, RayWorkerSpec
from mortal.specs.rewards import BUILTIN_ENVS, RewardSpec, SandboxSpec
from mortal.specs.run import API_VERSION, KIND, TrainingRun
from mortal.specs.schema import json_schema
from mortal.specs.status import (
    TERMINAL_PHASES,
    TRANSITIONS,
    CheckpointRef,
    Condition,
    Phase,
    ReplicaCount,
    ReplicaStatus,
    RunStatus,
)
from mortal.specs.tools import EnvironmentServiceSpec
from mortal.specs.training import (
    LOSS_TYPES,
    ActorSpec,
    AlgorithmSpec,
    CheckpointSpec,
    DatasetSpec,
    GenerationSpec,
    LoggingSpec,
    LoraSpec,
    ModelSpec,
    RestartPolicy,
    RolloutSpec,
    SyncSpec,
    TrainingSpec,
    WandbSpec,
)

EXAMPLES_DIR = Path(__file__).parent / "examples"
"""The shipped example specs (quickstart.yaml, gpu.yaml, modal.yaml, code-execution.yaml)."""

__all__ = [
    "API_VERSION",
    "BUILTIN_ENVS",
    "EXAMPLES_DIR",
    "KIND",
    "LOSS_TYPES",
    "TERMINAL_PHASES",
    "TRANSITIONS",
    "ActorSpec",
    "AlgorithmSpec",
    "CheckpointRef",
    "CheckpointSpec",
    "Condition",
    "DatasetSpec",
    "Duration",
    "EnvironmentServiceSpec",
    "GenerationSpec",
    "LimitsSpec",
    "LoggingSpec",
    "LoraSpec",
    "Metadata",
    "ModelSpec",
    "Phase",
    "ReplicaCount",
    "ReplicaStatus",
    "RaySpec",
    "RayWorkerSpec",
    "RestartPolicy",
    "RewardSpec",
    "RolloutSpec",
    "RunStatus",
    "SandboxSpec",
    "SpecError",
    "SpecIssue",
    "SyncSpec",
    "TrainingRun",
    "TrainingSpec",
    "WandbSpec",
    "dump_runs",
    "format_duration",
    "is_dns1123_label",
    "json_schema",
    "load_file",
    "load_path",
    "load_text",
    "parse_duration",
    "to_yaml",
]
