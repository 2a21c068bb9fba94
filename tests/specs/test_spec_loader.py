"""How TrainingRun documents are read: files, multi-document text, directories, and what a user sees
when a document is not right (file, line, field path as written, and a hint)."""

from __future__ import annotations

import io

import pytest

from mortal.specs import SpecError, TrainingRun, load_file, load_path, load_text

DOC = """\
apiVersion: mortal/v1
kind: TrainingRun
metadata:
  name: {name}
spec:
  model: {{name: tiny}}
  dataset: {{name: builtin:arith}}
  rewards:
    - function: my_rewards:score
"""


def doc(name: str = "demo") -> str:
    return DOC.format(name=name)


def errors_of(text: str, source: str = "run.yaml") -> list:
    with pytest.raises(SpecError) as caught:
        load_text(text, source)
    return caught.value.issues


def test_load_file_returns_typed_runs_with_snake_case_attributes(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_text(doc())
    [run] = load_file(path)
    assert isinstance(run, TrainingRun)
    assert run.name == "demo" and run.metadata.name == "demo"
    assert run.spec.algorithm.num_generations == 4 and run.spec.rewards[0].function == "my_rewards:score"


def test_unknown_key_names_file_line_and_closest_key(tmp_path):
    path = tmp_path / "quickstart.yaml"
    path.write_text(doc() + "  algorithm:\n    numGeneration: 4\n")
    with pytest.raises(SpecError) as caught:
        load_file(path)
    [issue] = caught.value.issues
    assert (issue.source, issue.line, issue.path) == (str(path), 11, "spec.algorithm.numGeneration")
    assert issue.message == "unknown field; did you mean 'numGenerations'?"
    assert (
        str(caught.value)
        == f"{path}:11: spec.algorithm.numGeneration: unknown field; did you mean 'numGenerations'?"
    )


@pytest.mark.parametrize(
    ("written", "suggested"),
    [("num_generation", "numGenerations"), ("learningrate", "learningRate"), ("maxstep", "maxSteps")],
)
def test_did_you_mean_ignores_case_and_underscores(written, suggested):
    [issue] = errors_of(doc() + f"  algorithm:\n    {written}: 4\n")
    assert issue.message == f"unknown field; did you mean {suggested!r}?"


def test_unknown_key_without_a_close_match_lists_the_valid_keys():
    [issue] = errors_of(doc() + "  checkpoint: {zzz: 1}\n")
    assert (issue.line, issue.path) == (10, "spec.checkpoint.zzz")
    assert issue.message == "unknown field; valid fields here: every, keep, uri"


def test_unknown_key_inside_a_list_item_is_found():
    [issue] = errors_of(doc() + "    - {env: llm-judge, baseUrl: http://x}\n")
    assert (issue.line, issue.path) == (10, "spec.rewards[1].baseUrl")
    assert "did you mean 'baseURL'?" in issue.message


def test_snake_case_keys_are_accepted_too():
    [run] = load_text(doc() + "  algorithm: {num_generations: 2, batch_size: 2}\n")
    assert run.spec.algorithm.num_generations == 2


def test_error_path_keeps_the_users_spelling_of_keys():
    [issue] = errors_of(doc() + "  algorithm: {num_generations: 1}\n")
    assert issue.path == "spec.algorithm.num_generations"


def test_missing_field_is_reported_at_its_parents_line():
    [issue] = errors_of(doc().replace("  model: {name: tiny}\n", "  model:\n    dtype: bfloat16\n"))
    assert (issue.line, issue.path, issue.message) == (6, "spec.model.name", "is required")


def test_missing_spec_is_reported_at_the_document_start():
    text = "---\n" + doc().split("spec:")[0]
    [issue] = errors_of(text)
    assert (issue.line, issue.path, issue.message) == (2, "spec", "is required")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(doc() + "  algorithm: {numGenerations: 4\n  rollout: {replicas: 2}\n")
    with pytest.raises(SpecError) as caught:
        load_file(path)
    [issue] = caught.value.issues
    assert issue.source == str(path) and issue.line is not None and issue.line >= 10
    assert issue.message.startswith("invalid YAML: ")


# The mistake is on the doc's line 10 (the indentation's on 12); the reader sees three of them only later.
SYNTAX_MISTAKES = {
    "a key without its colon": ("  backend local\n  actor: {}\n", "simple key"),
    "an unclosed quote": ('  backend: "local\n  actor: {}\n', "quoted scalar"),
    "an unclosed flow mapping": ("  actor: {gpu: none\n  backend: local\n", "flow mapping"),
    "a line indented one space short": ("  actor:\n    gpu: none\n   backend: local\n", None),
}


@pytest.mark.parametrize(("tail", "context"), SYNTAX_MISTAKES.values(), ids=SYNTAX_MISTAKES.keys())
def test_a_yaml_syntax_error_names_the_line_holding_the_mistake(tail, context):
    [issue] = errors_of(doc() + tail)
    if context is None:
        assert issue.line == 12 and "seen on line" not in issue.message
    else:
        assert (
            issue.line == 10 and f"(in a {context} that starts on this line; seen on line 1" in issue.message
        )


def test_duplicate_key_is_a_yaml_error_with_a_line():
    [issue] = errors_of(doc() + "  backend: local\n  backend: modal\n")
    assert issue.line in (10, 11) and "invalid YAML" in issue.message and "backend" in issue.message


def test_wrong_kind_is_one_clear_error():
    [issue] = errors_of(doc().replace("kind: TrainingRun", "kind: Deployment"))
    assert (issue.line, issue.path) == (2, "kind")
    assert (
        issue.message == "must be 'TrainingRun' (got 'Deployment'); mortal reads only TrainingRun documents"
    )


def test_wrong_api_version_is_one_clear_error():
    [issue] = errors_of(doc().replace("mortal/v1", "apps/v1"))
    assert (issue.line, issue.path, issue.message) == (1, "apiVersion", "must be 'mortal/v1' (got 'apps/v1')")


def test_missing_kind_says_what_to_add():
    [issue] = errors_of(doc().replace("kind: TrainingRun\n", ""))
    assert issue.path == "kind" and issue.message == "is required: add 'kind: TrainingRun'"


def test_a_document_that_is_not_a_mapping_is_refused():
    [issue] = errors_of("- a\n- b\n")
    assert "must be a mapping with apiVersion, kind, metadata and spec (got a list)" in issue.message


def test_wrong_type_errors_say_what_was_given():
    [issue] = errors_of(doc() + "  rollout: 3\n")
    assert (issue.line, issue.path) == (10, "spec.rollout")
    assert issue.message == "must be a mapping of key: value (got 3)"


@pytest.mark.parametrize(
    "block, path",
    [
        ("  algorithm: {maxSteps: true}\n", "spec.algorithm.maxSteps"),
        ("  generation: {temperature: false}\n", "spec.generation.temperature"),
        ("  rollout: {replicas: false}\n", "spec.rollout.replicas"),
    ],
)
def test_true_or_false_where_a_number_goes_is_refused_not_read_as_one_or_zero(block, path):
    [issue] = errors_of(doc() + block)
    assert (issue.line, issue.path) == (10, path)
    assert issue.message == "must be a number, not true or false"


def test_annotations_past_their_size_limit_are_refused_at_their_line():
    from mortal.specs.metadata import MAX_ANNOTATIONS_BYTES

    note = "x" * MAX_ANNOTATIONS_BYTES
    [issue] = errors_of(doc().replace("  name: demo\n", f"  name: demo\n  annotations: {{note: {note}}}\n"))
    assert (issue.line, issue.path) == (5, "metadata.annotations")
    assert issue.message.endswith(f"over the limit of {MAX_ANNOTATIONS_BYTES} (keys and values)")


def test_label_values_must_be_strings_and_the_hint_says_quote_them():
    [issue] = errors_of(doc().replace("  name: demo\n", "  name: demo\n  labels: {version: 2}\n"))
    assert (issue.line, issue.path) == (5, "metadata.labels.version")
    assert issue.message == 'must be a string (got 2); quote it: "2"'


def test_multi_document_file_yields_every_run_in_order():
    runs = load_text(doc("one") + "---\n" + doc("two") + "---\n")
    assert [r.name for r in runs] == ["one", "two"]


def test_errors_in_the_second_document_carry_that_documents_line():
    first_lines = doc("one").count("\n") + 1  # plus the '---' line
    [issue] = errors_of(doc("one") + "---\n" + doc("two") + "  checkpoint: {every: 0}\n")
    assert (issue.line, issue.path) == (first_lines + 10, "spec.checkpoint.every")


def test_errors_of_all_documents_are_reported_together():
    issues = errors_of(doc("One") + "---\n" + doc("two").replace("TrainingRun", "Job"))
    assert [i.path for i in issues] == ["metadata.name", "kind"]


def test_a_run_name_twice_is_an_error_naming_both_places():
    [issue] = errors_of(doc() + "---\n" + doc())
    assert (issue.line, issue.path) == (14, "metadata.name")
    assert issue.message == "run 'demo' is defined twice (first at run.yaml:4)"


def test_empty_documents_and_empty_text_give_no_runs():
    assert load_text("") == []
    assert [r.name for r in load_text("---\n# nothing\n---\n" + doc())] == ["demo"]


def test_load_path_reads_every_yaml_file_of_a_directory_sorted(tmp_path):
    (tmp_path / "b.yml").write_text(doc("bee"))
    (tmp_path / "a.yaml").write_text(doc("ay") + "---\n" + doc("ay-two"))
    (tmp_path / "notes.txt").write_text("not yaml: [")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.yaml").write_text(doc("sea"))
    assert [r.name for r in load_path(tmp_path)] == ["ay", "ay-two", "bee"]
    assert [r.name for r in load_path(tmp_path, recursive=True)] == ["ay", "ay-two", "bee", "sea"]


def test_load_path_of_a_directory_reports_all_files_problems_at_once(tmp_path):
    (tmp_path / "a.yaml").write_text(doc("a").replace("mortal/v1", "v1"))
    (tmp_path / "b.yaml").write_text(doc("b") + "  suspend: perhaps\n")
    (tmp_path / "c.yaml").write_text(doc("a"))
    with pytest.raises(SpecError) as caught:
        load_path(tmp_path)
    assert [(i.source.rsplit("/", 1)[-1], i.line) for i in caught.value.issues] == [
        ("a.yaml", 1),
        ("b.yaml", 10),
    ]


def test_the_same_name_in_two_files_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text(doc("same"))
    (tmp_path / "b.yaml").write_text(doc("same"))
    with pytest.raises(
        SpecError, match=r"b.yaml:4: metadata.name: run 'same' is defined twice \(first at .*a.yaml:4\)"
    ):
        load_path(tmp_path)


def test_load_path_of_a_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="no such file or directory"):
        load_path(tmp_path / "nope.yaml")


