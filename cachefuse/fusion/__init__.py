"""The blend core: one fused prefill, from a prompt's declared chunks to its fused K/V and saved holes.

    plan.py              FuseRequest / FuseResult: what travels into and out of a pass
    fusor.py             Fusor: the layer-wise blend pass (select, recompute, merge)
    layers.py            LoadedLayers: the loaded chunks' K/V the fusor reads, one layer at a time
    probe.py             the question probe of query-aware selectors
    engine.py            FusionEngine: keys -> variant choice -> load -> fuse -> save holes
    saving.py            hole saves: storable entries and HoleWriter
    background_saver.py  BackgroundSaver and PendingReadsStore: saves written behind the request
    stats.py             FusionStats: one fused prefill's figures

Imports flow down the list's dependencies only (engine -> fusor -> layers, probe, plan); never vllm.
The reference engine (demo, eval, benchmarks) and the vLLM worker run the same FusionEngine over
different model adapters. This file imports nothing: a package that imports its own modules closes
an import cycle with each of them.
"""
