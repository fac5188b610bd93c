"""CacheFuseConfig: every invalid field fails at construction with a message naming it and its value."""

import pytest

from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError

INVALID = [
    ("selector", "hkvd"),
    ("selector", None),
    ("recompute_ratio", 1.5),
    ("recompute_ratio", -0.1),
    ("recompute_ratio", "0.2"),
    ("recompute_ratio", True),
    ("cacheblend_check_layers", (0,)),
    ("cacheblend_check_layers", ()),
    ("cacheblend_check_layers", (2, 1)),
    ("cacheblend_check_layers", (1.5,)),
    ("cacheblend_ratio_schedule", (1.0, 1.0)),
    ("cacheblend_ratio_schedule", (0.5,)),
    ("cacheblend_deviation", "l1"),
    ("epic_k", -1),
    ("epic_k", 2.5),
    ("random_seed", "x"),
    ("attention_block_rows", 0),
    ("store_dir", ""),
    ("device_capacity_bytes", -1),
    ("memory_capacity_bytes", -1),
    ("disk_capacity_bytes", 1.5),
    ("eviction_policy", "fifo"),
    ("save_holes", "yes"),
    ("collect_attention_stats", "no"),
    ("max_blend_tokens_per_step", 0),
    ("separator_token_id", -3),
    ("allow_debug_overrides", 1),
    ("allow_sync_save", "yes"),
    ("ratio_mode", "auto"),
    ("max_recompute_ratio", 0.05),
    ("max_recompute_ratio", 1.5),
    ("force_fuse", "no"),
    ("controller_margin", 1.0),
    ("placement", "lfu"),
    ("placement_hot", 0),
    ("placement_cold", 5.0),
    ("placement_half_life_s", -1),
    ("cachecraft_alpha", -0.5),
    ("cachecraft_alpha", float("nan")),
    ("cachecraft_window", 0),
    ("cachecraft_early_termination", "yes"),
    ("force_cfo", 1.5),
    ("variant_admission_cfo", -0.1),
    ("variant_admission_max_chunks", -1),
    ("variant_admission_max_chunks", 1.5),
    ("variant_admission_max_chunks", True),
    ("max_variants", 0),
    ("exact_places", "no"),
    ("exact_places", 0),
    ("redis_url", "http://localhost:6379"),
    ("redis_url", "redis://localhost:6379/0x"),  # redis-py used database 0, silently
    ("redis_url", "redis://localhost:6379/abc"),
    ("redis_timeout_s", 0),
    ("index_refresh_interval_s", -1.0),
    ("placement_half_life_s", float("nan")),
    ("placement_half_life_s", float("inf")),
    ("placement_hot", float("inf")),
    ("max_chunks_per_request", 0),
    ("min_chunk_tokens", 0),
    ("max_chunk_text_bytes", True),
    ("max_variant_prefix_chunks", -1),
    ("random_seed", 2**64),  # torch's generator refused it per request: every random blend fell back
    ("random_seed", -(2**63) - 1),
    ("store_dir", "   "),
    ("index_refresh_interval_s", 1e-9),  # the scheduler would re-read the index in a busy loop
]


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_invalid_field_is_named(name, value):
    with pytest.raises(ConfigError) as info:
        CacheFuseConfig.from_dict({name: value})
    message = str(info.value)
    assert message.startswith(f"{name}=")
    assert repr(value) in message or repr(tuple(value)) in message
    assert "expected" in message


def test_schedule_must_nest():
    with pytest.raises(ConfigError, match="cacheblend_ratio_schedule.*non-increasing"):
        CacheFuseConfig(cacheblend_check_layers=(1, 2), cacheblend_ratio_schedule=(1.0, 1.5))
    ok = CacheFuseConfig(cacheblend_check_layers=(1, 2, 3), cacheblend_ratio_schedule=(1.5, 1.2, 1.0))
    assert ok.cacheblend_check_layers == (1, 2, 3)


