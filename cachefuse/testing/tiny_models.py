"""Tiny local checkpoints of every supported family: random weights, a locally trained tokenizer.

Tests, the demo and the benchmarks run without a model hub, so every model is built here from a
config: a byte-level BPE tokenizer trained on seeded synthetic English-like text, and a few-layer
float32 model with random weights, saved as safetensors in the layout `from_pretrained` and vLLM
load. Importing this module imports only the standard library; torch, tokenizers and transformers
are imported by the functions that need them.

Families (`FAMILIES`):

- `llama`: LlamaForCausalLM, default RoPE.
- `mistral`: MistralForCausalLM with `sliding_window=None` (windowed families: `WINDOWED_FAMILIES` below).
- `qwen2`: Qwen2ForCausalLM; q/k/v always carry a bias; `use_sliding_window=False`.
- `qwen3`: Qwen3ForCausalLM; per-head q/k RMSNorm; no sliding window.
- `llama31`: LlamaForCausalLM with Llama-3.1 scaled RoPE (`rope_type="llama3"`, factor 8) and a small
  `original_max_position_embeddings` so that the scaling changes most frequencies.

NOTE: biases and norm weights are perturbed away from their 0 / 1 initial values, so that code which
forgets a bias or a norm weight (e.g. Qwen3's q_norm) produces a different result and fails a test.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "llama31")

WINDOWED_FAMILIES = ("mistral_swa", "mistral_alt", "qwen2_swa")
"""Families with sliding windows shorter than the test prompts (TINY_WINDOW keys), kept apart from FAMILIES so
the tests of every family do not double:

- `mistral_swa`: MistralForCausalLM, every layer windowed; `layer_types` spells it out, since vLLM windows
  only the layers `layer_types` names (transformers loads a Mistral config with `layer_types` as Ministral,
  which windows the same layers);
- `mistral_alt`: the same with `layer_types` alternating windowed and full layers (Ministral-style), which
  vLLM and transformers both apply per layer;
- `qwen2_swa`: Qwen2ForCausalLM with `use_sliding_window` and `max_window_layers=2`: layers 0-1 full, 2-3
  windowed in transformers (vLLM 0.32's Qwen2 applies no window, and refuses such a mix).
"""

TINY_WINDOW = 16
"""The windowed families' sliding window, in keys."""

BUILDER_VERSION = 1
"""Bump when the bytes a build writes change, so that caches keyed on it rebuild."""

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
# NOTE: transformers' AutoTokenizer always loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer,
# which rebuilds the pipeline as NFC + this split + byte-level and adds its own unk token unless
# one is named. Every family therefore uses that pipeline and names `<|unk|>`, so the tokenizer
# gives the same ids whichever class loads it, and the same ids in every family.
_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_PERTURB_STD = 0.1  # std of the noise added to biases (around 0) and norm weights (around 1)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama31": "LlamaForCausalLM",
    "mistral_swa": "MistralForCausalLM",
    "qwen2_swa": "Qwen2ForCausalLM",
    "mistral_alt": "MistralForCausalLM",
}

# Word lists for the tokenizer's training text: common English plus a RAG-flavoured vocabulary.
_FUNCTION_WORDS = (
    "the a an of to in on at for with from by about into over after before under between and or but "
    "so because while if when then than that which who whose this these those it its they them their "
    "he she his her we our you your is are was were be been has have had do does did can could will "
    "would should may might must not no yes all some many few more most each every other same such"
).split()
_NOUNS = (
    "time year people way day man woman child world life hand part place case week company system "
    "program question work government number night point home water room mother area money story fact "
    "month lot right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea body "
    "information school face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education document chunk cache key value "
    "token model layer attention query answer paper river mountain village castle garden library museum "
    "engine memory network server request response battery planet ocean forest island bridge harbor "
    "kingdom festival recipe kitchen market station theory experiment evidence dataset benchmark"
).split()
_VERBS = (
    "said made went took came saw knew got gave found thought told became showed left felt brought began "
    "kept held wrote stood heard let meant set met ran paid sat spoke lay led read grew lost fell sent "
    "built understood drew broke spent cut rose drove bought wore chose stores computes retrieves "
    "describes explains contains reports measures improves reduces increases answers visits opens closes "
    "follows protects connects returns"
).split()
_ADJECTIVES = (
    "good new first last long great little own old right big high different small large next early young "
    "important few public bad same able quick brown lazy bright dark ancient modern famous quiet busy "
    "cold warm northern southern eastern western golden silver hidden simple complex fast slow final"
).split()
_NAMES = (
    "Alice Bob Carol David Elena Farid Grace Hiro Ines Jonas Kira Liam Maya Noah Olga Pedro Quinn Rosa "
    "Sami Tara Paris London Berlin Tokyo Lagos Lima Oslo Cairo Delhi Sydney Monday Friday January July"
).split()
_SYLLABLES = "ka lo mi te ra su ne po vi da ze chu qua bri sto fle gor man tis wex".split()


