"""QCFuse's offline anchors (cachefuse/offline/anchors.py): counts, first tokens, the attention and KVzip
rankings against transformers' own attention weights, and stored anchors used by the selector. The anchors every
save stores (select/qcfuse.py) are tested in tests/select/test_qcfuse.py."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from cachefuse.chunks import Segment
from cachefuse.config import CacheFuseConfig
from cachefuse.offline.anchors import (
    KVZIP_REPEAT_PROMPT,
    anchor_annotator,
    kvzip_repeat_ids,
    received_attention,
    reconstruction_attention,
)
from cachefuse.select.qcfuse import anchors_from_meta, choose_anchors
from cachefuse.select.registry import make_selector
from tests.helpers.fusion import make_case, make_engine

pytestmark = pytest.mark.tiny_model("llama", num_layers=3)  # `adapter`, `model_dir`: tests/conftest.py


def _eager_received(model_dir, token_ids, chunk_start):
    """The same quantity from transformers' eager attention weights: the specification."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_attentions=True)
    per_layer = [a[0, :, chunk_start:, :].sum(dim=1).mean(dim=0) for a in out.attentions]  # [T] each
    received = torch.stack(per_layer).mean(dim=0)[chunk_start:]
    viewers = torch.arange(len(token_ids) - chunk_start, 0, -1, dtype=torch.float32)
    return received / viewers


def test_received_attention_equals_transformers_attention_weights(adapter, model_dir):
    case = make_case(adapter.shape.vocab_size, seed=5)
    token_ids = case.system + case.pieces[0]
    start = len(case.system)
    ours = received_attention(adapter, token_ids, start)
    torch.testing.assert_close(ours, _eager_received(model_dir, token_ids, start), atol=1e-5, rtol=1e-4)
    # Negative control: the chunk computed at the prompt's start is another quantity.
    alone = received_attention(adapter, case.pieces[0], 0)
    assert not torch.allclose(alone, ours, atol=1e-3)


def _eager_reconstruction(model_dir, prefix, chunk, repeat):
    """KVzip's definition from transformers' eager attention weights: the prompt `[prefix][chunk][repeat]
    [chunk]`, each chunk token's largest probability from any row after the chunk, any head, any layer."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    token_ids = prefix + chunk + repeat + chunk
    start, end = len(prefix), len(prefix) + len(chunk)
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_attentions=True)
    per_layer = [a[0, :, end:, start:end].amax(dim=(0, 1)) for a in out.attentions]  # [len(chunk)] each
    return torch.stack(per_layer).amax(dim=0)


def test_kvzip_scores_equal_the_reconstruction_definition(adapter, model_dir):
    case = make_case(adapter.shape.vocab_size, seed=12)
    prefix, chunk, repeat = case.system, case.pieces[1], case.question
    ours = reconstruction_attention(adapter, prefix, chunk, repeat, block_rows=7)  # several row blocks
    torch.testing.assert_close(ours, _eager_reconstruction(model_dir, prefix, chunk, repeat), atol=1e-5, rtol=1e-4)
    # Negative controls: the chunk scored without its prefix (not as it is stored), or by its own rows
    # (the attention ranking), is another quantity. (Random weights attend almost uniformly, so the
    # largest probability comes from the first rows after the chunk, which see the fewest keys: leaving
    # the copy out would not show here.)
    alone = reconstruction_attention(adapter, [], chunk, repeat)
    assert (alone - ours).abs().max() > 1e-3
    torch.testing.assert_close(alone, _eager_reconstruction(model_dir, [], chunk, repeat), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(ours, received_attention(adapter, prefix + chunk, len(prefix)), atol=1e-3)
    with pytest.raises(ValueError, match="repeat prompt"):
        reconstruction_attention(adapter, prefix, chunk, [])
    with pytest.raises(ValueError, match="repeat_ids"):
        anchor_annotator(adapter, prefix, "kvzip", 0.1, 1)


def test_kvzip_repeat_prompt_closes_the_user_turn(model_dir):
    """The request ends the user's turn and opens the assistant's as the chat template renders them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.chat_template  # the tiny checkpoints carry SmolLM2's ChatML template
    text = tokenizer.decode(kvzip_repeat_ids(tokenizer))
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "chunk" + KVZIP_REPEAT_PROMPT}],
        tokenize=False, add_generation_prompt=True)
    assert text.startswith(KVZIP_REPEAT_PROMPT) and rendered.endswith(text) and len(text) > len(KVZIP_REPEAT_PROMPT)
    tokenizer.chat_template = None  # negative control: no template, a plain-text answer cue
    assert tokenizer.decode(kvzip_repeat_ids(tokenizer)) == KVZIP_REPEAT_PROMPT + "\n\nAnswer: "


@pytest.mark.parametrize("ranking", ["key_norm", "attention", "kvzip"])
def test_stored_anchors_are_counted_kept_first_and_used_by_the_selector(adapter, ranking):
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=6)
    config = CacheFuseConfig()
    ratio, sinks = config.qcfuse_anchor_ratio, config.qcfuse_sink_tokens
    engine.precompute([case.pieces[2]], prefix_ids=case.system,
                      annotate=anchor_annotator(adapter, case.system, ranking, ratio, sinks, case.question))
    entry = engine.store.get(engine.key(case.pieces[2]))
    stored = anchors_from_meta(entry.meta, entry.num_tokens, ratio, sinks)
    assert stored is not None and stored.numel() == math.ceil(ratio * entry.num_tokens)
    assert stored[:sinks].tolist() == list(range(sinks)) and stored.unique().numel() == stored.numel()
    selector = make_selector("qcfuse", config)
    segment = Segment(len(case.system), entry.num_tokens, is_chunk=True, is_system=False)
    assert torch.equal(selector.probe_anchors(segment, entry.k_nope, entry.meta), stored)


def test_the_three_rankings_choose_differently(adapter):
    engine = make_engine(adapter)
    case = make_case(adapter.shape.vocab_size, seed=8, lengths=(12, 80, 10, 10, 5))
    entry = engine.compute_chunk(case.pieces[0], case.system)
    scores = received_attention(adapter, case.system + case.pieces[0], len(case.system))
    kvzip = reconstruction_attention(adapter, case.system, case.pieces[0], case.question)
    by_norm = choose_anchors(entry, "key_norm", 0.1, 1)
    by_attention = choose_anchors(entry, "attention", 0.1, 1, scores)
    by_kvzip = choose_anchors(entry, "kvzip", 0.1, 1, kvzip)
    assert by_norm.numel() == by_attention.numel() == by_kvzip.numel() == 8
    assert not torch.equal(by_norm, by_attention) and not torch.equal(by_kvzip, by_attention)
    assert not torch.equal(by_kvzip, by_norm)
    for ranking in ("attention", "kvzip"):
        with pytest.raises(ValueError, match="ranking"):
            choose_anchors(entry, ranking, 0.1, 1)
