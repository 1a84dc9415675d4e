"""The `kvray` command line: help, generate on a local model, and clear errors."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvray import LLM, SamplingParams
from kvray.cli import main
from tests.helpers.skips import builtin_model_or_skip

pytestmark = pytest.mark.engine


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvray.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_help_lists_the_subcommands():
    out = _run("--help")
    assert out.returncode == 0
    assert "setup" in out.stdout and "generate" in out.stdout


def test_generate_help_lists_config_flags(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--block-size", "--tensor-parallel-size", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--config", "--chat"):
        assert flag in text


def test_generate_on_a_local_model_prints_the_offline_api_text(tiny_model_dir, capsys):
    path = tiny_model_dir("llama_gqa")
    rc = main(["generate", "--model", str(path), "--prompt", "Hello", "--max-tokens", "5",
               "--dtype", "float32"])
    assert rc == 0
    printed = capsys.readouterr().out
    # The CLI's default temperature is 0: it must print exactly the greedy completion of the
    # offline API (leading spaces included), followed by print()'s one newline.
    llm = LLM(str(path), dtype="float32")
    try:
        want = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    assert want and printed == want + "\n"


def test_flag_overrides_config_file_and_bad_value_fails_with_field_name(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("block_size: 16\n")
    rc = main(["generate", "--config", str(tmp_path / "c.yaml"), "--prompt", "x",
               "--block-size", "0"])
    assert rc == 2
    assert "block_size" in capsys.readouterr().err


def test_unknown_key_in_config_file_fails(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("blocksize: 16\n")
    assert main(["generate", "--config", str(tmp_path / "c.yaml"), "--prompt", "x"]) == 2
    assert "unknown config key 'blocksize'" in capsys.readouterr().err


def test_missing_model_path_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_config_json_transformers_rejects_is_a_clear_error_naming_the_model(
        tiny_model_dir, tmp_path, capsys):
    """A rope dict missing a key fails transformers' own config checks (a KeyError deep in
    it): the CLI says which model and why, exit 2, no traceback."""
    import json
    import shutil

    path = tmp_path / "bad_rope"
    shutil.copytree(tiny_model_dir("llama_gqa"), path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "'factor'" in err and "Traceback" not in err


def test_builtin_model_completion_through_the_cli():
    builtin_model_or_skip()
    out = _run("generate", "--prompt", "The capital of France is", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def _serve_args(*argv: str):
    from kvray.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_api_key_comes_from_a_file_the_environment_or_the_flag(tmp_path, monkeypatch):
    from kvray.cli import resolve_api_key
    from kvray.config import ConfigError

    monkeypatch.delenv("KVRAY_API_KEY", raising=False)
    assert resolve_api_key(_serve_args()) is None
    monkeypatch.setenv("KVRAY_API_KEY", "from-env")
    assert resolve_api_key(_serve_args()) == "from-env"
    assert resolve_api_key(_serve_args("--api-key", "from-flag")) == "from-flag"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert resolve_api_key(_serve_args("--api-key-file", str(key_file))) == "from-file"
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="--api-key-file.*empty"):
        resolve_api_key(_serve_args("--api-key-file", str(key_file)))
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_api_key(_serve_args("--api-key-file", str(tmp_path / "missing")))


def test_serve_refuses_an_unreadable_key_file_before_starting_anything(tmp_path, capsys):
    rc = main(["serve", str(tmp_path), "--api-key-file", str(tmp_path / "missing")])
    assert rc == 2
    assert "--api-key-file" in capsys.readouterr().err


def test_server_limits_are_flags_and_bad_values_name_the_field(capsys):
    from kvray.cli import config_from_args

    config = config_from_args(_serve_args("--max-waiting", "50", "--request-timeout-s", "9",
                                          "--enable-docs"))
    assert config.server.max_waiting == 50 and config.server.request_timeout_s == 9
    assert config.server.enable_docs
    rc = main(["serve", "--max-stop", "-1"])
    assert rc == 2 and "max_stop" in capsys.readouterr().err


def test_a_vllm_command_line_parses_to_the_same_settings(tmp_path, capsys):
    """The flags of a typical `vllm serve` line (a Helm chart's args) run unchanged:
    aliases map to kvray's settings, flags with nothing to do here are accepted."""
    from kvray.cli import config_from_args
    from kvray.cli.flags import resolve_num_replicas

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    args = _serve_args("--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser",
                       "hermes", "--disable-log-requests", "--dtype", "half",
                       "--data-parallel-size", "2", "--chat-template", str(tmp_path / "t.jinja"),
                       "--max-model-len", "512", "--gpu-memory-utilization", "0.8",
                       "--generation-config", "vllm",
                       "--override-generation-config", '{"temperature": 0.5}')
    config = config_from_args(args)
    assert config.server.log_requests is False and config.model.dtype == "float16"
    assert config.model.chat_template == template and config.server.tool_call_parser == "hermes"
    assert config.model.override_generation_config == {"temperature": 0.5}
    assert resolve_num_replicas(args) == 2
    rc = main(["serve", "--data-parallel-size", "2", "--num-replicas", "3"])
    assert rc == 2 and "--data-parallel-size 2 and --num-replicas 3" in capsys.readouterr().err


def test_serve_refuses_skip_tokenizer_init_before_starting_anything(capsys):
    """The HTTP server tokenizes prompts and detokenizes outputs: no tokenizer is an error
    naming the key, not a server that fails every request."""
    rc = main(["serve", "--skip-tokenizer-init"])
    assert rc == 2 and "skip_tokenizer_init" in capsys.readouterr().err


@pytest.mark.parametrize("ingress", ["process", "replica"])
def test_the_single_replica_front_ends_refuse_several_replicas_before_starting_anything(
        capsys, ingress):
    rc = main(["serve", "--ingress", ingress, "--num-replicas", "2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--num-replicas 2" in err and "--ingress serve" in err
    with pytest.raises(SystemExit):
        main(["serve", "--ingress", "threads"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--pipeline-parallel-size", "4"], "pipeline_parallel_size (4) exceeds the model's 3"),
    (["--tensor-parallel-size", "3"], "tensor_parallel_size (3) must be a multiple of "
                                      "num_key_value_heads (2)"),
    (["--tensor-parallel-size", "8"], "num_attention_heads (4) is not divisible"),
])
def test_serve_refuses_a_layout_the_model_cannot_split_before_starting_a_cluster(
        tiny_model_dir, capsys, flags, message):
    """Regression: the workers found it, after a cluster reserved and started tp x pp of
    them (50 stages: two minutes, then Serve's 'failed to update the deployments')."""
    rc = main(["serve", str(tiny_model_dir("llama_gqa")), *flags])
    assert rc == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("port", ["0", "65536", "99999", "-1"])
def test_a_port_outside_1_to_65535_is_a_usage_error_naming_it(capsys, port):
    """Regression: 99999 reached the socket bind and died with an OverflowError."""
    with pytest.raises(SystemExit):
        main(["serve", "--port", port])
    assert "--port" in capsys.readouterr().err


@pytest.mark.parametrize("ingress", ["serve", "process"])
def test_serve_on_a_port_in_use_is_an_error_naming_it_before_anything_starts(
        tiny_model_dir, capsys, ingress):
    """Regression: Serve's proxy binds with SO_REUSEPORT, so a second `kvray serve` on a
    port in use started quietly and took part of the first server's connections."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["serve", str(tiny_model_dir("llama_gqa")), "--host", "127.0.0.1",
                   "--port", str(port), "--ingress", ingress])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and "already in use" in err


def test_a_free_port_passes_the_check():
    from kvray.cli.serve_command import check_port_free

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_port_free("127.0.0.1", port)  # no error: nothing listens there


def test_a_replica_start_failure_is_reported_by_its_own_exception_line():
    """Serve's own error says only that a deployment failed; the CLI names the replica's."""
    from kvray.cli.serve_lifecycle import last_exception_line

    message = ("The deployment failed to start 3 times in a row.\nray.exceptions.RayTaskError"
               "(RuntimeError): ray::ServeReplica:kvray:LLMServer.initialize()\nRuntimeError: "
               "Traceback (most recent call last):\n  File \"/x/loader.py\", line 381, in "
               "resolve\n    raise ValueError(f\"quantization = {requested!r}\")\nValueError: "
               "quantization = 'awq', but the checkpoint is gguf\n")
    assert last_exception_line(message) == \
        "ValueError: quantization = 'awq', but the checkpoint is gguf"
    assert last_exception_line("no traceback here") is None


@pytest.mark.parametrize("host,where", [("0.0.0.0", "EveryNode"), ("::", "EveryNode"),
                                        ("10.0.0.7", "HeadOnly"), ("127.0.0.1", "HeadOnly"),
                                        ("my-head.internal", "HeadOnly")])
def test_serve_runs_a_proxy_per_node_only_for_a_wildcard_host(host, where):
    """A specific address exists on one node: proxies elsewhere would fail to bind it and
    restart forever (found on the namespace cluster, tests/test_multinode.py)."""
    from kvray.cli import proxy_location

    assert proxy_location(host) == where


def _throughput_ticks_until_stopped(monkeypatch, lifecycle, get_actor) -> int:
    """Run `kvray serve`'s throughput loop (serving, no wait per tick) with ``get_actor``
    standing in for Ray's; the ticks it took before ServeStop ended it (at most 3)."""
    import ray

    from kvray.cli.serve_lifecycle import ServeStop

    ticks = []

    def sleep(seconds):
        if len(ticks) >= 3:
            raise RuntimeError("the throughput loop went on after SIGTERM")
        ticks.append(seconds)

    monkeypatch.setattr(ray, "get_actor", get_actor)
    lifecycle.serving = True
    with pytest.raises(ServeStop):
        lifecycle.log_throughput(sleep, period=0.0)
    return len(ticks)


def test_a_sigterm_landing_in_the_throughput_lines_ray_calls_still_stops_the_server(
        monkeypatch):
    # Regression (CI, once): `kvray serve` stayed admitting after SIGTERM. The handler's
    # ServeStop was raised inside the throughput line's `try: ray... except Exception:` and
    # swallowed, so the main thread never reached the drain.
    import signal

    from kvray.cli.serve_lifecycle import ServeLifecycle

    lifecycle = ServeLifecycle("m", drain_timeout_s=1.0)

    def get_actor(*args, **kwargs):  # the signal arrives while Ray is being asked
        lifecycle.on_sigterm(signal.SIGTERM, None)

    assert _throughput_ticks_until_stopped(monkeypatch, lifecycle, get_actor) == 1


def test_a_swallowed_stop_is_still_seen_by_the_next_throughput_tick(monkeypatch):
    # Whatever catches the handler's ServeStop (a BaseException now, but Ray's internals may
    # catch those too), the flag it set ends the loop at the next tick.
    import contextlib
    import signal

    from kvray.cli.serve_lifecycle import ServeLifecycle, ServeStop

    lifecycle = ServeLifecycle("m", drain_timeout_s=1.0)

    def get_actor(*args, **kwargs):
        with contextlib.suppress(ServeStop):  # something caught it
            lifecycle.on_sigterm(signal.SIGTERM, None)
        raise ValueError("no board")

    assert _throughput_ticks_until_stopped(monkeypatch, lifecycle, get_actor) == 2


def test_without_log_stats_the_loop_asks_ray_nothing_and_still_stops_on_sigterm(
        monkeypatch, capsys):
    """--disable-log-stats (vLLM's) / log_stats: false: no throughput line and no Ray call
    per tick, but the loop still ends at the tick after a SIGTERM set the stop flag."""
    import ray

    from kvray.cli import config_from_args
    from kvray.cli.serve_lifecycle import ServeLifecycle, ServeStop

    assert config_from_args(_serve_args("--disable-log-stats")).server.log_stats is False
    lifecycle = ServeLifecycle("m", drain_timeout_s=1.0, log_stats=False)
    calls, ticks = [], []

    def sleep(seconds):
        ticks.append(seconds)
        if len(ticks) == 2:
            lifecycle.stop_requested = True  # what the SIGTERM handler sets

    monkeypatch.setattr(ray, "get_actor", lambda *a, **k: calls.append(a))
    lifecycle.serving = True
    with pytest.raises(ServeStop):
        lifecycle.log_throughput(sleep, period=0.0)
    assert len(ticks) == 2 and not calls and "tok/s" not in capsys.readouterr().out


def test_a_sigterm_during_start_up_is_noted_for_a_drain_and_a_second_stops_at_once(
        monkeypatch):
    # The HTTP app can admit requests before serve.run returns: a SIGTERM then must not
    # stop the server without a drain (it is noted, and the drain starts once it is up);
    # a second one stops a start-up that hangs.
    import signal

    from kvray.cli.serve_lifecycle import ServeLifecycle, ServeStop

    lifecycle = ServeLifecycle("m", drain_timeout_s=1.0)  # starting up: not yet serving
    lifecycle.on_sigterm(signal.SIGTERM, None)
    assert lifecycle.stop_requested
    with pytest.raises(ServeStop):
        lifecycle.on_sigterm(signal.SIGTERM, None)
