"""The YAML reader's limits (mortal.specs.parse_limits): alias uses, what they repeat, nesting depth,
values and comment lengths.

Each is refused while the text is composed, before an alias is expanded, as a SpecError naming the
file, the line and the limit; specs with a few legitimate aliases and merge keys still load, and so
does a text just under each limit.
"""

from __future__ import annotations

import io

import pytest
from hostile_yaml import FAST_SECONDS, SMALL_BYTES, billion_laughs, bounded, deep_json
from test_spec_loader import DOC

from mortal.specs import SpecError, load_file, load_path, load_text
from mortal.specs.fork import load_fragment, parse_set
from mortal.specs.parse_limits import (
    MAX_ALIASED_SIZE,
    MAX_ALIASES,
    MAX_COMMENT_CHARS,
    MAX_DEPTH,
    MAX_DOCUMENTS,
    MAX_NODES,
    MAX_TEXT_CHARS,
    load_documents,
)

RUN = DOC  # a valid run, as the loader's own tests write it


def refused_fast(call) -> SpecError:
    outcome, seconds, peak = bounded(call)
    assert isinstance(outcome, SpecError), outcome
    assert seconds < FAST_SECONDS and peak < SMALL_BYTES, (seconds, peak)
    return outcome


def test_a_billion_laughs_text_is_refused_fast_naming_the_line_and_the_limit():
    [issue] = refused_fast(lambda: load_text(billion_laughs(), "lol.yaml")).issues
    assert issue.source == "lol.yaml" and issue.line is not None and 6 <= issue.line <= 14
    assert "MAX_ALIASED_SIZE" in issue.message or "MAX_ALIASES" in issue.message


def test_more_alias_uses_than_the_limit_are_refused_even_when_each_is_small():
    text = RUN.format(name="many") + "  x: &x 1\n  uses: [" + ", ".join(["*x"] * (MAX_ALIASES + 1)) + "]\n"
    [issue] = refused_fast(lambda: load_text(text, "many.yaml")).issues
    assert (issue.source, issue.line) == ("many.yaml", 11)
    assert f"more than {MAX_ALIASES} alias uses" in issue.message and "(MAX_ALIASES)" in issue.message


def test_aliases_repeating_a_long_string_are_refused_by_size():
    long = "a" * (MAX_ALIASED_SIZE // 4)
    text = RUN.format(name="long") + f"  x: &x {long}\n  uses: [*x, *x, *x, *x, *x]\n"
    [issue] = refused_fast(lambda: load_text(text, "long.yaml")).issues
    assert "(MAX_ALIASED_SIZE)" in issue.message and issue.line == 11


def test_an_alias_inside_its_own_anchor_is_refused():
    [issue] = refused_fast(lambda: load_text(RUN.format(name="cycle") + "  x: &x [1, *x]\n", "c.yaml")).issues
    assert "cycle" in issue.message and issue.line == 10


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 100_000])
def test_json_nested_deeper_than_the_limit_is_refused(levels):
    [issue] = refused_fast(lambda: load_text(deep_json(levels), "deep.json")).issues
    assert (issue.source, issue.line) == ("deep.json", 1)
    assert issue.message == f"nested deeper than {MAX_DEPTH} levels (MAX_DEPTH)"


def test_block_yaml_nested_deeper_than_the_limit_is_refused_at_its_line():
    nested = "".join("  " * (i + 1) + f"k{i}:\n" for i in range(MAX_DEPTH))
    nested += "  " * (MAX_DEPTH + 1) + "v: 1\n"
    [issue] = refused_fast(lambda: load_text(RUN.format(name="deep") + "  deep:\n" + nested, "d.yaml")).issues
    assert "(MAX_DEPTH)" in issue.message and issue.line is not None and issue.line > 10


def test_a_spec_with_legitimate_anchors_and_merge_keys_still_loads():
    metadata = "  name: merged\n  labels: &team {team: rl}\n  annotations: {<<: *team, owner: me}\n"
    text = RUN.format(name="merged").replace("  name: merged\n", metadata)
    [run] = load_text(text + "  generation: &gen {maxTokens: 8}\n")
    assert (run.metadata.labels, run.metadata.annotations) == ({"team": "rl"}, {"team": "rl", "owner": "me"})
    assert run.spec.generation.max_tokens == 8


