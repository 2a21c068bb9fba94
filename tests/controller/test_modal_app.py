"""The Modal app module's wiring, imported under a recorder of Modal's definition API (no Modal here):
the names the backend looks up, the volume at MORTAL_HOME, one store container, and the store
endpoint's WSGI app answering for real. What only a deploy can show is in backends/test_modal_live.py."""

from __future__ import annotations

import importlib
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mortal.controller.backends.modal import APP_NAME, WORKER_FUNCTION


class Recorded:
    """Whatever a definition call returns: remembers its arguments, chains, and decorates."""

    def __init__(self, kind: str, *args: Any, **kwargs: Any) -> None:
        self.kind, self.args, self.kwargs, self.calls = kind, args, kwargs, []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Recorded:
            self.calls.append((name, args, kwargs))
            return self

        return call


class RecordingApp:
    def __init__(self, name: str, **kwargs: Any) -> None:
        self.name, self.kwargs, self.functions = name, kwargs, {}

    def function(self, **options: Any) -> Any:
        def register(fn: Any) -> Any:
            raw = getattr(fn, "raw", fn)
            self.functions[options.get("name") or raw.__name__] = SimpleNamespace(
                raw=raw, options=options, web=getattr(fn, "web", None), concurrent=getattr(fn, "concurrent", None))
            return raw

        return register


def _decorator(attribute: str) -> Any:
    def factory(*args: Any, **kwargs: Any) -> Any:
        def wrap(fn: Any) -> Any:
            wrapped = SimpleNamespace(raw=getattr(fn, "raw", fn), web=getattr(fn, "web", None),
                                      concurrent=getattr(fn, "concurrent", None))
            setattr(wrapped, attribute, kwargs or True)
            return wrapped

        return wrap

    return factory


@pytest.fixture
def modal_app(monkeypatch: pytest.MonkeyPatch) -> Any:
    volumes: dict[str, Recorded] = {}
    stub = SimpleNamespace(
        App=RecordingApp,
        Image=SimpleNamespace(debian_slim=lambda **kw: Recorded("image", **kw)),
        Volume=SimpleNamespace(from_name=lambda name, **kw: volumes.setdefault(name, Recorded("volume", name, **kw))),
        Secret=SimpleNamespace(from_name=lambda name: Recorded("secret", name)),
        Period=lambda **kw: Recorded("period", **kw),
        concurrent=_decorator("concurrent"),
        wsgi_app=_decorator("web"),
    )
    monkeypatch.setitem(sys.modules, "modal", stub)
    monkeypatch.delenv("MORTAL_MODAL_APP", raising=False)
    monkeypatch.setenv("MORTAL_MODAL_SECRETS", "huggingface, wandb")
    monkeypatch.delitem(sys.modules, "mortal.controller.modal_app", raising=False)
    module = importlib.import_module("mortal.controller.modal_app")
    yield module
    sys.modules.pop("mortal.controller.modal_app", None)


def test_the_app_defines_what_the_backend_looks_up(modal_app: Any) -> None:
    app = modal_app.app
    assert app.name == APP_NAME and set(app.functions) == {WORKER_FUNCTION, "store", "controller"}
    worker = app.functions[WORKER_FUNCTION].options
    assert worker["volumes"] == {"/mortal": modal_app.data_volume} and worker["retries"] == 0
    assert "gpu" not in worker, "the GPU comes per call, from with_options(gpu=...)"
    assert [s.args[0] for s in worker["secrets"]] == ["mortal-state", "huggingface", "wandb"]
    store = app.functions["store"]
    assert store.options["max_containers"] == 1 and store.web is True and store.concurrent == {"max_inputs": 64}
    env = next(args[0] for name, args, _ in modal_app.image.calls if name == "env")
    assert env["MORTAL_HOME"] == "/mortal" and env["MORTAL_MODAL_VOLUME"] == modal_app.data_volume.args[0]
    copied = next(args for name, args, _ in modal_app.image.calls if name == "add_local_dir")
    assert (Path(copied[0]) / "controller" / "modal_app.py").is_file(), "the image is built from this checkout"


def test_the_store_endpoint_serves_the_store(modal_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORTAL_STATE_TOKEN", "tok")
    monkeypatch.setenv("MORTAL_STORE_BACKING_URL", f"sqlite:///{tmp_path / 'state.db'}")
    wsgi = modal_app.app.functions["store"].raw()
    body = json.dumps({"args": {"name": "r", "spec": {"model": {"name": "m"}}}}).encode()
    environ = {"PATH_INFO": "/v1/apply_run", "REQUEST_METHOD": "POST", "HTTP_AUTHORIZATION": "Bearer tok",
               "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body)}
    seen = []
    answer = json.loads(b"".join(wsgi(environ, lambda status, headers: seen.append(status))))
    assert seen == ["200 OK"] and answer["result"][1] == "created"
    wsgi.store.close()
