"""CacheFuseConfig's field checks: what each field accepts, and the error that names field, value and fix.

Imports the standard library and cachefuse.errors (cachefuse.redis_client and cachefuse.metadata.base
lazily, inside the checks that need them); never torch (the scheduler reads the config), never
cachefuse.config (which calls these from `CacheFuseConfig.__post_init__`, in the order it lists them:
with several bad fields, the first one checked is the one reported). Each check takes the config being
built (`cfg`) and reads its fields; `resolve_redis_password` is the one place the environment is read.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from cachefuse.errors import ConfigError

SELECTORS = ("full_prefill", "full_reuse", "cacheblend", "epic", "random", "cachecraft", "fusionrag", "qcfuse")
QCFUSE_LAYERS = ("critical", "last", "all")
QCFUSE_VIEWS = ("anchors", "full", "question_only")  # select.qcfuse.VIEWS (that module imports torch)
RATIO_MODES = ("fixed", "controller")
PLACEMENTS = ("lru", "frequency")
DEVIATIONS = ("k", "v", "kv")
EVICTION_POLICIES = ("f_r", "lru")
DEFAULT_VARIANTS = ("base", "fused")


def fail(name: str, value: Any, expected: str) -> None:
    raise ConfigError(f"{name}={value!r} is invalid: expected {expected}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def check_ratio(cfg: Any) -> None:
    """The selector and the recompute ratio's fields (fixed, or the controller's bounds)."""
    if cfg.selector not in SELECTORS:
        fail("selector", cfg.selector, f"one of {', '.join(SELECTORS)}")
    if isinstance(cfg.recompute_ratio, bool) or not isinstance(cfg.recompute_ratio, int | float):
        fail("recompute_ratio", cfg.recompute_ratio, "a number in 0.0..1.0")
    if not 0.0 <= float(cfg.recompute_ratio) <= 1.0:
        fail("recompute_ratio", cfg.recompute_ratio, "a number in 0.0..1.0")
    if cfg.ratio_mode not in RATIO_MODES:
        fail("ratio_mode", cfg.ratio_mode, f"one of {', '.join(RATIO_MODES)}")
    if (isinstance(cfg.max_recompute_ratio, bool) or not isinstance(cfg.max_recompute_ratio, int | float)
            or not cfg.recompute_ratio <= cfg.max_recompute_ratio <= 1.0):
        fail("max_recompute_ratio", cfg.max_recompute_ratio, "a number in recompute_ratio..1.0")
    if (isinstance(cfg.controller_margin, bool) or not isinstance(cfg.controller_margin, int | float)
            or not 0.0 <= cfg.controller_margin < 1.0):
        fail("controller_margin", cfg.controller_margin, "a number in 0.0..1.0 (exclusive)")
    if not isinstance(cfg.force_fuse, bool):
        fail("force_fuse", cfg.force_fuse, "true or false")


def check_cacheblend(cfg: Any) -> None:
    """CacheBlend's check layers, ratio schedule, sink tokens, chunk floor and deviation."""
    layers, schedule = cfg.cacheblend_check_layers, cfg.cacheblend_ratio_schedule
    if not isinstance(layers, tuple) or not layers or not all(is_int(x) for x in layers):
        fail("cacheblend_check_layers", layers, "a non-empty list of layer indices")
    if layers[0] < 1:
        fail("cacheblend_check_layers", layers,
              "a first check layer >= 1 (layer 0's K/V do not depend on context, so cannot deviate)")
    if any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
        fail("cacheblend_check_layers", layers, "strictly increasing layer indices")
    if not isinstance(schedule, tuple) or len(schedule) != len(layers):
        fail("cacheblend_ratio_schedule", schedule,
              f"one multiplier per check layer ({len(layers)} values)")
    if any(not is_number(m) or not math.isfinite(m) or m <= 0 for m in schedule):
        fail("cacheblend_ratio_schedule", schedule, "positive finite multipliers")
    if any(b > a for a, b in zip(schedule, schedule[1:], strict=False)) or schedule[-1] != 1.0:
        fail("cacheblend_ratio_schedule", schedule,
              "non-increasing multipliers ending in 1.0 (gradual filtering nests the sets)")
    if not is_int(cfg.cacheblend_sink_tokens) or cfg.cacheblend_sink_tokens < 0:
        fail("cacheblend_sink_tokens", cfg.cacheblend_sink_tokens, "an integer >= 0 (0: none forced)")
    if not is_number(cfg.cacheblend_chunk_floor) or not 0.0 <= cfg.cacheblend_chunk_floor <= 1.0:
        fail("cacheblend_chunk_floor", cfg.cacheblend_chunk_floor, "a number in 0.0..1.0 (0.0: global ranking)")
    if cfg.cacheblend_deviation not in DEVIATIONS:
        fail("cacheblend_deviation", cfg.cacheblend_deviation, f"one of {', '.join(DEVIATIONS)}")


