"""Config: YAML round trip, overrides, and precise errors for bad values and keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvray.config import ConfigError, EngineConfig, dump_config, load_config

pytestmark = pytest.mark.unit

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_defaults_are_valid_and_cpu_friendly():
    cfg = load_config()
    assert cfg.model.dtype == "auto"
    assert cfg.cache.block_size == 16
    assert cfg.parallel.world_size == 1


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(path), EngineConfig)


def test_yaml_round_trip_preserves_every_value(tmp_path):
    cfg = load_config(block_size=8, max_num_seqs=3, scheduling_policy="priority",
                      swap_space=1.5, enable_prefix_caching=False, served_model_name="m")
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_overrides_beat_the_file_and_none_keeps_it(tmp_path):
    (tmp_path / "c.yaml").write_text("block_size: 8\nmax_num_seqs: 5\n")
    cfg = load_config(tmp_path / "c.yaml", block_size=32, max_num_seqs=None)
    assert cfg.cache.block_size == 32
    assert cfg.scheduler.max_num_seqs == 5


def test_relative_model_path_resolves_against_the_config_file(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "c.yaml").write_text("model: weights\n")
    assert load_config(tmp_path / "c.yaml").model.model == str(tmp_path / "weights")


def test_bad_value_names_field_value_and_bound():
    with pytest.raises(ConfigError) as err:
        load_config(block_size=0)
    msg = str(err.value)
    assert "block_size = 0" in msg and "greater than or equal to 1" in msg


@pytest.mark.parametrize(("alias", "dtype"), [("half", "float16"), ("float", "float32")])
def test_vllms_short_dtype_names_mean_the_full_ones(alias, dtype, tmp_path):
    assert load_config(dtype=alias).model.dtype == dtype
    (tmp_path / "c.yaml").write_text(f"dtype: {alias}\n")
    assert load_config(tmp_path / "c.yaml").model.dtype == dtype
    with pytest.raises(ConfigError, match="dtype = 'double'"):
        load_config(dtype="double")


def test_chat_template_is_read_from_a_file_or_taken_as_text(tmp_path):
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(text)
    assert load_config(chat_template=str(tmp_path / "t.jinja")).model.chat_template == text
    assert load_config(chat_template=text).model.chat_template == text
    (tmp_path / "c.yaml").write_text("chat_template: t.jinja\n")  # relative to the file
    assert load_config(tmp_path / "c.yaml").model.chat_template == text


def test_a_one_line_chat_template_has_its_escapes_decoded_as_vllm_does():
    """vLLM's documented single-line form (regression: a literal backslash-n went into
    every prompt); a template with real newlines is taken as it is."""
    one_line = r"{% for m in messages %}{{ m['content'] }}\n{% endfor %}\tend é"
    assert load_config(chat_template=one_line).model.chat_template == \
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}\tend é"
    lines = "{% for m in messages %}\n{{ m['content'] ~ '\\n' }}{% endfor %}"
    assert load_config(chat_template=lines).model.chat_template == lines
    # Jinja's own escapes, which decoding would break, stay as they are
    own = r"{{ messages[0]['content'] | replace('\\', '/') }}"
    assert load_config(chat_template=own).model.chat_template == own
    # HF's {% generation %} block (assistant masks) is a template too
    marked = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}" \
             "{% endfor %}"
    assert load_config(chat_template=marked).model.chat_template == marked


@pytest.mark.parametrize(("value", "message"), [
    ("/no/such/template.jinja", "chat_template = '/no/such/template.jinja': cannot read"),
    ("{% for m in messages %}", "chat_template: not a valid Jinja template"),
    ("x" * 5000, "chat_template = 'xxx"),
])
def test_a_bad_chat_template_is_an_error_naming_it(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(chat_template=value)


def test_bad_choice_lists_the_allowed_values(tmp_path):
    (tmp_path / "c.yaml").write_text("preemption_mode: evict\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "c.yaml")
    msg = str(err.value)
    assert "preemption_mode = 'evict'" in msg and "'recompute'" in msg and "'swap'" in msg


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigError, match="max_num_seqs = 'many'"):
        load_config(max_num_seqs="many")


def test_a_bad_list_item_names_the_field_and_its_index():
    """Regression: the message named only the index ("1 = 'a'"), not the field."""
    with pytest.raises(ConfigError, match=r"cuda_graph_sizes\[1\] = 'a'"):
        load_config(cuda_graph_sizes="1,a")
    with pytest.raises(ConfigError, match=r"pipeline_stage_nodes\[0\] = 5"):
        load_config(pipeline_stage_nodes=[5])
    with pytest.raises(ConfigError, match=r"cuda_graph_sizes: \[0\] outside 1..4096"):
        load_config(cuda_graph_sizes=[0, 8])


def test_unknown_key_is_an_error_with_a_suggestion(tmp_path):
    (tmp_path / "c.yaml").write_text("block_sise: 16\n")
    with pytest.raises(ConfigError, match="unknown config key 'block_sise'.*'block_size'"):
        load_config(tmp_path / "c.yaml")


def test_cross_field_check_without_chunked_prefill():
    with pytest.raises(ConfigError, match="max_num_batched_tokens .* max_model_len"):
        load_config(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_every_field_is_documented():
    for section in ("model", "cache", "scheduler", "parallel"):
        for name, field in EngineConfig.model_fields[section].annotation.model_fields.items():
            assert field.description, f"{section}.{name} lacks a description"
