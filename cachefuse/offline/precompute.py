"""Offline precompute: store every chunk's base variant through a connector-enabled vLLM engine.

Each chunk is sent once as the prompt below, with `max_tokens=1`, the `full_prefill` selector and
`sync_save` (the response comes once the chunk is written, so it reports the save; the engine must
allow it: `allow_sync_save`). The connector treats a declared chunk that is not stored as a hole:
its blend pass computes it in full and saves it RoPE-stripped. So the system prompt is stored at
position 0 (exact: it never moves) and the chunk as computed after the system prompt alone, which is
the base variant (docs/architecture.md, Definitions: variant).

```
| system (chunk, [BOS] + ids) | chunk (hole: computed, saved) | tail (1 token) |
0                             s                               s + c       N-1 = s + c
|<------------- written by cachefuse (blend pass) ------------------------>| vLLM |
```

The tail token exists because vLLM computes the last prompt token itself: the connector's hit
stops one token short of the prompt end, so a declared chunk may not end there
(`cachefuse.request.parse_request` rejects it). Any id serves; the tokenizer's EOS is used. It is
not part of any chunk, so it changes no key and no stored byte.

Resumable: before sending, every chunk's key is computed as the connector's scheduler computes it
(rank 0) and chunks already listed under the store directory are skipped.

Running beside a server that shares the store works: the server's scheduler sees the new metadata
rows at its next index refresh, and its worker's disk tier indexes a new entry the first time it is
asked for (`DiskStore.contains`). Each process keeps its own byte budget over the directory, so size
the precompute engine's `disk_capacity_bytes` like the server's.

Imports the standard library, tqdm and cachefuse.{chunks, config, errors, store.disk} at module
level; cachefuse.vllm only inside the functions that drive a vLLM engine (never vllm itself: the engine
is handed in, and requests are built by cachefuse.vllm.engines).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachefuse.chunks import PARAMS_KEY, KeyContext, chunk_key, model_fingerprint
from cachefuse.config import CacheFuseConfig
from cachefuse.errors import ConfigError
from cachefuse.rag_prompt import build_rag_prompt, tokenize_piece
from cachefuse.store.disk import list_keys

logger = logging.getLogger(__name__)

SELECTOR = "full_prefill"


@dataclass(frozen=True)
class PrecomputeFailure:
    """A chunk (or the system prompt) that was sent or checked but is not in the store."""

    index: int | None
    """Position in the input chunks; None for the system prompt."""
    reason: str
    """The connector's fallback_reason, or "empty", "too_long", "not_saved", "no_stats"."""
    detail: str = ""


@dataclass
class PrecomputeReport:
    """What a precompute run did; counts cover the input chunks, the system prompt is reported apart."""

    num_chunks: int = 0
    num_stored: int = 0
    """Chunks stored by this run."""
    num_skipped: int = 0
    """Chunks already stored before the run (or repeated earlier in the input)."""
    num_failed: int = 0
    failures: list[PrecomputeFailure] = field(default_factory=list)
    keys: list[str | None] = field(default_factory=list)
    """Each chunk's store key (rank 0), in input order; None for a chunk with no tokens."""
    system_key: str | None = None
    system_status: str = "none"
    """"stored", "skipped" (already stored), "failed", or "none" (empty system prompt)."""
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class _Item:
    """One prompt to send: `index` is None for the system prompt sent on its own."""

    index: int | None
    key: str
    token_ids: list[int]
    chunks: list[list[int]]


