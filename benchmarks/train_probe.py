"""Trains the RAG probe model: the stand-in for a real LLM in cachefuse's quality tests.

    python benchmarks/train_probe.py --out models/rag-probe --stop-at 4000   # the committed run, ~12 min
    python benchmarks/train_probe.py --out /tmp/p --steps 200          # a smoke run

The task (cachefuse/eval/probe_task.py) is associative recall over a stream of `VALUE NAME` facts;
a fact split by a chunk boundary can only be answered when its name's K/V knows the value before it,
which a chunk cached on its own does not. The model is a transformers `LlamaForCausalLM` that vLLM's
CPU backend serves too (head_dim 32), trained from random weights on full prefills only.

Deterministic: every batch is drawn from `random.Random(seed * 1_000_003 + step)`, weights from
`torch.manual_seed(seed)` (the grown layers from seed + 1), with a fixed thread count; `--resume`
continues from `train_state.pt` (saved every `--eval-every` steps).

Growth: `--grow-from` layers are trained until `--grow-at`, then `grow` inserts identity layers up to
8 (the trained ones at `--grow-map`) and a fresh optimizer warms up again. A 2-layer model learns
recall here within 1,000 steps; an 8-layer one from scratch had not after 2,300.

Curriculum (the first attempt learned shortcuts in 2k steps of a flat schedule): streams of 2-4 facts
for the first `--hold` of the steps, then the largest stream grows linearly to `--max-facts` over the
next `--ramp`, each batch drawing its count from [max/2, max]; up to 12 questions per stream, loss on
the answers only. Every batch also holds `--markov-share` x `--batch` order-2 Markov warm-up
sequences (probe_task.sample_markov_sequence), which need a previous-token head from the start.

Writes to `--out`: `model.safetensors` (fp16), `config.json`, the tokenizer, `training_log.jsonl`
(one line per logged step: mean loss on the answers, learning rate, seconds, and every
`--eval-every` steps the exact match of full prefill and of full reuse on 256 validation items by
kind) and `gate.json` (the gate measured with the reference engine on held-out items, and the CI
subset's recorded hits; `write_gate`).

    python benchmarks/train_probe.py --out models/rag-probe --export   # checkpoint from the last saved state
    python benchmarks/train_probe.py --out models/rag-probe --gate     # re-measure the gate
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
    from cachefuse.rag_prompt import build_rag_prompt

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
    """Linear warm-up, then cosine decay to 10%; after growth a fresh optimizer warms up again."""
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress)))))
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.grow_from and args.grow_at <= step < args.grow_at + args.warmup:
        return lr * (step - args.grow_at + 1) / args.warmup
    return lr


def grow(small, tokenizer, args):
    """The full-depth model with the small model's layers at `--grow-map` positions and the rest
    added as identities (o_proj and down_proj zero: each new layer adds nothing to the residual until
    training moves it); embeddings and final norm copied. Its output equals the small model's."""
    model = make_model(small.config.vocab_size, tokenizer, ProbeShape(), args.seed + 1)
    positions = [int(p) for p in args.grow_map.split(",")]
    model.model.embed_tokens.load_state_dict(small.model.embed_tokens.state_dict())
    model.model.norm.load_state_dict(small.model.norm.state_dict())
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            if index in positions:
                layer.load_state_dict(small.model.layers[positions.index(index)].state_dict())
            else:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return model


def _optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)


def train(args) -> Path:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = ProbeVocab.default()
    tokenizer = build_probe_tokenizer(vocab, out)
    token_id = {w: i for i, w in enumerate(vocab.words)}
    state_path, log_path = out / "train_state.pt", out / "training_log.jsonl"
    state = torch.load(state_path, weights_only=False) if args.resume and state_path.exists() else None
    start, elapsed = (state["step"], state["elapsed"]) if state else (0, 0.0)
    if state:  # the depth it was saved at (a run resumed at the growth step is still small)
        small_stage = len({k.split(".")[2] for k in state["model"] if k.startswith("model.layers.")}) == args.grow_from
    else:
        small_stage = bool(args.grow_from)
    shape = ProbeShape(num_layers=args.grow_from) if small_stage else ProbeShape()
    model = make_model(len(vocab.words), tokenizer, shape, args.seed)
    optimizer = _optimizer(model, args)
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    elif log_path.exists():
        log_path.unlink()
    val_items = make_items(VALIDATION_SEED, args.val_items)
    val_encoded = encode_items(tokenizer, val_items)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"probe: {n_params / 1e6:.2f}M parameters, steps {start}..{args.steps}", flush=True)
    clock = time.perf_counter()
    losses = []
    for step in range(start, args.stop_at or args.steps):
        if args.grow_from and step == args.grow_at and len(model.model.layers) == args.grow_from:
            model = grow(model, tokenizer, args)
            optimizer = _optimizer(model, args)
            print(f"probe: grown to {len(model.model.layers)} layers at step {step}", flush=True)
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
        if done % args.log_every == 0 or done in (args.steps, args.stop_at):
            now = time.perf_counter()
            elapsed, clock = elapsed + now - clock, now
            row = {"step": done, "answer_loss": sum(losses) / len(losses), "lr": lr_at(step, args),
                   "num_facts": num_facts, "seconds": round(elapsed, 1)}
            losses = []
            if done % args.eval_every == 0 or done in (args.steps, args.stop_at):
                model.eval()
                row["val_full_prefill"] = em_by_kind(model, val_encoded, val_items, reuse=False)
                row["val_full_reuse"] = em_by_kind(model, val_encoded, val_items, reuse=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done,
                            "elapsed": elapsed}, state_path)
                clock = time.perf_counter()
            with log_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    export(model, out, args)
    return out


