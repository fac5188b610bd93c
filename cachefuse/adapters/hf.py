"""HFAdapter: the ModelAdapter protocol over a transformers CausalLM (the reference engine).

Imports torch, transformers (lazily, through the model object) and cachefuse.rope. Supports the
Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm) families without sliding windows; norms,
rotary, activation and the LM head are the model's own modules, so results match `model(...)` to
fp rounding.

The q/k/v and gate/up projections run as one GEMM each over concatenated weights: the blend pass
multiplies a few hundred rows at a time, where one wide GEMM is markedly faster than three narrow
ones. The modules' own weights become views into the concatenated tensors, so memory is not
doubled and `model(...)` still reads the same bytes.
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

    def __init__(self, model: torch.nn.Module, compile: bool | str = False) -> None:
        """`compile`: run the per-layer elementwise work (residual adds and norms, RoPE, the MLP's
        activation) through `torch.compile` (True: inductor; a string: that backend), dynamic in the row
        count, so a GPU pass launches fewer kernels; off by default (its first calls compile)."""
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
        self.device = next(model.parameters()).device
        self.rope_spec = RopeSpec.from_hf(model).to(self.device)
        # The family's own RoPE application (rotate-half), used for freshly computed rows.
        self._apply_rotary = sys.modules[type(first_attn).__module__].apply_rotary_pos_emb
        self._qkv = [_fuse_linears(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj) for b in self.layers]
        self._gate_up = [_fuse_linears(b.mlp.gate_proj, b.mlp.up_proj) for b in self.layers]
        self._q_size = self.shape.num_heads * head_dim
        self._kv_size = self.shape.num_kv_heads * head_dim
        self._rotary_cache: tuple | None = None  # (positions, dtype, cos, sin) of the last rotate
        backend = "inductor" if compile is True else compile
        wrap = (lambda fn: torch.compile(fn, dynamic=True, backend=backend)) if backend else (lambda fn: fn)
        self._residual_norm = wrap(_residual_norm)
        self._mlp_block = wrap(_mlp_block)
        self._rotate_pair = wrap(_rotate_pair)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> HFAdapter:
        """Loads a checkpoint directory onto `device` in `dtype` (fp32 on CPU; bf16 or fp16 on a GPU)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        return cls(model.to(device))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def attention_input(self, layer, hidden, residual):
        if residual is None:
            return self.layers[layer].input_layernorm(hidden), hidden
        return self._residual_norm(self.layers[layer].input_layernorm, hidden, residual)

    def project_qkv(self, layer, x):
        attn = self.layers[layer].self_attn
        head_dim = self.shape.head_dim
        qkv = torch.nn.functional.linear(x, *self._qkv[layer])  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        q = q.view(x.shape[0], -1, head_dim)  # [T, num_heads, head_dim]
        k = k.view(x.shape[0], -1, head_dim)  # [T, num_kv_heads, head_dim]
        v = v.view(x.shape[0], -1, head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over head_dim before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def rotate(self, layer, positions, q_nope, k_nope):
        cos, sin = self._cos_sin(positions, q_nope)  # [1, T, head_dim]
        return self._rotate_pair(self._apply_rotary, q_nope, k_nope, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's cos/sin at `positions`, computed once per positions tensor: the blend pass
        rotates every layer at the same rows until a selection changes them (the module's own ~10
        kernels per layer were a visible share of a GPU pass's launch overhead). The cache holds the
        tensor itself, so an identical object is the same positions."""
        cached = self._rotary_cache
        if cached is None or cached[0] is not positions or cached[1] != like.dtype:
            cos, sin = self.decoder.rotary_emb(like, positions[None])
            self._rotary_cache = cached = (positions, like.dtype, cos, sin)
        return cached[2], cached[3]

    def attention_output(self, layer, attn, residual):
        return self._mlp_block(self.layers[layer], *self._gate_up[layer], attn, residual)

    def final_logits(self, hidden, residual):
        return self.model.lm_head(self.decoder.norm(hidden + residual)).float()


def _residual_norm(norm: torch.nn.Module, hidden: torch.Tensor, residual: torch.Tensor):
    residual = hidden + residual
    return norm(residual), residual


def _rotate_pair(apply_rotary, q_nope: torch.Tensor, k_nope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The family's own RoPE on [T, heads, head_dim] rows -> (q, k), same layout."""
    q, k = apply_rotary(q_nope.transpose(0, 1)[None], k_nope.transpose(0, 1)[None], cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


def _mlp_block(block: torch.nn.Module, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
               attn: torch.Tensor, residual: torch.Tensor):
    """o_proj, residual add, post-attention norm, MLP (gate and up as one GEMM) -> (hidden, residual)."""
    residual = block.self_attn.o_proj(attn) + residual
    x = block.post_attention_layernorm(residual)
    gate, up = torch.nn.functional.linear(x, gate_up_weight, gate_up_bias).chunk(2, dim=-1)
    return block.mlp.down_proj(block.mlp.act_fn(gate) * up), residual


def _fuse_linears(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenates the linears' weights (and biases) and re-points each module at its slice."""
    weight = torch.cat([lin.weight.detach() for lin in linears])  # [sum(out_features), in_features]
    has_bias = [lin.bias is not None for lin in linears]
    assert all(has_bias) or not any(has_bias), "mixed biases cannot be fused"
    bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
    offset = 0
    for lin in linears:
        rows = lin.out_features
        lin.weight = torch.nn.Parameter(weight[offset:offset + rows], requires_grad=False)
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[offset:offset + rows], requires_grad=False)
        offset += rows
    return weight, bias
