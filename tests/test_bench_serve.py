"""``kvray bench serve``: the metric math against numpy and hand-computed values, the
workloads against the tokenizer, gamma arrivals against the gamma distribution's moments,
the command line's errors, and one run against a real ``kvray serve`` whose own token
counters (``/metrics``) must match the result JSON."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvray.bench.cli import resolve_backend
from kvray.bench.client import Endpoint, RequestOutput, _Stream
from kvray.bench.datasets import SampleRequest, sample_random, sample_sharegpt
from kvray.bench.load import arrival_times
from kvray.bench.metrics import (
    compute_metrics,
    latency_stats,
    meets_slos,
    output_token_count,
    percentile,
)
from kvray.bench.report import build_result
from kvray.cli import build_parser, main
from tests.helpers.ports import free_port
from tests.helpers.server import API_KEY, launch_server
from tests.helpers.tiny_models import build_tokenizer

unit = pytest.mark.unit
VLLM_KEYS = ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput",
             "output_throughput", "total_token_throughput", "input_lens", "output_lens",
             "ttfts", "itls", "generated_texts", "errors")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def done(ttft: float, latency: float, tokens: int, prompt_len: int = 10,
         itl: list[float] | None = None) -> RequestOutput:
    """A completed request as the client would have measured it."""
    return RequestOutput(success=True, prompt_len=prompt_len, output_tokens=tokens,
                         num_chunks=tokens, ttft=ttft, latency=latency, itl=itl or [],
                         generated_text="x" * tokens)


# ---- metric math ------------------------------------------------------------------------
@unit
def test_percentiles_interpolate_between_ranks_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 99) == 0.0
    rng = np.random.default_rng(0)
    for n in (2, 5, 31, 200):
        values = rng.exponential(size=n).tolist()
        for q in (1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))


@unit
def test_latency_stats_are_milliseconds_with_population_std():
    seconds = [0.010, 0.020, 0.060, 0.030]
    stats = latency_stats(seconds, [50, 99])
    ms = np.array(seconds) * 1000
    assert stats.mean == pytest.approx(ms.mean())
    assert stats.median == pytest.approx(np.median(ms))
    assert stats.std == pytest.approx(ms.std())  # numpy's default: population
    assert stats.percentiles == {50: pytest.approx(25.0), 99: pytest.approx(np.percentile(ms, 99))}


@unit
def test_tpot_leaves_out_the_first_token():
    # 11 tokens: the first at 0.5 s, the other 10 over the next 1.0 s -> 100 ms each.
    metrics = compute_metrics([done(0.5, 1.5, 11), done(0.2, 0.2, 1)], 2.0, [50])
    assert metrics.stats["tpot"].mean == pytest.approx(100.0)  # the 1-token request has none
    assert metrics.stats["ttft"].mean == pytest.approx(350.0)
    assert metrics.stats["e2el"].median == pytest.approx(850.0)


@unit
def test_itl_pools_every_gap_of_every_request():
    metrics = compute_metrics([done(0.1, 0.4, 3, itl=[0.1, 0.2]), done(0.1, 0.2, 2, itl=[0.1])],
                              1.0, [50])
    assert metrics.stats["itl"].mean == pytest.approx(1000 * 0.4 / 3)


@unit
def test_output_tokens_come_from_usage_then_the_text_then_the_chunks(tokenizer):
    text = "The capital of France is Paris."
    out = RequestOutput(success=True, output_tokens=7, generated_text=text, num_chunks=3)
    assert output_token_count(out, tokenizer) == 7
    out.output_tokens = 0
    assert output_token_count(out, tokenizer) == len(
        tokenizer(text, add_special_tokens=False)["input_ids"])
    assert output_token_count(out, None) == 3


@unit
def test_goodput_counts_completed_requests_within_every_slo():
    outputs = [
        done(0.05, 0.50, 10),  # ttft 50 ms, tpot 50 ms: meets both
        done(0.20, 0.30, 11),  # ttft 200 ms: misses ttft
        done(0.05, 1.05, 11),  # tpot 100 ms: misses tpot
        done(0.09, 0.09, 1),  # one token: no tpot, counts as 0 -> meets
        RequestOutput(success=False, error="HTTP 500"),  # never counts
    ]
    slos = {"ttft": 100.0, "tpot": 60.0}
    metrics = compute_metrics(outputs, 4.0, [99], slos)
    assert metrics.request_goodput == pytest.approx(2 / 4.0)
    assert metrics.request_goodput <= metrics.request_throughput == pytest.approx(4 / 4.0)
    assert compute_metrics(outputs, 4.0, [99]).request_goodput is None
    assert meets_slos(0.1, 0.06, 5.0, {"ttft": 100, "tpot": 60})  # on the line is within
    assert not meets_slos(0.1, None, 5.0, {"e2el": 4999})


@unit
def test_throughputs_divide_completed_totals_by_the_duration():
    outputs = [done(0.1, 1.0, 20, prompt_len=100), done(0.1, 1.0, 30, prompt_len=50),
               RequestOutput(success=False, prompt_len=70, error="reset")]
    metrics = compute_metrics(outputs, 2.0, [99])
    assert (metrics.completed, metrics.failed) == (2, 1)
    assert (metrics.total_input, metrics.total_output) == (150, 50)
    assert metrics.request_throughput == pytest.approx(1.0)
    assert metrics.output_throughput == pytest.approx(25.0)
    assert metrics.total_token_throughput == pytest.approx(100.0)
    assert metrics.input_lens == [100, 50, 70] and metrics.output_lens == [20, 30, 0]


# ---- the stream ---------------------------------------------------------------------------
@unit
def test_the_stream_times_text_chunks_and_takes_the_servers_usage():
    out = RequestOutput(prompt_len=5, start_time=10.0)
    stream = _Stream(out)
    lines = [
        (": keep-alive", 10.1),
        ('data: {"choices":[{"delta":{"role":"assistant","content":""}}]}', 10.2),
        ('data: {"choices":[{"delta":{"content":"Hel"}}]}', 10.5),
        ("", 10.5),
        ('data: {"choices":[{"delta":{"content":"lo"}}]}', 10.7),
        ('data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3}}', 10.8),
    ]
    assert all(stream.feed(line, now) for line, now in lines)
    assert not stream.feed("data: [DONE]", 10.9)
    assert out.ttft == pytest.approx(0.5)  # the role-only chunk carries no token
    assert out.itl == [pytest.approx(0.2)]
    assert (out.num_chunks, out.output_tokens, out.prompt_len) == (2, 3, 9)
    assert "".join(stream.parts) == "Hello"
    assert not _Stream(RequestOutput()).feed('data: {"error":{"message":"overloaded"}}', 1.0)


@unit
def test_request_bodies_follow_the_backend():
    chat = Endpoint("http://h/v1/chat/completions", "openai-chat", "m",
                    extra_body={"ignore_eos": True})
    body = chat.body(SampleRequest("hi", 1, 7))
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_completion_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    body = Endpoint("http://h/v1/completions", "openai", "m").body(SampleRequest([1, 2], 2, 4))
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 4
    with pytest.raises(ValueError, match="openai-chat"):
        chat.body(SampleRequest([1, 2], 2, 4))
    assert resolve_backend(None, "/v1/chat/completions") == (
        "openai-chat", "/v1/chat/completions")
    assert resolve_backend("openai-chat", None) == ("openai-chat", "/v1/chat/completions")


# ---- workloads ----------------------------------------------------------------------------
@unit
def test_random_prompt_lengths_stay_within_the_range_ratio(tokenizer):
    reqs = sample_random(tokenizer, 64, input_len=40, output_len=20, range_ratio=0.25, seed=3)
    lens = [len(tokenizer(r.prompt)["input_ids"]) for r in reqs]
    assert all(30 <= n <= 50 for n in lens), lens
    assert all(15 <= r.output_len <= 25 for r in reqs)
    assert len(set(lens)) > 5 and len({r.output_len for r in reqs}) > 5
    assert [r.prompt_len for r in reqs] == lens
    fixed = sample_random(tokenizer, 8, input_len=40, output_len=20, seed=3)
    assert {len(tokenizer(r.prompt)["input_ids"]) for r in fixed} == {40}
    assert {r.output_len for r in fixed} == {20}


@unit
def test_random_prefix_is_shared_by_every_prompt(tokenizer):
    reqs = sample_random(tokenizer, 8, input_len=40, output_len=4, prefix_len=12, seed=5)
    shared = os.path.commonprefix([r.prompt for r in reqs])
    assert len(tokenizer(shared)["input_ids"]) >= 11  # the seam token may merge onward
    assert {len(tokenizer(r.prompt)["input_ids"]) for r in reqs} == {52}
    unshared = sample_random(tokenizer, 8, input_len=40, output_len=4, seed=5)
    assert len(tokenizer(os.path.commonprefix([r.prompt for r in unshared]))["input_ids"]) < 3


@unit
def test_the_seed_decides_the_workload(tokenizer, tmp_path):
    first = sample_random(tokenizer, 6, 30, 10, 0.5, 4, seed=11)
    assert sample_random(tokenizer, 6, 30, 10, 0.5, 4, seed=11) == first
    assert sample_random(tokenizer, 6, 30, 10, 0.5, 4, seed=12) != first
    path = write_sharegpt(tmp_path, [chat(f"Question number {i} about Paris and Rome?",
                                          f"Answer number {i}: Rome, then Paris.")
                                     for i in range(20)])
    picked = sample_sharegpt(tokenizer, path, 5, seed=1)
    assert sample_sharegpt(tokenizer, path, 5, seed=1) == picked
    assert sample_sharegpt(tokenizer, path, 5, seed=2) != picked


def chat(*turns: str, roles: tuple[str, ...] = ("human", "gpt")) -> dict:
    """A ShareGPT entry: ``turns`` spoken in turn by ``roles``."""
    return {"conversations": [{"from": role, "value": text}
                              for role, text in zip(roles, turns, strict=False)]}


def write_sharegpt(tmp_path: Path, entries: list) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return path


@unit
def test_sharegpt_takes_the_first_human_turn_and_drops_what_vllm_drops(tokenizer, tmp_path):
    keep = [("What is the capital of France?", "The capital of France is Paris."),
            ("Tell me a story about a small model.", "Once upon a time there was a model.")]
    sentence = "The capital of France is Paris. "
    entries = [
        chat(*keep[0]),
        chat("You are terse.", *keep[1], roles=("system", "human", "gpt")),
        chat("Only a question, never answered."),
        chat("Hi", "Hello world! kvray serves models."),  # prompt under 4 tokens
        chat("Why is the sky blue today?", "Rome"),  # reply under 4 tokens
        chat(sentence * 110, "a reply long enough for the filter"),  # prompt over 1024
        chat(sentence * 90, sentence * 120),  # prompt + reply over 2048
        chat("A question answered by another question?", "Why?", roles=("human", "human")),
        {"no": "conversations"},
    ]
    lens = {p: len(tokenizer(p)["input_ids"]) for p, _ in keep}

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    assert count("Hi") < 4 <= min(lens.values()) and count("Rome") < 4
    assert count(sentence * 110) > 1024 >= count(sentence * 90)
    assert count(sentence * 90) + count(sentence * 120) > 2048
    reqs = sample_sharegpt(tokenizer, write_sharegpt(tmp_path, entries), 2, seed=0)
    expected = {(p, lens[p], len(tokenizer(r, add_special_tokens=False)["input_ids"]))
                for p, r in keep}
    assert {(r.prompt, r.prompt_len, r.output_len) for r in reqs} == expected
    fixed = sample_sharegpt(tokenizer, write_sharegpt(tmp_path, entries), 2, seed=0,
                            output_len=3)
    assert {r.output_len for r in fixed} == {3}  # a fixed output length skips its minimum


@unit
def test_sharegpt_repeats_conversations_when_the_file_has_too_few(tokenizer, tmp_path):
    path = write_sharegpt(tmp_path, [chat("What is the capital of Italy?",
                                          "The capital of Italy is Rome.")])
    reqs = sample_sharegpt(tokenizer, path, 5, seed=0)
    assert len(reqs) == 5 and len({r.prompt for r in reqs}) == 1


@pytest.mark.parametrize("content", ["{\"conversations\": []}", "not json", "[]"])
@unit
def test_a_bad_sharegpt_file_names_the_flag(tokenizer, tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="--dataset-path"):
        sample_sharegpt(tokenizer, path, 3)


# ---- arrivals -----------------------------------------------------------------------------
@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
@unit
def test_gamma_arrivals_keep_the_mean_rate_and_their_burstiness(burstiness):
    times = arrival_times(4000, request_rate=5.0, burstiness=burstiness, seed=7)
    gaps = np.diff([0.0, *times])
    assert times[-1] == pytest.approx(4000 / 5.0)  # the mean rate is the one asked for
    assert np.all(gaps >= 0)
    # a gamma distribution of shape k has a coefficient of variation of 1 / sqrt(k)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


@unit
def test_arrivals_at_an_infinite_rate_or_burstiness():
    assert arrival_times(5, math.inf) == [0.0] * 5
    even = arrival_times(4, 2.0, burstiness=math.inf)
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrival_times(50, 3.0, seed=1) == arrival_times(50, 3.0, seed=1)


# ---- the result and the command line --------------------------------------------------------
@unit
def test_the_result_json_has_vllms_keys():
    outputs = [done(0.1, 0.5, 5, itl=[0.1] * 4), RequestOutput(success=False, error="x")]
    metrics = compute_metrics(outputs, 1.0, [50, 99.9], {"e2el": 1000})
    header = {"date": "20250101-000000", "backend": "openai", "model_id": "m",
              "tokenizer_id": "t", "num_prompts": 2, "request_rate": "inf",
              "burstiness": 1.0, "max_concurrency": None}
    result = build_result(header, metrics, outputs, ["ttft", "tpot", "itl", "e2el"])
    missing = [k for k in VLLM_KEYS if k not in result]
    assert not missing
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{name}_ms" in result
    assert result["errors"] == ["", "x"] and result["output_lens"] == [5, 0]
    json.dumps(result, allow_nan=False)  # plain JSON, no Infinity / NaN


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [
    ("--random-range-ratio", "1.0"), ("--request-rate", "0"), ("--burstiness", "-1"),
    ("--max-concurrency", "0"), ("--num-prompts", "x"), ("--goodput", "ttfx:10"),
    ("--goodput", "ttft"), ("--metadata", "novalue"), ("--percentile-metrics", "ttft,foo"),
    ("--metric-percentiles", "0,50"), ("--temperature", "-1"), ("--endpoint", "/v1/embed"),
    ("--dataset-path", "x.json"),
])
@unit
def test_bad_flags_exit_2_naming_the_flag(capsys, flag, value):
    code, err = run_cli(["bench", "serve", flag, value], capsys)
    assert code == 2 and flag in err, err


@unit
def test_sharegpt_needs_its_file_and_the_endpoint_must_fit_the_backend(capsys):
    code, err = run_cli(["bench", "serve", "--dataset-name", "sharegpt"], capsys)
    assert code == 2 and "--dataset-path" in err
    code, err = run_cli(["bench", "serve", "--backend", "openai",
                         "--endpoint", "/v1/chat/completions"], capsys)
    assert code == 2 and "--endpoint" in err


@unit
def test_the_help_has_no_bare_percent_sign():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    bench = next(a for a in sub.choices["bench"]._actions if a.dest == "bench_command")
    serve = bench.choices["serve"]
    texts = [serve.description] + [a.help or "" for a in serve._actions]
    assert not [t for t in texts if re.search(r"%(?!%)", t)]
    assert "--goodput" in serve.format_help()


@unit
def test_an_unreachable_server_is_a_one_line_error(capsys):
    start = time.monotonic()
    code, err = run_cli(["bench", "serve", "--port", str(free_port()), "--num-prompts", "1"],
                        capsys)
    assert code == 1
    assert err.count("\n") == 1 and "cannot reach the server" in err, err
    assert time.monotonic() - start < 30  # before any tokenizer or workload is built


# ---- against a real server -------------------------------------------------------------------
def token_counters(base: str) -> dict[str, float]:
    """kvray's request and token counters, each summed over its labels."""
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=30).text
    sums = dict.fromkeys(("kvray:prompt_tokens_total", "kvray:generation_tokens_total",
                          "kvray:request_success_total"), 0.0)
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


