"""``lockmgr-bench``: lockmgr against threading.Lock and friends, side by side in one run
(``python -m lockmgr.bench``; ``_cli`` reads the command line).

The package, by concern: ``_measure`` (settings, results, timing), ``_threads`` and
``_asyncio`` (the scenarios and their subjects), ``_servers`` (lock servers in processes of
their own; their workers are the modules ``pg_worker`` and ``server_worker``, run with
``python -m``), ``_distributed`` and ``_distributed_workers`` (``--scenario distributed``),
``_output`` (the table, the pictures, the contention report), ``_cli``.

This module imports nothing of them, so that a worker started with ``python -m
lockmgr.bench.<worker>`` imports only what it needs.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The command line (the ``lockmgr-bench`` script): see ``_cli.main``."""
    from ._cli import main as cli_main

    return cli_main(argv)