def test_load_path_of_an_empty_directory_is_no_runs(tmp_path):
    assert load_path(tmp_path) == []


def test_load_path_dash_reads_standard_input(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(doc("piped")))
    assert [r.name for r in load_path("-")] == ["piped"]


def test_json_text_is_read_too():
    text = (
        '{"apiVersion": "mortal/v1", "kind": "TrainingRun", "metadata": {"name": "j"}, "spec": '
        '{"model": {"name": "m"}, "dataset": {"name": "d"}, "rewards": [{"env": "math-answer"}]}}'
    )
    assert load_text(text)[0].spec.rewards[0].env == "math-answer"


def test_a_training_run_list_yields_its_items_and_locates_their_errors():
    text = (
        "apiVersion: mortal/v1\nkind: TrainingRunList\nitems:\n"
        "  - apiVersion: mortal/v1\n    kind: TrainingRun\n    metadata: {name: x}\n"
        "    spec: {model: {name: m}, dataset: {name: d}, rewards: [{env: math-answer}]}\n"
        "  - apiVersion: mortal/v1\n    kind: TrainingRun\n    metadata: {name: 'Y'}\n"
        "    spec: {model: {name: m}, dataset: {name: d}, rewards: [{env: math-answer}]}\n"
    )
    [issue] = errors_of(text)
    assert (issue.line, issue.path) == (10, "items[1].metadata.name")