def precompute_chunks(llm: Any, tokenizer: Any, system: str, chunks: Iterable[str], *, store_dir: str | Path,
                      config: CacheFuseConfig | None = None, batch_size: int = 16,
                      progress: bool = True) -> PrecomputeReport:
    """Stores the system prompt and each chunk's base variant, skipping what is already stored.

    Args:
        llm: a `vllm.LLM` whose kv_transfer_config names CacheFuseConnector (prefix caching off,
            kv_load_failure_policy "recompute", `allow_sync_save: true`), writing to `store_dir`.
        tokenizer: the model's tokenizer (`encode`, `bos_token_id`, `eos_token_id`).
        system: the system prompt every RAG prompt starts with; may be empty (no system chunk).
        chunks: chunk texts, each tokenized on its own exactly as `build_rag_prompt` does.
        store_dir: the connector's store directory (its disk tier), listed to skip stored chunks.
        config: the config whose hash joins the keys; default: the engine's connector config
            (its kv_connector_extra_config), which also says where the store is.
        batch_size: prompts per `llm.generate` call (one progress update each).
        progress: show a tqdm progress bar (stderr).

    Returns:
        The counts of stored, skipped and failed chunks, the failures with reasons, and the keys.

    Raises:
        ConfigError: the engine runs no cachefuse connector, writes elsewhere than `store_dir`, has
            no disk tier, does not allow `sync_save`, or `batch_size` < 1.
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} is invalid: expected an integer >= 1")
    start = time.perf_counter()
    vllm_config = llm.llm_engine.vllm_config
    engine_config = connector_config(vllm_config)
    store_dir = check_store(engine_config, store_dir)
    check_sync_save(engine_config)
    kv_dir = rank0_kv_dir(vllm_config, engine_config)  # listed to skip stored chunks and see new ones
    config = config or engine_config
    key_context = scheduler_key_context(vllm_config, config)
    max_model_len = vllm_config.model_config.max_model_len
    tail_id = tail_token_id(tokenizer)
    report, items = _plan(tokenizer, system, list(chunks), key_context, list_keys(kv_dir), max_model_len,
                          tail_id)
    bar = tqdm(total=report.num_chunks, unit="chunk", desc="precompute", disable=not progress)
    bar.update(report.num_skipped + report.num_failed)
    for at in range(0, len(items), batch_size):
        batch = items[at: at + batch_size]
        outputs = llm.generate([{"prompt_token_ids": item.token_ids} for item in batch],
                               [_sampling_params(item) for item in batch], use_tqdm=False)
        stored = list_keys(kv_dir)
        for item, output in zip(batch, outputs, strict=True):
            _record(report, item, output, stored)
        bar.update(sum(item.index is not None for item in batch))
    bar.close()
    if report.system_key is not None and report.system_status != "skipped":
        _record_system(report, list_keys(kv_dir))
    report.elapsed_s = time.perf_counter() - start
    logger.info("precompute: %d stored, %d skipped, %d failed of %d chunks in %.1f s (store %s)",
                report.num_stored, report.num_skipped, report.num_failed, report.num_chunks, report.elapsed_s,
                store_dir)
    return report


def scheduler_key_context(vllm_config: Any, config: CacheFuseConfig) -> KeyContext:
    """The KeyContext the connector's scheduler builds (rank 0): fingerprint, dtype, TP size, config hash,
    paged cache dtype."""
    from cachefuse.chunks import dtype_name, paged_cache_dtype_name, resolve_model_dir

    model_config = vllm_config.model_config
    return KeyContext(model_fingerprint(resolve_model_dir(model_config)), dtype_name(model_config.dtype),
                      vllm_config.parallel_config.tensor_parallel_size, 0, config.compute_hash(),
                      paged_cache_dtype_name(vllm_config.cache_config.cache_dtype, model_config.dtype))


def connector_config(vllm_config: Any) -> CacheFuseConfig:
    """The engine's cachefuse config (its kv_connector_extra_config); ConfigError if it runs no connector."""
    from cachefuse.vllm.plugin import uses_cachefuse

    if not uses_cachefuse(vllm_config):
        raise ConfigError(
            "llm runs no CacheFuseConnector: build it with kv_transfer_config=KVTransferConfig("
            "kv_connector='CacheFuseConnector', kv_connector_module_path='cachefuse.vllm.connector', "
            "kv_role='kv_both', kv_load_failure_policy='recompute', "
            "kv_connector_extra_config={'store_dir': ..., 'allow_sync_save': True})")
    return CacheFuseConfig.from_dict(dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}))


def check_store(config: CacheFuseConfig, store_dir: str | Path) -> Path:
    """`store_dir`, checked to be the engine's disk tier; ConfigError naming the fix if not."""
    path = Path(store_dir).expanduser()
    if path.resolve() != config.store_path.resolve():
        raise ConfigError(
            f"store_dir={str(store_dir)!r} is not the engine's store: its connector writes to "
            f"{str(config.store_path)!r}; pass that directory or start the engine with store_dir={str(path)!r}")
    if not config.disk_capacity_bytes:
        raise ConfigError("disk_capacity_bytes=0 is invalid for precompute: chunks are stored on the disk tier")
    return path


def rank0_kv_dir(vllm_config: Any, config: CacheFuseConfig) -> Path:
    """Where the engine's rank 0 writes K/V (the keys the scheduler and precompute compute are rank 0's)."""
    return config.kv_store_path(vllm_config.parallel_config.tensor_parallel_size, 0)


