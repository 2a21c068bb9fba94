"""MortalTrainer: seed-style arguments -> the right TrainingRun; importability of rewards; train()."""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path

import pytest

from mortal.client.modes import Distributed, GPUConfig, SingleNode
from mortal.client.trainer import MortalTrainer, RewardNotImportable, TrainerError, TrainingFailed
from mortal.state import NotFound, open_store
from mortal.workers.rewards import RewardEnvironment
from mortal.workers.rewards.builtin import correct_answer

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)]

NO_TOOLS = {
    "tools": [],
    "environment": None,
    "maxToolCallingIterations": None,
    "toolTimeoutSeconds": 30.0,
    "chatTemplate": None,
    "environmentService": {
        "mode": "inProcess",
        "processes": None,
        "url": None,
        "tokenEnv": None,
        "resetTimeoutSeconds": 300.0,
    },
}  # spec.rollout's tool-calling fields, at their defaults
UNCAPPED = {
    "gpuMemoryUtilization": None,
    "colocatedReplicas": None,
}  # spec.rollout's GPU sharing, at its defaults


def format_reward(completions, **kwargs):
    return [1.0 if "<answer>" in str(c) else 0.0 for c in completions]


class ThresholdEnv(RewardEnvironment):
    def __init__(self, threshold: float = 0.5, mode: str = "strict"):
        self.threshold = threshold
        self.mode = mode

    def score(self, completion, prompt, **kwargs):
        return float(len(completion) > self.threshold)


class OpaqueEnv(RewardEnvironment):
    def __init__(self, secret: str):
        self._hidden = secret


@pytest.fixture(autouse=True)
def _isolated(mortal_home, monkeypatch):
    monkeypatch.setenv("MORTAL_NO_CONTROLLER", "1")


def trainer(**kwargs):
    base = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "reward_funcs": [format_reward],
        "train_dataset": ROWS,
        "name": "t1",
        "quiet": True,
    }
    return MortalTrainer(**{**base, **kwargs})


def test_seed_style_single_node_arguments_become_the_spec(mortal_home):
    t = trainer(
        mode=SingleNode(gpu="A100", use_vllm=True, vllm_mode="colocate"),
        reward_funcs=[format_reward, correct_answer],
        reward_weights=[0.3, 1.0],
        num_generations=4,
        batch_size=16,
        learning_rate=1e-5,
        max_steps=7,
        loss_type="grpo",
        beta=0.04,
        epsilon=0.3,
        scale_rewards="batch",
        max_completion_length=128,
        temperature=0.9,
        use_lora=True,
        lora_r=8,
        lora_alpha=16,
        gradient_checkpointing=True,
        torch_compile=True,
        use_liger_kernel=True,
        seed=3,
        labels={"team": "rl"},
        annotations={"example.com/ticket": "RL-7"},
    )
    spec = t.run.spec_dict()
    assert spec["actor"] == {
        "gpu": "A100",
        "count": 1,
        "compile": True,
        "compileScope": "layer",  # TRL's torch_compile
        "liger": True,  # TRL's use_liger_kernel
        "mixedPrecision": False,
        "cpuOffload": False,
        "strategy": "fsdp",
        "reshardAfterForward": True,
    }
    assert spec["rollout"] == {
        "gpu": "A100",
        "replicas": 1,
        "colocate": True,
        "promptsPerTask": None,
        **NO_TOOLS,
        **UNCAPPED,
    }
    assert spec["generation"]["engine"] == "vllm" and spec["generation"]["maxTokens"] == 128
    assert spec["generation"]["temperature"] == 0.9
    a = spec["algorithm"]
    assert (a["numGenerations"], a["batchSize"], a["learningRate"], a["maxSteps"], a["lossType"]) == (
        4,
        16,
        1e-5,
        7,
        "grpo",
    )
    assert (a["beta"], a["epsilon"], a["scaleRewards"], a["seed"]) == (0.04, 0.3, "batch", 3)
    assert spec["model"]["lora"]["r"] == 8 and spec["model"]["lora"]["alpha"] == 16
    assert spec["model"]["gradientCheckpointing"] is True
    assert [(r["function"], r["weight"]) for r in spec["rewards"]] == [
        ("test_trainer:format_reward", 0.3),
        ("mortal.workers.rewards.builtin:correct_answer", 1.0),
    ]
    assert t.run.metadata.labels == {"team": "rl"} and t.name == "t1"
    assert t.run.metadata.annotations == {"example.com/ticket": "RL-7"}
    assert "kind: TrainingRun" in t.to_yaml()


