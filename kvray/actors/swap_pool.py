"""CPU pool for preempted requests' KV blocks, in the Ray object store when Ray runs here.

Each worker saves its own shard: one object per swapped request per step batch, holding every
local layer's copy of the request's blocks. Objects are released as soon as they are restored
or the request ends, so nothing outlives its request.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

# numpy has no bf16 nor fp8: blocks travel as raw bits (a quantized cache's codes and scales
# together, see kvray.kernels.kv_quant).
_AS_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
           torch.int8: torch.int8, torch.float8_e4m3fn: torch.uint8,
           torch.float8_e5m2: torch.uint8}


logger = logging.getLogger(__name__)


class SwapPool:
    """A save that cannot be stored (object store and its spill disk full) or a restore
    that cannot be read (object lost) is not an error of the step: the request is reported
    in :meth:`take_failed` and the scheduler has it recompute instead."""

    def __init__(self) -> None:
        self._objects: dict[str, object] = {}  # req id -> ObjectRef (or array without Ray)
        self._failed: set[str] = set()

    def take_failed(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def __len__(self) -> int:
        return len(self._objects)

    @staticmethod
    def _ray():
        try:
            import ray
        except ImportError:
            return None
        return ray if ray.is_initialized() else None

    def save(self, req_id: str, kv_caches: list[torch.Tensor | None],
             block_ids: list[int]) -> None:
        """Copy ``block_ids`` of every local layer into one CPU object."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=_device(kv_caches))
        local = [c.view(_AS_INT[c.dtype]) for c in kv_caches if c is not None]
        # raw bits (numpy arrays are zero-copy in the object store)
        arr = torch.stack([c.index_select(2, idx) for c in local]).cpu().numpy()
        ray = self._ray()
        try:
            self._objects[req_id] = ray.put(arr) if ray is not None else arr.copy()
        except Exception as err:  # e.g. OutOfDiskError / ObjectStoreFullError
            logger.warning("swap-out of %s failed (%s); it will recompute", req_id,
                           err.__class__.__name__)
            self._failed.add(req_id)

    def restore(self, req_id: str, kv_caches: list[torch.Tensor | None],
                block_ids: list[int]) -> None:
        """Copy the saved blocks into ``block_ids`` (same count) and release the object."""
        obj = self._objects.pop(req_id, None)
        ray = self._ray()
        try:
            if obj is None:
                raise KeyError("never saved")
            arr = ray.get(obj) if ray is not None and not isinstance(obj, np.ndarray) else obj
        except Exception as err:  # the save failed, or the object was lost
            logger.warning("swap-in of %s failed (%s); it will recompute", req_id,
                           err.__class__.__name__)
            self._failed.add(req_id)
            return
        local = [c.view(_AS_INT[c.dtype]) for c in kv_caches if c is not None]
        data = torch.from_numpy(np.array(arr)).to(local[0].device)
        assert data.shape[3] == len(block_ids), "restored block count differs from saved"
        idx = torch.tensor(block_ids, dtype=torch.int64, device=local[0].device)
        for layer, cache in enumerate(local):
            cache.index_copy_(2, idx, data[layer])

    def drop(self, req_id: str) -> None:
        self._objects.pop(req_id, None)

    # ---- the KV tier (kvray.scheduler.kv_tier): one object per block, kept by the tier ----
    def copy_out(self, kv_caches: list[torch.Tensor | None],
                 blocks: list[tuple[int, int]]) -> dict[int, list[tuple[object, int]]]:
        """Each evicted block (id, key) of every local layer as one object: key ->
        [(handle, nbytes)] (this worker's share). A block that cannot be stored is left
        out (it is simply not in the tier)."""
        if not blocks:
            return {}
        local = [c.view(_AS_INT[c.dtype]) for c in kv_caches if c is not None]
        idx = torch.tensor([b for b, _ in blocks], dtype=torch.int64, device=local[0].device)
        data = torch.stack([c.index_select(2, idx) for c in local]).cpu().numpy()
        ray = self._ray()
        out = {}
        for i, (_, key) in enumerate(blocks):
            arr = np.ascontiguousarray(data[:, :, :, i])
            try:
                out[key] = [(ray.put(arr) if ray is not None else arr, arr.nbytes)]
            except Exception as err:  # the object store is full: that block is not kept
                logger.warning("KV tier: could not store a block (%s)", err.__class__.__name__)
        return out

    def copy_in(self, req_id: str, kv_caches: list[torch.Tensor | None],
                blocks: list[tuple[int, list]], rank: int) -> None:
        """Fill each block id from its tier copy (this worker's, ``handles[rank]``); a copy
        that cannot be read (its owner is gone, the object lost) fails the request's fetch:
        it is reported in :meth:`take_failed` and the scheduler has it recompute."""
        ray = self._ray()
        try:
            handles = [handles[rank] for _, handles in blocks]
            arrays = ray.get(handles) if ray is not None and handles and \
                not isinstance(handles[0], np.ndarray) else handles
        except Exception as err:
            logger.warning("KV tier: fetch for %s failed (%s); it will recompute", req_id,
                           err.__class__.__name__)
            self._failed.add(req_id)
            return
        local = [c.view(_AS_INT[c.dtype]) for c in kv_caches if c is not None]
        data = torch.from_numpy(np.stack([np.asarray(a) for a in arrays], axis=3)).to(
            local[0].device)
        idx = torch.tensor([b for b, _ in blocks], dtype=torch.int64, device=local[0].device)
        for layer, cache in enumerate(local):
            cache.index_copy_(2, idx, data[layer])


def _device(kv_caches: list[torch.Tensor | None]) -> torch.device:
    return next(c for c in kv_caches if c is not None).device
