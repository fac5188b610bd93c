"""cachefuse demo: fuse a RAG prompt from precomputed chunk caches and compare it with full prefill.

Builds a 12-layer model locally (random weights, locally trained tokenizer: no hub), assembles a
prompt of a system prompt, 6 retrieved chunks and a question, precomputes every chunk into the disk
store, then runs full prefill, full reuse and the fusor at 5/15/30% with each selector, and prints
prefill time and fidelity to full prefill. Random weights make the fidelity figures a mechanics
check, not a quality claim (quality is measured on a trained probe model: see docs/).

    python examples/demo.py [--store demo-out/store] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transformers import AutoTokenizer  # noqa: E402

from cachefuse.adapters.hf import HFAdapter  # noqa: E402
from cachefuse.chunks import KeyContext, build_rag_prompt, model_fingerprint  # noqa: E402
from cachefuse.config import CacheFuseConfig  # noqa: E402
from cachefuse.engine import FusionEngine  # noqa: E402
from cachefuse.eval import fidelity  # noqa: E402
from cachefuse.store.base import StoreIdentity  # noqa: E402
from cachefuse.store.tiered import open_store  # noqa: E402
from cachefuse.testing.tiny_models import cached_tiny_model  # noqa: E402

MODEL = dict(num_layers=12, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4,
             head_dim=64, vocab_size=1024, max_position_embeddings=8192)
SELECTORS = ("cacheblend", "epic", "random")
RATIOS = (0.05, 0.15, 0.30)
CONTINUATION = 16

WORDS = ("river city harbour bridge tower market council valley engine archive station garden "
         "library canal mountain village festival merchant captain teacher lantern orchard").split()
NAMES = ("Kalo Minteh Surap Doravi Pellin Quasto Brivane Tessaly Orun Velmar Zadok Ilrune").split()


def make_text(rng: random.Random, num_sentences: int) -> str:
    sentences = []
    for _ in range(num_sentences):
        a, b = rng.choice(NAMES), rng.choice(NAMES)
        sentences.append(f"The {rng.choice(WORDS)} of {a} is {rng.randint(2, 99)} miles from the "
                         f"{rng.choice(WORDS)} of {b}, and its {rng.choice(WORDS)} opened in {rng.randint(1700, 2020)}.")
    return " ".join(sentences) + "\n"


def timed(fn, repeats: int = 3):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description="cachefuse demo")
    parser.add_argument("--store", type=Path, default=REPO / "demo-out" / "store")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-cache", type=Path, default=REPO / ".cache" / "bench-models")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = cached_tiny_model("llama", args.model_cache, **MODEL)
    adapter = HFAdapter.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(7)
    prompt = build_rag_prompt(
        tokenizer,
        system="You answer questions about the towns below, using only the documents given.\n",
        chunks=[f"Document {i + 1}: " + make_text(rng, 6) for i in range(6)],
        question="Question: how far is the harbour of Kalo from the tower of Minteh? Answer:")

    fingerprint = model_fingerprint(model_dir)
    config = CacheFuseConfig(store_dir=str(args.store))
    store = open_store(config.store_path, StoreIdentity(fingerprint, adapter.shape.num_layers, adapter.shape.dtype),
                       memory_capacity_bytes=config.memory_capacity_bytes,
                       disk_capacity_bytes=config.disk_capacity_bytes)
    engine = FusionEngine(adapter, store, KeyContext(fingerprint, "float32", config_hash=config.compute_hash()),
                          config)
    system_ids, *chunk_ids = prompt.chunk_token_ids
    start = time.perf_counter()
    engine.precompute([system_ids])
    engine.precompute(chunk_ids, prefix_ids=system_ids)
    print(f"model: 12 layers, hidden 512, {sum(p.numel() for p in adapter.model.parameters()) / 1e6:.1f}M params; "
          f"prompt: {prompt.num_tokens} tokens = system {len(system_ids)} + 6 chunks "
          f"({', '.join(str(len(c)) for c in chunk_ids)}) + question {prompt.question[1] - prompt.question[0]}")
    print(f"precomputed 7 chunk caches into {args.store} in {time.perf_counter() - start:.1f} s; "
          f"threads={torch.get_num_threads()}\n")

    def run(selector: str, ratio: float):
        return engine.prefill(prompt.token_ids, prompt.chunks, selector=selector, ratio=ratio, save_holes=False)

    full_s, (full, _) = timed(lambda: run("full_prefill", 1.0))
    full_tokens = fidelity.greedy_continuation(adapter, full, CONTINUATION)
    configs = [("full_prefill", 1.0), ("full_reuse", 0.0)] + [(s, r) for s in SELECTORS for r in RATIOS]
    header = (f"{'config':<18}{'prefill ms':>11}{'vs full':>9}{'recomputed':>11}{'KV dev mean':>12}"
              f"{'KV dev max':>11}{'KL':>10}{'top-1':>7}{'greedy 16':>10}")
    print(header)
    print("-" * len(header))
    for selector, ratio in configs:
        seconds, (result, stats) = (full_s, (full, None)) if selector == "full_prefill" else timed(
            lambda s=selector, r=ratio: run(s, r))
        deviation = fidelity.kv_deviation_per_layer(result, full)
        tokens = fidelity.greedy_continuation(adapter, result, CONTINUATION)
        recomputed = prompt.num_tokens if stats is None else stats.tokens_recomputed
        name = selector if selector.startswith("full") else f"{selector} {ratio:.0%}"
        print(f"{name:<18}{seconds * 1e3:>11.1f}{full_s / seconds:>8.2f}x{recomputed:>11d}"
              f"{statistics.mean(deviation):>12.4f}{max(deviation):>11.4f}"
              f"{fidelity.logits_kl(full.logits, result.logits):>10.2e}"
              f"{'yes' if fidelity.top1_agree(full.logits, result.logits) else 'no':>7}"
              f"{fidelity.matching_prefix(full_tokens, tokens):>7d}/{CONTINUATION}")
    print("\nKV dev: relative L2 distance of the fused K/V from full prefill's, per layer (mean, max);"
          " KL: last-token KL(full || fused) in nats; greedy 16: tokens matching full prefill's"
          " continuation before the first divergence.")


if __name__ == "__main__":
    main()