def check_selector_options(cfg: Any) -> None:
    """EPIC's k, the random selector's seed, and the query-aware selectors' (FusionRAG, QCFuse) fields."""
    if cfg.epic_k is not None and (not is_int(cfg.epic_k) or cfg.epic_k < 0):
        fail("epic_k", cfg.epic_k, "null or an integer >= 0")
    if not is_int(cfg.random_seed) or not -(2**63) <= cfg.random_seed < 2**63:
        fail("random_seed", cfg.random_seed, "an integer in -2**63..2**63-1 (a torch generator's seed)")
    if not is_int(cfg.fusionrag_score_layers) or cfg.fusionrag_score_layers < 1:
        fail("fusionrag_score_layers", cfg.fusionrag_score_layers, "an integer >= 1 (1: the final layer)")
    ratio = cfg.qcfuse_anchor_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < ratio <= 1.0:
        fail("qcfuse_anchor_ratio", ratio, "a number in 0.0..1.0, above 0 (the paper's default: 0.1)")
    if not is_int(cfg.qcfuse_sink_tokens) or cfg.qcfuse_sink_tokens < 0:
        fail("qcfuse_sink_tokens", cfg.qcfuse_sink_tokens, "an integer >= 0")
    if cfg.qcfuse_layers not in QCFUSE_LAYERS:
        fail("qcfuse_layers", cfg.qcfuse_layers, f"one of {', '.join(QCFUSE_LAYERS)}")
    layers = cfg.qcfuse_critical_layers
    if layers is not None and (not isinstance(layers, tuple) or not layers
                               or not all(is_int(x) for x in layers)):
        fail("qcfuse_critical_layers", layers, "null or a non-empty list of layer indices (negative: from the end)")
    if cfg.qcfuse_view not in QCFUSE_VIEWS:
        fail("qcfuse_view", cfg.qcfuse_view, f"one of {', '.join(QCFUSE_VIEWS)} (QCLast: question_only with "
             "qcfuse_layers last; QCAll: full with qcfuse_layers all)")


def check_loading(cfg: Any) -> None:
    """The blend's loading (attention blocks, preload depth, load timeout), the tiers' place and budgets, placement,
    attention statistics."""
    if not is_int(cfg.attention_block_rows) or not 1 <= cfg.attention_block_rows <= 4096:
        fail("attention_block_rows", cfg.attention_block_rows, "an integer in 1..4096")
    if cfg.preload_depth is not None and (not is_int(cfg.preload_depth) or cfg.preload_depth < 0):
        fail("preload_depth", cfg.preload_depth, "null or an integer >= 0")
    if cfg.load_timeout_s is not None and (not is_number(cfg.load_timeout_s)
                                            or not 0.0 < cfg.load_timeout_s <= 3600.0):
        fail("load_timeout_s", cfg.load_timeout_s, "null (no bound) or a positive number of seconds (at most 3600)")
    if cfg.metadata_wait_s is not None and (not is_number(cfg.metadata_wait_s)
                                             or not 0.0 <= cfg.metadata_wait_s <= 60.0):
        fail("metadata_wait_s", cfg.metadata_wait_s, "null (SQLite's own 2 s per call) or seconds in 0..60")
    if not isinstance(cfg.store_dir, str) or not cfg.store_dir.strip():
        fail("store_dir", cfg.store_dir, "a non-empty directory path")
    for name in ("device_capacity_bytes", "memory_capacity_bytes", "disk_capacity_bytes", "redis_capacity_bytes"):
        value = getattr(cfg, name)
        if not is_int(value) or value < 0:
            fail(name, value, "an integer number of bytes >= 0")
    if cfg.placement not in PLACEMENTS:
        fail("placement", cfg.placement, f"one of {', '.join(PLACEMENTS)}")
    for name in ("placement_hot", "placement_cold", "placement_half_life_s"):
        value = getattr(cfg, name)
        if not is_number(value) or not 0 < value < math.inf:
            fail(name, value, "a positive finite number")
    if not cfg.placement_cold < cfg.placement_hot:
        fail("placement_cold", cfg.placement_cold, f"a number below placement_hot={cfg.placement_hot!r}")
    if cfg.collect_attention_stats is not None and not isinstance(cfg.collect_attention_stats, bool):
        fail("collect_attention_stats", cfg.collect_attention_stats, "null, true or false")


