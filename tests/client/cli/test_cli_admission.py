"""`mortalctl apply` admits a run before writing it: its rewards import from the applying folder with TRL's
signature, its model and dataset file are here; a failure names the file and the field and leaves the store
empty; what the run takes from the folder is snapshotted with it, and an edit of it makes apply `configured`.
On SQLite only: admission happens before the store is touched (tests/store_kinds.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_kinds import sqlite_only

from mortal.controller.snapshot import CODE_ANNOTATION
from mortal.state import open_store, paths

REWARDS = '''
def correct(completions, prompts=None, **kwargs):
    return [1.0 for _ in completions]


def no_kwargs(x):
    return [1.0]


VALUE = 3


class NoReset:
    def step(self, x: int) -> int:
        """Step.

        Args:
            x: a number
        """
        return x


class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def reset(self, **row):
        return None


def undocumented(x: int) -> int:
    return x


class UndocumentedTool:
    def reset(self, **row):
        return None

    def look(self, x: int) -> int:
        return x


def calculator(expression: str) -> str:
    """The user's own calculator, of the name of mortal's.

    Args:
        expression: what to compute
    """
    return expression


my_calculator = calculator  # an alias: to the model, the function's own name


class Calculating:
    def reset(self, **row):
        return None

    def calculator(self, expression: str) -> str:
        """A method of a standalone tool's name.

        Args:
            expression: what to compute
        """
        return expression
'''


@pytest.fixture
def user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's project: a reward module and a dataset file; apply runs from here."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "myrewards.py").write_text(REWARDS)
    (folder / "data" / "train.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    (folder / "data" / "cut.jsonl").write_text('\n{"prompt": "What is 1')
    (folder / "data" / "questions.jsonl").write_text('{"question": "What is 1 + 1?"}\n')
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    monkeypatch.chdir(folder)
    return folder


def runs(store_url: str) -> list[str]:
    store = open_store(store_url)
    try:
        return [r.name for r in store.list_runs()]
    finally:
        store.close()


@sqlite_only
def test_a_run_carries_the_reward_module_and_the_dataset_file_of_the_applying_folder(
    cli, spec_file, store_url, user_folder
):
    path = spec_file(
        "mine",
        **{"spec.rewards": [{"function": "myrewards:correct"}], "spec.dataset": {"name": "data/train.jsonl"}},
    )
    out = cli("apply", "-f", str(path))
    assert out.exit_code == 0, out.output
    assert "trainingrun/mine created" in out.stdout
    store = open_store(store_url)
    digest = store.get_run("mine").annotations[CODE_ANNOTATION]
    store.close()
    snapshot = paths.code_dir("mine", digest)
    assert (snapshot / "myrewards.py").read_text() == REWARDS
    assert (snapshot / "data" / "train.jsonl").is_file()
    assert not (snapshot / ".git").exists()


@sqlite_only
def test_editing_the_reward_module_makes_a_re_apply_configured(cli, spec_file, user_folder):
    path = spec_file("mine", **{"spec.rewards": [{"function": "myrewards:correct"}]})
    assert "created" in cli("apply", "-f", str(path)).stdout
    assert "trainingrun/mine unchanged" in cli("apply", "-f", str(path)).stdout
    (user_folder / "myrewards.py").write_text(REWARDS.replace("1.0 for", "0.5 for"))
    out = cli("apply", "-f", str(path))
    assert "trainingrun/mine configured" in out.stdout, out.output
    assert len(list(paths.run_dir("mine").joinpath("code").iterdir())) == 2  # each version kept by its hash


@sqlite_only
@pytest.mark.parametrize(
    ("edits", "field", "says"),
    [
        (
            {"spec.rewards": [{"function": "nothere:correct"}]},
            "spec.rewards[0].function",
            "cannot import module 'nothere'",
        ),
        (
            {"spec.rewards": [{"function": "myrewards:missing"}]},
            "spec.rewards[0].function",
            "has no attribute missing",
        ),
        (
            {"spec.rewards": [{"function": "myrewards:no_kwargs"}]},
            "spec.rewards[0].function",
            "does not take TRL's reward call",
        ),
        ({"spec.rewards": [{"function": "myrewards:VALUE"}]}, "spec.rewards[0].function", "is not callable"),
        ({"spec.model": {"name": "./models/tiny"}}, "spec.model.name", "no such file or folder"),
        ({"spec.model": {"name": "absent.gguf"}}, "spec.model.name", "no such file or folder"),
        ({"spec.dataset": {"name": "data/missing.jsonl"}}, "spec.dataset.name", "no such file"),
        ({"spec.dataset": {"name": "data/cut.jsonl"}}, "spec.dataset.name", "line 2 is not JSON"),
        (
            {"spec.dataset": {"name": "data/questions.jsonl"}},
            "spec.dataset.name",
            "line 1 has no 'prompt' column (spec.dataset.promptColumn): question",
        ),
        ({"spec.rollout.tools": ["myrewards:VALUE"]}, "spec.rollout.tools[0]", "a tool must be a function"),
        ({"spec.rollout.environment": "myrewards:correct"}, "spec.rollout.environment", "must be a class"),
        (
            {"spec.rollout.environment": "myrewards:NoReset"},
            "spec.rollout.environment",
            "has no reset() method",
        ),
        (
            {"spec.rollout.environment": {"a": "myrewards:NeedsArgs"}},
            "spec.rollout.environment.a",
            "TRL builds it with no arguments",
        ),
        (
            {
                "spec.rollout.chatTemplate": "nosuch",
                "spec.rollout.tools": ["mortal.workers.rollout.builtin_tools:calculator"],
            },
            "spec.rollout.chatTemplate",
            "'nosuch': neither a .jinja file nor a TRL template (",
        ),
        (
            {"spec.rollout.tools": ["myrewards:undocumented"]},
            "spec.rollout.tools[0]",
            "TRL cannot describe it to the model",
        ),
        (
            {"spec.rollout.environment": "myrewards:UndocumentedTool"},
            "spec.rollout.environment",
            "UndocumentedTool.look: DocstringParsingException",
        ),
        (
            {
                "spec.rollout.tools": [
                    "myrewards:my_calculator",
                    "mortal.workers.rollout.builtin_tools:calculator",
                ]
            },
            "spec.rollout.tools",
            "'myrewards:my_calculator' and 'mortal.workers.rollout.builtin_tools:calculator' are both the "
            "function 'calculator' to the model",
        ),
        (
            {
                "spec.rollout.tools": ["mortal.workers.rollout.builtin_tools:calculator"],
                "spec.rollout.environment": "myrewards:Calculating",
            },
            "spec.rollout.environment",
            "method calculator has the name of a tool of spec.rollout.tools",
        ),
    ],
)
def test_what_cannot_work_is_refused_naming_file_and_field_and_nothing_is_written(
    cli, spec_file, store_url, user_folder, edits, field, says
):
    path = spec_file("bad", **edits)
    out = cli("apply", "-f", str(path))
    assert out.exit_code == 1, out.output
    assert f"{path}:" in out.output and f": {field}: " in out.output and says in out.output
    line = out.output.split(f"{path}:", 1)[1].split(":", 1)[0]
    assert line.isdigit(), f"no line number: {out.output}"  # the field's line in the file
    assert runs(store_url) == []
    assert not paths.run_dir("bad").exists()


@sqlite_only
def test_dry_run_prints_every_check_and_writes_nothing(cli, spec_file, store_url, user_folder):
    path = spec_file("mine", **{"spec.rewards": [{"function": "myrewards:correct"}]})
    out = cli("apply", "-f", str(path), "--dry-run")
    assert out.exit_code == 0, out.output
    assert out.stdout == "trainingrun/mine created (dry run)\n"
    assert "check: trainingrun/mine: spec.rewards[0].function: ok: 'myrewards:correct'" in out.stderr
    assert "check: trainingrun/mine: spec.model.name: ok:" in out.stderr
    assert "check: trainingrun/mine: spec.dataset.name: ok: 'builtin:arith'" in out.stderr
    assert f"{CODE_ANNOTATION}: " in out.stderr
    assert runs(store_url) == [] and not paths.run_dir("mine").exists()
    bad = spec_file("bad", **{"spec.rewards": [{"function": "nothere:f"}]})
    refused = cli("apply", "-f", str(bad), "--dry-run")
    assert refused.exit_code == 1 and "spec.rewards[0].function" in refused.output


@sqlite_only
def test_a_modal_run_says_which_checks_the_backend_makes_later(cli, spec_file, user_folder):
    path = spec_file(
        "remote",
        **{
            "spec.backend": "modal",
            "spec.model": {"name": "nobody/not-cached-here"},
            "spec.actor": {"gpu": "H100"},
            "spec.rollout": {"gpu": "H100"},
        },
    )
    out = cli("apply", "-f", str(path), "--dry-run")
    assert out.exit_code == 0, out.output
    said = "spec.model.name: deferred: 'nobody/not-cached-here': looked for where the modal backend runs"
    assert said in out.stderr
    assert "spec.backend: deferred: modal: GPUs H100 are checked by the backend" in out.stderr


@sqlite_only
def test_a_snapshot_over_the_limit_is_refused_naming_what_is_large(
    cli, spec_file, store_url, user_folder, monkeypatch
):
    (user_folder / "big").mkdir()
    (user_folder / "big" / "__init__.py").write_text("def f(completions, **kwargs):\n    return [0.0]\n")
    (user_folder / "big" / "blob.bin").write_bytes(b"\0" * 300_000)
    monkeypatch.setenv("MORTAL_CODE_SNAPSHOT_LIMIT_MB", "0.1")
    out = cli("apply", "-f", str(spec_file("big", **{"spec.rewards": [{"function": "big:f"}]})))
    assert out.exit_code == 1, out.output
    assert "spec.rewards[0].function" in out.output and "over the snapshot limit" in out.output
    assert "big (0.3 MiB)" in out.output
    assert runs(store_url) == []


@sqlite_only
def test_the_output_of_get_applied_from_another_folder_keeps_the_run_s_snapshot(
    cli, spec_file, user_folder, tmp_path, monkeypatch
):
    path = spec_file("mine", **{"spec.rewards": [{"function": "myrewards:correct"}]})
    assert cli("apply", "-f", str(path)).exit_code == 0
    document = cli("get", "run", "mine", "-o", "yaml").stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no myrewards.py here: the run keeps the code it was applied with
    out = cli("apply", "-f", "-", input=document)
    assert out.exit_code == 0 and "trainingrun/mine unchanged" in out.stdout, out.output
    missing = spec_file("other", **{"spec.rewards": [{"function": "myrewards:correct"}]})
    refused = cli("apply", "-f", str(missing))  # a new run has no snapshot to keep: its code must be here
    assert refused.exit_code == 1 and "cannot import module 'myrewards'" in refused.output


@sqlite_only
def test_a_new_run_the_store_refuses_leaves_no_code_folder_under_its_name(
    cli, spec_file, store_url, user_folder, monkeypatch
):
    """Admitted with its code installed, then refused by the store (here a value it cannot hold; a
    creation race does the same): the run was never created, so nothing of it stays under its name, while
    the other run of the same apply is written with its code."""
    import mortal.state.apply_document as apply_document
    from mortal.state import InvalidValue

    write = apply_document.apply_document

    def refusing(store, run, **kwargs):
        if run.name == "refused":
            raise InvalidValue("the database refused a value")
        return write(store, run, **kwargs)

    monkeypatch.setattr(apply_document, "apply_document", refusing)
    rewards = {"spec.rewards": [{"function": "myrewards:correct"}]}
    out = cli("apply", "-f", str(spec_file("refused", **rewards)), "-f", str(spec_file("kept", **rewards)))
    assert out.exit_code == 1 and "the database refused a value" in out.output, out.output
    assert runs(store_url) == ["kept"] and not paths.run_dir("refused").exists()
    store = open_store(store_url)
    digest = store.get_run("kept").annotations[CODE_ANNOTATION]
    store.close()
    assert (paths.code_dir("kept", digest) / "myrewards.py").is_file()


@sqlite_only
def test_a_reward_module_in_the_folder_that_imports_a_missing_package_is_found_and_names_the_package(
    cli, spec_file, user_folder
):
    (user_folder / "needsdeps.py").write_text("import no_such_package_here\n")
    path = spec_file("deps", **{"spec.rewards": [{"function": "needsdeps:f"}]})
    out = cli("apply", "-f", str(path), "--dry-run")
    assert out.exit_code == 1, out.output
    assert (
        "'needsdeps:f': module 'needsdeps' was found (needsdeps.py, in the folder you applied from) but "
        "importing it failed: needsdeps.py:1 imports 'no_such_package_here', which is neither in the folder "
        "you applied from nor installed where mortal runs"
    ) in out.output


GOOD_ROW = b'{"prompt": "What is 1 + 1?"}\n'


@sqlite_only
@pytest.mark.parametrize(
    ("content", "says"),
    [
        (
            GOOD_ROW * 5 + b'{"prompt": "cut',
            "line 6 is not JSON: Unterminated string starting at (column 12)",
        ),
        (GOOD_ROW * 2 + b'{"prompt": "\xff"}\n', "line 3 is not UTF-8 text (byte 0xff at column 13)"),
        (
            GOOD_ROW + b'{"question": "x"}\n',
            "line 2 has no 'prompt' column (spec.dataset.promptColumn): question",
        ),
        (GOOD_ROW + b'"What is 1 + 1?"\n', "line 2 is a string, not a JSON object"),
        (GOOD_ROW + b'{"prompt": 7}\n', "line 2 has a 'prompt' that is a number"),
        (
            GOOD_ROW + b'{"prompt": "' + b"x" * (1 << 20) + b'x"}\n',
            "line 2 has a prompt of 1,048,577 characters",
        ),
    ],
)
def test_dry_run_refuses_a_dataset_naming_its_bad_line(
    cli, spec_file, store_url, user_folder, content: bytes, says: str
):
    (user_folder / "data" / "bad.jsonl").write_bytes(content)
    path = spec_file("bad", **{"spec.dataset": {"name": "data/bad.jsonl"}})
    out = cli("apply", "-f", str(path), "--dry-run")
    assert out.exit_code == 1, out.output
    assert f"{path}:" in out.output and f": spec.dataset.name: 'data/bad.jsonl': {says}" in out.output
    assert runs(store_url) == []
