"""`kvray serve` with a tensor-parallel replica (two worker actors placed in the bundles the
Serve deployment reserved) answers exactly like one in-process worker."""

from __future__ import annotations

import httpx
import pytest

from kvray import LLM, SamplingParams
from tests.helpers.server import API_KEY, launch_server
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    path = make_tiny_model("llama_gqa", tmp_path_factory.mktemp("serve_tp") / "tiny-tp")
    with launch_server(path, ["--tensor-parallel-size", "2"]) as base:
        yield base, path


def test_tensor_parallel_replica_answers_like_one_worker(tp_server):
    base, path = tp_server
    prompts = ["Hello world", "The capital of France is"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    got = [httpx.post(f"{base}/v1/completions", headers=headers, timeout=60,
                      json={"prompt": p, "max_tokens": 10, "temperature": 0}).json()
           for p in prompts]
    llm = LLM(str(path), dtype="float32", block_size=4, max_model_len=1024)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    llm.shutdown()
    assert [g["choices"][0]["text"] for g in got] == [w.outputs[0].text for w in want]
