"""The Ray Serve application builder ``kvray.serve:build_app``: Serve config files under
configs/serve/ pass Ray's own schema, bad arguments fail naming the key, and `serve run`
on a config file against a loopback Ray cluster (`ray start`) serves completions to the
`openai` client."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import openai
import psutil
import pytest
import yaml

from kvray.config import ConfigError
from kvray.serve import build_app
from tests.helpers.ports import free_port
from tests.helpers.server import stop_process, wait_for_health
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIGS = sorted((ROOT / "configs" / "serve").glob("*.yaml"))
BIN = Path(sys.executable).parent


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=[p.name for p in SERVE_CONFIGS])
def test_shipped_serve_configs_pass_rays_schema_and_kvrays_config(path):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema(**yaml.safe_load(path.read_text()))
    for app in schema.applications:
        assert app.import_path == "kvray.serve:build_app"
        args = {k: v for k, v in app.args.items()
                if k not in ("config", "num_replicas", "name", "api_key", "api_key_file",
                             "ingress")}
        from kvray.config import load_config

        load_config(None, **args)  # every model key valid


@pytest.mark.parametrize("args,match", [
    ({"tensor_parallel_size": "zero"}, "tensor_parallel_size"),
    ({"max_num_seqs": "0"}, "max_num_seqs"),
    ({"block_sise": 16}, "block_sise.*Did you mean 'block_size'"),
    ({"num_replicas": 0}, "num_replicas"),
    ({"num_replicas": "two"}, "num_replicas"),
    ({"use_gpu": "maybe"}, "use_gpu"),
    ({"ingress": "proxy"}, "ingress = 'proxy'.*separate, replica"),
    ({"ingress": "replica", "num_replicas": 2}, "ingress = 'replica'.*num_replicas = 2"),
    ({"model": "/nonexistent/model"}, "does not exist"),
    ({"skip_tokenizer_init": True}, "skip_tokenizer_init: the HTTP server"),
    ({"config": "/nonexistent.yaml"}, "config file not found"),
])
def test_bad_builder_arguments_fail_naming_the_key(args, match):
    with pytest.raises(ConfigError, match=match):
        build_app(args)


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head` on 127.0.0.1 in a private temp dir; its processes are found by
    that dir and killed at the end (`ray stop` would stop every Ray on the machine)."""
    temp = Path(tempfile.gettempdir()) / f"kvr-{uuid.uuid4().hex[:6]}"
    port = free_port()
    # Auth off explicitly: Ray >= 2.5x turns token auth on when ~/.ray/auth_token exists.
    # KVRAY_API_KEY in the nodes' environment, as a Secret would put it in KubeRay's pods.
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "KVRAY_API_KEY": "k3y"}
    env.pop("RAY_ADDRESS", None)
    subprocess.run([str(BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1",
                    "--port", str(port), "--num-cpus", "8", "--include-dashboard", "false",
                    "--temp-dir", str(temp), "--disable-usage-stats"],
                   env=env, check=True, capture_output=True, timeout=120)
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        procs = [p for p in psutil.process_iter(["cmdline"])
                 if any(str(temp) in arg for arg in (p.info["cmdline"] or []))]
        for p in procs:
            for child in p.children(recursive=True):
                child.kill()
            p.kill()


def test_serve_run_on_a_config_file_serves_the_openai_client(ray_head, tmp_path):
    address, env = ray_head
    model = make_tiny_model("llama_gqa", tmp_path / "tiny-llama")
    http_port = free_port()
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [{
            "name": "kvray", "route_prefix": "/", "import_path": "kvray.serve:build_app",
            "args": {"model": str(model), "dtype": "float32", "block_size": 4,
                     "max_model_len": 256, "num_gpu_blocks_override": 64,
                     "served_model_name": "tiny", "num_replicas": 1}}]}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen([str(BIN / "serve"), "run", "--address", address, str(path)],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={k: v for k, v in env.items() if k != "KVRAY_API_KEY"})
        base = f"http://127.0.0.1:{http_port}"
        try:
            def exited() -> str | None:
                if proc.poll() is None:
                    return None
                log.seek(0)
                return f"serve run exited:\n{log.read()[-3000:]}"

            wait_for_health(base, 180, exited)
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="k3y")
            assert [m.id for m in client.models.list().data] == ["tiny"]
            out = client.completions.create(model="tiny", prompt="Hello world", max_tokens=5,
                                            temperature=0)
            assert out.choices[0].text and out.usage.completion_tokens == 5
            with pytest.raises(openai.AuthenticationError):  # the nodes' KVRAY_API_KEY
                openai.OpenAI(base_url=f"{base}/v1", api_key="wrong").models.list()
        finally:
            stop_process(proc)
