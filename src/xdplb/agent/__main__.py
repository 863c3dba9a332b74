"""``python -m xdplb.agent``: the agent's command line.

::

    python -m xdplb.agent --name 198.18.0.11 --to 198.18.0.2:19700 --interval 1 \\
        [--host-instance host]

``--name`` is the backend's address as the LB's configuration writes it: load feedback
and drains find the backend by it. Exit codes: 0 stopped by SIGINT/SIGTERM, 1 runtime
failure, 2 usage.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from xdplb.agent.run import run_agent

log = logging.getLogger("xdplb.agent")  # the agent's one logger, whichever module logs

DEFAULT_PORT = 19700

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


def parse_target(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; the port defaults to 19700 when left out."""
    host, port = text, str(DEFAULT_PORT)
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"--to: expected [address]:port, got {text!r}")
        port = rest[1:] or port
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--to: expected host:port, got {text!r}")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m xdplb.agent", description="Report this backend's load to xdplb."
    )
    parser.add_argument("--name", required=True, help="backend identity, as the LB names it")
    parser.add_argument("--to", required=True, help="controller address, host:port")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between reports (e.g. 1, or 0.2)"
    )
    parser.add_argument(
        "--host-instance",
        default="host",
        help="host_tc instance whose counters to report, when pinned (default: host)",
    )
    parser.add_argument(
        "--steer-instance",
        default=None,
        help="keep this instance's sk_lookup steering (xdplb host steer) on live sockets: "
        "a restarted server's new socket takes its rules (default: not followed)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        target = parse_target(args.to)
    except ValueError as e:
        parser.error(str(e))  # exits 2

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sent = run_agent(
            args.name,
            target,
            args.interval,
            stop,
            host_instance=args.host_instance,
            steer_instance=args.steer_instance,
        )
    except ValueError as e:
        print(f"xdplb.agent: {e}", file=sys.stderr)
        return EXIT_USAGE if str(e).startswith(("backend:", "interval:")) else EXIT_RUNTIME
    except OSError as e:
        print(f"xdplb.agent: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("stopped after %d reports", sent)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
