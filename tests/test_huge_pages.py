"""Large CPU tensors on transparent huge pages: the arena, the KV cache, the model's weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvray.actors.cache_engine import CacheEngine
from kvray.kernels import huge_pages
from kvray.kernels.huge_pages import (
    HUGE_PAGE,
    HugePageArena,
    move_to_huge_pages,
    transparent_huge_pages,
    zeros_on_huge_pages,
)
from tests.helpers.skips import NOT_THIS_HARDWARE

pytestmark = pytest.mark.unit

THP = transparent_huge_pages() in ("always", "madvise")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` in this process (KiB)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_arena_hands_out_aligned_tensors_front_to_back_and_refuses_past_its_end():
    arena = HugePageArena(3 * HUGE_PAGE)
    assert arena.buffer.data_ptr() % HUGE_PAGE == 0
    assert arena.capacity == 3 * HUGE_PAGE
    a = arena.take((5,), torch.float32)
    b = arena.take((3, 7), torch.bfloat16)
    assert a.data_ptr() == arena.buffer.data_ptr()
    assert b.data_ptr() % 64 == 0 and b.data_ptr() >= a.data_ptr() + 20
    assert b.shape == (3, 7) and b.dtype == torch.bfloat16 and b.is_contiguous()
    with pytest.raises(ValueError, match="bytes left"):
        arena.take((3 * HUGE_PAGE,), torch.uint8)


@pytest.mark.skipif(not THP, reason=f"{NOT_THIS_HARDWARE}: THP off (never, or no sysfs)")
def test_arena_memory_is_backed_by_huge_pages_once_written():
    arena = HugePageArena(8 * HUGE_PAGE)
    assert arena.advised
    arena.take((8 * HUGE_PAGE // 4,), torch.float32).fill_(1.0)
    assert _anon_huge_kib(arena.buffer.data_ptr()) >= HUGE_PAGE // 1024


def test_zeros_on_huge_pages_are_zero_separate_and_plain_when_turned_off(monkeypatch):
    tensors = zeros_on_huge_pages(3, (2, 3, 5, 16, 8), torch.float32)
    assert [t.shape for t in tensors] == [(2, 3, 5, 16, 8)] * 3
    assert all(int(t.count_nonzero()) == 0 for t in tensors)
    tensors[0].fill_(1.0)  # no overlap between the layers' tensors
    assert int(tensors[1].count_nonzero()) == 0 and int(tensors[2].count_nonzero()) == 0
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.huge_pages_usable()
    plain = zeros_on_huge_pages(2, (4, 4), torch.bfloat16)
    assert [t.dtype for t in plain] == [torch.bfloat16] * 2
    assert all(int(t.count_nonzero()) == 0 for t in plain)


@pytest.mark.skipif(not THP, reason=f"{NOT_THIS_HARDWARE}: THP off (never, or no sysfs)")
def test_cpu_kv_cache_layers_come_from_one_huge_page_arena():
    cache = CacheEngine(num_layers=4, layer_range=(1, 3), num_blocks=64, block_size=16,
                        num_kv_heads=2, head_dim=64, dtype=torch.float32,
                        device=torch.device("cpu"))
    assert cache.kv_caches[0] is None and cache.kv_caches[3] is None
    a, b = cache.kv_caches[1], cache.kv_caches[2]
    assert a.shape == b.shape == (2, 2, 64, 16, 64)
    assert int(a.count_nonzero()) == 0 and int(b.count_nonzero()) == 0
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one arena
    assert a.data_ptr() % HUGE_PAGE == 0  # the first layer opens the arena


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 64)
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter object
        self.proj = nn.Linear(64, 256)
        self.proj.packed = torch.randn(256 * 64)  # a plain tensor attribute (prepacked copy)
        self.norm = nn.Parameter(torch.ones(64))  # too small to move
        self.register_buffer("table", torch.arange(64 * 300, dtype=torch.int64))
        self.window = self.table[:100]  # a view into another tensor: stays where it is
        self.proj.onednn = torch.randn(256, 64).to_mkldnn()  # opaque (oneDNN): left alone


@pytest.mark.skipif(not THP, reason=f"{NOT_THIS_HARDWARE}: THP off (never, or no sysfs)")
def test_move_to_huge_pages_keeps_values_ties_and_views():
    torch.manual_seed(0)
    model = _Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    packed = model.proj.packed.clone()
    x = torch.randint(0, 512, (3, 5))
    want = model.head(model.proj(model.embed(x)) @ torch.ones(256, 64) / 256)
    embed_param, norm_ptr = model.embed.weight, model.norm.data_ptr()
    moved = move_to_huge_pages(model)
    sizes = [512 * 64 * 4, 256 * 64 * 4, 256 * 64 * 4, 64 * 300 * 8]
    assert moved == sum(sizes)
    assert model.embed.weight is embed_param and model.head.weight is embed_param
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    base = model.embed.weight.untyped_storage().data_ptr()
    arena = (model.embed.weight, model.proj.weight, model.proj.packed, model.table)
    assert all(t.untyped_storage().data_ptr() == base for t in arena)  # one arena
    assert min(t.data_ptr() for t in arena) % HUGE_PAGE == 0
    assert model.norm.data_ptr() == norm_ptr  # small: not moved
    assert model.window.untyped_storage().data_ptr() != base  # a view: not moved
    assert model.proj.onednn.is_mkldnn
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(model.proj.packed, packed)
    got = model.head(model.proj(model.embed(x)) @ torch.ones(256, 64) / 256)
    assert torch.equal(got, want)


def test_move_to_huge_pages_does_nothing_when_turned_off(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    model = _Tied()
    ptr = model.proj.weight.data_ptr()
    assert move_to_huge_pages(model) == 0
    assert model.proj.weight.data_ptr() == ptr
