"""Shared set-up for fusor tests: a RAG-shaped prompt of random ids over a tiny model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.chunks import KeyContext, segment_prompt
from cachefuse.config import CacheFuseConfig
from cachefuse.fusion.engine import FusionEngine
from cachefuse.store.base import StoreIdentity
from cachefuse.store.memory import MemoryStore


@dataclass
class RagCase:
    token_ids: list[int]
    chunks: list[tuple[int, int]]   # declared: system, A, B (hole unless precomputed), C
    system: list[int]
    pieces: list[list[int]]         # A, B, C ids
    question: list[int]


def make_case(vocab_size: int, seed: int = 0, lengths=(12, 23, 19, 31, 9)) -> RagCase:
    g = torch.Generator().manual_seed(seed)
    system_len, a_len, b_len, c_len, question_len = lengths

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=g).tolist()

    system, a, b, c, question = ids(system_len), ids(a_len), ids(b_len), ids(c_len), ids(question_len)
    token_ids = system + a + b + c + question
    starts = [0, system_len, system_len + a_len, system_len + a_len + b_len]
    ends = [system_len, system_len + a_len, system_len + a_len + b_len, system_len + a_len + b_len + c_len]
    return RagCase(token_ids, list(zip(starts, ends, strict=True)), system, [a, b, c], question)


def make_engine(adapter: HFAdapter, config: CacheFuseConfig | None = None) -> FusionEngine:
    identity = StoreIdentity("test-model", adapter.shape.num_layers, adapter.shape.dtype)
    store = MemoryStore(identity, capacity_bytes=1 << 30)
    return FusionEngine(adapter, store, KeyContext("test-model", "float32"), config or CacheFuseConfig())


def precompute_case(engine: FusionEngine, case: RagCase, *, with_hole: bool = True) -> None:
    """System at position 0, chunks A and C after the system alone; B stays a hole if with_hole."""
    engine.precompute([case.system])
    pieces = [case.pieces[0], case.pieces[2]] if with_hole else case.pieces
    engine.precompute(pieces, prefix_ids=case.system)


def hole_request_parts(adapter: HFAdapter, seed: int):
    """A precomputed case (system, A and C stored; B a hole) and its FuseRequest parts:
    (engine, case, segments, loaded entries by segment index)."""
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=seed)
    precompute_case(engine, case)
    segments = segment_prompt(len(case.token_ids), case.chunks)
    loaded = {i: engine.store.get(engine.key(case.token_ids[s.start:s.end], at_prompt_start=s.is_system))
              for i, s in enumerate(segments) if s.is_chunk and i != 2}
    return engine, case, segments, loaded
