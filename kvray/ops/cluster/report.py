"""What a cluster config check found: problems that fail it, notes that inform."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClusterReport:
    """What :func:`~kvray.ops.cluster.check.check_cluster` found: ``problems`` fail the check,
    ``notes`` inform."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems
