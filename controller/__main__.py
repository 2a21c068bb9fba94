"""`python -m mortal.controller [--watch DIR] [--state-url URL] [--idle-exit SECONDS]`: a controller.

What `mortalctl apply` starts in the background (with --idle-exit) and what `mortalctl controller`
runs in the foreground. Logs go to stderr (the background controller's go to $MORTAL_HOME/controller.log).
"""

from __future__ import annotations

import argparse
import logging

from mortal.controller.manager import run_controller


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mortal.controller", description=__doc__.splitlines()[0])
    parser.add_argument("--state-url", default=None, help="store URL (default: $MORTAL_STATE_URL or SQLite)")
    parser.add_argument("--watch", default=None, metavar="DIR", help="apply the specs of DIR on every change")
    parser.add_argument(
        "--idle-exit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="exit after this long with no active run and no live worker",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    run_controller(state_url=args.state_url, watch=args.watch, idle_exit_seconds=args.idle_exit)


if __name__ == "__main__":
    main()
