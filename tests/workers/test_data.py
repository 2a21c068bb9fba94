"""Datasets: built-in sets (and their generator), .jsonl/.json/.parquet, normalization, error paths."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mortal.specs.training import DatasetSpec
from mortal.workers.data import MAX_PROMPT_CHARS, builtin_names, load_rows
from mortal.workers.errors import FatalWorkerError

BUILTIN = Path(__file__).resolve().parents[2] / "workers" / "builtin_data"


def spec(name: str, **kw) -> DatasetSpec:
    return DatasetSpec(name=name, **kw)


def test_builtin_sets_load_with_answers() -> None:
    assert {"arith", "wordproblems"} <= set(builtin_names())
    arith = load_rows(spec("builtin:arith"))
    assert len(arith) == 2000
    first = arith[0]
    assert first["prompt"][0]["role"] == "user" and first["prompt"][0]["content"].startswith("What is ")
    a, b = (int(x) for x in first["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + "))
    assert first["answer"] == str(a + b)
    problems = load_rows(spec("builtin:wordproblems", max_samples=50))
    assert len(problems) == 50
    for row in problems:
        assert row["solution"].endswith(f"#### {row['answer']}")
        assert "####" in row["prompt"][0]["content"]


def test_builtin_files_are_what_the_generator_writes() -> None:
    module_spec = importlib.util.spec_from_file_location("make_builtin_data", BUILTIN / "make.py")
    make = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(make)
    for name, build in make.BUILDERS.items():
        assert (BUILTIN / f"{name}.jsonl").read_text() == make.render(build()), f"rerun make.py for {name}"


def test_jsonl_with_prompt_column_system_prompt_and_max_samples(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"question": f"q{i}", "answer": i} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    loaded = load_rows(spec(str(path), prompt_column="question", max_samples=3, system_prompt="Be brief."))
    assert loaded == [{"answer": i, "prompt": f"Be brief.\n\nq{i}"} for i in range(3)]


def test_chat_prompts_get_the_system_message_in_front(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(
        json.dumps(
            [
                {"prompt": [{"role": "user", "content": "hi"}]},
                {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]},
            ]
        )
    )
    first, second = load_rows(spec(str(path), system_prompt="Be brief."))
    assert first["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert second["prompt"][0] == {"role": "system", "content": "own"}  # a row's own system message wins


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    assert load_rows(spec(str(path))) == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]


GOOD = b'{"prompt": "What is 1 + 1?"}\n'


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (None, "no such file"),
        (b"{not json\n", "line 1 is not JSON: Expecting property name enclosed in double quotes (column 2)"),
        (GOOD * 5 + b'{"prompt": "cut\n', "line 6 is not JSON"),
        (GOOD * 2 + b"\n" + b'{"prompt": "caf\xe9"}\n', "line 4 is not UTF-8 text (byte 0xe9 at column 16)"),
        (
            GOOD + b'{"question": "x"}\n',
            "line 2 has no 'prompt' column (spec.dataset.promptColumn): question",
        ),
        (GOOD + b'["a prompt"]\n', "line 2 is an array, not a JSON object"),
        (
            GOOD + b'{"prompt": 5}\n',
            "line 2 has a 'prompt' that is a number: a prompt must be text or a list",
        ),
        (b'{"prompt": []}\n', "line 1 has a 'prompt' that is an empty array"),
        (b"", "the dataset has no rows"),
    ],
)
def test_a_bad_line_is_fatal_naming_the_file_and_its_line(
    tmp_path: Path, make: bytes | None, message: str
) -> None:
    path = tmp_path / "d.jsonl"
    if make is not None:
        path.write_bytes(make)
    with pytest.raises(FatalWorkerError) as caught:
        load_rows(spec(str(path)))
    assert caught.value.reason == "DatasetUnreadable"
    assert message in caught.value.message
    if "line" in message:
        assert f"{path} {message}" in caught.value.message


def test_a_prompt_over_the_bound_is_refused_and_one_at_it_is_read(tmp_path: Path) -> None:
    """MAX_PROMPT_CHARS counts a text prompt's characters, a chat prompt's contents together."""
    path = tmp_path / "d.jsonl"
    half = "x" * (MAX_PROMPT_CHARS // 2)
    at_bound = {"prompt": [{"role": "system", "content": half}, {"role": "user", "content": half}]}
    path.write_text(json.dumps(at_bound) + "\n" + json.dumps({"prompt": "é" * (MAX_PROMPT_CHARS + 1)}) + "\n")
    with pytest.raises(
        FatalWorkerError, match=r"line 2 has a prompt of 1,048,577 characters; .*MAX_PROMPT_CHARS"
    ):
        load_rows(spec(str(path)))
    assert len(load_rows(spec(str(path), max_samples=1))[0]["prompt"]) == 2


def test_lines_past_max_samples_are_not_read(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD * 2 + b"{not json\n")
    assert len(load_rows(spec(str(path), max_samples=2))) == 2


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (b'[{"prompt": "a"},\n {"prompt": "\xff"}]', "line 2 is not UTF-8 text (byte 0xff)"),
        (b'[{"prompt": "a"},\n {"prompt": }]', "line 2 is not JSON: Expecting value (column 13)"),
        (b'[{"prompt": "a"}, {"question": "b"}]', "row 2 has no 'prompt' column (spec.dataset.promptColumn)"),
        (b'[{"prompt": "a"}, {"prompt": null}]', "row 2 has a 'prompt' that is null"),
    ],
)
def test_a_json_file_s_bad_row_is_named_by_its_line_or_its_place(
    tmp_path: Path, make: bytes, message: str
) -> None:
    path = tmp_path / "d.json"
    path.write_bytes(make)
    with pytest.raises(FatalWorkerError, match="DatasetUnreadable") as caught:
        load_rows(spec(str(path)))
    assert message in caught.value.message


def test_bad_parquet_unknown_builtin_and_folders_are_fatal(tmp_path: Path) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(FatalWorkerError, match="not a readable parquet file"):
        load_rows(spec(str(tmp_path / "bad.parquet")))
    with pytest.raises(FatalWorkerError, match="no built-in dataset 'nope'; built-in: arith"):
        load_rows(spec("builtin:nope"))
    with pytest.raises(FatalWorkerError, match="is not a .jsonl, .json or .parquet file"):
        load_rows(spec(str(tmp_path)))


def test_a_hub_id_that_cannot_be_reached_is_fatal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    # Read when those libraries were first imported (maybe by an earlier test): set here too, or the
    # hub's retries take half a minute before the same error.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(FatalWorkerError, match="cannot load it from the hub"):
        load_rows(spec("mortal-test/no-such-dataset"))


def test_a_hub_dataset_is_read_with_its_config_and_split(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def load_dataset(name, config=None, split=None):  # the hub cannot be reached here: record the call
        calls.append((name, config, split))
        return [{"question": "1 + 1?", "answer": "#### 2"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    model = DatasetSpec(name="openai/gsm8k", config="main", split="test", prompt_column="question")
    rows = load_rows(model)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert rows[0]["prompt"] == "1 + 1?" and rows[0]["answer"] == "#### 2"
