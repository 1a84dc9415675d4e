"""Where a replica's worker actors go: one placement-group bundle per rank.

No torch, no Ray: the engine (:mod:`kvray.actors.ray_executor`) and the Serve deployment
(:mod:`kvray.serve.app`) build the same bundles from the config.
"""

from __future__ import annotations

from kvray.config import EngineConfig

# A pinned bundle asks this much of its node's resource: any number of ranks fit on one node.
PIN_AMOUNT = 0.001


def node_resource(pin: str) -> str:
    """The Ray resource that only the node ``pin`` names has: ``node:<ip>`` for an IP
    address (Ray gives every node one), else ``pin`` itself (a custom resource)."""
    import ipaddress

    try:
        return f"node:{ipaddress.ip_address(pin)}"
    except ValueError:
        return pin


def worker_bundles(config: EngineConfig, use_gpu: bool) -> list[dict[str, float]]:
    """One placement-group bundle per rank (``rank = pp_rank * tp + tp_rank``): a CPU, a
    GPU on GPU clusters, and the pinned node's resource when ``pipeline_stage_nodes`` is
    set."""
    par = config.parallel
    bundles = []
    for rank in range(par.world_size):
        bundle: dict[str, float] = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        if par.pipeline_stage_nodes is not None:
            pin = par.pipeline_stage_nodes[rank // par.tensor_parallel_size]
            bundle[node_resource(pin)] = PIN_AMOUNT
        bundles.append(bundle)
    return bundles
