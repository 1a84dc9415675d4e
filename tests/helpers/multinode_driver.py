"""The driver side of tests/test_multinode.py: runs on the head node of a namespace cluster
(``python tests/helpers/multinode_driver.py MODE JSON``), joins it through ``RAY_ADDRESS`` and
prints one JSON line per result for the test on the host to check.

Modes:
  layouts    {"model", "prompts", "scenarios": [{"name", "config", "max_tokens"}]}: greedy
             tokens, the node of every rank and the engine's counters, per scenario.
  node_loss  {"model", "config", "prompt", "max_tokens"}: prints ``READY {nodes}`` once the
             request is generating, then waits for the step that fails (the test kills a
             node meanwhile), reports how long that took, then runs a new request (the
             executor rebuilds on the nodes left) and reports its tokens or its error.
"""

from __future__ import annotations

import json
import sys
import time


def _emit(kind: str, payload: dict) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def layouts(spec: dict) -> None:
    from kvray import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    for scenario in spec["scenarios"]:
        start = time.monotonic()
        llm = LLM(scenario.get("model", spec["model"]), **scenario["config"])
        started = time.monotonic() - start
        try:
            params = SamplingParams(temperature=0.0, max_tokens=scenario["max_tokens"],
                                    ignore_eos=True)
            rounds = [[o.outputs[0].token_ids
                       for o in llm.generate(prompts, params, use_tqdm=False)]
                      for _ in range(scenario.get("rounds", 1))]
            engine = llm.llm_engine
            s = engine.stats
            _emit("RESULT", {
                "name": scenario["name"],
                "tokens": rounds[-1], "rounds": rounds,
                "tier": dict(s.kv_tier),
                "worker_nodes": engine.executor.worker_nodes,
                "prefix_cache_hits": s.prefix_cache_hits,
                "preemptions": s.num_preemptions,
                "swaps_out": s.num_swaps_out, "swaps_in": s.num_swaps_in,
                "swap_objects": engine.executor.swap_objects(),
                "quantized": [r["quantized"] for r in engine.startup["ranks"]],
                "start_s": started, "total_s": time.monotonic() - start,
            })
        finally:
            llm.shutdown()


def node_loss(spec: dict) -> None:
    from kvray import LLM, SamplingParams
    from kvray.actors import ray_executor

    ray_executor.PLACEMENT_TIMEOUT_S = spec.get("placement_timeout_s", 20.0)
    llm = LLM(spec["model"], **spec["config"])
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    engine.add_request("victim", {"prompt_token_ids": spec["prompt"]}, params)
    for _ in range(3):
        engine.step()
    _emit("READY", {"worker_nodes": engine.executor.worker_nodes})
    sys.stdin.readline()  # the test kills a node, then says so
    start = time.monotonic()
    error = None
    steps = 0
    try:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    except Exception as err:  # noqa: BLE001 - reported to the test
        error = f"{type(err).__name__}: {err}"
    _emit("FAILED", {"seconds": time.monotonic() - start, "error": error, "steps": steps,
                     "unfinished": engine.has_unfinished_requests()})
    result: dict = {}
    start = time.monotonic()
    try:
        outs = llm.generate([{"prompt_token_ids": spec["prompt"]}],
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
        result["tokens"] = outs[0].outputs[0].token_ids
        result["worker_nodes"] = engine.executor.worker_nodes
    except Exception as err:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(err).__name__}: {err}"
    result["seconds"] = time.monotonic() - start
    _emit("AFTER", result)
    llm.shutdown()


if __name__ == "__main__":
    {"layouts": layouts, "node_loss": node_loss}[sys.argv[1]](json.loads(sys.argv[2]))