def test_distributed_mode():
    spec = trainer(
        mode=Distributed(
            actor="H100",
            rollout="A10G",
            num_rollout_workers=3,
            weight_sync_method="volume",
            sync_weights_every=2,
        )
    ).run.spec_dict()
    assert spec["actor"]["gpu"] == "H100"
    assert spec["rollout"] == {
        "gpu": "A10G",
        "replicas": 3,
        "colocate": False,
        "promptsPerTask": None,
        **NO_TOOLS,
        **UNCAPPED,
    }
    assert spec["sync"] == {"method": "volume", "every": 2, "keepVersions": 3}


@pytest.mark.parametrize("seed_name", ["reload", "checkpoint"])
def test_seed_sync_names_become_the_spec_method_they_are(seed_name):
    t = trainer(mode=Distributed(weight_sync_method=seed_name))
    assert t.run.spec_dict()["sync"]["method"] == "volume"
    assert any(f"{seed_name!r} is stored as 'volume'" in note for note in t.run.spec.notes())


def test_a_sync_method_the_mode_cannot_use_says_why_naming_the_field():
    """nccl sends from the actor's GPU to rollout GPUs of this host, with the transformers engine;
    Distributed's engine is auto (vLLM where installed) unless it says otherwise."""
    with pytest.raises(TrainerError, match=r"spec\.sync\.method: sync nccl.*generation\.engine transformers"):
        trainer(mode=Distributed(actor="H100", rollout="H100", weight_sync_method="nccl"))
    spec = trainer(
        mode=Distributed(actor="H100", rollout="H100", weight_sync_method="nccl", engine="transformers")
    ).run.spec_dict()
    assert (spec["sync"]["method"], spec["generation"]["engine"]) == ("nccl", "transformers")


def test_modes_with_several_trainer_gpus_shard_the_actor_over_them():
    """SingleNode colocate on N GPUs: the trainer sharded over all N, a rollout beside it on each (TRL runs a
    vLLM beside each training process); Distributed's actor=GPUConfig(type, N): the trainer sharded over N."""
    spec = trainer(mode=SingleNode(gpu=GPUConfig("H100", count=2)), batch_size=16).run.spec_dict()
    assert (spec["actor"]["gpu"], spec["actor"]["count"]) == ("H100", 2)
    assert (spec["rollout"]["replicas"], spec["rollout"]["colocate"]) == (2, True)
    spec = trainer(
        mode=Distributed(actor=GPUConfig("H200", count=2), rollout="H200", num_rollout_workers=2),
        batch_size=16,
    ).run.spec_dict()
    assert (spec["actor"]["gpu"], spec["actor"]["count"], spec["rollout"]["replicas"]) == ("H200", 2, 2)


def test_single_node_serve_needs_two_gpus():
    with pytest.raises(ValueError, match="count=2"):
        trainer(mode=SingleNode(gpu="A100", use_vllm=True, vllm_mode="serve"))
    spec = trainer(
        mode=SingleNode(gpu=GPUConfig("A100", count=3), use_vllm=True, vllm_mode="serve")
    ).run.spec_dict()
    assert spec["rollout"] == {
        "gpu": "A100",
        "replicas": 2,
        "colocate": False,
        "promptsPerTask": None,
        **NO_TOOLS,
        **UNCAPPED,
    }


def test_no_mode_keeps_the_spec_defaults():
    spec = trainer().run.spec_dict()
    assert spec["actor"]["gpu"] == "none"
    assert spec["rollout"] == {
        "gpu": "none",
        "replicas": 1,
        "colocate": False,
        "promptsPerTask": None,
        **NO_TOOLS,
        **UNCAPPED,
    }


def test_invalid_combination_is_reported_with_the_spec_message():
    with pytest.raises(TrainerError, match="divisible by numGenerations"):
        trainer(num_generations=4, batch_size=6)


@pytest.mark.parametrize(
    "reward, says",
    [
        (lambda completions, **kw: [0.0] * len(completions), "lambda"),
        (functools.partial(format_reward), "no importable name"),
    ],
)
def test_rewards_the_workers_cannot_import_are_refused(reward, says):
    with pytest.raises(RewardNotImportable, match=says) as err:
        trainer(reward_funcs=[reward])
    assert "module" in str(err.value)


