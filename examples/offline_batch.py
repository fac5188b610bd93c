"""Offline RAG batch with `LLM.generate` and CacheFuseConnector: chunk caches reused in new orders.

A pool of retrieved chunks; every prompt is the same system prompt, a random subset of the pool in
a random order, and a question. The batch runs twice:

- pass 1: the chunks are not stored yet; each is computed in full (a hole) and saved, so later
  requests of the same pass may already hit chunks that earlier ones saved;
- pass 2: the same subsets, shuffled into new orders: every chunk is a hit, re-rotated to its new
  position, and only the selected tokens, the question and the last token are recomputed.

It prints each request's hits and recomputed tokens, and the time of each pass.

    python examples/offline_batch.py [--model-dir DIR] [--store DIR]

Without --model-dir a tiny random-weight Llama is built into ./.cache/examples-model (no hub;
the answers are noise, the figures are real). On CPU, VLLM_ENABLE_V1_MULTIPROCESSING=0 starts
the engine in seconds instead of ~25 s.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cachefuse.rag_prompt import build_rag_prompt  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer the question using the documents.\n"
PLACES = "Kalo Minteh Surap Doravi Pellin Quasto Brivane Tessaly Orun Velmar Zadok Ilrune".split()
THINGS = "river harbour bridge tower market library canal garden station festival".split()


def make_chunk(rng: random.Random, index: int, num_sentences: int) -> str:
    sentences = [f"Document {index}:"]
    for _ in range(num_sentences):
        sentences.append(f"The {rng.choice(THINGS)} of {rng.choice(PLACES)} is {rng.randint(2, 99)} miles from "
                         f"the {rng.choice(THINGS)} of {rng.choice(PLACES)}.")
    return " ".join(sentences) + "\n"


def make_batch(args: argparse.Namespace) -> tuple[list[str], list[list[int]], list[list[int]], list[str]]:
    """The chunk pool, each prompt's chunk order for pass 1 and pass 2, and the questions."""
    rng = random.Random(args.seed)
    pool = [make_chunk(rng, i, args.sentences_per_chunk) for i in range(args.pool_size)]
    first = [rng.sample(range(args.pool_size), args.chunks_per_prompt) for _ in range(args.num_prompts)]
    second = [rng.sample(order, len(order)) for order in first]  # same chunks, new positions
    questions = [f"Question: how far is the {rng.choice(THINGS)} of {rng.choice(PLACES)}?\nAnswer:"
                 for _ in range(args.num_prompts)]
    return pool, first, second, questions


def run_pass(llm, tokenizer, pool, orders, questions, max_tokens: int) -> float:
    from vllm import SamplingParams

    prompts = [build_rag_prompt(tokenizer, SYSTEM, [pool[i] for i in order], question)
               for order, question in zip(orders, questions, strict=True)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                             extra_args={"kv_transfer_params": p.kv_transfer_params()}) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p.token_ids} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for index, (order, prompt, output) in enumerate(zip(orders, prompts, outputs, strict=True)):
        stats = (output.kv_transfer_params or {}).get("cachefuse") or {}
        print(f"  request {index}: chunks {order}, {prompt.num_tokens} tokens: "
              f"hits {stats.get('chunks_hit')}/{stats.get('chunks')} (system prompt included), "
              f"reused {stats.get('tokens_reused')}, recomputed {stats.get('tokens_recomputed')}, "
              f"status {stats.get('status')}, answer {output.outputs[0].text!r}")
    return elapsed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="a local checkpoint (default: a tiny built model)")
    parser.add_argument("--store", default=None, help="the chunk store (default: a temporary directory)")
    parser.add_argument("--selector", default="cacheblend")
    parser.add_argument("--recompute-ratio", type=float, default=0.15)
    parser.add_argument("--pool-size", type=int, default=8)
    parser.add_argument("--chunks-per-prompt", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--sentences-per-chunk", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 1 <= args.chunks_per_prompt <= args.pool_size:
        parser.error(f"--chunks-per-prompt {args.chunks_per_prompt}: expected 1..--pool-size ({args.pool_size})")
    return args


def main() -> None:
    args = parse_args()
    if args.model_dir is None:
        from cachefuse.testing.tiny_models import cached_tiny_model

        args.model_dir = str(cached_tiny_model("llama", Path(".cache") / "examples-model"))
    store = args.store or tempfile.mkdtemp(prefix="cachefuse-offline-batch-")

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv_transfer_config = KVTransferConfig(
        kv_connector="CacheFuseConnector", kv_connector_module_path="cachefuse.vllm.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store_dir": store, "selector": args.selector,
                                   "recompute_ratio": args.recompute_ratio})
    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
              kv_transfer_config=kv_transfer_config,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    pool, first, second, questions = make_batch(args)
    # A plain request first, so that pass 1 is not charged with the engine's first-step costs.
    llm.generate([{"prompt_token_ids": tokenizer.encode(SYSTEM)}], SamplingParams(max_tokens=1), use_tqdm=False)
    try:
        print(f"pass 1 (cold store {store}):")
        time1 = run_pass(llm, tokenizer, pool, first, questions, args.max_tokens)
        print("pass 2 (same chunks, new orders):")
        time2 = run_pass(llm, tokenizer, pool, second, questions, args.max_tokens)
    finally:
        if args.store is None:
            shutil.rmtree(store, ignore_errors=True)
    print(f"pass 1: {time1:.2f} s, pass 2: {time2:.2f} s for {args.num_prompts} requests")


if __name__ == "__main__":
    main()