def test_yaml_anchors_and_merge_keys_work():
    text = doc() + "  generation: &g {maxTokens: 8}\n"
    assert load_text(text)[0].spec.generation.max_tokens == 8


def test_generation_max_num_seqs_is_a_positive_count_named_at_its_line():
    assert (
        load_text(doc() + "  generation: {maxNumSeqs: 64}\n", "run.yaml")[0].spec.generation.max_num_seqs
        == 64
    )
    [issue] = errors_of(doc() + "  generation: {maxNumSeqs: 0}\n")
    assert (issue.line, issue.path) == (10, "spec.generation.maxNumSeqs")


def test_a_field_a_later_check_names_finds_its_line_or_its_nearest_parents(tmp_path):
    """Admission names fields ('spec.rewards[1].function') after loading; the file read again gives their
    lines, and a field the file does not spell out (a default) the line of the nearest enclosing one."""
    from mortal.specs.diagnostics import dotted, line_of, undotted
    from mortal.specs.loader import field_lines

    path = tmp_path / "run.yaml"
    path.write_text(
        "apiVersion: mortal/v1\nkind: TrainingRun\nmetadata:\n  name: other\nspec: {model: {name: x}}\n---\n"
        "apiVersion: mortal/v1\nkind: TrainingRun\nmetadata:\n  name: mine\nspec:\n  model:\n    name: m\n"
        "  rewards:\n    - function: a:b\n    - function: c:d\n"
    )
    lines = field_lines(str(path), "mine")
    assert line_of(undotted("spec.rewards[1].function"), lines) == 16
    assert line_of(undotted("spec.rewards[1].weight"), lines) == 16  # not written: its item's line
    assert line_of(undotted("spec.dataset.path"), lines) == 11  # no dataset: the spec's line
    assert field_lines(str(path), "absent") == {} and field_lines(str(tmp_path / "gone.yaml"), "mine") == {}
    assert dotted(undotted("spec.rewards[12].args.x[3]")) == "spec.rewards[12].args.x[3]"
