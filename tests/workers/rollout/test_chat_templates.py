"""spec.rollout.chatTemplate (mortal.workers.rollout.chat_templates): one reading for apply and worker."""

from __future__ import annotations

import pytest

from mortal.workers.rollout.chat_templates import UnknownChatTemplate, template_file, trl_template_names


def test_a_trl_name_leads_to_trls_template() -> None:
    assert "qwen2_5" in trl_template_names()
    path = template_file("qwen2_5")
    assert path.name == "qwen2_5.jinja" and path.is_file()


def test_a_jinja_name_is_the_users_file_with_home_expanded(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine.jinja").write_text("{{ messages }}")
    assert template_file("~/mine.jinja") == tmp_path / "mine.jinja"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("missing.jinja", "'missing.jinja': no such file"),
        ("nosuch", "neither a .jinja file nor a TRL template"),
    ],
)
def test_a_name_that_leads_nowhere_is_refused_with_what_exists(name: str, says: str) -> None:
    with pytest.raises(UnknownChatTemplate, match=says) as refused:
        template_file(name)
    if not name.endswith(".jinja"):
        assert "qwen2_5" in str(refused.value), "the refusal lists TRL's templates"
