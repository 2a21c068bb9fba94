"""The real `modal` library, offline: what it builds from mortal's app module, and a Modal API that refuses.

    describe()                 the app as the library built it (names, Function.info() of each function)
    python modal_offline.py    prints describe() as JSON, for whichever install the interpreter imports
                               mortal from (the editable checkout, or a built wheel first on PYTHONPATH)
    with RefusingModalAPI() as url:   a local gRPC server of Modal's API (modal_proto's own service
                               definition) answering every call UNAUTHENTICATED: `modal deploy` pointed
                               at it (MODAL_SERVER_URL) gets as far as a real deploy without a token

No network and no token: nothing here reaches Modal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

APP_MODULE = "mortal.client.modal_app"
REFUSAL = "token refused by the test's Modal API"


def describe(module: Any = None) -> dict[str, Any]:
    """The deployed names and each function's FunctionInfo, as the modal library reports them."""
    module = module or importlib.import_module(APP_MODULE)
    with warnings.catch_warnings():
        # Deprecated for modal 1.7 and still the only public map from the names `Function.from_name` looks up
        warnings.simplefilter("ignore")
        functions = dict(module.app.registered_functions)
    return {
        "file": module.__file__,
        "app": module.app.name,
        "functions": {name: dataclasses.asdict(fn.info()) for name, fn in functions.items()},
    }


@contextmanager
def RefusingModalAPI() -> Iterator[str]:  # noqa: N802 - reads as the server it is
    """A Modal API server on 127.0.0.1 that refuses every call as an unknown token would; its URL."""
    import grpclib.server
    from grpclib import GRPCError, Status
    from modal_proto import api_grpc

    def refuse(name: str) -> Any:
        async def handler(self: Any, stream: Any) -> None:
            self.calls.append(name)
            await stream.recv_message()
            raise GRPCError(Status.UNAUTHENTICATED, REFUSAL)

        return handler

    methods = {name: refuse(name) for name in api_grpc.ModalClientBase.__abstractmethods__}
    servicer = type("RefusingServicer", (api_grpc.ModalClientBase,), methods)()
    servicer.calls = []
    started, bound = threading.Event(), {}

    async def serve() -> None:  # grpclib's server belongs to the loop it is made in
        server = grpclib.server.Server([servicer])
        await server.start("127.0.0.1", 0)
        bound.update(
            port=server._server.sockets[0].getsockname()[1],
            stop=asyncio.Event(),
            loop=asyncio.get_running_loop(),
        )
        started.set()
        await bound["stop"].wait()
        server.close()
        await server.wait_closed()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="refusing-modal-api", daemon=True)
    thread.start()
    started.wait(30)
    try:
        yield f"http://127.0.0.1:{bound['port']}"
    finally:
        bound["loop"].call_soon_threadsafe(bound["stop"].set)
        thread.join(10)


if __name__ == "__main__":
    print(json.dumps(describe(), default=str))
