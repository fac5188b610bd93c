"""HFAdapter: the ModelAdapter protocol over a transformers CausalLM (the reference engine).

Imports torch, transformers (lazily, through the model object) and cachefuse.rope. Supports the
Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm) families without sliding windows; every
call goes through the model's own modules so results match `model(...)` to fp rounding.
"""

from __future__ import annotations

import sys

import torch

from cachefuse.adapters.base import ModelShape
from cachefuse.errors import UnsupportedModelError
from cachefuse.rope import RopeSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported: expected one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", window is not None)
    layer_types = getattr(config, "layer_types", None) or ()
    if (window is not None and uses_window) or "sliding_attention" in layer_types:
        raise UnsupportedModelError(
            f"sliding_window={window!r}: sliding-window attention is not supported by the blend pass "
            "(its per-query mask would differ from full causal attention); use a config without it")


class HFAdapter:
    """Wraps a loaded transformers `*ForCausalLM` in eval mode."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        _check_supported(config)
        self.model = model.eval()
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        first_attn = self.layers[0].self_attn
        self.shape = ModelShape(
            num_layers=len(self.layers),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            scaling=float(first_attn.scaling),
            dtype=next(model.parameters()).dtype,
        )
        self.rope_spec = RopeSpec.from_hf(model)
        # The family's own RoPE application (rotate-half), used for freshly computed rows.
        self._apply_rotary = sys.modules[type(first_attn).__module__].apply_rotary_pos_emb

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> HFAdapter:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        return cls(model)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def attention_input(self, layer, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return self.layers[layer].input_layernorm(residual), residual

    def project_qkv(self, layer, x):
        attn = self.layers[layer].self_attn
        head_dim = self.shape.head_dim
        q = attn.q_proj(x).view(x.shape[0], -1, head_dim)  # [T, num_heads, head_dim]
        k = attn.k_proj(x).view(x.shape[0], -1, head_dim)  # [T, num_kv_heads, head_dim]
        v = attn.v_proj(x).view(x.shape[0], -1, head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over head_dim before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def rotate(self, layer, positions, q_nope, k_nope):
        cos, sin = self.decoder.rotary_emb(q_nope, positions[None])  # [1, T, head_dim]
        q, k = self._apply_rotary(q_nope.transpose(0, 1)[None], k_nope.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1)  # [T, heads, head_dim]

    def attention_output(self, layer, attn, residual):
        block = self.layers[layer]
        residual = block.self_attn.o_proj(attn) + residual
        return block.mlp(block.post_attention_layernorm(residual)), residual

    def final_logits(self, hidden, residual):
        return self.model.lm_head(self.decoder.norm(hidden + residual)).float()
