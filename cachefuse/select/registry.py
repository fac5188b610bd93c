"""Selector registry: `selector="<name>"` maps to cachefuse/select/<name>.py, built from the config.

Imports cachefuse.select.base and, when asked for it, the one selector module named; no vllm.
"""

from __future__ import annotations

from cachefuse.config import CacheFuseConfig
from cachefuse.select.base import Selector


def make_selector(name: str, config: CacheFuseConfig) -> Selector:
    """Builds a fresh selector for one request from the config's fields."""
    if name == "full_prefill":
        from cachefuse.select.full_prefill import FullPrefillSelector

        return FullPrefillSelector()
    if name == "full_reuse":
        from cachefuse.select.full_reuse import FullReuseSelector

        return FullReuseSelector()
    if name == "cacheblend":
        from cachefuse.select.cacheblend import CacheBlendSelector

        return CacheBlendSelector(
            config.cacheblend_check_layers, config.cacheblend_ratio_schedule, config.cacheblend_deviation,
            config.cacheblend_sink_tokens, config.cacheblend_chunk_floor)
    if name == "epic":
        from cachefuse.select.epic import EpicSelector

        return EpicSelector(config.epic_k)
    if name == "random":
        from cachefuse.select.random import RandomSelector

        return RandomSelector(config.random_seed)
    if name == "cachecraft":
        from cachefuse.select.cachecraft import CacheCraftSelector

        return CacheCraftSelector(force_cfo=config.force_cfo, window=config.cachecraft_window,
                                  early_termination=config.cachecraft_early_termination)
    if name == "fusionrag":
        from cachefuse.select.fusionrag import FusionRAGSelector

        return FusionRAGSelector(config.fusionrag_score_layers)
    if name == "qcfuse":
        from cachefuse.select.qcfuse import QCFuseSelector

        return QCFuseSelector(anchor_ratio=config.qcfuse_anchor_ratio, sink_tokens=config.qcfuse_sink_tokens,
                              layers=config.qcfuse_layers, critical_layers=config.qcfuse_critical_layers,
                              view=config.qcfuse_view)
    raise ValueError(f"selector={name!r}: expected one of full_prefill, full_reuse, cacheblend, epic, random, "
                     "cachecraft, fusionrag, qcfuse")
