"""MortalTrainer.train admits its run as `mortalctl apply` does: the module of a reward function defined in
the script's folder travels with the run (its snapshot), and a reward TRL could not call is refused before
the store is written. On SQLite only: the subject is the client (tests/store_kinds.py)."""

from __future__ import annotations

import importlib
import sys

import pytest
from store_kinds import sqlite_only

from mortal.client.trainer import MortalTrainer
from mortal.controller.admission import AdmissionRefused
from mortal.controller.snapshot import CODE_ANNOTATION
from mortal.state import open_store, paths

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
MODULE = """
def shaped(completions, prompts=None, **kwargs):
    return [float(len(str(c)) < 50) for c in completions]


def positional_only(completions, /):
    return [0.0 for _ in completions]
"""


@pytest.fixture
def script_rewards(tmp_path, monkeypatch, mortal_home):
    """A module next to the user's script (imported from there, as `python train.py` does); run elsewhere."""
    script = tmp_path / "script"
    script.mkdir()
    (script / "user_shaping.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(script))
    monkeypatch.chdir(mortal_home)
    monkeypatch.setenv("MORTAL_NO_CONTROLLER", "1")
    yield importlib.import_module("user_shaping"), script
    sys.modules.pop("user_shaping", None)


def trainer(reward, store_url):
    return MortalTrainer(
        model="simulated",
        reward_funcs=[reward],
        train_dataset=ROWS,
        name="t1",
        quiet=True,
        detach=True,
        state_url=store_url,
    )


@sqlite_only
def test_the_rewards_module_of_the_script_travels_with_the_run(store_url, script_rewards):
    module, script = script_rewards
    trainer(module.shaped, store_url).train()
    store = open_store(store_url)
    digest = store.get_run("t1").annotations[CODE_ANNOTATION]
    store.close()
    copied = paths.code_dir("t1", digest) / "user_shaping.py"
    assert copied.read_text() == (script / "user_shaping.py").read_text()


@sqlite_only
def test_a_reward_trl_cannot_call_is_refused_before_anything_is_written(store_url, script_rewards):
    module, _ = script_rewards
    with pytest.raises(AdmissionRefused) as refused:
        trainer(module.positional_only, store_url).train()
    said = str(refused.value)
    assert "spec.rewards[0].function" in said and "does not take TRL's reward call" in said
    store = open_store(store_url)
    assert store.list_runs() == []
    store.close()


@sqlite_only
def test_a_run_of_the_same_name_being_deleted_is_waited_for_before_the_code_is_installed(
    store_url, script_rewards, monkeypatch
):
    from mortal.client import apply
    from mortal.client.errors import ClientError

    module, _ = script_rewards
    trainer(module.shaped, store_url).train()
    store = open_store(store_url)
    store.mark_deleted("t1")
    store.close()
    folder = paths.run_dir("t1")
    for child in sorted(folder.rglob("*"), reverse=True):  # the purge sets the old run's folder aside
        child.rmdir() if child.is_dir() else child.unlink()
    folder.rmdir()
    monkeypatch.setattr(apply, "DELETION_WAIT_SECONDS", 0.3)  # no controller here to finish the purge
    with pytest.raises(ClientError, match="still being deleted"):
        trainer(module.shaped, store_url).train()
    assert not folder.exists()  # nothing installed where the purge would move it