def _synthetic_text(seed: int = 1234, num_sentences: int = 4000) -> str:
    """Seeded English-like text: sentences, numbers, lists, questions, newlines and pseudo-words."""
    rng = random.Random(seed)

    def phrase() -> str:
        words = [rng.choice(_FUNCTION_WORDS)]
        if rng.random() < 0.6:
            words.append(rng.choice(_ADJECTIVES))
        words.append(rng.choice(_NOUNS) + ("s" if rng.random() < 0.3 else ""))
        return " ".join(words)

    lines = []
    for _ in range(num_sentences):
        kind = rng.random()
        if kind < 0.55:
            subject = rng.choice(_NAMES) if rng.random() < 0.4 else phrase().capitalize()
            s = f"{subject} {rng.choice(_VERBS)} {phrase()}"
            if rng.random() < 0.5:
                s += f" {rng.choice(_FUNCTION_WORDS[:12])} {phrase()}"
            s += rng.choice([".", ".", ".", "!", ";"])
        elif kind < 0.7:
            s = f"{rng.choice(['What', 'Who', 'Where', 'When', 'Why', 'How'])} {rng.choice(_VERBS)} {phrase()}?"
        elif kind < 0.8:
            num = rng.choice([str(rng.randint(0, 100)), str(rng.randint(1000, 2100)), f"{rng.random():.2f}"])
            s = f"In {rng.randint(1800, 2030)}, {phrase()} had {num} {rng.choice(_NOUNS)}s."
        elif kind < 0.9:
            s = f"{rng.randint(1, 9)}. {rng.choice(_NAMES)}: {phrase()}, {phrase()}, and {phrase()}."
        else:
            s = " ".join(
                "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
                for _ in range(rng.randint(3, 9))
            ) + rng.choice([".", ",", "?", "!"])
        lines.append(s)
        lines.append("\n" if rng.random() < 0.2 else " ")
    return "".join(lines)


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    """The trained backend tokenizer as JSON (training is deterministic; cached per process)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_synthetic_text()], trainer=trainer)
    return tok.to_str()


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Trains (or reuses this process's) byte-level BPE tokenizer and saves it into `out_dir`.

    Byte-level BPE (NFC, Qwen2's pre-tokenizer split, no prefix space) with the special tokens
    `<|bos|>`, `<|eos|>`, `<|pad|>`, `<|unk|>` and a small chat template. Like Llama's, it prepends
    `<|bos|>` when `add_special_tokens=True`; pieces encoded with `add_special_tokens=False` carry
    no special token.

    Args:
        out_dir: directory to save into (created if missing).
        vocab_size: target vocabulary size, special tokens included.

    Returns:
        The tokenizer; the files in `out_dir` are identical for the same `vocab_size`.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        add_bos_token=True,
        model_max_length=4096,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def _make_config(family: str, tok: PreTrainedTokenizerFast, p: dict[str, Any]):
    """The transformers config of `family` with the sizes in `p` (build_tiny_model's arguments)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_layers"],
        num_attention_heads=p["num_heads"],
        num_key_value_heads=p["num_kv_heads"],
        head_dim=p["head_dim"],
        max_position_embeddings=p["max_position_embeddings"],
        initializer_range=p["initializer_range"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama31":
        common["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False, sliding_window=None)
    if family == "qwen3":
        return Qwen3Config(**common, use_sliding_window=False, sliding_window=None, attention_bias=False)
    num_layers = p["num_layers"]
    if family == "mistral_swa":
        return MistralConfig(**common, sliding_window=TINY_WINDOW, layer_types=["sliding_attention"] * num_layers)
    if family == "qwen2_swa":
        return Qwen2Config(**common, use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=2)
    if family == "mistral_alt":
        alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        return MistralConfig(**common, sliding_window=TINY_WINDOW, layer_types=alternating)
    raise ValueError(f"family={family!r}, expected one of {FAMILIES}")


# NOTE: over a screen only by its layout (one keyword per line, and the same keywords again as `params`); the
# body is one job (tokenizer, config, seeded weights, save). Its arguments stay flat: cached_tiny_model
# hashes them through _BUILD_SIGNATURE, so grouping them into a dataclass would rename every cache entry.
def build_tiny_model(
    family: str,
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    initializer_range: float = 0.02,
) -> Path:
    """Builds a random-weight float32 checkpoint of `family` with its tokenizer into `out_dir`.

    Writes config.json, generation_config.json, model.safetensors and the tokenizer files. The
    same arguments give byte-identical files. vLLM's CPU backend needs `head_dim` in 32, 64, ...

    Returns:
        `out_dir` as a Path.
    """
    if family not in FAMILIES + WINDOWED_FAMILIES:
        raise ValueError(f"family={family!r}, expected one of {FAMILIES + WINDOWED_FAMILIES}")
    import torch
    from transformers import AutoModelForCausalLM

    params = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
    )
    out = Path(out_dir)
    tok = build_tokenizer(out, vocab_size=vocab_size)
    if len(tok) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {len(tok)} tokens")
    config = _make_config(family, tok, params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, _PERTURB_STD)
            elif param.dim() == 1:  # RMSNorm weights
                param.normal_(1.0, _PERTURB_STD)
    assert model.config.architectures is None or model.config.architectures == [_ARCHITECTURES[family]]
    model.config.architectures = [_ARCHITECTURES[family]]
    model.save_pretrained(str(out), safe_serialization=True)
    return out


_BUILD_SIGNATURE = inspect.signature(build_tiny_model)


def cached_tiny_model(family: str, cache_root: str | os.PathLike, **kwargs: Any) -> Path:
    """Returns `cache_root/<family>-<hash>`, building it once with `build_tiny_model(family, ..., **kwargs)`.

    The hash covers the family, every build argument (defaults filled in) and `BUILDER_VERSION`.
    The build goes to a temporary directory renamed into place, so a directory that exists is
    complete; when several processes race, the first rename wins and the others use its result.
    """
    bound = _BUILD_SIGNATURE.bind(family, "", **kwargs)
    bound.apply_defaults()
    key = {k: v for k, v in bound.arguments.items() if k != "out_dir"}
    key["builder_version"] = BUILDER_VERSION
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_root)
    final = root / f"{family}-{digest}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        build_tiny_model(family, tmp, **kwargs)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
