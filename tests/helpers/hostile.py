"""Hypothesis strategies for what a hostile or careless client may put in `kv_transfer_params`.

JSON-like values of any shape (wrong types, non-string keys, NaN, nesting, lone surrogates), mixed with
values close to valid ones, so that generated requests reach every check of cachefuse.request and the
planning behind it, not only the first type check.
"""

from __future__ import annotations

from hypothesis import strategies as st

SELECTORS = ["cacheblend", "epic", "full_reuse", "full_prefill", "random", "cachecraft", "nope", ""]

scalars = (st.none() | st.booleans() | st.integers(-3, 130) | st.integers() | st.floats()
           | st.text(max_size=12) | st.sampled_from(["\ud800", "\udfff x", "é" * 5]))
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6) | st.integers(),
                                                                       children, max_size=4),
    max_leaves=12)
offsets = st.lists(st.integers(-2, 110), min_size=0, max_size=3) | json_values
texts = st.lists(st.text(max_size=24) | st.sampled_from(["\ud800", "hello world", "a"]) | json_values,
                 max_size=5) | json_values
cachefuse_fields = st.fixed_dictionaries({}, optional={
    "chunks": st.lists(offsets, max_size=6) | json_values,
    "chunk_texts": texts,
    "selector": st.sampled_from(SELECTORS) | json_values,
    "recompute_ratio": st.floats(-1, 2) | json_values,
    "selected_rows": st.lists(st.integers(-5, 120), max_size=6) | json_values,
    "bogus": json_values,
})
kv_transfer_params = st.none() | json_values | st.fixed_dictionaries(
    {"cachefuse": cachefuse_fields | json_values}, optional={"other": json_values})
