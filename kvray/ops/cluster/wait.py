"""``kvray cluster wait-gpus N``: wait on a live Ray cluster until its GPUs have joined.

The cluster configs' head commands run it before ``kvray serve``, which picks GPU or CPU
workers from the GPUs it finds when it starts.
"""

from __future__ import annotations

import time


def wait_for_gpus(count: int, timeout_s: float, address: str = "auto",
                  poll_s: float = 5.0) -> bool:
    """Wait until the Ray cluster at ``address`` has ``count`` GPUs; False on timeout."""
    import ray  # here, not at the top: the offline check must not need a Ray runtime

    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            have = ray.cluster_resources().get("GPU", 0)
            if have >= count:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
    finally:
        ray.shutdown()
