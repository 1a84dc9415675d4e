"""`ray up` cluster configs in cluster/: they pass what `ray up` checks before it contacts a
provider (Ray's prepare_config + validate_config, its raw JSON schema), the EC2 RunInstances
parameter model botocore ships, and kvray's GPU / TP x PP placement checks; bad fixtures in
tests/fixtures/cluster/ each fail with the intended message. Offline: nothing touches a cloud.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml

from kvray.config import load_config
from kvray.ops.cluster import (
    VERIFIED_RAY_VERSION,
    add_cluster_parser,
    check_cluster,
    check_cluster_config,
    wait_for_gpus,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
FIXTURES = Path(__file__).parent / "fixtures" / "cluster"
SHIPPED = sorted(CLUSTER.glob("*.yaml"))
MODELS = sorted((CLUSTER / "models").glob("*.yaml"))
TP8_PP2 = CLUSTER / "models" / "qwen2.5-72b-tp8-pp2.yaml"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    # file_mounts' local paths are relative to where `ray up` runs: the repository root.
    monkeypatch.chdir(ROOT)


def _aws() -> dict:
    return yaml.safe_load((CLUSTER / "aws.yaml").read_text())


def _write(tmp_path: Path, config: dict, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ---- shipped configs --------------------------------------------------------------------
def test_the_configs_are_shipped():
    assert {p.name for p in SHIPPED} >= {"local.yaml", "aws.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_passes_the_check(path):
    report = check_cluster(path)
    assert report.problems == []
    # the served model was found and placed, not skipped
    assert any("fits" in note for note in report.notes), report.notes


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_passes_rays_raw_json_schema(path):
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(yaml.safe_load(path.read_text()), schema)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_shipped_model_configs_are_valid_kvray_configs(path):
    config = load_config(path)
    assert config.parallel.distributed_executor_backend == "ray"


def test_aws_hosts_tp8_pp2_on_two_gpu_8x_nodes():
    report = check_cluster(CLUSTER / "aws.yaml", model_config=TP8_PP2)
    assert report.problems == []
    assert any("fits (2 TP group(s) of 8 GPUs available, 2 needed)" in n for n in report.notes)


def test_shipped_configs_pin_versions_and_start_kvray_serve():
    for path in SHIPPED:
        if path.name == "netns.yaml":  # the test cluster: runs the machine's environment
            continue
        text = path.read_text()
        assert "torch==2.13.0" in text and f"ray[default,serve]=={VERIFIED_RAY_VERSION}" in text
        assert "KVRAY_PIP_SPEC" in text and "not on PyPI" in text
        head = " ".join(yaml.safe_load(text)["head_start_ray_commands"])
        assert "kvray serve --config" in head and "--address auto" in head
        assert "--api-key-file" in head


def test_shipped_configs_start_ray_with_the_serve_env():
    """Every `ray start` of every shipped config carries `kvray serve`'s SERVE_ENV (Serve's
    processes read it at start-up; `kvray serve --address auto` cannot set it there)."""
    from kvray.cli import SERVE_ENV

    for path in SHIPPED:
        config = yaml.safe_load(path.read_text())
        starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
                  for c in config[key] if "ray start" in c]
        assert len(starts) == 2, path.name
        for command in starts:
            for key, value in SERVE_ENV.items():
                assert f"{key}={value} " in command.split("ray start")[0], (path.name, command)


# ---- bad fixtures -------------------------------------------------------------------------
BAD = {
    "typo-max-worker.yaml": (None, "ray schema: at available_node_types.gpu_4x: Additional "
                             "properties are not allowed ('max_worker' was unexpected); did you "
                             "mean 'max_workers' instead of 'max_worker'?"),
    "typo-setup-comands.yaml": (None, "ray schema: at top level: Additional properties are not "
                                "allowed ('setup_comands' was unexpected); did you mean "
                                "'setup_commands' instead of 'setup_comands'?"),
    "gpu-type-without-gpus.yaml": (None, "node type 'gpu_4x' is meant for GPU workers "
                                   "(InstanceType g5.12xlarge has 4 GPU(s)) but its resources "
                                   "declare no GPU"),
    "tp-too-wide.yaml": (None, "tensor_parallel_size=8 needs 8 GPUs on one node; the largest "
                         "GPU node type 'gpu_4x' has 4"),
    "pp-not-enough-nodes.yaml": (TP8_PP2, "tensor_parallel_size=8 x pipeline_parallel_size=2 "
                                 "x 1 replica(s)"),
    "ec2-unknown-parameter.yaml": (None, "node type 'gpu_4x': node_config.InstanceTyp is not "
                                   "an EC2 RunInstances parameter; did you mean "
                                   "'InstanceType'?"),
    "ec2-wrong-type.yaml": (None, "node type 'gpu_4x': node_config.BlockDeviceMappings[0].Ebs."
                            "VolumeSize = '500GB' (str): EC2 RunInstances wants int"),
    "no-gpus-at-start.yaml": (None, "no GPU starts with the cluster (the head has none and "
                              "min_workers is 0 on 'gpu_4x'): it would run the model on CPU "
                              "workers"),
    "local-missing-worker-ips.yaml": (None, "ray up's prepare_config rejects it: Please supply "
                                      "a `head_ip` and list of `worker_ips`"),
}


def test_every_fixture_is_covered():
    assert {p.name for p in FIXTURES.glob("*.yaml")} == set(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_fixture_fails_with_the_intended_message(name):
    model, expected = BAD[name]
    problems = check_cluster_config(FIXTURES / name, model_config=model)
    assert any(expected in p for p in problems), problems


def test_pp_message_says_how_many_groups_fit():
    problems = check_cluster_config(FIXTURES / "pp-not-enough-nodes.yaml", model_config=TP8_PP2)
    assert problems == [
        f"tensor_parallel_size=8 x pipeline_parallel_size=2 x 1 replica(s) ({TP8_PP2}) needs 2 "
        "groups of 8 GPUs, each on one node (PP stages may span nodes); the node types host at "
        "most 1 ('gpu_8x': 1 per node x max_workers 1; global max_workers 1)"]


def test_wait_gpus_above_the_gpus_at_start_is_reported(tmp_path):
    config = _aws()
    config["head_start_ray_commands"][-1] = config["head_start_ray_commands"][-1].replace(
        "wait-gpus 4", "wait-gpus 8")
    problems = check_cluster_config(_write(tmp_path, config))
    assert problems == [
        "the head waits for 8 GPUs before kvray serve, but only 4 start with the cluster (head "
        "+ min_workers): the autoscaler adds no node for a wait, so it would wait until its "
        "timeout; raise min_workers or lower wait-gpus"]


def test_replicas_from_the_cli_must_fit(tmp_path):
    problems = check_cluster_config(CLUSTER / "aws.yaml", num_replicas=7)
    assert len(problems) == 1 and "x 7 replica(s)" in problems[0]
    assert "needs 7 groups of 4 GPUs" in problems[0] and "host at most 6" in problems[0]


def test_instance_type_typo_is_caught_against_botocore_model(tmp_path):
    config = _aws()
    config["available_node_types"]["gpu_4x"]["node_config"]["InstanceType"] = "g5.12xlage"
    problems = check_cluster_config(_write(tmp_path, config))
    assert len(problems) == 1
    assert "InstanceType 'g5.12xlage' is not an EC2 instance type" in problems[0]
    assert "did you mean 'g5.12xlarge'?" in problems[0]


def test_more_gpus_than_the_instance_has_is_reported(tmp_path):
    config = _aws()
    config["available_node_types"]["gpu_4x"]["resources"]["GPU"] = 8
    problems = check_cluster_config(_write(tmp_path, config))
    assert problems == ["node type 'gpu_4x' declares GPU: 8 but InstanceType g5.12xlarge has 4 "
                        "GPU(s): Ray would schedule workers onto GPUs that do not exist"]


def test_mincount_in_node_config_is_noted_as_ignored(tmp_path):
    # Ray's AWS node provider overwrites MinCount / MaxCount, so ray up accepts any value.
    config = _aws()
    config["available_node_types"]["gpu_4x"]["node_config"]["MinCount"] = "one"
    report = check_cluster(_write(tmp_path, config))
    assert report.problems == []
    assert any("node_config.MinCount is ignored" in n for n in report.notes)


def test_missing_local_model_config_is_reported(tmp_path):
    config = _aws()
    config["file_mounts"] = {"~/kvray-models": "no/such/dir"}
    problems = check_cluster_config(_write(tmp_path, config))
    assert len(problems) == 1 and "no/such/dir/qwen2.5-32b-tp4.yaml does not exist" in problems[0]


def test_serve_flag_overrides_apply_to_the_placement(tmp_path):
    config = _aws()
    config["head_start_ray_commands"][-1] = config["head_start_ray_commands"][-1].replace(
        "--address auto", "--address auto --tensor-parallel-size 16")
    problems = check_cluster_config(_write(tmp_path, config))
    assert any("tensor_parallel_size=16 needs 16 GPUs on one node; the largest GPU node type "
               "'gpu_8x' has 8" in p for p in problems), problems


def test_serve_without_config_uses_its_flags(tmp_path):
    config = _aws()
    config["head_start_ray_commands"][-1] = config["head_start_ray_commands"][-1].replace(
        "--config ~/kvray-models/qwen2.5-32b-tp4.yaml", "~/models/m --tensor-parallel-size 8")
    report = check_cluster(_write(tmp_path, config))
    assert report.problems == []
    assert any(n.startswith("tensor_parallel_size=8 x pipeline_parallel_size=1 x 1 replica(s) "
                            "(kvray serve's defaults and flags): fits") for n in report.notes)


def test_unparsable_serve_command_is_reported(tmp_path):
    config = _aws()
    config["head_start_ray_commands"][-1] = config["head_start_ray_commands"][-1].replace(
        "--port 8000", "--port eighty")
    problems = check_cluster_config(_write(tmp_path, config))
    assert len(problems) == 1 and "does not parse as kvray serve" in problems[0]
    assert "argument --port: invalid" in problems[0] and "'eighty'" in problems[0]


def test_invalid_kvray_model_config_is_reported(tmp_path):
    bad = tmp_path / "model.yaml"
    bad.write_text("tensor_parallel_sise: 4\n")
    problems = check_cluster_config(CLUSTER / "aws.yaml", model_config=bad)
    assert len(problems) == 1 and "unknown config key 'tensor_parallel_sise'" in problems[0]


def test_local_without_num_gpus_skips_placement_with_a_note(tmp_path):
    config = yaml.safe_load((CLUSTER / "local.yaml").read_text())
    config["worker_start_ray_commands"] = ["ray stop", "ray start --address=$RAY_HEAD_IP:6379"]
    report = check_cluster(_write(tmp_path, config))
    assert report.problems == []
    assert any("state --num-gpus" in n for n in report.notes)


def test_local_with_too_few_gpus_per_host(tmp_path):
    config = yaml.safe_load((CLUSTER / "local.yaml").read_text())
    commands = config["worker_start_ray_commands"]
    start = next(i for i, c in enumerate(commands) if "ray start" in c)
    commands[start] = commands[start].replace("--num-gpus=4", "--num-gpus=2")
    problems = check_cluster_config(_write(tmp_path, config))
    assert any("tensor_parallel_size=4 needs 4 GPUs on one node; the largest GPU node type "
               "'worker hosts (provider.worker_ips)' has 2" in p for p in problems), problems


def test_missing_private_ray_api_is_a_clear_problem(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.autoscaler._private.util",
                        types.ModuleType("ray.autoscaler._private.util"))
    problems = check_cluster_config(CLUSTER / "aws.yaml")
    assert len(problems) == 1
    assert "ray.autoscaler._private.util.prepare_config" in problems[0]
    assert f"verified with ray {VERIFIED_RAY_VERSION}" in problems[0]


def test_unreadable_and_non_mapping_files(tmp_path):
    assert check_cluster_config(tmp_path / "missing.yaml")[0].startswith("cannot read")
    (tmp_path / "list.yaml").write_text("- a\n")
    assert "must hold a mapping" in check_cluster_config(tmp_path / "list.yaml")[0]


# ---- CLI ------------------------------------------------------------------------------------
def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvray")
    add_cluster_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_check_ok(capsys):
    assert _cli(["cluster", "check", str(CLUSTER / "aws.yaml")]) == 0
    out = capsys.readouterr()
    assert "aws.yaml: ok" in out.out and out.err == ""


def test_cli_check_bad_file_exits_2_naming_the_problem(capsys):
    path = FIXTURES / "tp-too-wide.yaml"
    assert _cli(["cluster", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"kvray cluster check: {path}: 1 problem(s):" in err
    assert "tensor_parallel_size=8 needs 8 GPUs on one node" in err


def test_cli_check_with_model_config_flag(capsys):
    path = FIXTURES / "pp-not-enough-nodes.yaml"
    assert _cli(["cluster", "check", str(path)]) == 0
    assert _cli(["cluster", "check", str(path), "--model-config", str(TP8_PP2)]) == 2
    assert "needs 2 groups of 8 GPUs" in capsys.readouterr().err


def test_wait_gpus_polls_the_cluster(monkeypatch):
    seen = iter([0, 4, 8])
    fake = types.SimpleNamespace(init=lambda **kw: None, shutdown=lambda: None,
                                 cluster_resources=lambda: {"GPU": next(seen)})
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert wait_for_gpus(8, timeout_s=5, poll_s=0)
    seen = iter([0] * 1000)
    assert not wait_for_gpus(8, timeout_s=0, poll_s=0)


def test_cli_wait_gpus_times_out_with_exit_2(monkeypatch, capsys):
    fake = types.SimpleNamespace(init=lambda **kw: None, shutdown=lambda: None,
                                 cluster_resources=lambda: {"CPU": 8})
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert _cli(["cluster", "wait-gpus", "4", "--timeout", "0"]) == 2
    assert "fewer than 4 GPUs after 0 s" in capsys.readouterr().err


def _local_serving(tmp_path: Path, *flags: str) -> list[str]:
    """The on-prem config (2 worker hosts of 4 GPUs, TP=4 x PP=2) with ``flags`` added to
    its kvray serve command."""
    config = yaml.safe_load((CLUSTER / "local.yaml").read_text())
    serve = next(i for i, c in enumerate(config["head_start_ray_commands"]) if "kvray serve" in c)
    config["head_start_ray_commands"][serve] = config["head_start_ray_commands"][serve].replace(
        "--address auto", "--address auto " + " ".join(flags))
    return check_cluster_config(_write(tmp_path, config))


def test_the_check_places_a_replica_as_its_placement_strategy_says(tmp_path):
    assert _local_serving(tmp_path) == []
    assert _local_serving(tmp_path, "--placement-strategy SPREAD") == []
    # STRICT_PACK: all 8 workers on one host of 4 GPUs
    [problem] = _local_serving(tmp_path, "--placement-strategy STRICT_PACK")
    assert "placement_strategy=STRICT_PACK puts each replica's workers on one node" in problem
    assert "needs 8 GPUs and 9 CPUs on one node per replica" in problem
    # STRICT_SPREAD: 8 workers on 8 GPU hosts (there are two); TP=1 x PP=2 fits
    [problem] = _local_serving(tmp_path, "--placement-strategy STRICT_SPREAD")
    assert "needs 8 GPU nodes for the workers plus one more node for the replica" in problem
    assert "the node types give at most 2 GPU nodes and 3 nodes" in problem
    assert _local_serving(tmp_path, "--placement-strategy STRICT_SPREAD",
                          "--tensor-parallel-size 1") == []


def test_the_check_holds_pinned_stages_to_the_hosts_they_name(tmp_path):
    assert _local_serving(tmp_path, "--pipeline-stage-nodes 192.0.2.11,192.0.2.12") == []
    [problem] = _local_serving(tmp_path, "--pipeline-stage-nodes 192.0.2.11,192.0.2.99")
    assert "pipeline_stage_nodes names 192.0.2.99, which is not a host of this cluster" \
        in problem
    [problem] = _local_serving(tmp_path, "--pipeline-stage-nodes 192.0.2.11,192.0.2.11")
    assert "puts 2 stage(s) of 4 workers per replica on 192.0.2.11 (8 GPUs); it has 4" \
        in problem


@pytest.mark.parametrize("path", [p for p in SHIPPED
                                  if yaml.safe_load(p.read_text())["provider"]["type"] == "local"],
                         ids=lambda p: p.name)
def test_on_prem_worker_hosts_stop_their_ray_once_the_head_is_gone(path):
    """`ray down` stops Ray on the head only: every on-prem config's worker hosts run the
    watchdog tests/test_ray_up.py proves on the namespace cluster (ray down leaves nothing)."""
    def watchdog(config_path: Path) -> str:
        commands = yaml.safe_load(config_path.read_text())["worker_start_ray_commands"]
        [command] = [c for c in commands if "ray stop --force" in c]
        return command

    assert watchdog(path) == watchdog(CLUSTER / "netns.yaml")


def test_an_autoscaled_model_must_fit_at_its_max_replicas(tmp_path):
    assert _local_serving(tmp_path, "--min-replicas 1 --max-replicas 1") == []
    [problem] = _local_serving(tmp_path, "--min-replicas 1 --max-replicas 2")
    assert "x 2 replica(s)" in problem and "max_replicas" in problem
