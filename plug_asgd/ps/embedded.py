"""The PS as a process of its own: the command rank 0 starts for the embedded PS, and its entry point.

The command carries the whole :class:`~plug_asgd.ps.config.PSConfig` as one JSON argument
(``--config``) and runs the parent's own plug_asgd (its folder first on ``sys.path``); ``import
plug_asgd`` imports neither torch nor Lightning, so the PS starts fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.disk import raise_fd_limit
from plug_asgd.ps.server import ParameterServer
from plug_asgd.ps.standby_join import standby_config

_RUN_MAIN = "import sys; sys.path.insert(0, {path!r}); from plug_asgd.ps.embedded import main; sys.exit(main())"


def serve(config: PSConfig) -> int:
    """Run a parameter server in this process until it ends; SIGINT and SIGTERM stop it cleanly.

    Args:
        config: the server's options; a standby's (``standby_of``) take the primary's mode and options.

    Raises:
        OSError: where a standby's primary does not answer or refuses it (and where the PS cannot listen).
    """
    raise_fd_limit()  # an idle connection holds a file descriptor: leave room for the checkpoints
    if config.standby_of is not None:
        config = standby_config(config)
    server = ParameterServer(config)
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    code = server.serve_forever()
    return 2 if server.join_failed else code


def embedded_command(config: PSConfig) -> list[str]:
    """The command that runs a PS with ``config`` in a fresh interpreter, as rank 0 starts the embedded one.

    Args:
        config: the options the PS is to run with (passed whole as ``--config`` JSON).
    """
    parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [sys.executable, "-c", _RUN_MAIN.format(path=parent), "--config", config.to_json()]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the embedded PS process (see :func:`embedded_command`); 2 for a refused config.

    Args:
        argv: the command-line arguments; None: ``sys.argv[1:]``.
    """
    parser = argparse.ArgumentParser(description="plug_asgd parameter server (embedded)")
    parser.add_argument("--config", required=True, help="a PSConfig as JSON (PSConfig.to_json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("PLUG_ASGD_LOG", "WARNING"), stream=sys.stderr,
                        format="[plug_asgd PS %(asctime)s] %(message)s")
    try:
        return serve(PSConfig.from_json(args.config))
    except (OSError, ValueError) as exc:
        print(f"plug_asgd parameter server: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
