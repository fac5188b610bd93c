"""Fidelity of a fused prefill to the full prefill of the same prompt.

Imports torch and transformers (for the decode cache); works on FuseResults of the reference engine.
Metrics: per-layer relative K/V deviation, KL(full || fused) of the last-token distribution,
top-1 agreement, how many greedy continuation tokens match before the first divergence, and the
per-position divergence of a continuation teacher-forced on the same tokens (`teacher_forced_logits`).
"""

from __future__ import annotations

import torch

from cachefuse.adapters.hf import HFAdapter
from cachefuse.fusion.plan import FuseResult


def kv_deviation_per_layer(fused: FuseResult, full: FuseResult) -> list[float]:
    """Per layer, ||[K;V]_fused - [K;V]_full|| / ||[K;V]_full|| over the whole prompt (fp32)."""
    out = []
    for k_a, v_a, k_b, v_b in zip(fused.k, fused.v, full.k, full.v, strict=True):
        diff = (k_a.float() - k_b.float()).pow(2).sum() + (v_a.float() - v_b.float()).pow(2).sum()
        norm = k_b.float().pow(2).sum() + v_b.float().pow(2).sum()
        out.append(float((diff / norm.clamp_min(1e-30)).sqrt()))
    return out


def logits_kl(full_logits: torch.Tensor, fused_logits: torch.Tensor) -> float:
    """KL(p_full || p_fused) in nats over the vocabulary."""
    log_p = torch.log_softmax(full_logits.float(), dim=-1)
    log_q = torch.log_softmax(fused_logits.float(), dim=-1)
    return float((log_p.exp() * (log_p - log_q)).sum())


def top1_agree(full_logits: torch.Tensor, fused_logits: torch.Tensor) -> bool:
    return bool(full_logits.argmax() == fused_logits.argmax())


@torch.inference_mode()
def greedy_continuation(adapter: HFAdapter, result: FuseResult, num_tokens: int) -> list[int]:
    """Greedy tokens decoded by the transformers model on top of the fused K/V of the prompt."""
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=[
        (k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous())
        for k, v in zip(result.k, result.v, strict=True)])
    position = result.k[0].shape[0]
    token = int(result.logits.argmax())
    tokens = [token]
    for _ in range(num_tokens - 1):
        out = adapter.model(torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
                            past_key_values=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        position += 1
    return tokens


@torch.inference_mode()
def teacher_forced_logits(adapter: HFAdapter, result: FuseResult, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] fp32: the distribution of continuation token i (i = 0: the prefill's own
    logits) when `tokens[:i]` are fed after the prompt's fused K/V, one forward for all of them.

    Feeding every setting the same tokens (full prefill's greedy continuation) compares their
    distributions position by position, where free greedy decoding stops comparing at the first
    different token."""
    from transformers import DynamicCache

    rows = [result.logits.float()[None]]
    if len(tokens) > 1:
        cache = DynamicCache(ddp_cache_data=[
            (k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous())
            for k, v in zip(result.k, result.v, strict=True)])
        start = result.k[0].shape[0]
        out = adapter.model(torch.tensor([tokens[:-1]]),
                            position_ids=torch.arange(start, start + len(tokens) - 1)[None],
                            past_key_values=cache, use_cache=True)
        rows.append(out.logits[0].float())
    return torch.cat(rows)


def matching_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading tokens on which two continuations agree."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count
