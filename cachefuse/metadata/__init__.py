"""Chunk-variant metadata (Cache-Craft's metadata store) and the factory that opens the configured backend
(backends.py).

    scores.py    CCI, beta, gamma, beta', CFO, variant choice, f_r: the math, on plain values
    base.py      VariantRecord, ids and K/V keys, pins, the MetaStore contract every backend follows
    sqlite.py    SqliteMetaStore: one file next to the disk tier (the embedded default)
    redis.py     RedisMetaStore: shared by several engines
    index.py     VariantIndex (the scheduler's in-process snapshot), the variant choice rules, plan_variants
    refresher.py IndexRefresher: the index kept current from the store on a thread of its own
    backends.py  open_metastore / open_config_metastore: the configured backend

Backends import `base` and `scores` only; backends.py imports a backend when asked for it (Redis only
when configured). This file imports nothing: a package that imports its own modules closes a cycle with
them. No torch, no vllm anywhere in the package: the scheduler process reads it.
"""