def test_the_limits_count_every_document_of_a_text_together():
    one = RUN.format(name="{}") + "  x: &x 1\n  uses: [" + ", ".join(["*x"] * (MAX_ALIASES // 2)) + "]\n"
    text = "---\n".join(one.replace("{}", name) for name in ("a", "b", "c"))
    [issue] = refused_fast(lambda: load_text(text, "three.yaml")).issues
    assert "(MAX_ALIASES)" in issue.message


def test_load_file_and_load_path_refuse_a_billion_laughs_file(tmp_path):
    path = tmp_path / "lol.yaml"
    path.write_text(billion_laughs())
    (tmp_path / "fine.yaml").write_text(RUN.format(name="fine"))
    assert refused_fast(lambda: load_file(path)).issues[0].source == str(path)
    [issue] = refused_fast(lambda: load_path(tmp_path)).issues
    assert issue.source == str(path)


def test_standard_input_is_held_to_the_same_limits(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(billion_laughs()))
    assert refused_fast(lambda: load_path("-")).issues[0].source == "<stdin>"


def test_fork_fragments_and_set_values_are_held_to_the_same_limits():
    fragment = billion_laughs().split("spec:\n", 1)[1]
    [issue] = refused_fast(lambda: load_fragment("spec:\n" + fragment, "over.yaml")).issues
    assert issue.source == "over.yaml"
    laughs = "[" + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)) + "]"
    value = "[&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol], " + laughs[1:]
    error = refused_fast(lambda: parse_set(f"spec.model.name={value}"))
    assert "MAX_" in str(error)
    assert parse_set("spec.algorithm.learningRate=1e-6")[1] == 1e-6


def test_a_text_past_the_size_limit_is_refused_without_reading_the_file_whole(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(RUN + "# " + "x" * MAX_TEXT_CHARS + "\n")
    [issue] = refused_fast(lambda: load_file(big)).issues
    assert issue.source == str(big) and "MAX_TEXT_CHARS" in issue.message


def test_more_documents_than_the_limit_are_refused_naming_it():
    [issue] = refused_fast(lambda: load_text("---\n{}\n" * (MAX_DOCUMENTS + 1), "many.yaml")).issues
    assert issue.source == "many.yaml" and "MAX_DOCUMENTS" in issue.message


def test_hundreds_of_unknown_keys_list_the_first_problems_and_count_the_rest():
    """At most SHOWN_ISSUES problems a document, in document order, then one line that counts the others."""
    from mortal.specs.diagnostics import SHOWN_ISSUES

    keys = ", ".join(f"k{i}: {i}" for i in range(300))
    text = f"apiVersion: mortal/v1\nkind: TrainingRun\nmetadata: {{name: mk}}\nspec: {{{keys}}}\n"
    with pytest.raises(SpecError) as refused:
        load_text(text, "keys.yaml")
    issues = refused.value.issues
    assert len(issues) == SHOWN_ISSUES + 1
    assert any(i.path == "spec.k0" and "unknown field" in i.message for i in issues)
    left_out = int(issues[-1].message.split()[1])
    assert issues[-1].message == f"and {left_out} more problems not shown" and left_out >= 300 - SHOWN_ISSUES


def flow_list(values: int) -> str:
    """One list holding values - 1 scalars: `values` values in all, on one line."""
    return "[" + ",".join(["1"] * (values - 1)) + "]\n"


def test_a_text_of_more_values_than_the_limit_is_refused_naming_the_file_line_and_limit(tmp_path):
    path = tmp_path / "wide.yaml"
    path.write_text(flow_list(MAX_NODES + 1))
    with pytest.raises(SpecError) as refused:
        load_file(path)
    [issue] = refused.value.issues
    assert (issue.source, issue.line) == (str(path), 1)
    assert f"more than {MAX_NODES} values" in issue.message and issue.message.endswith("(MAX_NODES)")


def test_a_text_of_as_many_values_as_the_limit_still_loads():
    [values] = load_documents(flow_list(MAX_NODES), "wide.yaml")
    assert len(values) == MAX_NODES - 1


def test_the_values_of_every_document_of_a_text_count_together():
    half = flow_list(MAX_NODES // 2 + 1)
    with pytest.raises(SpecError) as refused:
        load_documents(half + "---\n" + half, "two.yaml")
    [issue] = refused.value.issues
    assert (issue.source, issue.line) == ("two.yaml", 3) and "(MAX_NODES)" in issue.message


def test_a_comment_longer_than_the_limit_is_refused_at_its_line(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(RUN.format(name="long") + "  # " + "x" * MAX_COMMENT_CHARS + "\n")
    with pytest.raises(SpecError) as refused:
        load_file(path)
    [issue] = refused.value.issues
    assert (issue.source, issue.line) == (str(path), RUN.count("\n") + 1)
    assert issue.message == f"a comment longer than {MAX_COMMENT_CHARS} characters (MAX_COMMENT_CHARS)"


def test_a_comment_as_long_as_the_limit_still_loads():
    [run] = load_text(RUN.format(name="long") + "#" + "x" * (MAX_COMMENT_CHARS - 1) + "\n", "long.yaml")
    assert run.name == "long"
