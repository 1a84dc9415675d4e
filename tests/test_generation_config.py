"""A model's generation_config.json supplies the sampling defaults of requests that leave
them unset, as vLLM's ``--generation-config auto`` does: only the sampling keys, only
values that differ from transformers' own defaults, and bad values are start-up errors."""

from __future__ import annotations

import json

import pytest

from kvray.engine.generation_config import (
    generation_defaults,
    generation_eos_ids,
    generation_max_tokens_cap,
)

pytestmark = pytest.mark.unit


def _write(folder, data) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))


def test_auto_takes_the_sampling_keys_that_differ_from_transformers_defaults(tmp_path):
    _write(tmp_path, {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True,
                      "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                      "repetition_penalty": 1.05, "max_new_tokens": 300,
                      "transformers_version": "4.51.0"})
    assert generation_defaults("auto", tmp_path) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.05, "max_tokens": 300}
    _write(tmp_path, {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None})
    assert generation_defaults("auto", tmp_path) == {}


def test_vllm_ignores_the_file_and_a_folder_names_another_one(tmp_path):
    _write(tmp_path / "model", {"temperature": 0.3})
    _write(tmp_path / "other", {"top_p": 0.5})
    assert generation_defaults("vllm", tmp_path / "model") == {}
    assert generation_defaults(str(tmp_path / "other"), tmp_path / "model") == {"top_p": 0.5}
    assert generation_defaults("auto", tmp_path / "nothing-here") == {}
    assert generation_defaults("auto", tmp_path / "model.gguf") == {}
    with pytest.raises(ValueError, match="generation_config = .*no generation_config.json"):
        generation_defaults(str(tmp_path / "nothing-here"), tmp_path / "model")


@pytest.mark.parametrize(("data", "message"), [
    ({"temperature": -1}, "temperature = -1"), ({"top_p": 2}, "top_p = 2"),
    ({"max_new_tokens": 0}, "max_tokens = 0"), ("[1, 2]", "not a JSON object"),
    ("{nope", "cannot read .* as JSON")])
def test_a_value_sampling_cannot_take_is_an_error_naming_the_file(tmp_path, data, message):
    if isinstance(data, dict):
        _write(tmp_path, data)
    else:
        (tmp_path / "generation_config.json").write_text(data)
    with pytest.raises(ValueError, match=message) as err:
        generation_defaults("auto", tmp_path)
    assert "generation_config" in str(err.value)


def test_overrides_lie_over_the_file_and_apply_even_at_transformers_defaults(tmp_path):
    _write(tmp_path, {"temperature": 0.6, "top_p": 0.9})
    assert generation_defaults("auto", tmp_path, {"temperature": 1.0, "max_new_tokens": 64}) \
        == {"temperature": 1.0, "top_p": 0.9, "max_tokens": 64}
    assert generation_defaults("vllm", tmp_path, {"top_k": 5}) == {"top_k": 5}
    with pytest.raises(ValueError, match="override_generation_config: top_k = -5"):
        generation_defaults("vllm", tmp_path, {"top_k": -5})


def test_eos_ids_are_read_whatever_the_sampling_source_says(tmp_path):
    """vLLM reads the file's eos_token_id even with generation_config vllm."""
    _write(tmp_path, {"eos_token_id": [7, 3], "temperature": 0.6})
    assert generation_eos_ids("auto", tmp_path) == generation_eos_ids("vllm", tmp_path) \
        == (7, 3)
    _write(tmp_path / "other", {"eos_token_id": 9})
    assert generation_eos_ids(str(tmp_path / "other"), tmp_path) == (9,)
    for bad in ('{"eos_token_id": "x"}', "[1]", "not json"):
        (tmp_path / "generation_config.json").write_text(bad)
        assert generation_eos_ids("auto", tmp_path) == ()
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [true, -1, 4]}')
    assert generation_eos_ids("auto", tmp_path) == (4,)
    assert generation_eos_ids("auto", tmp_path / "missing") == ()


def test_max_new_tokens_caps_requests_only_when_the_server_config_sets_it():
    """vLLM's serving cap: an override's max_new_tokens, or a named folder's; the model's
    own file (auto) only fills requests that leave max_tokens unset."""
    defaults = {"max_tokens": 64}
    assert generation_max_tokens_cap("auto", None, defaults) is None
    assert generation_max_tokens_cap("vllm", None, {}) is None
    assert generation_max_tokens_cap("auto", {"max_new_tokens": 8}, defaults) == 8
    assert generation_max_tokens_cap("/some/folder", None, defaults) == 64