def check_variants(cfg: Any) -> None:
    """Cache-Craft's fields, variant admission and budget, and the Redis URL (redis-py must be installed for one)."""
    if not is_number(cfg.cachecraft_alpha) or not 0.0 <= cfg.cachecraft_alpha <= 100.0:
        fail("cachecraft_alpha", cfg.cachecraft_alpha, "a number in 0..100 (1.0 is the paper's scale)")
    if not is_int(cfg.cachecraft_window) or cfg.cachecraft_window < 1:
        fail("cachecraft_window", cfg.cachecraft_window, "an integer >= 1")
    if not isinstance(cfg.cachecraft_early_termination, bool):
        fail("cachecraft_early_termination", cfg.cachecraft_early_termination, "true or false")
    for name in ("force_cfo", "variant_admission_cfo"):
        value = getattr(cfg, name)
        if value is not None and (not is_number(value) or not 0.0 <= value <= 1.0):
            fail(name, value, "null or a number in 0.0..1.0")
    if not is_int(cfg.variant_admission_max_chunks) or cfg.variant_admission_max_chunks < 0:
        fail("variant_admission_max_chunks", cfg.variant_admission_max_chunks,
              "an integer >= 0 (chunks admitted per request; 0 turns admission off)")
    if cfg.default_variant not in DEFAULT_VARIANTS:
        fail("default_variant", cfg.default_variant,
             '"base" (a chunk out of its stored place loads its base variant) or "fused" (its neighbour-fused '
             'variant, from `cachefuse precompute --fuse-neighbours`)')
    if not isinstance(cfg.exact_places, bool):
        fail("exact_places", cfg.exact_places, "true (a chunk at its entry's exact place is not blended) or false "
             "(every non-system chunk is blended, as the papers do)")
    if not is_int(cfg.max_variants) or cfg.max_variants < 1:
        fail("max_variants", cfg.max_variants, "an integer >= 1 (N x M variants over all chunks)")
    if cfg.redis_url is not None and (not isinstance(cfg.redis_url, str)
                                       or not cfg.redis_url.startswith(("redis://", "rediss://"))
                                       or not redis_db_ok(cfg.redis_url)):
        from cachefuse.redis_client import redact_url  # the rejected value may carry a password

        shown = redact_url(cfg.redis_url) if isinstance(cfg.redis_url, str) else cfg.redis_url
        fail("redis_url", shown, 'null or a URL "redis://host:port/db" or "rediss://..." (TLS)')
    if cfg.redis_url is not None:
        from cachefuse.redis_client import require_redis_package

        require_redis_package("redis_url")


def resolve_redis_password(cfg: Any) -> str | None:
    """Reads the password named by redis_password_env / _file (the config is where the environment is
    read); kept out of the fields, so no repr, dict or log of the config shows it."""
    env, file = cfg.redis_password_env, cfg.redis_password_file
    if env is not None and file is not None:
        fail("redis_password_file", file, "null when redis_password_env is set (one source of the password)")
    password = None
    if env is not None:
        if not isinstance(env, str) or not env:
            fail("redis_password_env", env, "null or the name of an environment variable")
        password = os.environ.get(env)
        if password is None:
            fail("redis_password_env", env, "the name of an environment variable that is set; export it")
    if file is not None:
        if not isinstance(file, str) or not file:
            fail("redis_password_file", file, "null or a path to a file holding the password")
        try:
            password = Path(file).expanduser().read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            fail("redis_password_file", file, f"a readable UTF-8 file ({type(exc).__name__})")
    if password is not None and cfg.redis_url is None:
        fail("redis_url", None, "a redis:// URL when redis_password_env or redis_password_file is set")
    return password


