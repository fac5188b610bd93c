"""Trains the RAG probe model: the stand-in for a real LLM in cachefuse's quality tests.

    python benchmarks/train_probe.py --out models/rag-probe            # ~1-2 h on 2 CPU cores
    python benchmarks/train_probe.py --out /tmp/p --steps 200          # a smoke run

The task (cachefuse/eval/probe_task.py) is associative recall over a stream of `NAME VALUE` facts;
a fact split by a chunk boundary can only be answered when its value's K/V knows the name before it,
which a chunk cached on its own does not. The model is a transformers `LlamaForCausalLM` that vLLM's
CPU backend serves too (head_dim 32), trained from random weights on full prefills only.

Deterministic: every batch is drawn from `random.Random(seed * 1_000_003 + step)`, weights from
`torch.manual_seed(seed)`, with a fixed thread count; `--resume` continues from `train_state.pt`.

Curriculum (the first attempt learned shortcuts in 2k steps of a flat schedule): the number of facts
per stream grows linearly from 2 to `--max-facts` over the first `--ramp` of the steps, each batch
drawing its count from [max/2, max]; 12 questions per stream, loss on the answers only.

Writes to `--out`: `model.safetensors` (fp16), `config.json`, the tokenizer, `training_log.jsonl`
(one line per logged step: mean loss on the answers, learning rate, seconds, and every `--eval-every` steps the exact
match of full prefill and of full reuse on 256 validation items by kind) and `gate.json` (the gate
measured with the reference engine on held-out items; see `gate`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachefuse.eval.probe_task import (  # noqa: E402
    PAD,
    ProbeItem,
    ProbeVocab,
    build_probe_tokenizer,
    make_items,
    sample_markov_sequence,
    sample_train_sequence,
)

VALIDATION_SEED = 7_000
"""Seed of the items monitored while training (quality.py's splits use other seeds)."""


@dataclass(frozen=True)
class ProbeShape:
    num_layers: int = 8
    hidden_size: int = 128
    num_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 512


def make_model(vocab_size: int, tokenizer, shape: ProbeShape, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# --------------------------------------------------------------------------- batches


def facts_at(step: int, args) -> int:
    """The curriculum's largest stream (in facts) at `step`."""
    hold_steps, ramp_steps = int(args.hold * args.steps), max(1, int(args.ramp * args.steps))
    return min(args.max_facts, 4 + (args.max_facts - 4) * max(0, step - hold_steps) // ramp_steps)


def make_batch(step: int, args, vocab: ProbeVocab, token_id: dict[str, int]):
    """(input ids [B, T], labels [B, T] with -100 everywhere but the answers), right-padded."""
    rng = random.Random(args.seed * 1_000_003 + step)
    top = facts_at(step, args)
    num_facts = rng.randint(max(2, top // 2), top)
    seqs = [sample_train_sequence(rng, vocab, num_facts, args.questions) for _ in range(args.batch)]
    seqs += [sample_markov_sequence(rng, vocab) for _ in range(round(args.markov_share * args.batch))]
    width = max(len(s.words) for s in seqs)
    ids = torch.full((len(seqs), width), token_id[PAD], dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, seq in enumerate(seqs):
        ids[row, :len(seq.words)] = torch.tensor([token_id[w] for w in seq.words])
        for pos in seq.answer_positions:
            labels[row, pos] = ids[row, pos]
    return ids, labels, num_facts


# --------------------------------------------------------------------------- monitoring


def encode_items(tokenizer, items: list[ProbeItem]):
    """Per item: ids, the (start, end) of every retrieved chunk, and the answer id."""
    from cachefuse.chunks import build_rag_prompt

    out = []
    for item in items:
        prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
        answer = tokenizer.convert_tokens_to_ids(item.answer)
        out.append((prompt.token_ids, [c for c in prompt.chunks if c[0] != 0], answer))
    return out


@torch.inference_mode()
def masked_em(model, encoded, reuse: bool) -> list[bool]:
    """Greedy next-token exact match per item, with full attention or with each retrieved chunk
    seeing only the system prompt and itself (full reuse at real positions: the same K/V as
    concatenating chunk caches computed after the system prompt)."""
    width = max(len(ids) for ids, _, _ in encoded)
    ids = torch.zeros((len(encoded), width), dtype=torch.long)
    mask = torch.tril(torch.ones(width, width, dtype=torch.bool)).repeat(len(encoded), 1, 1)
    last = []
    for row, (tokens, chunks, _) in enumerate(encoded):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        last.append(len(tokens) - 1)
        if reuse:
            system_end = chunks[0][0]
            for start, end in chunks:
                mask[row, start:end, system_end:start] = False
    logits = model(ids, attention_mask=mask[:, None]).logits
    predicted = logits[torch.arange(len(encoded)), torch.tensor(last)].argmax(-1)
    return [int(p) == answer for p, (_, _, answer) in zip(predicted, encoded, strict=True)]


def em_by_kind(model, encoded, items, reuse: bool) -> dict[str, float]:
    hits = masked_em(model, encoded, reuse)
    out = {}
    for kind in ("same_chunk", "cross_chunk"):
        sel = [h for h, item in zip(hits, items, strict=True) if item.kind == kind]
        out[kind] = sum(sel) / len(sel)
    return out


# --------------------------------------------------------------------------- training


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args) -> Path:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = ProbeVocab.default()
    tokenizer = build_probe_tokenizer(vocab, out)
    token_id = {w: i for i, w in enumerate(vocab.words)}
    model = make_model(len(vocab.words), tokenizer, ProbeShape(), args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    state_path, log_path = out / "train_state.pt", out / "training_log.jsonl"
    start, elapsed = 0, 0.0
    if args.resume and state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, elapsed = state["step"], state["elapsed"]
    elif log_path.exists():
        log_path.unlink()
    val_items = make_items(VALIDATION_SEED, args.val_items)
    val_encoded = encode_items(tokenizer, val_items)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"probe: {n_params / 1e6:.2f}M parameters, steps {start}..{args.steps}", flush=True)
    clock = time.perf_counter()
    losses = []
    for step in range(start, args.steps):
        model.train()
        ids, labels, num_facts = make_batch(step, args, vocab, token_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        logits = model(ids).logits[:, :-1]
        token_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="none").view(len(ids), -1)
        targets = labels[:, 1:] != -100
        loss = token_loss.sum() / targets.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        facts = slice(0, args.batch)  # the rows after them are warm-up sequences
        losses.append((token_loss[facts].sum() / targets[facts].sum()).item())
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            now = time.perf_counter()
            elapsed, clock = elapsed + now - clock, now
            row = {"step": done, "answer_loss": sum(losses) / len(losses), "lr": lr_at(step, args),
                   "num_facts": num_facts, "seconds": round(elapsed, 1)}
            losses = []
            if done % args.eval_every == 0 or done == args.steps:
                model.eval()
                row["val_full_prefill"] = em_by_kind(model, val_encoded, val_items, reuse=False)
                row["val_full_reuse"] = em_by_kind(model, val_encoded, val_items, reuse=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done,
                            "elapsed": elapsed}, state_path)
                clock = time.perf_counter()
            with log_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    model.eval()
    model.to(torch.float16).save_pretrained(str(out), safe_serialization=True)
    (out / "train_args.json").write_text(json.dumps(vars(args), indent=2) + "\n")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="models/rag-probe")
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-facts", type=int, default=16)
    parser.add_argument("--hold", type=float, default=0.25, help="share of the steps at 2-4 facts per stream")
    parser.add_argument("--ramp", type=float, default=0.35, help="share of the steps over which streams then grow")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--markov-share", type=float, default=0.5,
                        help="warm-up sequences per batch, as a share of --batch (previous-token heads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--val-items", type=int, default=256)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