def test_lists_are_taken_where_tuples_are_stored():
    """The docs say "a list of layer indices": a Python list works as YAML's does, stored as a tuple (the
    config is hashable and immutable); the list is validated like the tuple."""
    config = CacheFuseConfig(cacheblend_check_layers=[1, 2], cacheblend_ratio_schedule=[1.0, 1.0],
                             qcfuse_critical_layers=[3])
    assert (config.cacheblend_check_layers, config.cacheblend_ratio_schedule, config.qcfuse_critical_layers) == \
        ((1, 2), (1.0, 1.0), (3,))
    assert config.replace(cacheblend_check_layers=[2, 3]).cacheblend_check_layers == (2, 3)
    hash(config)
    with pytest.raises(ConfigError, match="strictly increasing"):
        CacheFuseConfig(cacheblend_check_layers=[2, 1], cacheblend_ratio_schedule=[1.0, 1.0])


def test_unknown_key_rejected_by_name():
    with pytest.raises(ConfigError, match="'recompute_ratoi'"):
        CacheFuseConfig.from_dict({"recompute_ratoi": 0.2})


def test_yaml_and_dict_agree(tmp_path):
    path = tmp_path / "cf.yaml"
    path.write_text("selector: epic\nrecompute_ratio: 0.3\ncacheblend_check_layers: [1, 3]\n"
                    "cacheblend_ratio_schedule: [1.2, 1.0]\n")
    from_yaml = CacheFuseConfig.from_yaml(path)
    assert from_yaml == CacheFuseConfig.from_dict(
        {"selector": "epic", "recompute_ratio": 0.3, "cacheblend_check_layers": [1, 3],
         "cacheblend_ratio_schedule": [1.2, 1.0]})
    # config_file loads first; explicit keys override it (the kv_connector_extra_config path).
    assert CacheFuseConfig.from_dict({"config_file": str(path), "recompute_ratio": 0.1}).recompute_ratio == 0.1


def test_bad_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="config_file="):
        CacheFuseConfig.from_dict({"config_file": str(tmp_path / "missing.yaml")})
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        CacheFuseConfig.from_yaml(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("selector: epic\nrecompute_ratio: [0.1\n")  # a YAML syntax error
    with pytest.raises(ConfigError, match=r"config_file=.*broken.yaml.*not valid YAML \(line \d+"):
        CacheFuseConfig.from_yaml(tmp_path / "broken.yaml")
    (tmp_path / "binary.yaml").write_bytes(b"selector: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        CacheFuseConfig.from_yaml(tmp_path / "binary.yaml")


def test_hash_ignores_selection_fields():
    assert CacheFuseConfig().compute_hash() == CacheFuseConfig(selector="epic", recompute_ratio=0.5).compute_hash()


def test_a_redis_url_without_the_redis_package_names_the_field_and_the_install(monkeypatch):
    """redis-py is an optional extra: without it a configured redis_url died in the worker with a bare
    ModuleNotFoundError."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "redis" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"redis_url needs the redis package.*cachefuse\[redis\]"):
        CacheFuseConfig(redis_url="redis://localhost:6379/0")
    CacheFuseConfig()  # control: no Redis configured, no package needed
    monkeypatch.undo()
    CacheFuseConfig(redis_url="redis://localhost:6379/0")  # control: installed here


@pytest.mark.parametrize("path", [None, 3, "", ["a.yaml"]])
def test_config_file_must_be_a_path(path):
    """An int was opened as a file descriptor (and closed); None raised a bare TypeError."""
    with pytest.raises(ConfigError, match=r"config_file=.* is invalid: expected the path of a YAML file"):
        CacheFuseConfig.from_dict({"config_file": path})


@pytest.mark.parametrize("multiplier", [float("nan"), float("inf")])
def test_a_ratio_schedule_multiplier_must_be_finite(multiplier):
    """Accepted, a NaN or infinite multiplier made every CacheBlend request fall back (blend_error)."""
    with pytest.raises(ConfigError, match="cacheblend_ratio_schedule.*positive finite"):
        CacheFuseConfig.from_dict({"cacheblend_check_layers": [1, 2], "cacheblend_ratio_schedule": [multiplier, 1.0]})


def test_unknown_keys_of_mixed_types_are_named():
    """A YAML file may have non-string keys: they are named like any unknown key (sorting them raised)."""
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) 'foo', 1"):
        CacheFuseConfig.from_dict({1: 2, "foo": 3})
