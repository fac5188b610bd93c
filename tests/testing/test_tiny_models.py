"""cachefuse.testing.tiny_models: local checkpoints load offline, carry their family's traits, build deterministically."""

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cachefuse.chunks import model_fingerprint
from cachefuse.testing import tiny_models
from cachefuse.testing.tiny_models import build_tokenizer, cached_tiny_model
from tests.helpers.models import ALL_FAMILIES

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama31": "LlamaForCausalLM",
}
TEXT = "In 1999, Alice's 12 documents   said:\n\nhello  world!! Ünïcode <|eos|>"


def _file_hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def reference_tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_loads_offline_and_runs(family, tiny_model_dir, reference_tokenizer):
    path = tiny_model_dir(family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.architectures == [ARCHITECTURES[family]]
    assert model.config.num_hidden_layers >= 4 and model.config.head_dim == 32
    assert model.config.tie_word_embeddings is False
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    # every family's tokenizer class gives the ids of the tokenizer build_tokenizer returns
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.encode(TEXT) == reference_tokenizer.encode(TEXT)
    ids = torch.tensor([tokenizer.encode(TEXT)])
    assert ids[0, 0] == tokenizer.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert "assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_family_traits(family, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), dtype=torch.float32)
    config = model.config
    attn = model.model.layers[0].self_attn
    assert config.rope_parameters["rope_type"] == ("llama3" if family == "llama31" else "default")
    assert getattr(config, "sliding_window", None) is None
    assert not getattr(config, "use_sliding_window", False)
    if family == "qwen2":
        assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
        assert attn.q_proj.bias.abs().sum() > 0  # perturbed, so forgetting the bias changes results
    else:
        assert attn.q_proj.bias is None
    assert hasattr(attn, "q_norm") == (family == "qwen3")
    if family == "qwen3":
        assert not torch.equal(attn.q_norm.weight, torch.ones_like(attn.q_norm.weight))
    if family == "llama31":
        rope = config.rope_parameters
        assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == (8.0, 1.0, 4.0)
        assert rope["original_max_position_embeddings"] < config.max_position_embeddings
        head_dim, theta = config.head_dim, rope["rope_theta"]
        default_inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        inv_freq = model.model.rotary_emb.inv_freq
        changed = ~torch.isclose(inv_freq, default_inv_freq)
        assert changed.sum() >= head_dim // 4  # the scaling changes a good share of the frequencies


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_builds_are_deterministic(family, tmp_path):
    a = cached_tiny_model(family, tmp_path / "a")
    b = cached_tiny_model(family, tmp_path / "b")
    assert a.name == b.name
    assert _file_hashes(a) == _file_hashes(b)
    assert model_fingerprint(a) == model_fingerprint(b)


def test_cache_hit_does_not_rebuild(tmp_path, monkeypatch):
    path = cached_tiny_model("llama", tmp_path, num_layers=4)
    assert path.parent == tmp_path and path.name.startswith("llama-")

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt on a cache hit")

    monkeypatch.setattr(tiny_models, "build_tiny_model", no_build)
    assert cached_tiny_model("llama", tmp_path) == path  # defaults fill in: same key
    with pytest.raises(AssertionError, match="rebuilt"):
        cached_tiny_model("llama", tmp_path, seed=1)


def test_cache_lost_race_uses_winner(tmp_path, monkeypatch):
    real_build = tiny_models.build_tiny_model
    winner: list[Path] = []

    def racing_build(family, out_dir, **kwargs):
        final = Path(out_dir).parent / Path(out_dir).name.split(".")[1]
        real_build(family, final, **kwargs)  # another process finishes first
        winner.append(final)
        return real_build(family, out_dir, **kwargs)

    monkeypatch.setattr(tiny_models, "build_tiny_model", racing_build)
    path = cached_tiny_model("mistral", tmp_path)
    assert [path] == winner
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the loser's temp dir is gone


def test_unknown_family(tmp_path):
    with pytest.raises(ValueError, match="family="):
        cached_tiny_model("gpt2", tmp_path)
