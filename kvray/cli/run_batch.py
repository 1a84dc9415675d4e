"""``kvray run-batch``: an OpenAI batch file run offline through kvray's own OpenAI app.

Each input line (OpenAI's batch format: ``{"custom_id", "method": "POST", "url", "body"}``)
is POSTed, in process, to the :class:`~kvray.serve.openai_app.OpenAIServer` that ``kvray
serve`` runs, over one :class:`~kvray.engine.async_engine.AsyncLLM`: a result's body is
exactly what the online API answers to that body, its validation and errors included
(``stream`` is forced off). Up to ``--max-in-flight`` lines run at once, so the engine
batches them as it batches a busy server's requests.

OUTPUT has one line per non-blank input line, in input order: ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error": null}``; a line that is no valid
batch line gets ``"response": null`` and ``"error": {"code", "message"}``. Each result is
appended (flushed) as it completes, so a killed run loses only the lines in flight; a run
on an existing OUTPUT skips the lines that have an answer there (a 5xx or a line error is
redone), and OUTPUT is rewritten in input order at the end (temp file + rename).

A batch run is also a calibration run for a mixture-of-experts model: ``--expert-load-out
FILE`` writes the tokens the batch routed to each expert of each layer (JSON, the counts
``expert_placement`` balances the experts over the ranks by).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvray.cli.flags import _positive_int, add_config_flags, config_from_args

logger = logging.getLogger("kvray.cli")
# The POST routes of the OpenAI app that run the model (vLLM's aliases of the pooling routes
# included): a batch line may name any of them.
URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
        "/classify", "/v1/classify", "/pooling", "/v1/pooling",
        "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
IN_FLIGHT_PER_SEQ = 4  # default lines in flight per max_num_seqs: the engine never starves
MAX_WAITING = 1 << 20  # the engine's admission lifted: run-batch admits by --max-in-flight
RETRIES = 5  # a 503 (the engine restarting after a worker failure) is retried this often


@dataclass
class BatchLine:
    """One non-blank input line: a request to run, or why it cannot run (``error``)."""

    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    error: dict[str, str] | None = None


def _bad(custom_id: str | None, code: str, message: str) -> BatchLine:
    return BatchLine(custom_id, error={"code": code, "message": message})


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_line(raw: bytes, number: int, seen: set[str]) -> BatchLine:
    """Input line ``number`` (1-based) checked as a batch line; ``seen`` holds the custom_ids
    of the lines before it (this line's is added)."""
    try:
        obj = json.loads(raw)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError alike
        return _bad(None, "invalid_json", f"line {number}: not valid JSON ({err})")
    if not isinstance(obj, dict):
        return _bad(None, "invalid_json", f"line {number}: a batch line is a JSON object, "
                    f"got {type(obj).__name__}")
    cid = obj.get("custom_id")
    if cid is None:
        return _bad(None, "missing_custom_id", f"line {number}: custom_id: required (a "
                    "string that names the line in the output)")
    if not isinstance(cid, str) or not cid or not _utf8(cid):
        return _bad(None, "invalid_custom_id", f"line {number}: custom_id: must be a "
                    f"non-empty string, got {_show(cid)}")
    if cid in seen:
        return _bad(cid, "duplicate_custom_id", f"line {number}: custom_id {cid!r} is "
                    "already used by an earlier line; every line needs its own")
    seen.add(cid)
    method = obj.get("method")
    if method != "POST":
        return _bad(cid, "invalid_method", f"line {number}: method: must be 'POST', got "
                    f"{_show(method)}")
    url = obj.get("url")
    if not isinstance(url, str) or url not in URLS:
        return _bad(cid, "invalid_url", f"line {number}: url: {_show(url)} is not one of "
                    f"{', '.join(URLS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return _bad(cid, "invalid_body", f"line {number}: body: required, a JSON object "
                    f"(got {_show(body)})")
    return BatchLine(cid, url, {**body, "stream": False})


def _utf8(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (a lone surrogate from a ``\\ud800`` escape
    cannot)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def read_input(path: str) -> list[BatchLine]:
    """The non-blank lines of the batch file at ``path`` (``-``: stdin), each checked; a
    ValueError naming the file when it cannot be read."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"-i {path}: cannot read it ({err.strerror or err})") from None
    seen: set[str] = set()
    return [parse_line(raw, number, seen)
            for number, raw in enumerate(data.split(b"\n"), 1) if raw.strip()]


def read_results(path: Path) -> dict[str, str]:
    """The result lines already in OUTPUT worth keeping, by custom_id: the request ran and
    got an answer other than a 5xx. A ValueError when ``path`` is no batch output file (only
    its last line may be cut short: a killed run's)."""
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as err:
        raise ValueError(f"-o {path}: cannot read it ({err.strerror or err})") from None
    kept: dict[str, str] = {}
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            if number == len(lines):
                continue
            rec = None
        if not isinstance(rec, dict) or "custom_id" not in rec or "response" not in rec:
            raise ValueError(f"-o {path}: line {number} is not a batch result, so this is no "
                             "batch output file to resume; remove it or choose another -o")
        resp = rec["response"]
        status = resp.get("status_code") if isinstance(resp, dict) else None
        if isinstance(rec["custom_id"], str) and isinstance(status, int) and status < 500:
            kept[rec["custom_id"]] = raw.rstrip(b"\r").decode(errors="replace")
    return kept


def _record(custom_id: str | None, response: dict | None, error: dict | None) -> str:
    """One output line (compact JSON, UTF-8 text as is)."""
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                       "response": response, "error": error},
                      ensure_ascii=False, separators=(",", ":"))


async def post(app: Any, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` as JSON to ``url`` of the ASGI ``app``, in process: the status and the
    JSON body of the answer (its text when it is not JSON)."""
    payload = json.dumps(body).encode()
    answered = asyncio.Event()
    sent_body = False
    status, chunks = 500, []

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await answered.wait()  # the client stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": url, "raw_path": url.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 0),
             "server": ("kvray-run-batch", 0),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode())]}
    try:
        await app(scope, receive, send)
    finally:
        answered.set()
    raw = b"".join(chunks)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


@dataclass
class Tally:
    """What the lines run so far came to: for the summary line."""

    ok: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0  # from the engine ready to the last line done

    def add(self, status: int | None, body: Any) -> None:
        if status == 200:
            self.ok += 1
        else:
            self.failed += 1
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):  # completions and embeddings' names, or the Responses'
            self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
            self.generated_tokens += usage.get("completion_tokens",
                                               usage.get("output_tokens", 0))


class FileSink:
    """OUTPUT on disk: each result appended and flushed as it completes; rewritten in input
    order by :meth:`finish`. ``kept`` (index -> line) are the results of an earlier run."""

    def __init__(self, path: Path, kept: dict[int, str]) -> None:
        self.path, self.lines = path, dict(kept)
        if path.exists():  # drop what is not kept (a cut line, 5xx) before appending
            write_atomically(path, [self.lines[i] for i in sorted(self.lines)])
        self.file: TextIO = path.open("a", encoding="utf-8")

    def add(self, index: int, line: str) -> None:
        self.lines[index] = line
        self.file.write(line + "\n")
        self.file.flush()

    def finish(self, total: int) -> None:
        self.file.close()
        write_atomically(self.path, [self.lines[i] for i in range(total)])

    def close(self) -> None:
        self.file.close()


class StdoutSink:
    """OUTPUT on stdout: results written in input order, each as soon as those before it
    are (no resuming)."""

    def __init__(self) -> None:
        self.ready: dict[int, str] = {}
        self.next = 0

    def add(self, index: int, line: str) -> None:
        self.ready[index] = line
        while self.next in self.ready:
            sys.stdout.write(self.ready.pop(self.next) + "\n")
            self.next += 1
        sys.stdout.flush()

    def finish(self, total: int) -> None:
        assert self.next == total and not self.ready, "a line's result is missing"

    def close(self) -> None:
        sys.stdout.flush()


def write_atomically(path: Path, lines: list[str]) -> None:
    """``path`` replaced by ``lines`` at once: written beside it, synced, renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class BatchRun:
    """Runs lines through the OpenAI app, ``max_in_flight`` at once, handing each result
    line to ``sink`` as it completes, with a progress bar on stderr unless ``quiet``."""

    sink: FileSink | StdoutSink
    max_in_flight: int
    quiet: bool = False
    app: Any = None  # the OpenAI app (ASGI), given to run()
    tally: Tally = field(default_factory=Tally)

    async def run(self, app: Any, todo: list[tuple[int, BatchLine]]) -> None:
        from tqdm import tqdm

        self.app, lines = app, iter(todo)
        bar = tqdm(total=len(todo), desc="run-batch", unit="line", file=sys.stderr,
                   disable=self.quiet, dynamic_ncols=True)

        async def worker() -> None:
            for index, line in lines:  # one shared iterator: each line goes to one worker
                self.sink.add(index, await self.result(line))
                bar.update()

        start = time.perf_counter()
        try:
            await asyncio.gather(*(worker() for _ in range(min(self.max_in_flight,
                                                                len(todo)))))
        finally:
            bar.close()
            self.tally.wall_s = time.perf_counter() - start

    async def result(self, line: BatchLine) -> str:
        """The output line of one batch line."""
        if line.error is not None:
            self.tally.add(None, None)
            return _record(line.custom_id, None, line.error)
        assert line.body is not None
        for attempt in range(RETRIES + 1):
            try:
                status, body = await post(self.app, line.url, line.body)
            except Exception as err:  # a bug, not the request's fault: the line records it
                logger.exception("custom_id %s failed", line.custom_id)
                self.tally.add(None, None)
                return _record(line.custom_id, None, {
                    "code": "internal_error", "message": f"kvray failed on this line: {err!r}"})
            if status != 503 or attempt == RETRIES:
                break
            await asyncio.sleep(2.0 ** attempt)
        self.tally.add(status, body)
        return _record(line.custom_id, {"status_code": status,
                                        "request_id": f"req_{uuid.uuid4().hex}",
                                        "body": body}, None)


def _output_path(output: str, input_path: str) -> Path | None:
    """OUTPUT as a path (None: stdout); a ValueError when it cannot be written."""
    if output == "-":
        return None
    path = Path(output)
    if input_path != "-" and path.resolve() == Path(input_path).resolve():
        raise ValueError(f"-o {output}: is the input file; write the results elsewhere")
    if not path.parent.is_dir():
        raise ValueError(f"-o {output}: folder {path.parent} does not exist")
    if path.is_dir():
        raise ValueError(f"-o {output}: is a folder; give a file path")
    return path


def _engine_config(args: argparse.Namespace) -> tuple[Any, str]:
    """The engine config (built-in model when none is named, admission lifted unless
    ``--max-waiting`` is given) and the model's served name."""
    from kvray.models.default_model import resolve_model_path, with_builtin_model
    from kvray.serve.options import served_model_name

    if args.model_positional is not None:
        args.model = args.model_positional
    config = with_builtin_model(config_from_args(args))
    path = resolve_model_path(config.model.model)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    update: dict[str, Any] = {"model": config.model.model_copy(update={"model": str(path)})}
    if args.max_waiting is None:
        update["server"] = config.server.model_copy(update={"max_waiting": MAX_WAITING})
    return config.model_copy(update=update), served_model_name(config, path)


def _expert_load_path(path: str | None) -> Path | None:
    """Where ``--expert-load-out`` writes (checked before the run: a folder that exists)."""
    if path is None:
        return None
    out = Path(path)
    if not out.parent.is_dir() or out.is_dir():
        raise ValueError(f"--expert-load-out {path}: give a file path in a folder that exists")
    return out


def _run_engine(config: Any, name: str, run: BatchRun, todo: list[tuple[int, BatchLine]],
                expert_load_out: Path | None = None) -> None:
    """Build the engine and the OpenAI app over it, run ``todo`` (then write the expert
    load to ``expert_load_out``), shut the engine down."""
    import torch

    from kvray.engine.async_engine import AsyncLLM
    from kvray.hardware import available_cores
    from kvray.serve.openai_app import OpenAIServer

    if config.parallel.world_size == 1 and not torch.cuda.is_available():
        torch.set_num_threads(available_cores())
    engine = AsyncLLM(config)
    try:
        if expert_load_out is not None and not engine.engine.spec.num_experts:
            raise ValueError(f"--expert-load-out: {name} is not a mixture-of-experts model")
        server = OpenAIServer(engine, name, engine.engine.max_model_len, None, config.server,
                              lora=config.lora, model_head=engine.engine.spec.head)
        asyncio.run(run.run(server.app, todo))
        if expert_load_out is not None:
            write_atomically(expert_load_out, [json.dumps(engine.expert_load())])
            print(f"kvray run-batch: tokens per expert of each MoE layer in "
                  f"{expert_load_out} (for expert_placement)", file=sys.stderr)
    finally:
        engine.shutdown()


def cmd_run_batch(args: argparse.Namespace) -> int:
    """Run the batch file ``-i`` and write its results to ``-o`` (see the module doc)."""
    from kvray.cli.generate import show_kvray_info_on_stderr

    lines = read_input(args.input_file)
    out = _output_path(args.output_file, args.input_file)
    expert_load_out = _expert_load_path(args.expert_load_out)
    config, name = _engine_config(args)
    done = read_results(out) if out is not None and out.exists() else {}
    kept = {i: done[line.custom_id] for i, line in enumerate(lines)
            if line.error is None and line.custom_id in done}
    todo = [(i, line) for i, line in enumerate(lines) if i not in kept]
    if out is not None and out.exists():
        print(f"kvray run-batch: resuming {out}: {len(kept)} of {len(lines)} lines already "
              f"have a result there (skipped); running {len(todo)}", file=sys.stderr)
    show_kvray_info_on_stderr()
    serve_log = logging.getLogger("kvray.serve")
    serve_level = serve_log.level
    serve_log.setLevel(logging.WARNING)  # no log line per request
    sink = StdoutSink() if out is None else FileSink(out, kept)
    in_flight = args.max_in_flight or IN_FLIGHT_PER_SEQ * config.scheduler.max_num_seqs
    run = BatchRun(sink, in_flight, quiet=args.disable_tqdm)
    try:
        if any(line.error is None for _, line in todo):
            _run_engine(config, name, run, todo, expert_load_out)
        else:  # nothing for the model (all done, or bad lines only): no engine to build
            asyncio.run(run.run(None, todo))
    except KeyboardInterrupt:
        print(f"\nkvray run-batch: interrupted; the results so far are in {out or 'stdout'}: "
              "run the same command again to resume", file=sys.stderr)
        return 130
    finally:
        sink.close()
        serve_log.setLevel(serve_level)
    sink.finish(len(lines))
    _print_summary(run.tally, len(kept), out)
    return 0


def _print_summary(tally: Tally, skipped: int, out: Path | None) -> None:
    wall_s = max(tally.wall_s, 1e-9)
    print(f"kvray run-batch: {tally.ok} ok, {tally.failed} failed, {skipped} skipped "
          f"(already done) in {wall_s:.1f} s; {tally.prompt_tokens:,} prompt + "
          f"{tally.generated_tokens:,} generated tokens, "
          f"{tally.generated_tokens / wall_s:,.1f} generated tok/s, "
          f"{(tally.prompt_tokens + tally.generated_tokens) / wall_s:,.1f} total tok/s; "
          f"results in {out or 'stdout'}", file=sys.stderr)


def add_run_batch_parser(sub: argparse._SubParsersAction) -> None:
    """The ``run-batch`` subcommand."""
    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) through the "
                       "OpenAI API, offline")
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                   help="model directory or .gguf file (default: the built-in SmolLM2)")
    p.add_argument("-i", "--input-file", required=True, metavar="INPUT",
                   help="batch file: one {custom_id, method, url, body} request per line, "
                   "OpenAI's batch format ('-': stdin)")
    p.add_argument("-o", "--output-file", required=True, metavar="OUTPUT",
                   help="results, one line per input line in input order ('-': stdout); an "
                   "existing OUTPUT is resumed: lines with a result there are skipped")
    p.add_argument("--max-in-flight", type=_positive_int, default=None, metavar="N",
                   help=f"lines running at once (default {IN_FLIGHT_PER_SEQ} x max_num_seqs)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--expert-load-out", metavar="FILE", default=None,
                   help="mixture-of-experts models: after the batch, write the tokens it "
                   "routed to each expert of each layer to FILE (JSON; give it as "
                   "expert_placement to balance the experts over the ranks by this load)")
    add_config_flags(p)
    p.set_defaults(func=cmd_run_batch)
