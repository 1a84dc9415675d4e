"""Expert parallelism's collectives at TP = 2 over gloo: kvray's all-reduce against an
all-to-all dispatch, per MoE layer, in one run.

kvray's scheme (``enable_expert_parallel``): attention leaves every token on every rank, each
rank runs its experts on the tokens routed to them and one all-reduce of [tokens, hidden]
completes the layer. The alternative vLLM and SGLang use with data-parallel attention: each
rank owns 1/TP of the tokens, sends each (token, expert) pair's hidden row to the rank
holding that expert (all-to-all), gets the expert outputs back (all-to-all), and here,
since kvray's attention is tensor-parallel, must then all-gather the tokens again. Timed
per layer for the Mixtral and Qwen3-MoE shapes of ``benchmarks/moe.py`` at 1, 32 and 256
tokens (at least one per rank), routing uniform at random (top-k distinct experts per
token); both schemes
alternated, median of ``--rounds``. Reports the bytes each rank sends and the time, and the
all-to-all scheme over the all-reduce. Only the communication is timed (the experts' GEMMs
are the same work under both).

    python benchmarks/moe_dispatch.py [--rounds 30] [--tokens 1,32,256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvray.hardware import describe  # noqa: E402

TP = 2
SHAPES = {"Mixtral-shaped": (512, 8, 2), "Qwen3-MoE-shaped": (512, 32, 4)}  # hidden, E, k


def _all_reduce(x: torch.Tensor) -> int:
    dist.all_reduce(x)
    return x.numel() * x.element_size() * (TP - 1) // TP * 2  # ring: reduce-scatter + gather


def _all_to_all(x: torch.Tensor, experts: torch.Tensor, num_experts: int, rank: int) -> int:
    """This rank's share of the tokens to the ranks holding their experts and back, then
    every rank gathers every token. Returns the bytes this rank sent."""
    mine = x.chunk(TP)[rank]
    my_experts = experts.chunk(TP)[rank]  # [tokens / TP, k]
    owner = my_experts // (num_experts // TP)  # contiguous placement
    order = owner.reshape(-1).argsort(stable=True)
    rows = mine.repeat_interleave(my_experts.shape[1], dim=0)[order]
    send = torch.bincount(owner.reshape(-1), minlength=TP)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)  # how many rows each rank will get
    out = rows.new_empty((int(recv.sum()), x.shape[1]))
    dist.all_to_all_single(out, rows, recv.tolist(), send.tolist())  # dispatch
    back = rows.new_empty(rows.shape)
    dist.all_to_all_single(back, out, send.tolist(), recv.tolist())  # combine
    gathered = [torch.empty_like(mine) for _ in range(TP)]
    dist.all_gather(gathered, mine)  # attention is TP: every rank needs every token
    row = x.shape[1] * x.element_size()
    other = int(send.sum() - send[rank])
    return (2 * other + mine.shape[0] * (TP - 1)) * row + 2 * send.numel() * 8


def _worker(rank: int, init: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=TP)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, (hidden, num_experts, k) in SHAPES.items():
        for tokens in args.tokens:
            t = max(tokens, TP)  # every rank owns at least one token
            x = torch.randn(t, hidden, generator=gen)
            experts = torch.rand(t, num_experts, generator=gen).topk(k, dim=1).indices
            times: dict[str, list[float]] = {"all-reduce": [], "all-to-all": []}
            sent = {}
            for _ in range(args.rounds):
                for scheme in times:
                    dist.barrier()
                    start = time.perf_counter()
                    sent[scheme] = _all_reduce(x.clone()) if scheme == "all-reduce" else \
                        _all_to_all(x, experts, num_experts, rank)
                    times[scheme].append(time.perf_counter() - start)
            results.append((name, t, {s: statistics.median(v) for s, v in times.items()},
                            sent))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--tokens", default="1,32,256")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    print(describe())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_worker, args=(r, init, args, queue)) for r in range(TP)]
        for p in procs:
            p.start()
        results = queue.get()
        for p in procs:
            p.join()
    print(f"\nTP = {TP} over gloo, one MoE layer's collectives, median of {args.rounds}; "
          "routing uniform at random, contiguous expert placement")
    print("| shape | tokens | all-reduce KB sent / us | all-to-all (+ all-gather) KB sent / us "
          "| all-to-all / all-reduce time |")
    print("|---|---:|---:|---:|---:|")
    for name, tokens, t, sent in results:
        print(f"| {name} | {tokens} | {sent['all-reduce'] / 1e3:.1f} / "
              f"{t['all-reduce'] * 1e6:.0f} | {sent['all-to-all'] / 1e3:.1f} / "
              f"{t['all-to-all'] * 1e6:.0f} | {t['all-to-all'] / t['all-reduce']:.2f}x |")


if __name__ == "__main__":
    main()