def check_sync_save(config: CacheFuseConfig) -> None:
    """ConfigError naming the fix when the engine would refuse precompute's `sync_save` requests: they would
    run as plain vLLM and store nothing."""
    if not config.allow_sync_save:
        raise ConfigError("allow_sync_save=False is invalid for precompute: its requests ask for sync_save (the "
                          "response says whether each chunk was stored); start the engine with "
                          "allow_sync_save: true, as cachefuse.vllm.engines.connector_extra_config does")


def tail_token_id(tokenizer: Any) -> int:
    """The computed last token; any id works (see the module docstring), EOS when there is one."""
    for candidate in (getattr(tokenizer, "eos_token_id", None), *tokenize_piece(tokenizer, "\n")[-1:],
                      getattr(tokenizer, "bos_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    return 0


def _plan(tokenizer: Any, system: str, texts: list[str], key_context: KeyContext, stored: set[str],
          max_model_len: int, tail_id: int) -> tuple[PrecomputeReport, list[_Item]]:
    """Keys every chunk, counts what is stored, and lists the prompts to send."""
    report = PrecomputeReport(num_chunks=len(texts))
    system_ids = build_rag_prompt(tokenizer, system, [], "").token_ids
    if not system_ids:
        raise ConfigError(
            "system='' is invalid with a tokenizer that has no BOS token: each chunk would start its prompt, "
            "where it is a system chunk (stored for offset 0 only), and no base variant would be stored for "
            "the chunk anywhere else; pass the system prompt your prompts start with (--system or --system-file)")
    if system:
        report.system_key = chunk_key(system_ids, key_context, at_prompt_start=True)
        report.system_status = "skipped" if report.system_key in stored else "pending"
    items, seen = [], set()
    for index, text in enumerate(texts):
        ids = tokenize_piece(tokenizer, text)
        if not ids:
            report.keys.append(None)
            _fail(report, index, "empty", "the chunk text tokenizes to no tokens")
            continue
        key = chunk_key(ids, key_context)
        report.keys.append(key)
        if key in stored or key in seen:
            report.num_skipped += 1
            continue
        seen.add(key)
        prompt = build_rag_prompt(tokenizer, system, [text], "")
        token_ids = [*prompt.token_ids, tail_id]
        if len(token_ids) >= max_model_len:
            _fail(report, index, "too_long",
                  f"system + chunk + 1 = {len(token_ids)} tokens; the engine's max_model_len is {max_model_len}")
            continue
        items.append(_Item(index, key, token_ids, [[s, e] for s, e in prompt.chunks]))
    if report.system_status == "pending" and not items:  # nothing else to send: the system prompt alone
        items.append(_Item(None, report.system_key, [*system_ids, tail_id], [[0, len(system_ids)]]))
    return report, items


def _sampling_params(item: _Item) -> Any:
    from cachefuse.vllm.engines import sampling_params

    # store_variant: the chunk is computed in full even when the server has already stored a variant of it
    # after some prefix (the scheduler would load that one instead, and no base variant would be written).
    # The chunk never starts the prompt (a system prompt or BOS comes first: _plan checks).
    return sampling_params(max_tokens=1, temperature=0.0, cachefuse={"chunks": item.chunks, "selector": SELECTOR,
                                                                        "sync_save": True,
                                                                        "store_variant": item.index is not None})


def _record(report: PrecomputeReport, item: _Item, output: Any, stored: set[str]) -> None:
    """Classifies one response: stored when its key is now listed, else failed with the reason."""
    if item.index is None:
        return  # the system prompt alone: judged by _record_system
    params = getattr(output, "kv_transfer_params", None)
    outcome = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(outcome, dict):
        _fail(report, item.index, "no_stats", "the response carries no kv_transfer_params['cachefuse']")
    elif outcome.get("status") == "fallback" or outcome.get("fallback_reason"):
        _fail(report, item.index, str(outcome.get("fallback_reason")), str(outcome.get("detail", "")))
    elif item.key in stored:
        report.num_stored += 1
    else:
        _fail(report, item.index, "not_saved",
              f"status={outcome.get('status')!r}, save_failures={outcome.get('save_failures')}, "
              f"miss_reasons={outcome.get('miss_reasons')}")


def _record_system(report: PrecomputeReport, stored: set[str]) -> None:
    if report.system_key in stored:
        report.system_status = "stored"
    else:
        report.system_status = "failed"
        report.failures.append(PrecomputeFailure(None, "not_saved", "the system prompt is not in the store"))


def _fail(report: PrecomputeReport, index: int, reason: str, detail: str) -> None:
    report.num_failed += 1
    report.failures.append(PrecomputeFailure(index, reason, detail))
    logger.warning("precompute: chunk %d failed (%s: %s)", index, reason, detail)
