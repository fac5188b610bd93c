"""CacheFuseConfig: the only configuration object.

Loaded from YAML (`from_yaml`) or a dict (`from_dict`, e.g. vLLM's `kv_connector_extra_config`),
validated in `__post_init__` by cachefuse.config_checks, with messages that name the field, the bad value
and what is accepted. Imports only the standard library, yaml, cachefuse.config_checks and cachefuse.errors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachefuse import config_checks as checks
from cachefuse.errors import ConfigError

# Bumped whenever the on-disk entry format changes; joins every chunk key through compute_hash().
CACHE_FORMAT_VERSION = 1


_LIST_FIELDS = ("cacheblend_check_layers", "cacheblend_ratio_schedule", "qcfuse_critical_layers")
"""Fields given as lists (YAML, JSON, Python) and stored as tuples."""


def rank_dir_name(tp_size: int | str, tp_rank: int) -> str:
    """The name of one tensor-parallel rank's K/V directory inside the store (`CacheFuseConfig.kv_store_path`);
    `rank_dir_name("*", 0)` is the glob for rank 0's, whatever the TP size (as `cachefuse inspect` reads)."""
    return f"tp{tp_size}-rank{tp_rank}"


@dataclass(frozen=True)
class CacheFuseConfig:
    selector: str = "cacheblend"
    """Token selector, a module name under cachefuse/select/."""
    recompute_ratio: float = 0.15
    """Selected rows / cached tokens of the declared non-system chunks (docs/architecture.md, Definitions)."""
    ratio_mode: str = "controller"
    """"fixed": use recompute_ratio; "controller": the loading controller picks r >= recompute_ratio
    from measured figures, and runs a request as plain vLLM when fusing would not be faster."""
    max_recompute_ratio: float = 1.0
    """Upper bound of the controller's ratio (r_max)."""
    controller_margin: float = 0.1
    """Fuse only if the estimated fused time is this fraction below vLLM's own prefill (the estimates are fits)."""
    force_fuse: bool = False
    """Disable the controller's go/no-go (tests, or when the measured figures are known to mislead)."""
    cacheblend_check_layers: tuple[int, ...] = (1,)
    """Layers where HKVD re-selects; layers 0..first are computed in full. First must be >= 1."""
    cacheblend_ratio_schedule: tuple[float, ...] = (1.0,)
    """Multipliers of recompute_ratio per check layer (gradual filtering); non-increasing, last 1.0."""
    cacheblend_deviation: str = "v"
    """What HKVD compares between fresh and loaded rows: "k", "v" or "kv" (squared L2, summed over heads)."""
    cacheblend_sink_tokens: int = 0
    """The first tokens of every loaded chunk, always among the rows HKVD keeps (within the ratio's
    budget): a chunk's opening tokens, cached at its own start, are attention sinks out of place."""
    cacheblend_chunk_floor: float = 0.0
    """The fraction of its proportional share of HKVD's rows each loaded chunk keeps (its own highest
    deviations) before the rest is chosen across chunks; 0.0: one global ranking (CacheBlend)."""
    epic_k: int | None = None
    """EPIC: recompute the first k tokens of every chunk; None derives k = ceil(ratio * chunk length)."""
    random_seed: int = 0
    """Seed of the `random` control selector."""
    fusionrag_score_layers: int = 1
    """FusionRAG: the question's attention is read at the last this-many layers (the paper: 1, the final one)."""
    qcfuse_anchor_ratio: float = 0.1
    """QCFuse's r_a: each chunk's anchors are ceil(r_a x its tokens) of them (Eq. 14)."""
    qcfuse_sink_tokens: int = 1
    """A chunk's first this-many tokens are always anchors (attention sinks), the rest ranked by key norm."""
    qcfuse_layers: str = "critical"
    """Where QCFuse scores: "critical" (`qcfuse_critical_layers`), "last" (QCLast) or "all" (QCAll)."""
    qcfuse_critical_layers: tuple[int, ...] | None = None
    """The critical layers (negative: from the end), e.g. from `cachefuse profile-layers`; None: three
    layers around 60% of the depth (docs/selectors.md)."""
    qcfuse_view: str = "anchors"
    """What the probe's question attends over besides the system chunk: "anchors" (QCFuse), "full"
    (every loaded row; with qcfuse_layers "all": QCAll, ProphetKV's full view) or "question_only" (no
    retrieved row, a context-free probe; with qcfuse_layers "last": QCLast, FusionRAG's query-only view)."""
    attention_block_rows: int = 64
    """Selected rows per attention call in the blend pass (sorted blocks with truncated keys)."""
    preload_depth: int | None = 0
    """Layers of chunk K/V fetched ahead of the blend pass on a loader thread (docs/loading.md).
    0: entries are read whole before the pass (serial; the default, since on CPU a page-cache read
    competes with compute); k >= 1: per-layer pipelined loading, at most k layers buffered;
    None: derive from measured figures (today: 2)."""
    load_timeout_s: float | None = 5.0
    """Seconds one blend may spend in store calls, all of them together (the calls' own time: a pipelined
    pass computes beside its reads, and compute is never charged); a chunk not read once it is spent is
    computed in full (miss reason "load_timeout"). A slow tier (a Redis answering each call just inside
    `redis_timeout_s`, a cold network disk) otherwise holds the step for every request for as many calls
    as the request makes. A Redis call in flight is cut once it would outlast what is left (a reply
    trickled in over many socket reads), and the blend's metadata calls (pins, reuse records) are charged
    and bounded alike. None: no bound."""
    metadata_wait_s: float | None = 0.05
    """Seconds one request may wait, in all its calls, for a busy metadata store (a meta.sqlite locked by
    another process); past it the call is refused as a store failure: its variants are not pinned (their
    entries are then read whole before the pass), its reuses not recorded, an inline hole save not
    admitted. Offline jobs and the background hole writer wait up to SQLite's own 2 s. None: no request
    budget (each call waits up to those 2 s)."""
    store_dir: str = "~/.cache/cachefuse"
    """Directory of the local disk tier (the embedded default store)."""
    device_capacity_bytes: int = 0
    """Byte capacity of a tier in the accelerator's own memory, above host memory: hot chunks load without
    a host-to-device copy (same LRU and pinning rules as the other tiers); 0 disables it. Only where the
    model runs on a GPU; it is memory vLLM's KV cache does not get, so lower gpu_memory_utilization by as
    much."""
    memory_capacity_bytes: int = 2 << 30
    """Byte capacity of the host-memory tier (page-locked when the model runs on a GPU); 0 disables it."""
    disk_capacity_bytes: int = 20 << 30
    """Byte capacity of the disk tier; 0 disables it."""
    eviction_policy: str = "f_r"
    """Which variant a full metadata store (max_variants) evicts: "f_r" (Cache-Craft: the lowest
    frequency-reuse score) or "lru" (the comparison baseline). Byte budgets of the tiers evict LRU."""
    placement: str = "lru"
    """"lru": a disk hit is copied into memory (memory caches disk); "frequency": chunks move between
    tiers by decayed access count (placement_hot / placement_cold), see cachefuse/loading/placement.py."""
    placement_hot: float = 3.0
    """Decayed access count at which a chunk is promoted to the next faster tier."""
    placement_cold: float = 0.5
    """Decayed access count at or below which a chunk leaves its faster tier."""
    placement_half_life_s: float = 600.0
    """Half-life of the access counts, in seconds."""
    save_holes: bool = True
    """Store chunks the blend pass computed in full (holes) as new variants."""
    save_queue_bytes: int = 256 << 20
    """The vLLM worker writes holes on a background thread whose queue holds at most this many bytes of
    K/V; a hole that does not fit is skipped and counted (`saves_skipped`), never waited for. 0 writes
    them on the request's path, before its response (the reference engine always does)."""
    save_flush_timeout_s: float = 30.0
    """At shutdown, how long the worker waits for queued hole saves to be written."""
    collect_attention_stats: bool | None = None
    """Gather each hole's attention mass per segment in the blend pass and store it with the variant
    (Cache-Craft's inter/intra attention, for CCI, and its recompute-token ranking); costs one extra
    softmax pass over the hole's rows. None: on when `selector` is "cachecraft"."""
    cachecraft_alpha: float = 1.0
    """Cache-Craft's alpha: CFO = alpha * CCI * (1 - beta'), the fraction of a chunk's tokens recomputed
    (Eq. 12); fit it with `cachefuse tune-alpha` (Eq. 13)."""
    cachecraft_window: int = 3
    """Algorithm 1's layer confidence window w: the focused-chunk set must stay equal for w layers."""
    cachecraft_early_termination: bool = True
    """Stop recomputing unfocused chunks after the layer where the focused set stabilises (Algorithm 1)."""
    force_cfo: float | None = None
    """Debug/test override of every chunk's CFO in the cachecraft selector (variant choice keeps the real one)."""
    max_variants: int = 10000
    """N x M: the total number of chunk variants (K/V entries) the metadata store admits, over all chunks."""
    variant_admission_cfo: float | None = None
    """A stored chunk whose best variant has CFO >= this is computed in full in the fused prompt and
    stored as a new variant for its prefix (docs/variants.md, Admission). None: min(1, alpha / 2) when
    `selector` is "cachecraft" (no variant shares any of the chunk's context), else off: under cacheblend
    and qcfuse it was measured to buy quality only by recomputing more, which `recompute_ratio` buys as well."""
    variant_admission_max_chunks: int = 1
    """At most this many chunks per request are admitted (the highest CFO first); 0 turns admission off."""
    default_variant: str = "fused"
    """What a chunk loads where no stored variant fits its prefix better than its base variant (Cache-Craft's
    choice is the base variant, and the chunk is not first): "fused" loads the chunk's best neighbour-fused
    variant instead (FusionRAG's fused cache, stored by `cachefuse precompute --fuse-neighbours`, used
    wherever the chunk appears), its base variant when it has none, so a store without neighbour variants
    plans as under "base"; "base" always loads the base variant. Variants saved from served requests' holes
    are never loaded this way. docs/variants.md, Neighbour variants."""
    exact_places: bool = True
    """A declared chunk placed after exactly the tokens its stored entry was computed after (the first
    document after the system prompt, under its base variant) is exact: no row of it is a candidate, the
    ratio is spent on the others (docs/variants.md, Exact places). False: every non-system chunk is
    blended as the papers do; for measuring what exact places save (benchmarks/frontier.py)."""
    redis_url: str | None = None
    """A shared tier for several vLLM instances: "redis://[:password@]host:port/db" or "rediss://..." (TLS).
    K/V and variant metadata then live in Redis (memory and disk tiers, when enabled, cache it locally)."""
    redis_password_env: str | None = None
    """The name of an environment variable holding Redis's password, so it need not sit in the URL (or
    in a config file); read once, when the config is built. Overrides a password in `redis_url`."""
    redis_password_file: str | None = None
    """A file holding Redis's password (e.g. a mounted secret; surrounding whitespace is dropped), read
    once, when the config is built. Overrides a password in `redis_url`."""
    redis_capacity_bytes: int = 0
    """Byte budget of the Redis tier over its namespace (LRU); 0: only Redis's own maxmemory applies (under
    noeviction; allkeys-* policies are refused at start-up)."""
    redis_timeout_s: float = 0.5
    """Socket connect timeout, and timeout of each socket read, of every Redis call: a slow or unreachable
    Redis is a miss after this. Within a blend a call also ends by what is left of `load_timeout_s`,
    however many reads its reply takes (cachefuse.call_deadline)."""
    index_refresh_interval_s: float = 1.0
    """How often the scheduler's background thread re-reads the variant index (other engines' saves)."""
    max_blend_tokens_per_step: int = 16384
    """Prompt tokens the connector admits for blending per scheduler step; at least one request always runs."""
    blend_step_tokens: int | None = None
    """The blend work the worker does per engine step, in tokens of a plain prefill (a layer that computes R
    rows of a prompt counts R / num_layers). A blend that fits what is left of it, with no older blend
    waiting, runs whole before the step's forward (synchronous: its first token out of the same step); the
    others wait as vLLM's asynchronous loads and run batched, oldest first, split across steps while the
    running requests decode. None: vLLM's `max_num_batched_tokens` (a step of blends costs about a step of
    vLLM's chunked prefill). 0: every blend runs whole before the forward of the step that schedules its
    request (under load every running request then waits for every blend of the step)."""
    separator_token_id: int | None = None
    """Fallback segmentation for requests without declared chunks: the pieces between this token split
    the prompt (before the first: system chunk; after the last: the question). None disables it."""
    allow_debug_overrides: bool = False
    """Accept `selected_rows` in a request (tests inject the same selection into two engines)."""
    allow_sync_save: bool = False
    """Accept `sync_save: true` in a request: its holes are written (fsync, metadata transaction, Redis) before
    the step's forward, so every request of the batch waits on them. For offline jobs, whose engine has no
    other clients (`cachefuse precompute`); off on a server, where any API client could stall the rest."""
    max_chunks_per_request: int = 128
    """Declared chunks a request may carry; one with more runs as plain vLLM (reason `over_limit`). Planning
    and saving cost grows with it, inside vLLM's scheduler step."""
    min_chunk_tokens: int = 2
    """Tokens a declared chunk must have; a request declaring a shorter one runs as plain vLLM (`over_limit`):
    a one-token chunk costs a store entry and a metadata row and saves nothing."""
    max_chunk_text_bytes: int = 1 << 20
    """UTF-8 bytes of a request's `chunk_texts`, summed; more runs as plain vLLM (`over_limit`) before any is
    tokenized (tokenizing happens inside vLLM's scheduler step)."""
    max_variant_prefix_chunks: int = 16
    """A variant's prefix is the declared chunks before it, the nearest this many: Cache-Craft's order penalty
    costs O(m^2) per variant scored, so an unbounded prefix would make planning cubic in a request's chunks."""

    def __post_init__(self) -> None:
        for name in _LIST_FIELDS:  # a list where a tuple is stored (the config stays hashable, immutable)
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        checks.check_ratio(self)
        checks.check_cacheblend(self)
        checks.check_selector_options(self)
        checks.check_loading(self)
        checks.check_variants(self)
        # kept out of the fields, so no repr, dict or log of the config shows it
        object.__setattr__(self, "_redis_password", checks.resolve_redis_password(self))
        checks.check_redis_timeouts(self)
        checks.check_saving(self)
        checks.check_request_limits(self)

    @property
    def redis_connection_url(self) -> str | None:
        """The URL to connect with: `redis_url`, with the password from redis_password_env / _file when set.
        Never log it (cachefuse.redis_client.redact_url)."""
        password = getattr(self, "_redis_password", None)
        if self.redis_url is None or password is None:
            return self.redis_url
        from cachefuse.redis_client import url_with_password

        return url_with_password(self.redis_url, password)

    @property
    def gathers_attention_stats(self) -> bool:
        """collect_attention_stats, with None resolved: on for the cachecraft selector."""
        if self.collect_attention_stats is None:
            return self.selector == "cachecraft"
        return self.collect_attention_stats

    @property
    def admission_cfo(self) -> float | None:
        """variant_admission_cfo, with None resolved (min(1, alpha / 2) for cachecraft); None: off."""
        if self.variant_admission_max_chunks == 0:
            return None
        if self.variant_admission_cfo is not None:
            return self.variant_admission_cfo
        if self.selector == "cachecraft" and self.cachecraft_alpha > 0.0:
            return min(1.0, 0.5 * self.cachecraft_alpha)
        return None

    def check_model(self, num_layers: int) -> None:
        """The fields that name layers, against the model (at engine start-up; raises ConfigError).

        A check layer at the last layer would be ignored (the last layer computes only the last row), so
        cacheblend's must be below it; QCFuse's critical layers must exist (negative: from the end).
        """
        if max(self.cacheblend_check_layers) > num_layers - 2:
            checks.fail("cacheblend_check_layers", self.cacheblend_check_layers,
                  f"layers in 1..{num_layers - 2}: the model has {num_layers} layers and the last computes only "
                  "the last row, so a check layer there selects nothing")
        layers = self.qcfuse_critical_layers or ()
        if any(not -num_layers <= layer < num_layers for layer in layers):
            checks.fail("qcfuse_critical_layers", layers,
                  f"layers in 0..{num_layers - 1} (or -1..-{num_layers} from the end): the model has {num_layers}")

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> CacheFuseConfig:
        """Builds a config from a dict; a `config_file` key loads that YAML first, then overrides."""
        data = dict(data or {})
        base: dict[str, Any] = {}
        if "config_file" in data:
            path = data.pop("config_file")
            if not isinstance(path, str | os.PathLike) or not str(path):
                # an int would be opened as a file descriptor, None raised a bare TypeError
                checks.fail("config_file", path, "the path of a YAML file")
            base = _read_yaml(path)
        merged = {**base, **data}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - known, key=repr)  # YAML keys need not be strings
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(map(repr, unknown))}: expected some of {', '.join(sorted(known))}")
        return cls(**merged)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> CacheFuseConfig:
        return cls.from_dict(_read_yaml(path))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) }

    def replace(self, **changes: Any) -> CacheFuseConfig:
        return dataclasses.replace(self, **changes)

    @property
    def store_path(self) -> Path:
        return Path(self.store_dir).expanduser()

    def kv_store_path(self, tp_size: int = 1, tp_rank: int = 0) -> Path:
        """The directory of one tensor-parallel rank's K/V files: `store_path` itself with one rank, else a
        directory per rank inside it (the metadata stays at the top, rank 0's). A disk tier's index, byte
        budget and pins live in its process, so ranks sharing one directory would each count, evict and
        unlink the others' files (tp_size x the budget on disk, pinned entries deleted under a reader)."""
        if tp_size == 1:
            return self.store_path
        return self.store_path / rank_dir_name(tp_size, tp_rank)

    def compute_hash(self) -> str:
        """Hash of what changes stored bytes; it joins every chunk key (docs/architecture.md, Definitions).

        Selection and capacity fields change which rows are recomputed or kept, never the bytes of a
        stored entry, so only the entry format version enters today.
        """
        payload = json.dumps({"cache_format_version": CACHE_FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"config_file={str(path)!r} cannot be read: {e.strerror}") from e
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        reason = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"config_file={str(path)!r} is not valid YAML{at}: {reason}; fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config_file={str(path)!r} must hold a mapping of config fields")
    return data