def check_redis_timeouts(cfg: Any) -> None:
    """The Redis call timeout and the scheduler's index refresh interval."""
    for name, low in (("redis_timeout_s", 0.0), ("index_refresh_interval_s", 0.01)):
        value = getattr(cfg, name)
        if not is_number(value) or not low < value <= 3600.0:
            # a refresh interval near 0 would re-read the index in a busy loop
            fail(name, value, f"a number of seconds above {low:g}, at most 3600")


def check_saving(cfg: Any) -> None:
    """Hole saves (background queue, flush at shutdown), the per-step blend budget, the separator token,
    the debug and sync-save switches."""
    if not isinstance(cfg.save_holes, bool):
        fail("save_holes", cfg.save_holes, "true or false")
    if not is_int(cfg.save_queue_bytes) or cfg.save_queue_bytes < 0:
        fail("save_queue_bytes", cfg.save_queue_bytes, "an integer >= 0 (0 saves on the request's path)")
    if not is_number(cfg.save_flush_timeout_s) or not 0.0 <= cfg.save_flush_timeout_s <= 3600.0:
        fail("save_flush_timeout_s", cfg.save_flush_timeout_s, "a number of seconds in 0..3600")
    if not is_int(cfg.max_blend_tokens_per_step) or cfg.max_blend_tokens_per_step < 1:
        fail("max_blend_tokens_per_step", cfg.max_blend_tokens_per_step, "an integer >= 1")
    if cfg.blend_step_tokens is not None and (not is_int(cfg.blend_step_tokens) or cfg.blend_step_tokens < 0):
        fail("blend_step_tokens", cfg.blend_step_tokens, "null (vLLM's max_num_batched_tokens), 0 (each blend "
             "whole in its step) or an integer >= 1")
    if cfg.separator_token_id is not None and (not is_int(cfg.separator_token_id)
                                                or cfg.separator_token_id < 0):
        fail("separator_token_id", cfg.separator_token_id, "null or a token id >= 0")
    for name in ("allow_debug_overrides", "allow_sync_save"):
        if not isinstance(getattr(cfg, name), bool):
            fail(name, getattr(cfg, name), "true or false")


def check_request_limits(cfg: Any) -> None:
    """The bounds on one request (chunks, chunk size, chunk text bytes, a variant's prefix), then the metadata
    eviction policy (checked last, as it always was)."""
    for name, low in (("max_chunks_per_request", 1), ("min_chunk_tokens", 1), ("max_chunk_text_bytes", 1),
                      ("max_variant_prefix_chunks", 0)):
        value = getattr(cfg, name)
        if not is_int(value) or value < low:
            fail(name, value, f"an integer >= {low}")
    from cachefuse.metadata.base import MAX_PREFIX_CHUNKS

    if cfg.max_variant_prefix_chunks > MAX_PREFIX_CHUNKS:  # rows past it are refused as foreign
        fail("max_variant_prefix_chunks", cfg.max_variant_prefix_chunks,
              f"an integer in 0..{MAX_PREFIX_CHUNKS}")
    if cfg.eviction_policy not in EVICTION_POLICIES:
        fail("eviction_policy", cfg.eviction_policy, f"one of {', '.join(EVICTION_POLICIES)}")


def redis_db_ok(url: str) -> bool:
    """The URL's database (its path) is empty or a number: redis-py read "/0x" or "/abc" as database 0,
    silently, and a number the server lacks fails every call (a config error, not an outage; that one
    only the server can tell)."""
    from urllib.parse import urlsplit

    try:
        path = urlsplit(url).path.strip("/")
    except ValueError:
        return False
    return path == "" or (path.isascii() and path.isdigit() and int(path) < 2**31)
