"""``kvray run-batch``: an OpenAI batch file in, one result line per input line out, in
input order; each result's body is what the online API (the OpenAI app over an AsyncLLM,
driven here through its own test client) answers to the same body; bad lines get a line
error naming what is wrong; a second run on a cut-short OUTPUT (or a killed run's) skips
what is done there and ends with the same file; command-line mistakes exit 2 before any
model is loaded."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvray.cli import main
from kvray.serve.openai_app import OpenAIServer

NAME = "tiny"
FLAGS = ["--dtype", "float32", "--block-size", "4", "--max-model-len", "256",
         "--served-model-name", NAME, "--disable-tqdm"]

# (custom_id, url, body) of the lines the API answers (200 or a 4xx of its own)
REQUESTS = [
    ("cmpl-one", "/v1/completions",
     {"model": NAME, "prompt": "Hello world", "max_tokens": 12, "temperature": 0}),
    ("cmpl-two-prompts", "/v1/completions",
     {"model": NAME, "prompt": ["Once upon a", "The cat sat"], "max_tokens": 9,
      "temperature": 0, "logprobs": 2, "echo": True}),
    ("chat-streamed", "/v1/chat/completions",  # stream is forced off: a whole response
     {"model": NAME, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 10,
      "temperature": 0, "stream": True}),
    ("chat-stop", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Count to ten"}],
      "max_tokens": 16, "temperature": 0, "stop": ["e"], "logprobs": True, "top_logprobs": 2}),
    ("embed", "/v1/embeddings", {"model": NAME, "input": ["a b c", "hello there"]}),
    ("wrong-model", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}),
    ("bad-max-tokens", "/v1/chat/completions",
     {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
    ("too-long", "/v1/completions", {"model": NAME, "prompt": "word " * 300, "max_tokens": 4}),
]
STATUS = {"wrong-model": 404, "bad-max-tokens": 400, "too-long": 400}


def _line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _mixed_file() -> tuple[str, list[tuple[str | None, int | str]]]:
    """The input text and, per output line, (custom_id, status code or line error code)."""
    lines = [_line(*r) for r in REQUESTS]
    expected: list[tuple[str | None, int | str]] = [
        (cid, STATUS.get(cid, 200)) for cid, _, _ in REQUESTS]
    bad = [
        ('{"custom_id": "cut", "method": "POST"', None, "invalid_json"),
        ("[1, 2]", None, "invalid_json"),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), None,
         "missing_custom_id"),
        (json.dumps({"custom_id": 7, "method": "POST", "url": "/v1/completions",
                     "body": {}}), None, "invalid_custom_id"),
        (_line("get", "/v1/completions", {"prompt": "x"}, method="GET"), "get",
         "invalid_method"),
        (_line("models", "/v1/models", {}), "models", "invalid_url"),
        (json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/embeddings",
                     "body": "x"}), "no-body", "invalid_body"),
        (_line("cmpl-one", "/v1/completions", {"prompt": "again"}), "cmpl-one",
         "duplicate_custom_id"),
    ]
    # bad lines spread between the good ones, and a blank line (no output line for it)
    for k, (text, cid, code) in enumerate(bad):
        at = 2 * k + 1
        lines.insert(at, text)
        expected.insert(at, (cid, code))
    lines.insert(5, "   ")
    return "\n".join(lines) + "\n", expected


def _run(model: Path, inp: Path | str, out: Path | str, *extra: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["run-batch", str(model), "-i", str(inp), "-o", str(out), *FLAGS, *extra])
    return rc, err.getvalue()


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same(got, want, where: str = "body") -> None:
    """Equal JSON, ids and timestamps aside; floats (logprobs, embeddings) to 1e-4."""
    if isinstance(want, dict):
        skip = {"id", "created", "created_at", "request_id"}
        assert set(got) - skip == set(want) - skip, where
        for key in set(want) - skip:
            _same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-5), (where, got, want)
    else:
        assert got == want, (where, got, want)


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama_gqa")


@pytest.fixture(scope="module")
def first_run(model, tmp_path_factory):
    """The mixed file run once: (input path, output path, expected, stderr)."""
    root = tmp_path_factory.mktemp("run_batch")
    text, expected = _mixed_file()
    inp, out = root / "in.jsonl", root / "out.jsonl"
    inp.write_text(text)
    rc, err = _run(model, inp, out)
    assert rc == 0, err
    return inp, out, expected, err


@pytest.mark.serve
def test_one_result_per_line_in_input_order_with_line_errors_named(first_run):
    _, out, expected, err = first_run
    records = _read(out)
    assert [(r["custom_id"], r["response"]["status_code"] if r["response"] else
             r["error"]["code"]) for r in records] == expected
    for r in records:
        assert r["id"].startswith("batch_req_")
        assert (r["response"] is None) != (r["error"] is None)
        if r["error"] is not None:
            assert r["error"]["message"].startswith("line ")
    errors = {r["custom_id"]: r["error"]["message"] for r in records if r["error"]}
    assert "method" in errors["get"] and "url" in errors["models"]
    assert "body" in errors["no-body"] and "earlier line" in errors["cmpl-one"]
    refused = {r["custom_id"]: r["response"]["body"] for r in records
               if r["response"] and r["response"]["status_code"] != 200}
    assert refused["wrong-model"]["error"]["param"] == "model"
    assert refused["bad-max-tokens"]["error"]["param"] == "max_tokens"
    n_ok = len(REQUESTS) - len(STATUS)
    assert f"kvray run-batch: {n_ok} ok, {len(expected) - n_ok} failed, 0 skipped" in err


@pytest.mark.serve
def test_bodies_equal_the_online_api_for_the_same_requests(first_run, tiny_async_llm):
    _, out, _, _ = first_run
    got = {r["custom_id"]: r["response"] for r in _read(out) if r["response"]}
    engine = tiny_async_llm(max_model_len=256)
    client = TestClient(OpenAIServer(engine, NAME, 256).app)
    for cid, url, body in REQUESTS:
        want = client.post(url, json={**body, "stream": False})
        assert got[cid]["status_code"] == want.status_code, cid
        _same(got[cid]["body"], want.json(), cid)
    # the greedy texts are real completions, not empty strings
    assert got["cmpl-one"]["body"]["choices"][0]["text"]
    assert got["chat-streamed"]["body"]["object"] == "chat.completion"


@pytest.mark.engine
def test_resumed_run_skips_done_lines_and_ends_with_the_same_file(first_run, model, tmp_path):
    _, out, expected, _ = first_run
    full = out.read_text().splitlines()
    half = len(full) // 2
    # a killed run: the first half written, and the next line cut mid-write
    resumed = tmp_path / "out.jsonl"
    resumed.write_text("\n".join(full[:half]) + "\n" + full[half][:40])
    done = sum(1 for line in full[:half] if json.loads(line)["response"] is not None)
    rc, err = _run(model, first_run[0], resumed)
    assert rc == 0, err
    assert f"{done} of {len(expected)} lines already have a result there (skipped)" in err
    again = resumed.read_text().splitlines()
    assert len(again) == len(full)
    for i, (new, old) in enumerate(zip(again, full, strict=True)):
        if i < half and json.loads(old)["response"] is not None:
            assert new == old  # kept as written, not run again
        _same(json.loads(new), json.loads(old), f"line {i + 1}")


@pytest.mark.engine
def test_a_killed_run_keeps_every_finished_line_and_resumes(model, tmp_path):
    """SIGKILL mid-run: every line in OUTPUT is a whole result (the last one perhaps cut),
    and a second run does only the rest."""
    n = 60
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(_line(f"l{i}", "/v1/completions", {
        "prompt": f"Story number {i}", "max_tokens": 100, "temperature": 0,
        "ignore_eos": True}) + "\n" for i in range(n)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvray.cli", "run-batch", str(model), "-i", str(inp), "-o",
         str(out), "--max-in-flight", "2", *FLAGS], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 6):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    lines = out.read_text().split("\n")
    whole = [json.loads(line) for line in lines[:-1]]
    assert 6 <= len(whole) < n
    assert all(r["response"]["status_code"] == 200 for r in whole)
    rc, err = _run(model, inp, out)
    assert rc == 0, err
    assert f"{len(whole)} of {n} lines already have a result there (skipped)" in err
    final = _read(out)
    assert [r["custom_id"] for r in final] == [f"l{i}" for i in range(n)]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 100 for r in final)


@pytest.mark.engine
def test_stdin_to_stdout_in_input_order(model, monkeypatch, capsys):
    lines = [_line("b", "/v1/completions", {"prompt": "Hello", "max_tokens": 3,
                                            "temperature": 0}),
             "oops",
             _line("a", "/v1/embeddings", {"input": "x"})]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode())))
    rc = main(["run-batch", str(model), "-i", "-", "-o", "-", *FLAGS])
    assert rc == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["custom_id"] for r in records] == ["b", None, "a"]
    assert records[0]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert records[1]["error"]["code"] == "invalid_json"


@pytest.mark.engine
def test_command_line_mistakes_exit_2_with_one_line(model, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "\n")
    not_batch = tmp_path / "notes.txt"
    not_batch.write_text("my notes\nmore notes\n")
    cases = {
        "cannot read": ["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o")],
        "is the input file": ["-i", str(inp), "-o", str(inp)],
        "does not exist": ["-i", str(inp), "-o", str(tmp_path / "no" / "o.jsonl")],
        "block_size": ["-i", str(inp), "-o", str(tmp_path / "o"), "--block-size", "0"],
        "no batch output file": ["-i", str(inp), "-o", str(not_batch)],
        "--expert-load-out": ["-i", str(inp), "-o", str(tmp_path / "o"), "--expert-load-out",
                              str(tmp_path / "no" / "load.json")],
    }
    for needle, args in cases.items():
        rc = main(["run-batch", str(model), *args])
        err = capsys.readouterr().err
        assert rc == 2, needle
        assert needle in err and err.count("\n") == 1, err
    assert not_batch.read_text() == "my notes\nmore notes\n"  # never overwritten
    for args in (["-o", "x"], ["-i", str(inp), "-o", "x", "--max-in-flight", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["run-batch", *args])
        assert exc.value.code == 2


@pytest.mark.serve
def test_a_calibration_batch_writes_the_expert_load_that_expert_placement_reads(
        tiny_model_dir, tmp_path):
    """--expert-load-out on a MoE model (Qwen3-MoE: 3 layers of 8 experts, top-2): one
    count per expert of each layer, every computed token counted twice per layer (the
    layers' sums agree), in a file expert_placement takes as it is."""
    from kvray.config import load_config

    inp, load = tmp_path / "in.jsonl", tmp_path / "load.json"
    inp.write_text("".join(_line(f"c{i}", "/v1/completions", {
        "model": NAME, "prompt": f"Once upon a time {i}", "max_tokens": 6,
        "temperature": 0}) + "\n" for i in range(4)))
    rc, err = _run(tiny_model_dir("qwen3_moe"), inp, tmp_path / "out.jsonl",
                   "--expert-load-out", str(load))
    assert rc == 0, err
    counts = json.loads(load.read_text())
    assert sorted(counts) == ["0", "1", "2"] and {len(c) for c in counts.values()} == {8}
    assert len({sum(c) for c in counts.values()}) == 1 and sum(counts["0"]) % 2 == 0 \
        and sum(counts["0"]) > 0
    config = load_config(expert_placement=str(load), enable_expert_parallel=True,
                         tensor_parallel_size=2)
    assert config.parallel.expert_placement == {int(k): c for k, c in counts.items()}