def export(model, out: Path, args) -> None:
    """The checkpoint as committed: fp16 safetensors, config, and the arguments it was trained with."""
    model.eval()
    model.to(torch.float16).save_pretrained(str(out), safe_serialization=True)
    (out / "train_args.json").write_text(json.dumps(vars(args), indent=2) + "\n")


def export_state(args) -> None:
    """`--export`: writes the checkpoint from the last `train_state.pt` (a run stopped early)."""
    out = Path(args.out)
    vocab = ProbeVocab.default()
    tokenizer = build_probe_tokenizer(vocab, out)
    model = make_model(len(vocab.words), tokenizer, ProbeShape(), args.seed)
    state = torch.load(out / "train_state.pt", weights_only=False)
    model.load_state_dict(state["model"])
    args.exported_at_step = state["step"]
    export(model, out, args)


# --------------------------------------------------------------------------- gate

GATE_SEED, GATE_ITEMS = 3, 1000
CI_SEED, CI_ITEMS = 11, 40
"""The fixed subset tests/eval/test_probe_model.py checks in CI (its full-prefill hits are recorded)."""


def write_gate(out: Path, threads: int) -> dict:
    """The gate measured with the reference engine (cachefuse.eval.harness) on GATE_ITEMS held-out
    items: full-prefill EM on same-chunk questions >= 80%, and full reuse >= 15 EM points below full
    prefill on cross-chunk ones (McNemar). Also records the CI subset's full-prefill hits."""
    from cachefuse.config import CacheFuseConfig
    from cachefuse.eval.harness import EvalSpec, probe_eval_items, reference_engine, run_eval
    from cachefuse.eval.report import probe_gate

    torch.set_num_threads(threads)
    engine, tokenizer = reference_engine(out, CacheFuseConfig())
    spec = EvalSpec(selectors=(), ratios=())  # the baselines only
    runs = run_eval(engine, tokenizer, probe_eval_items(GATE_SEED, GATE_ITEMS), spec, desc="gate")
    gate = {"items": GATE_ITEMS, "seed": GATE_SEED, "threads": threads, **probe_gate(runs)}
    ci_runs = run_eval(engine, tokenizer, probe_eval_items(CI_SEED, CI_ITEMS), spec, desc="CI subset")
    gate["ci_subset"] = {"seed": CI_SEED, "items": CI_ITEMS,
                         "full_prefill_hits": int(sum(r.score for r in ci_runs.runs["full_prefill"]))}
    (out / "gate.json").write_text(json.dumps(gate, indent=2) + "\n")
    return gate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="models/rag-probe")
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-facts", type=int, default=16)
    parser.add_argument("--hold", type=float, default=0.1, help="share of the steps at 2-4 facts per stream")
    parser.add_argument("--ramp", type=float, default=0.25, help="share of the steps over which streams then grow")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--markov-share", type=float, default=1.0,
                        help="warm-up sequences per batch, as a share of --batch (previous-token heads)")
    parser.add_argument("--grow-from", type=int, default=2,
                        help="train this many layers first, then grow to the full depth (0: full depth throughout)")
    parser.add_argument("--grow-at", type=int, default=3000, help="the step at which the model grows")
    parser.add_argument("--grow-map", default="0,2", help="positions of the small model's layers in the grown one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--val-items", type=int, default=256)
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop after this step (the schedule still spans --steps)")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--export", action="store_true", help="only write the checkpoint from train_state.pt")
    parser.add_argument("--gate", action="store_true", help="only measure the gate of the checkpoint in --out")
    args = parser.parse_args(argv)
    if args.export:
        export_state(args)
    elif not args.gate:
        train(args)
    print(json.dumps(write_gate(Path(args.out), args.threads), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
