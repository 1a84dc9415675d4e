"""Pooling models and endpoints: embeddings of decoder models equal transformers' pooled,
normalised hidden states (last token, mean, first; batched and one by one; chunked prefill
and prefix-cache hits included), a sentence-transformers checkpoint's own pooling config is
honoured, a base-model (``*Model``) checkpoint loads, ``*ForSequenceClassification`` scores
equal the classification head's logits; and through the OpenAI app: ``/v1/embeddings``
(float and base64, dimensions, token ids), ``/score`` and ``/rerank``, and their 400s."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch
import transformers
from fastapi.testclient import TestClient

from kvray import LLM, SamplingParams
from kvray.sampling_params import PoolingParams
from tests.helpers.tiny_models import build_tokenizer, make_tiny_model

TEXTS = ["Hello world", "The capital of France is Paris. The capital of Italy is Rome.",
         "numbers 0123456789 and symbols", "Once upon a time there was a small model that "
         "generated tokens one at a time, with a paged KV cache on Ray."]


def _reference(model_dir, texts, pooling_type: str, normalize: bool = True) -> list:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    hf = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for text in texts:
        with torch.no_grad():
            hidden = hf(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0]
        vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling_type]
        out.append(torch.nn.functional.normalize(vec, dim=0) if normalize else vec)
    return out


def _embed(llm: LLM, texts, **pooling) -> list[torch.Tensor]:
    outs = llm.generate(texts, SamplingParams(pooling=PoolingParams(**pooling)),
                        use_tqdm=False)
    return [torch.tensor(o.pooled) for o in outs]


@pytest.fixture(scope="module", params=["llama_gqa", "qwen3_qknorm_headdim"])
def embed_model(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp("embed") / request.param)
    # small chunks and blocks: long prompts prefill in several chunks
    llm = LLM(str(path), dtype="float32", block_size=4, max_model_len=256,
              max_num_batched_tokens=16, max_num_seqs=4)
    yield path, llm
    llm.shutdown()


@pytest.mark.parity
@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
def test_embeddings_equal_transformers_pooled_hidden_states(embed_model, pooling_type):
    path, llm = embed_model
    want = _reference(path, TEXTS, pooling_type)
    batched = _embed(llm, TEXTS, pooling_type=pooling_type)
    single = [_embed(llm, [t], pooling_type=pooling_type)[0] for t in TEXTS]
    for got_b, got_s, ref in zip(batched, single, want, strict=True):
        assert torch.allclose(got_b, ref, atol=1e-5), (got_b - ref).abs().max()
        assert torch.allclose(got_s, ref, atol=1e-5)
        assert abs(float(got_b.norm()) - 1.0) < 1e-5


@pytest.mark.parity
def test_prefix_cache_hits_keep_last_token_embeddings_exact(embed_model):
    path, llm = embed_model
    long = TEXTS[3] * 2
    first = _embed(llm, [long])[0]
    hits_before = llm.llm_engine.stats.prefix_cache_hits
    again = _embed(llm, [long])[0]  # its prompt's blocks are cached now
    assert llm.llm_engine.stats.prefix_cache_hits > hits_before
    assert torch.allclose(first, again, atol=1e-6)
    assert torch.allclose(again, _reference(path, [long], "last")[0], atol=1e-5)
    # a mean needs every position: such a request never hits
    hits_before = llm.llm_engine.stats.prefix_cache_hits
    mean = _embed(llm, [long], pooling_type="mean")[0]
    assert llm.llm_engine.stats.prefix_cache_hits == hits_before
    assert torch.allclose(mean, _reference(path, [long], "mean")[0], atol=1e-5)


@pytest.mark.parity
def test_dimensions_and_normalize_options(embed_model):
    path, llm = embed_model
    raw = _reference(path, TEXTS[:2], "last", normalize=False)
    got = _embed(llm, TEXTS[:2], normalize=False)
    for g, r in zip(got, raw, strict=True):
        assert torch.allclose(g, r, atol=1e-5)
    cut = _embed(llm, TEXTS[:2], dimensions=8)
    for c, r in zip(cut, raw, strict=True):
        assert torch.allclose(c, torch.nn.functional.normalize(r[:8], dim=0), atol=1e-5)


@pytest.mark.parity
def test_token_embeddings_are_every_prompt_positions_hidden_state(embed_model):
    """vLLM's ``token_embed``: one normalised row per prompt token, also when the prompt
    prefills in several chunks and after a cached run of the same prompt."""
    path, llm = embed_model
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    long = TEXTS[3] * 2  # several 16-token chunks
    llm.embed([long], use_tqdm=False)  # its blocks are cached now: rows must still be whole
    outs = llm.encode([TEXTS[0], long], use_tqdm=False, pooling_task="token_embed")
    for text, out in zip([TEXTS[0], long], outs, strict=True):
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            want = hf(torch.tensor([ids])).last_hidden_state[0]
        got = out.outputs.data
        assert got.shape == (len(ids), want.shape[1]) and out.prompt_token_ids == ids
        assert torch.allclose(got, torch.nn.functional.normalize(want, dim=-1), atol=1e-5)
    raw = llm.encode([TEXTS[0]], PoolingParams(use_activation=False), use_tqdm=False,
                     pooling_task="token_embed")[0].outputs.data
    with torch.no_grad():
        want = hf(torch.tensor([tok(TEXTS[0])["input_ids"]])).last_hidden_state[0]
    assert torch.allclose(raw, want, atol=1e-5)
    # the default task stays one vector; embed is an embedding whatever params it gets
    assert llm.encode([TEXTS[0]], use_tqdm=False)[0].outputs.data.shape == (want.shape[1],)
    token_params = PoolingParams(task="token_embed")
    assert len(llm.embed([TEXTS[0]], token_params, use_tqdm=False)[0].outputs.embedding) \
        == want.shape[1]


@pytest.mark.unit
def test_pooling_params_keep_all_rows_for_the_token_tasks_only():
    assert PoolingParams(task="token_embed").pooling_type == "all"
    assert PoolingParams(task="token_classify", pooling_type="all").pooling_type == "all"
    for bad in (dict(task="embed", pooling_type="all"),
                dict(task="token_embed", pooling_type="mean"), dict(task="reward")):
        with pytest.raises(ValueError, match="pooling_type|task"):
            PoolingParams(**bad)
    for bad in (dict(use_activation="no"), dict(normalize="yes"), dict(activation=None),
                dict(dimensions=True), dict(task="classify", dimensions=2)):
        with pytest.raises(ValueError, match=next(iter(bad)) if "task" not in bad
                           else "dimensions"):
            PoolingParams(**bad)
    off = PoolingParams(use_activation=False)
    assert off.normalize is False and off.activation is False
    on = PoolingParams(normalize=False, activation=False, use_activation=True)
    assert on.normalize is True and on.activation is True


def _sentence_transformers_dir(base, path, mode: str, normalize: bool):
    """A sentence-transformers checkpoint of ``base``: the base model's weights
    (``*Model``, keys without ``model.``), modules.json, its pooling config."""
    hf = transformers.AutoModel.from_pretrained(str(base), dtype=torch.float32)
    hf.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir()
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hf.config.hidden_size, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": mode == "lasttoken"}))
    return path


@pytest.mark.parity
@pytest.mark.parametrize(("mode", "normalize"), [("mean", True), ("lasttoken", False)])
def test_a_sentence_transformers_checkpoint_pools_as_it_says(tmp_path, tiny_model_dir, mode,
                                                              normalize):
    path = _sentence_transformers_dir(tiny_model_dir("qwen3_qknorm_headdim"),
                                      tmp_path / "st", mode, normalize)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Model"]  # the base model alone
    llm = LLM(str(path), dtype="float32", block_size=4, max_model_len=256)
    try:
        outs = llm.embed(TEXTS, use_tqdm=False)  # its own pooling
        got = [torch.tensor(o.outputs.embedding) for o in outs]
        assert all(o.finished and o.prompt_token_ids for o in outs)
        cut = llm.embed(TEXTS[:1], use_tqdm=False, truncate_prompt_tokens=3)[0]
        assert cut.prompt_token_ids == outs[0].prompt_token_ids[-3:]
        encoded = llm.encode(TEXTS, use_tqdm=False)  # vLLM's tensors, the same vectors
        assert all(torch.allclose(e.outputs.data, g, atol=1e-6)
                   for e, g in zip(encoded, got, strict=True))
        want = _reference(path, TEXTS, "mean" if mode == "mean" else "last", normalize)
        for g, r in zip(got, want, strict=True):
            assert torch.allclose(g, r, atol=1e-5)
        with pytest.raises(ValueError, match="pooling model"):  # no LM head: no text
            llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny random Qwen2ForSequenceClassification with one label (a reranker)."""
    config = transformers.Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_labels=1,
                                      pad_token_id=0, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.Qwen2ForSequenceClassification(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("cls") / "reranker"
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path, model


@pytest.mark.parity
def test_classification_scores_are_the_heads_logits_through_the_models_activation(
        classifier):
    """vLLM's outputs: ``classify`` gives ``probs`` (a one-label reranker's sigmoid;
    ``activation=False``: the logits), ``score`` the pair's activated logit."""
    path, hf = classifier
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    llm = LLM(str(path), dtype="float32", block_size=4, max_model_len=256)
    try:
        probs = llm.classify(TEXTS, use_tqdm=False)
        raw = llm.classify(TEXTS, use_tqdm=False,
                           pooling_params=PoolingParams(activation=False))
        for text, p, r in zip(TEXTS, probs, raw, strict=True):
            with torch.no_grad():
                want = hf(torch.tensor([tok(text)["input_ids"]])).logits[0]
            assert torch.allclose(torch.tensor(r.outputs.probs), want, atol=1e-5)
            assert torch.allclose(torch.tensor(p.outputs.probs), want.sigmoid(), atol=1e-6)
            assert p.outputs.num_classes == 1
        scores = llm.score("capital of France", TEXTS[:3], use_tqdm=False)
        for doc, got in zip(TEXTS[:3], scores, strict=True):
            ids = tok("capital of France", text_pair=doc)["input_ids"]
            with torch.no_grad():
                want = hf(torch.tensor([ids])).logits[0, 0].sigmoid().item()
            assert abs(got.outputs.score - want) < 1e-6 and got.prompt_token_ids == ids
        with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
            llm.score(["a", "b"], ["c", "d", "e"])
        # vLLM's LLM.reward: the head's activated logits at every prompt token
        # Regression: use_activation (vLLM's) also turned on the embeddings' normalisation,
        # which L2-normalised class logits before the sigmoid
        used = llm.classify(TEXTS[:2], use_tqdm=False,
                            pooling_params=PoolingParams(use_activation=True))
        assert torch.allclose(torch.tensor([u.outputs.probs for u in used]),
                              torch.tensor([p.outputs.probs for p in probs[:2]]), atol=1e-6)
        rewards = llm.reward(TEXTS[:2], use_tqdm=False, truncate_prompt_tokens=9)
        for text, out in zip(TEXTS[:2], rewards, strict=True):
            ids = tok(text)["input_ids"][-9:]
            with torch.no_grad():
                hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
                want = hf.score(hidden).sigmoid()
            assert out.prompt_token_ids == ids and out.outputs.data.shape == (len(ids), 1)
            assert torch.allclose(out.outputs.data, want, atol=1e-5)
    finally:
        llm.shutdown()


@pytest.mark.unit
def test_score_takes_every_name_vllm_gave_its_texts():
    from kvray.serve.pooling_api import ScoreRequest

    for first, second in (("text_1", "text_2"), ("data_1", "data_2"),
                          ("queries", "documents")):
        req = ScoreRequest(**{first: "q", second: ["a", "b"]})
        assert (req.text_1, req.text_2) == ("q", ["a", "b"])


@pytest.mark.unit
@pytest.mark.parametrize(("config", "want"), [
    ({"id2label": {"0": "LABEL_0"}}, "sigmoid"),  # one label: a reranker
    ({"id2label": {"0": "a", "1": "b"}}, "softmax"),
    ({"id2label": {"0": "a", "1": "b"}, "problem_type": "multi_label_classification"},
     "sigmoid"),
    ({"id2label": {"0": "a"}, "sentence_transformers": {
        "activation_fn": "torch.nn.modules.linear.Identity"}}, "identity"),
    # regressions: a regression head's logits are its scores; the older cross-encoder key
    ({"id2label": {"0": "a"}, "problem_type": "regression"}, "identity"),
    ({"id2label": {"0": "a", "1": "b"}, "problem_type": "regression"}, "identity"),
    ({"id2label": {"0": "a"},
      "sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"},
     "identity"),
    ({"id2label": {"0": "a"},
      "sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, "tanh"),
    # an explicit problem type comes first (vLLM's order)
    ({"id2label": {"0": "a"}, "problem_type": "regression", "sentence_transformers": {
        "activation_fn": "torch.nn.modules.activation.Sigmoid"}}, "identity"),
    ({"id2label": {"0": "a", "1": "b"}, "problem_type": "single_label_classification",
      "sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"},
     "softmax"),
    ({}, "softmax")])
def test_a_classifiers_activation_is_read_from_its_config(tmp_path, config, want):
    from kvray.models.pooling import activated, classify_activation

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert classify_activation(tmp_path) == want
    logits = [2.0, -1.0, 800.0, -800.0]
    scores = activated(logits, want)
    if want == "sigmoid":
        assert scores[2] == 1.0 and scores[3] == 0.0 and abs(scores[0] - 0.8807971) < 1e-6
    elif want == "softmax":
        assert abs(sum(scores) - 1.0) < 1e-9 and scores[2] == 1.0
    elif want == "tanh":
        assert scores[2] == 1.0 and scores[3] == -1.0 and abs(scores[0] - 0.9640276) < 1e-6
    else:
        assert scores == logits


# ---- the HTTP endpoints ----------------------------------------------------------------
def _app(model_dir, head_check: str):
    from kvray.config import config_from_flat
    from kvray.engine.async_engine import AsyncLLM
    from kvray.serve.openai_app import OpenAIServer

    engine = AsyncLLM(config_from_flat({"model": str(model_dir), "dtype": "float32",
                                        "block_size": 4, "max_model_len": 256}))
    assert engine.engine.spec.head == head_check
    return engine, TestClient(OpenAIServer(engine, "m", 256,
                                           model_head=engine.engine.spec.head).app)


@pytest.mark.serve
def test_rerank_and_score_use_the_classification_head(classifier):
    path, hf = classifier
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    engine, client = _app(path, "classify")
    try:
        docs = ["Paris is the capital.", "Bananas are yellow.", "Rome, Italy"]
        resp = client.post("/rerank", json={"query": "capital of France", "documents": docs,
                                            "top_n": 2})
        assert resp.status_code == 200, resp.text
        want = []
        for doc in docs:
            ids = tok("capital of France", text_pair=doc)["input_ids"]
            with torch.no_grad():
                want.append(float(hf(torch.tensor([ids])).logits[0, 0].sigmoid()))
        results = resp.json()["results"]
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [r["index"] for r in results] == order
        for r in results:
            assert abs(r["relevance_score"] - want[r["index"]]) < 1e-5
            assert r["document"]["text"] == docs[r["index"]]
        score = client.post("/v1/score", json={"text_1": "capital of France",
                                               "text_2": docs}).json()
        assert all(abs(d["score"] - w) < 1e-5 for d, w in zip(score["data"], want,
                                                               strict=True))
        # vLLM's /classify: the activated head per input, the likeliest class's name
        classified = client.post("/classify", json={"model": "m", "input": docs})
        assert classified.status_code == 200, classified.text
        body = classified.json()
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        for i, (doc, item) in enumerate(zip(docs, body["data"], strict=True)):
            with torch.no_grad():
                logit = hf(torch.tensor([tok(doc)["input_ids"]])).logits[0, 0]
            assert item["index"] == i and item["label"] == "LABEL_0"
            assert item["num_classes"] == 1
            assert abs(item["probs"][0] - logit.sigmoid().item()) < 1e-5
        raw = client.post("/v1/classify", json={"input": docs[0], "activation": False})
        assert abs(raw.json()["data"][0]["probs"][0] - float(hf(torch.tensor(
            [tok(docs[0])["input_ids"]])).logits[0, 0])) < 1e-4
        # vLLM's /pooling: the model's own task (classify here), or per token
        pooled = client.post("/pooling", json={"input": docs[:2]})
        assert pooled.status_code == 200, pooled.text
        for doc, item in zip(docs[:2], pooled.json()["data"], strict=True):
            assert item["object"] == "pooling"
            with torch.no_grad():
                logit = hf(torch.tensor([tok(doc)["input_ids"]])).logits[0, 0]
            assert abs(item["data"][0] - logit.sigmoid().item()) < 1e-5
        rows = client.post("/v1/pooling", json={"input": docs[0], "task": "token_classify",
                                                "use_activation": False}).json()["data"][0]
        with torch.no_grad():
            hidden = hf.model(torch.tensor([tok(docs[0])["input_ids"]])).last_hidden_state
            want = hf.score(hidden)[0]
        assert torch.allclose(torch.tensor(rows["data"]), want, atol=1e-4)
        # a pooling model serves no text
        resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
        for body, param in [({"query": "q", "documents": []}, "documents"),
                            ({"query": "", "documents": ["a"]}, "query"),
                            ({"query": "q", "documents": [{"x": 1}]}, "documents.0"),
                            ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n")]:
            resp = client.post("/rerank", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, body
        every = client.post("/rerank", json={"query": "q", "documents": docs, "top_n": 0})
        assert len(every.json()["results"]) == len(docs)  # vLLM's: 0 means all
        resp = client.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "text_2"
    finally:
        engine.shutdown()


@pytest.mark.serve
def test_embeddings_endpoint_errors_name_the_field(tiny_model_dir):
    engine, client = _app(tiny_model_dir("llama_gqa"), "lm")
    try:
        for body, param in [({"input": []}, "input"), ({"input": ""}, "input"),
                            ({"input": [[]]}, "input"), ({"input": [10**9]}, "input"),
                            ({"input": "x " * 400}, "input"), ({"input": 5}, "input"),
                            ({"input": "x", "dimensions": 0}, "dimensions"),
                            ({"input": "x", "dimensions": 10**6}, "dimensions"),
                            ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                            ({"input": ["a"] * 10**4}, "input")]:
            resp = client.post("/v1/embeddings", json=body)
            assert resp.status_code == 400, (body, resp.text)
            assert resp.json()["error"]["param"] == param, (body, resp.json())
        resp = client.post("/classify", json={"input": "x"})  # no classification head
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
        ok = client.post("/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]],
                                                 "encoding_format": "base64"}).json()
        floats = client.post("/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]]}).json()
        for b, f in zip(ok["data"], floats["data"], strict=True):
            raw = base64.b64decode(b["embedding"])
            decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
            assert len(decoded) == len(f["embedding"])
            assert max(abs(x - y) for x, y in zip(decoded, f["embedding"], strict=True)) < 1e-6
        assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] == 5
    finally:
        engine.shutdown()


@pytest.mark.serve
def test_pooling_routes_take_a_conversation_truncation_and_use_activation(tiny_model_dir):
    """vLLM's pooling inputs: ``messages`` (the chat template's ids, no assistant turn
    opened), ``truncate_prompt_tokens`` (the last k), ``add_special_tokens``,
    ``use_activation``; ``/pooling`` per token; and their 400s."""
    path = tiny_model_dir("llama_gqa")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    llm_engine, client = _app(path, "lm")
    try:
        def embedding(body, route="/v1/embeddings"):
            resp = client.post(route, json=body)
            assert resp.status_code == 200, (body, resp.text)
            return resp.json()

        hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()

        def direct(ids, normalize=True):  # transformers' last hidden state of ids
            with torch.no_grad():
                vec = hf(torch.tensor([ids])).last_hidden_state[0, -1]
            return torch.nn.functional.normalize(vec, dim=0) if normalize else vec

        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello there"}]
        conv_ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           add_generation_prompt=False)["input_ids"]
        body = embedding({"messages": messages})
        assert body["usage"]["prompt_tokens"] == len(conv_ids)
        assert torch.allclose(torch.tensor(body["data"][0]["embedding"]), direct(conv_ids),
                              atol=1e-5)
        opened = embedding({"messages": messages, "add_generation_prompt": True})
        assert opened["usage"]["prompt_tokens"] > len(conv_ids)
        ids = tok(TEXTS[1])["input_ids"]
        cut = embedding({"input": TEXTS[1], "truncate_prompt_tokens": 5})
        assert cut["usage"]["prompt_tokens"] == 5
        assert torch.allclose(torch.tensor(cut["data"][0]["embedding"]), direct(ids[-5:]),
                              atol=1e-5)
        # a whole context's input pools (its sampled token is never cached), as in vLLM;
        # -1 keeps as much
        full = embedding({"input": [list(range(5, 261))]})
        assert full["usage"]["prompt_tokens"] == 256
        kept = embedding({"input": [list(range(5, 300))], "truncate_prompt_tokens": -1})
        assert kept["usage"]["prompt_tokens"] == 256
        bare = embedding({"input": TEXTS[1], "add_special_tokens": False})
        assert bare["usage"]["prompt_tokens"] == len(tok(TEXTS[1],
                                                         add_special_tokens=False)["input_ids"])
        raw = embedding({"input": [ids], "use_activation": False})["data"][0]["embedding"]
        assert torch.allclose(torch.tensor(raw), direct(ids, normalize=False), atol=1e-5)
        # /pooling: an embedding by default, every position's row for token_embed
        one = embedding({"input": [ids]}, "/pooling")["data"][0]
        assert one["object"] == "pooling"
        assert torch.allclose(torch.tensor(one["data"]), direct(ids), atol=1e-5)
        rows = embedding({"input": [ids], "task": "token_embed"}, "/pooling")["data"][0]
        assert len(rows["data"]) == len(ids) and len(rows["data"][0]) == 64
        encoded = embedding({"input": [ids], "task": "token_embed",
                             "encoding_format": "base64"}, "/v1/pooling")["data"][0]["data"]
        raw_bytes = base64.b64decode(encoded)
        flat = struct.unpack(f"<{len(raw_bytes) // 4}f", raw_bytes)
        assert len(flat) == len(ids) * 64
        assert max(abs(a - b) for a, b in zip(flat, [x for r in rows["data"] for x in r],
                                               strict=True)) < 1e-6
        for route, body, param in [
                ("/v1/embeddings", {}, "input"),
                ("/v1/embeddings", {"input": "x", "messages": messages}, "input"),
                ("/v1/embeddings", {"messages": []}, "messages"),
                ("/v1/embeddings", {"messages": messages, "add_special_tokens": True},
                 "add_special_tokens"),
                ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0},
                 "truncate_prompt_tokens"),
                ("/v1/embeddings", {"messages": messages, "continue_final_message": True},
                 "continue_final_message"),
                ("/pooling", {"input": "x", "task": "token_classify"}, "task"),
                ("/pooling", {"input": "x", "dimensions": 4, "task": "token_embed",
                              "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
                ("/v1/embeddings", {"input": [5] * 257}, "input"),
                ("/score", {"text_1": "a", "text_2": []}, "text_2"),
                ("/score", {"text_1": "a", "text_2": ["x" * 10**6]}, "text_2"),
                ("/rerank", {"query": "a", "documents": ["b " * 300]}, "documents"),
                ("/pooling", {"input": "x", "task": "reward"}, "task"),
                ("/classify", {"messages": messages}, "model")]:
            resp = client.post(route, json=body)
            assert resp.status_code == 400, (route, body, resp.text)
            assert resp.json()["error"]["param"] == param, (route, body, resp.json())
    finally:
        llm_engine.shutdown()


@pytest.mark.unit
def test_a_sentence_transformers_config_kvray_cannot_honour_is_an_error(tmp_path):
    from kvray.models.pooling import ModelPooling, model_pooling

    assert model_pooling(tmp_path) == ModelPooling("last", True)  # nothing said: defaults
    assert model_pooling(tmp_path, classify=True) == ModelPooling("last", False)
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="Dense"):  # a projection kvray would skip
        model_pooling(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(modules[:2]))
    assert model_pooling(tmp_path) == ModelPooling("mean", False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        model_pooling(tmp_path)