@pytest.mark.serve
def test_bench_serve_against_kvray_serve_matches_the_servers_own_counts(tiny_model_dir,
                                                                        tmp_path):
    model = tiny_model_dir("llama_gqa")
    with launch_server(model, ["--ingress", "process"]) as base:
        before = token_counters(base)
        proc = subprocess.run(
            [sys.executable, "-m", "kvray.cli", "bench", "serve", "--base-url", base,
             "--api-key", API_KEY, "--tokenizer", str(model), "--num-prompts", "8",
             "--max-concurrency", "4", "--random-input-len", "32", "--random-output-len", "8",
             "--random-range-ratio", "0.25", "--metric-percentiles", "50,90,99",
             "--goodput", "ttft:60000", "tpot:60000", "--save-result", "--result-dir",
             str(tmp_path), "--result-filename", "result.json", "--metadata", "run=ci",
             "--disable-tqdm"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        deadline = time.monotonic() + 10  # the counters move as each request is finished
        while (after := token_counters(base))["kvray:request_success_total"] < (
                before["kvray:request_success_total"] + 8) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"], result["run"]) == (8, 0, "ci")
    assert result["model_id"] == model.name and result["max_concurrency"] == 4
    assert result["total_input_tokens"] == (after["kvray:prompt_tokens_total"]
                                            - before["kvray:prompt_tokens_total"])
    assert result["total_output_tokens"] == (after["kvray:generation_tokens_total"]
                                             - before["kvray:generation_tokens_total"])
    assert sum(result["output_lens"]) == result["total_output_tokens"]
    assert all(6 <= n <= 10 for n in result["output_lens"])  # EOS ignored: as asked
    for name in ("ttft", "tpot", "itl", "e2el"):
        p50, p90, p99 = (result[f"p{p}_{name}_ms"] for p in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, name
        assert result[f"median_{name}_ms"] == pytest.approx(p50)
    assert result["p99_ttft_ms"] <= result["p99_e2el_ms"]
    assert 0 < result["request_goodput"] <= result["request_throughput"]
    assert result["request_throughput"] == pytest.approx(8 / result["duration"])
    assert statistics.fmean(result["ttfts"]) * 1000 == pytest.approx(result["mean_ttft_ms"])