def test_a_closure_and_a_main_function_are_refused():
    def inner(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(RewardNotImportable, match="inside a function"):
        trainer(reward_funcs=[inner])

    def script_reward(completions, **kwargs):
        return [0.0] * len(completions)

    script_reward.__module__, script_reward.__qualname__ = "__main__", "script_reward"
    with pytest.raises(RewardNotImportable, match="__main__"):
        trainer(reward_funcs=[script_reward])


def test_a_reward_whose_path_leads_elsewhere_is_refused():
    def impostor(completions, **kwargs):
        return [0.0] * len(completions)

    impostor.__module__, impostor.__qualname__ = "test_trainer", "format_reward"
    with pytest.raises(RewardNotImportable, match="different object"):
        trainer(reward_funcs=[impostor])


def test_reward_environments_and_strings():
    rewards = trainer(
        reward_funcs=[ThresholdEnv, ThresholdEnv(threshold=3.0), "sandbox", "my_pkg.rewards:score"],
    ).run.spec_dict()["rewards"]
    assert rewards[0]["function"] == "test_trainer:ThresholdEnv" and rewards[0]["args"] == {}
    assert rewards[1]["function"] == "test_trainer:ThresholdEnv" and rewards[1]["args"] == {"threshold": 3.0}
    assert rewards[2]["env"] == "code-execution"
    assert rewards[3]["function"] == "my_pkg.rewards:score"


def test_an_environment_whose_arguments_cannot_be_recovered_is_refused():
    with pytest.raises(TrainerError, match="self.secret"):
        trainer(reward_funcs=[OpaqueEnv("x")])


def test_argument_mistakes_are_clear():
    with pytest.raises(TrainerError, match="one weight per reward"):
        trainer(reward_funcs=[format_reward], reward_weights=[1.0, 2.0])
    with pytest.raises(TrainerError, match="train_dataset is required"):
        MortalTrainer(reward_funcs=[format_reward])
    with pytest.raises(TrainerError, match="no 'question' column"):
        trainer(prompt_column="question")
    with pytest.raises(TrainerError, match="train_dataset row 1 has no 'prompt' \\(its keys: question\\)"):
        trainer(train_dataset=[{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(TypeError):
        trainer(max_model_len=4096)
    with pytest.raises(TrainerError, match="metadata.labels"):
        trainer(labels={"bad key!": "x"})


def test_in_memory_dataset_is_written_once_under_mortal_home(mortal_home):
    t = trainer()
    path = t.run.spec.dataset.name
    assert path.startswith(str(mortal_home / "datasets" / "t1-")) and path.endswith(".jsonl")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert rows == ROWS
    assert trainer().run.spec.dataset.name == path  # same rows -> same file
    assert len(list((mortal_home / "datasets").iterdir())) == 1


def test_hf_dataset_and_names(tmp_path):
    from datasets import Dataset

    t = trainer(train_dataset=Dataset.from_list(ROWS))
    assert [json.loads(line) for line in Path(t.run.spec.dataset.name).read_text().splitlines()] == ROWS
    local = tmp_path / "data.jsonl"
    local.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert trainer(train_dataset=str(local)).run.spec.dataset.name == str(local.resolve())
    assert trainer(train_dataset="openai/gsm8k").run.spec.dataset.name == "openai/gsm8k"


@pytest.mark.parametrize("name", ["../../evil", "{tmp}/absolute", "team/run", "MyRun"])
def test_a_refused_name_writes_no_dataset_file_anywhere(name, mortal_home, tmp_path):
    """The in-memory rows become a file only once the run validated: a name that leads out of
    $MORTAL_HOME/datasets, or any refused construction, leaves nothing behind."""
    before = set(tmp_path.rglob("*"))
    with pytest.raises(TrainerError, match="name"):
        trainer(name=name.format(tmp=tmp_path))
    assert set(tmp_path.rglob("*")) == before  # mortal_home is inside tmp_path
    trainer(name="fine")
    assert [p.name.split("-")[0] for p in (mortal_home / "datasets").iterdir()] == ["fine"]


def test_arguments_of_the_wrong_type_are_refused_naming_them(mortal_home):
    with pytest.raises(TrainerError, match="max_steps: expected an int, got str '10'"):
        trainer(max_steps="10")
    with pytest.raises(TrainerError, match="mode: expected mortal's SingleNode"):
        trainer(mode="cpu")


def test_num_epochs_sets_max_steps():
    # 12 rows, 8 completions / 4 generations = 2 prompts per step: 2 epochs = 12 steps
    assert trainer(num_epochs=2, num_generations=4, batch_size=8).run.spec.algorithm.max_steps == 12
    assert trainer(max_steps=5, num_epochs=2).run.spec.algorithm.max_steps == 5


def test_num_epochs_counts_a_builtin_dataset_and_refuses_a_hub_one():
    spec = MortalTrainer(model="m", num_epochs=2, batch_size=8, num_generations=4, quiet=True).run.spec
    assert spec.algorithm.max_steps == 51  # 2 passes over builtin:mbpp-mini's 51 rows, 2 prompts per step
    with pytest.raises(TrainerError, match="num_epochs: .*hub dataset.*give maxSteps"):
        MortalTrainer(
            model="m", train_dataset="openai/gsm8k", reward_funcs="sandbox", num_epochs=1, quiet=True
        )


def test_the_seeds_minimal_form_trains_code_execution_on_the_builtin_coding_set_under_a_generated_name():
    t = MortalTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct", mode=SingleNode(gpu="A100"), max_steps=5, quiet=True
    )
    assert t.run.spec.dataset.name == "builtin:mbpp-mini" and t.run.spec.dataset.system_prompt
    assert [r.env for r in t.run.spec.rewards] == ["code-execution"]
    assert t.run.spec.algorithm.max_steps == 5
    assert t.name.startswith("smollm2-135m-instruct-") and len(t.name) == len("smollm2-135m-instruct-") + 5


def test_detach_applies_and_returns(store_url):
    t = trainer(detach=True, state_url=store_url)
    status = t.train()
    assert str(status.phase) == "Pending"
    store = open_store(store_url)
    try:
        row = store.get_run("t1")
        assert row.spec == t.run.spec_dict() and row.generation == 1
        assert trainer(detach=True, state_url=store_url).train() is not None
        assert store.get_run("t1").resource_version == row.resource_version  # unchanged
    finally:
        store.close()


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_train_follows_to_the_end(store_url, phase):
    t = trainer(state_url=store_url)
    store = open_store(store_url)

    def controller():
        # train() applies t1 after admission's probe (a subprocess importing this module: no test helper
        # imports here); on a loaded CI machine that took more than the 5 s this wait once gave it, and
        # train() then followed forever.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                row = store.get_run("t1")
            except NotFound:
                time.sleep(0.05)
                continue
            store.write_status("t1", {**row.status, "phase": phase, "step": 3, "message": "it broke"})
            return

    thread = threading.Thread(target=controller)
    thread.start()
    try:
        if phase == "Succeeded":
            assert t.train().step == 3
        else:
            with pytest.raises(TrainingFailed, match="it broke"):
                t.train()
    finally:
        thread.join()
        store.close()


def test_facade_exports():
    import mortal

    assert mortal.MortalTrainer is MortalTrainer and mortal.SingleNode is SingleNode
    assert mortal.RewardEnvironment is RewardEnvironment
    assert set(mortal.__all__) >= {
        "MortalTrainer",
        "TrainingRun",
        "SingleNode",
        "Distributed",
        "GPUConfig",
        "RewardEnvironment",
    }
    with pytest.raises(AttributeError):
        mortal.NoSuchThing  # noqa: B018


def test_sandbox_rewards_map_to_the_code_execution_env_as_in_the_seed():
    alone = MortalTrainer(reward_funcs="sandbox", name="code1", quiet=True).run.spec
    assert alone.dataset.name == "builtin:mbpp-mini" and alone.dataset.system_prompt
    assert [(r.env, r.weight) for r in alone.rewards] == [("code-execution", 1.0)]
    rows = [{"prompt": "Write f() returning 1.", "tests": ["assert f() == 1"]}] * 4
    spec = trainer(reward_funcs=None, train_dataset=rows).run.spec  # None + a dataset: the seed's default
    assert [r.env for r in spec.rewards] == ["code-execution"] and spec.dataset.name.endswith(".jsonl")
    with pytest.raises(TrainerError, match="'tests' column"):
        trainer(reward_funcs="sandbox")  # ROWS have no tests


def test_builtin_environment_instances_become_env_entries():
    from mortal.rewards.examples import CodeExecutionEnvironment, LLMJudgeEnvironment

    rows = [{"prompt": "p", "checks": ["assert True"]}] * 4
    judge = LLMJudgeEnvironment(model="gpt-4o-mini", base_url="http://judge:8000/v1", score_range=(1, 5))
    run = trainer(
        reward_funcs=[
            CodeExecutionEnvironment(tests_column="checks", partial_credit=True, timeout=5),
            judge,
            CodeExecutionEnvironment,
        ],
        train_dataset=rows,
        reward_weights=[1.0, 0.5, 0.1],
        secrets=["HF_TOKEN"],
    ).run
    code, graded, plain = run.spec_dict()["rewards"]
    assert code["env"] == "code-execution" and code["args"] == {
        "tests_column": "checks",
        "partial_credit": True,
    }
    assert code["sandbox"]["timeoutSeconds"] == 5
    assert (graded["env"], graded["model"], graded["baseURL"], graded["apiKeyEnv"]) == (
        "llm-judge",
        "gpt-4o-mini",
        "http://judge:8000/v1",
        "OPENAI_API_KEY",
    )
    assert graded["args"] == {"score_range": [1, 5]} and graded["weight"] == 0.5
    assert plain["env"] == "code-execution"
    assert run.spec.secrets == ["HF_TOKEN", "OPENAI_API_KEY"]  # the judge's key travels to the workers


def _checkpointed_parent(store, spec: dict, step: int) -> None:
    """Run 'parent' with the given spec and a complete (fake) checkpoint of `step`, its actor ended."""
    from mortal.state import WorkerRef, paths

    store.apply_run("parent", spec)
    row = store.create_worker("parent", "actor", 0, "local", lease_seconds=30)
    folder = paths.checkpoints_dir("parent") / f"step-{step}"
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        (folder / name).write_bytes(b"x")
    (folder / "mortal.json").write_text(
        json.dumps({"run": "parent", "step": step, "weight_version": 1, "seed": 0})
    )
    store.record_checkpoint(WorkerRef("parent", "actor", 0, row.incarnation), step, str(folder), 1)
    store.end_worker(row.id, "Stopped")


def test_resume_from_checkpoint_forks_another_runs_checkpoint_with_this_trainers_spec(store_url):
    from mortal.client.fork import CannotCarryOver, CheckpointNotFound, RunExists
    from mortal.controller.snapshot import CODE_ANNOTATION
    from mortal.state import paths

    store = open_store(store_url)
    try:
        _checkpointed_parent(store, trainer(max_steps=30).run.spec_dict(), 10)
        t = trainer(detach=True, state_url=store_url, learning_rate=1e-7, max_steps=40, quiet=True)
        t.train(resume_from_checkpoint="parent:step-10")
        row = store.get_run("t1")
        assert (row.forked_from, row.forked_from_step) == ("parent", 10)
        assert row.spec == t.run.spec_dict() and row.spec["algorithm"]["learningRate"] == 1e-7
        assert [c.step for c in store.list_checkpoints("t1")] == [10]
        t.train(resume_from_checkpoint="parent:step-10")  # the script run again: just applied
        assert [c.step for c in store.list_checkpoints("t1")] == [10]
        folder = str(paths.checkpoints_dir("parent") / "step-10")
        trainer(name="t2", detach=True, state_url=store_url, quiet=True).train(resume_from_checkpoint=folder)
        assert store.get_run("t2").forked_from_step == 10
        with pytest.raises(CheckpointNotFound, match="no complete checkpoint of step 5"):
            trainer(name="t3", detach=True, state_url=store_url).train(resume_from_checkpoint="parent:step-5")
        with pytest.raises(CannotCarryOver, match="spec.model.lora"):
            trainer(name="t3", detach=True, state_url=store_url, use_lora=True).train(
                resume_from_checkpoint="parent"
            )
        with pytest.raises(RunExists, match="'parent' already exists and was not forked from 't1'"):
            trainer(name="parent", detach=True, state_url=store_url).train(resume_from_checkpoint="t1")
        with pytest.raises(TrainerError, match="resume_from_checkpoint"):
            trainer(name="t3", detach=True, state_url=store_url).train(resume_from_checkpoint="Not A Run")
        assert not paths.run_dir("t3").exists()  # refused: no code snapshot left under a name never created
        assert paths.code_dir("t1", row.annotations[CODE_ANNOTATION]).is_dir()  # the run made keeps its own
    finally:
        store.close()
