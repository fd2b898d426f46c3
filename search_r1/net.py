"""Small networking helpers shared by the trainer, the benchmarks and the tests."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it; a race with other binders is
    possible but harmless for loopback test and run-local servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
