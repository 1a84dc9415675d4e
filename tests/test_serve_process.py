"""`kvray serve --ingress process`: the OpenAI app and the engine core in one process
(uvicorn), Ray only for TP x PP workers. The API itself is tested through both front ends
by test_serve.py (its server fixture runs each); here, what differs: no Ray at all at world
size 1, worker actors on a private Ray cluster at TP=2, and the SIGTERM drain."""

from __future__ import annotations

import signal

import openai
import psutil
import pytest

from kvray import LLM, SamplingParams
from tests.helpers.serve_faults import (
    CONTEXT,
    DRAIN_TIMEOUT_S,
    processes_left,
    server_process,
    sigterm_drains_then_aborts,
)
from tests.helpers.server import API_KEY, launch_server
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.serve

FLAGS = ["--ingress", "process", "--drain-timeout-s", str(DRAIN_TIMEOUT_S),
         "--max-model-len", str(CONTEXT), "--num-gpu-blocks-override", "9000"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama_gqa", tmp_path_factory.mktemp("process") / "tiny-llama",
                           max_position_embeddings=CONTEXT)


def _is_ray(proc: psutil.Process) -> bool:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return "raylet" in cmd or "gcs_server" in cmd or cmd.startswith("ray::")


def _stop_with_sigterm(server: psutil.Process) -> list[psutil.Process]:
    """SIGTERM; the process must exit 0. Its descendants (taken before), for leak checks."""
    family = server.children(recursive=True)
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=90) == 0
    return family


def test_sigterm_drains_then_aborts_and_no_ray_runs_at_world_size_1(model_dir):
    """A short request finishes, a long one is ended with a 503 error event at the drain
    deadline, new requests get 503 + Retry-After, the process exits 0; and at TP x PP = 1
    no Ray process was ever started."""
    with launch_server(model_dir, FLAGS) as base:
        server = server_process(base)
        assert not any(_is_ray(p) for p in server.children(recursive=True))
        refused = sigterm_drains_then_aborts(base, model_dir.name, server)
    assert refused.json()["error"]["type"] == "ServiceUnavailableError"


def test_tensor_parallel_workers_run_on_ray_and_stop_with_the_server(model_dir):
    """TP=2: the engine is in the server process, its two workers are Ray actors of a
    private cluster; greedy text equals the offline LLM's; SIGTERM stops all of it."""
    flags = [*FLAGS, "--tensor-parallel-size", "2", "--max-model-len", "1024",
             "--num-gpu-blocks-override", "400"]
    with launch_server(model_dir, flags) as base:
        server = server_process(base)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
        prompts = ["Hello world", "The capital of France is"]
        got = [client.completions.create(model=model_dir.name, prompt=p, max_tokens=10,
                                         temperature=0).choices[0].text for p in prompts]
        assert sum(_is_ray(p) for p in server.children(recursive=True)) >= 2
        family = _stop_with_sigterm(server)
    left = processes_left(family)
    assert not left, left
    llm = LLM(str(model_dir), dtype="float32", block_size=4, max_model_len=256)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    llm.shutdown()
    assert got == [w.outputs[0].text for w in want]
