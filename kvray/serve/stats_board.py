"""The stats board: a small named actor that holds each model replica's latest engine stats,
so that one ``/metrics`` scrape (and ``kvray serve``'s throughput line) sees every replica.

Replicas publish every STATS_PERIOD_S; ingresses read the board as often. A replica whose
reports stop drops out of the snapshot after ``max_age_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

STATS_PERIOD_S = 0.5
STATS_NAMESPACE = "kvray"


def stats_board(name: str) -> Any:
    """The board actor called ``name``, started if it does not run yet."""
    import ray

    @ray.remote(num_cpus=0)
    class StatsBoard:
        """Latest engine stats of each model replica."""

        def __init__(self) -> None:
            self.stats: dict[str, tuple[float, dict]] = {}

        def report(self, replica: str, stats: dict) -> None:
            self.stats[replica] = (time.monotonic(), stats)

        def snapshot(self, max_age_s: float = 10.0) -> list[tuple[str, dict]]:
            cutoff = time.monotonic() - max_age_s  # a dead replica drops out
            return [(r, s) for r, (t, s) in self.stats.items() if t >= cutoff]

    # Restarted by Ray if its process dies (the stats refill within STATS_PERIOD_S);
    # callers also look it up again when a call fails.
    outside = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(None)
    return StatsBoard.options(name=name, namespace=STATS_NAMESPACE, get_if_exists=True,
                              lifetime="detached", max_restarts=-1,
                              scheduling_strategy=outside).remote()


async def report_stats(engine: Any, replica: str, board_name: str) -> None:
    """Publish ``engine``'s stats to the board every STATS_PERIOD_S, forever."""
    board = stats_board(board_name)
    while True:
        try:
            await board.report.remote(replica, vars(engine.stats()).copy())
        except Exception:  # the board died: look it up (or start it) again
            with contextlib.suppress(Exception):
                board = stats_board(board_name)
        await asyncio.sleep(STATS_PERIOD_S)


class StatsReader:
    """An ingress' copy of the board's snapshot, refreshed by :meth:`run`."""

    def __init__(self, board_name: str) -> None:
        self.board_name = board_name
        self.board = stats_board(board_name)
        self.latest: list[tuple[str, dict]] = []

    async def run(self) -> None:
        """Refresh :attr:`latest` every STATS_PERIOD_S, forever."""
        while True:
            try:
                self.latest = await self.board.snapshot.remote()
            except Exception:  # the board died: look it up (or start it) again
                with contextlib.suppress(Exception):
                    self.board = stats_board(self.board_name)
            await asyncio.sleep(STATS_PERIOD_S)
