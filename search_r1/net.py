"""Small networking helpers shared by the trainer, the benchmarks and the tests."""
from __future__ import annotations

# One implementation, kept in the retriever service's launcher (the service imports nothing from
# search_r1, so it cannot live here).
from retriever_server.launcher import free_port

__all__ = ["free_port"]
