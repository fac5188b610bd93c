"""`cachefuse eval --engine vllm`: the same comparison through a connector-enabled vLLM engine.

Imports the standard library, tqdm and cachefuse.{chunks, eval.harness, eval.metrics, offline}; vllm
only through the engine it is handed and cachefuse.vllm.engines, which builds its requests. What vLLM hands back is tokens and logprobs, not K/V, so per
setting this measures the task score, greedy tokens that match the reference, top-1 agreement, and
the largest |difference| of the first token's top-20 logprobs to the reference's; K/V deviation,
attention deviation and the full KL need the reference engine (`--engine reference`, the default).

The reference is plain vLLM (the same engine, a request with no cachefuse parameters: vLLM's own
prefill). Chunks are stored first with `cachefuse precompute`'s path (each computed after the system
prompt: the base variant). Each setting is one request carrying `selector` and `recompute_ratio`
(cachefuse.request); a request that fell back to plain vLLM, loaded fewer chunks than it declared, or
ran at another ratio (the loading controller's choice: `cachefuse eval` runs its engine at `ratio_mode:
fixed`), stops the run: it would not measure what it is labelled with.

NOTE: `cachecraft` is not offered here: its ratio axis is `force_cfo`, an engine-wide config field,
not a per-request one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachefuse.chunks import PARAMS_KEY
from cachefuse.eval.harness import EvalItem, EvalRuns, EvalSpec, ItemRun, decode_text, setting_name
from cachefuse.eval.metrics import best_score
from cachefuse.rag_prompt import build_rag_prompt

TOP_LOGPROBS = 20


def run_eval_vllm(llm: Any, items: Sequence[EvalItem], spec: EvalSpec, *, store_dir: str | Path,
                  progress: bool = True) -> EvalRuns:
    """Every setting on every item through `llm` (a vllm.LLM with CacheFuseConnector over `store_dir`)."""
    from tqdm.auto import tqdm

    from cachefuse.eval.harness import METRICS
    from cachefuse.offline.precompute import precompute_chunks

    if "cachecraft" in spec.selectors:
        raise ValueError("selector 'cachecraft' runs on the reference engine only (its ratio is force_cfo, an "
                         "engine-wide field); drop it from --selectors or use --engine reference")
    tokenizer = llm.get_tokenizer()
    for system in dict.fromkeys(item.system for item in items):
        report = precompute_chunks(llm, tokenizer, system,
                                   dict.fromkeys(c for item in items if item.system == system for c in item.chunks),
                                   store_dir=store_dir, progress=False)
        if report.num_failed:
            raise RuntimeError(f"precompute failed for {report.num_failed} chunk(s): {report.failures[:3]}")
    runs = EvalRuns(list(items), spec, {setting_name(n, r): [] for n, r in spec.settings()},
                    {setting_name(n, r): [] for n, r in spec.settings()})
    metric = METRICS[spec.metric]
    with tqdm(total=len(items) * len(spec.settings()), unit="request", desc="cachefuse eval (vllm)",
              disable=not progress) as bar:
        for item in items:
            prompt = build_rag_prompt(tokenizer, item.system, item.chunks, item.question)
            settings = spec.settings()
            outputs = _generate(llm, prompt, settings, spec.max_new_tokens)
            reference = outputs[0]
            for (name, ratio), output in zip(settings, outputs, strict=True):
                if name != "full_prefill":
                    _check_fused(setting_name(name, ratio), output, len(prompt.chunks), ratio)
                runs.runs[setting_name(name, ratio)].append(
                    _item_run(output, reference, tokenizer, item, prompt, metric, spec.max_new_tokens))
            bar.update(len(settings))
    return runs


def _generate(llm: Any, prompt: Any, settings: list[tuple[str, float]], max_new_tokens: int) -> list[Any]:
    """One request per setting, in one batch; full_prefill is plain vLLM (no cachefuse parameters).

    `ignore_eos`: every request decodes exactly `max_new_tokens`, as the reference engine does, so
    greedy match counts the same tokens in both engines (a stop at EOS made identical answers read as
    a partial match); the prediction is still cut at the first EOS (`decode_text`).
    """
    from cachefuse.vllm.engines import sampling_params

    chunks = [[s, e] for s, e in prompt.chunks]
    params = []
    for name, ratio in settings:
        fields = None if name == "full_prefill" else {"chunks": chunks, "selector": name, "recompute_ratio": ratio}
        params.append(sampling_params(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True,
                                      logprobs=TOP_LOGPROBS, cachefuse=fields))
    return llm.generate([{"prompt_token_ids": prompt.token_ids}] * len(settings), params, use_tqdm=False)


def _check_fused(name: str, output: Any, num_chunks: int, ratio: float) -> None:
    status = (output.kv_transfer_params or {}).get(PARAMS_KEY, {})
    if status.get("status") != "fused":
        raise RuntimeError(f"{name}: the request ran as plain vLLM ({status.get('fallback_reason')}: "
                           f"{status.get('detail')})")
    if status.get("recompute_ratio") != ratio:
        raise RuntimeError(f"{name}: the request ran at ratio {status.get('recompute_ratio')!r} "
                           f"({(status.get('controller') or {}).get('reason')}); run the engine at ratio_mode: fixed")
    if status.get("chunks_hit") != num_chunks:
        raise RuntimeError(f"{name}: {status.get('chunks_hit')} of {num_chunks} declared chunks were loaded "
                           f"({status.get('miss_reasons')})")


def _item_run(output: Any, reference: Any, tokenizer: Any, item: EvalItem, prompt: Any, metric,
              max_new_tokens: int) -> ItemRun:
    tokens, ref_tokens = list(output.outputs[0].token_ids), list(reference.outputs[0].token_ids)
    matched = 0
    for a, b in zip(tokens, ref_tokens, strict=False):
        if a != b:
            break
        matched += 1
    prediction = decode_text(tokenizer, tokens)
    return ItemRun(score=best_score(metric, prediction, item.answers), prediction=prediction, kl=None,
                   top1_agree=bool(tokens[:1] == ref_tokens[:1]), greedy_match=matched / max_new_tokens,
                   kv_deviation=[], attention_deviation=[], recompute_fraction=_recompute_fraction(output, prompt),
                   logprob_deviation=_logprob_deviation(reference, output))


def _logprob_deviation(reference: Any, output: Any) -> float:
    """Largest |difference| of the first token's logprobs over the reference's top tokens. A token
    missing from the output's top list counts at the list's lowest logprob, an upper bound of its
    own, so the figure is then a lower bound of the true difference (and finite)."""
    expected = {t: lp.logprob for t, lp in reference.outputs[0].logprobs[0].items()}
    actual = {t: lp.logprob for t, lp in output.outputs[0].logprobs[0].items()}
    floor = min(actual.values())
    return max(abs(lp - actual.get(t, floor)) for t, lp in expected.items())


def _recompute_fraction(output: Any, prompt: Any) -> float:
    """Selected rows / candidate rows, the candidates being the retrieved chunks' tokens less those of chunks
    reused at their exact place (the system chunk sits at position 0 and is never a candidate either), as the
    reference engine counts them."""
    status = (output.kv_transfer_params or {}).get(PARAMS_KEY)
    if not status:
        return 1.0  # plain vLLM computes every row
    candidates = sum(end - start for start, end in prompt.chunks if start != 0) - status.get("exact_prefix_tokens", 0)
    return status.get("num_selected", 0) / candidates if candidates else 0.0
