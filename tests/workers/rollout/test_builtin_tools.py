"""The built-in tools' old path (`mortal.workers.builtin_tools`, named by specs written before the move)
still loads, with a DeprecationWarning, and gives the very objects of mortal.workers.rollout.builtin_tools."""

from __future__ import annotations

import importlib
import sys

import pytest

from mortal.workers.rollout import builtin_tools


def test_the_old_path_warns_and_re_exports_the_same_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mortal.workers.builtin_tools", raising=False)
    with pytest.warns(DeprecationWarning, match="mortal.workers.rollout.builtin_tools"):
        old = importlib.import_module("mortal.workers.builtin_tools")
    for name in ("calculator", "ArithEnvironment", "CodeAgentEnvironment"):
        assert getattr(old, name) is getattr(builtin_tools, name)
