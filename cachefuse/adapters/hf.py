"""HFAdapter: the ModelAdapter protocol over a transformers CausalLM (the reference engine).

Imports torch, transformers (lazily, through the model object), cachefuse.ops and cachefuse.rope.
Supports the Llama, Mistral (and Ministral: Mistral with per-layer windows), Qwen2 (qkv bias) and Qwen3
(q/k norm) families, with the sliding windows
transformers applies to each layer (`layer_windows`), which the blend pass's attention applies too.

A GPU pass over a few hundred selected rows is launch-bound, so each layer's work is a few large
calls rather than the modules' many small ones, with the model's own weights and constants:

- q/k/v and gate/up each run as one GEMM over concatenated weights (the modules' weights become views
  into them, so memory is not doubled and `model(...)` reads the same bytes);
- RMSNorm is `torch.nn.functional.rms_norm` with the module's weight and epsilon (one fused kernel on
  CUDA against the module's eight);
- RoPE is `cachefuse.ops.apply_rope` at the model's RopeSpec, the same rotation the loaded chunks' keys
  get (one Triton launch per tensor on CUDA against the module's cos/sin and rotate-half's ten).

On a CPU in fp32 both give the modules' results bit for bit (tests/adapters/test_hf_fused_ops.py); in
bf16 on a GPU they round once where the modules round two to four times, so they agree with
`model(...)` to bf16 rounding. Activation, projections and the LM head are the model's own modules.
"""

from __future__ import annotations

import torch

from cachefuse import ops
from cachefuse.adapters.base import ModelShape
from cachefuse.errors import UnsupportedModelError
from cachefuse.rope import RopeSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3")


def _check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported: expected one of {', '.join(SUPPORTED_MODEL_TYPES)}")


def layer_windows(config, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it, () when no layer has one.

    Mistral masks every layer with `sliding_window`; Ministral (what transformers loads a Mistral config with
    `layer_types` as), Qwen2 and Qwen3 window the layers `layer_types` calls "sliding_attention" (Qwen's
    derived from `use_sliding_window` and `max_window_layers`); Llama never windows.

    Raises:
        UnsupportedModelError: a window that is not a positive number of keys.
    """
    model_type = getattr(config, "model_type", None)
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral":
        windows = (window,) * num_layers
    elif model_type in ("ministral", "qwen2", "qwen3"):
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
        windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types[:num_layers])
    else:
        windows = (None,) * num_layers
    for index, layer_window in enumerate(windows):
        if layer_window is not None and (not isinstance(layer_window, int) or layer_window < 1):
            raise UnsupportedModelError(
                f"layer {index}: sliding_window={layer_window!r} is not a number of keys >= 1; fix the config's "
                "sliding_window (null for full attention)")
    return windows if any(w is not None for w in windows) else ()


class HFAdapter:
    """Wraps a loaded transformers `*ForCausalLM` in eval mode."""

    def __init__(self, model: torch.nn.Module, compile: bool | str = False) -> None:
        """`compile`: run the per-layer elementwise work (residual adds and norms, the MLP's activation)
        through `torch.compile` (True: inductor; a string: that backend), dynamic in the row count, so a
        GPU pass launches fewer kernels; off by default (its first calls compile)."""
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
            layer_windows=layer_windows(config, len(self.layers)),
        )
        self.device = next(model.parameters()).device
        self.rope_spec = RopeSpec.from_hf(model).to(self.device)
        self._qkv = [_fuse_linears(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj) for b in self.layers]
        self._gate_up = [_fuse_linears(b.mlp.gate_proj, b.mlp.up_proj) for b in self.layers]
        self._q_size = self.shape.num_heads * head_dim
        self._kv_size = self.shape.num_kv_heads * head_dim
        backend = "inductor" if compile is True else compile
        wrap = (lambda fn: torch.compile(fn, dynamic=True, backend=backend)) if backend else (lambda fn: fn)
        self._residual_norm = wrap(_residual_norm)
        self._mlp_block = wrap(_mlp_block)

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
            return rms_norm(self.layers[layer].input_layernorm, hidden), hidden
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
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        return q, k, v

    def rotate(self, layer, positions, q_nope, k_nope):
        qk_nope = _adjacent_heads(q_nope, k_nope)
        if qk_nope is None:  # q/k normed into tensors of their own (Qwen3)
            return ops.apply_rope(q_nope, positions, self.rope_spec), ops.apply_rope(k_nope, positions, self.rope_spec)
        # One launch for both: a pass over few rows is launch-bound (on CUDA each Triton launch costs tens of
        # microseconds of host time, the kernel itself a few). q and k are views of the rotated heads.
        qk = ops.apply_rope(qk_nope, positions, self.rope_spec)
        return qk[:, :q_nope.shape[1]], qk[:, q_nope.shape[1]:]

    def attention_output(self, layer, attn, residual):
        return self._mlp_block(self.layers[layer], *self._gate_up[layer], attn, residual)

    def final_logits(self, hidden, residual):
        return self.model.lm_head(rms_norm(self.decoder.norm, hidden + residual)).float()


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, num_heads + num_kv_heads, head_dim] over q's and k's memory when k's heads directly follow q's in
    every row (both views of one fused projection, as project_qkv returns them); else None.

    Compared by storage, not `_base`: views made under inference mode (every pass) have none."""
    if (q.device != k.device or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
            or q.dtype != k.dtype or q.shape[0] != k.shape[0]):
        return None
    head_dim = q.shape[2]
    if (k.shape[2] != head_dim or q.stride() != k.stride() or q.stride(2) != 1 or q.stride(1) != head_dim
            or k.storage_offset() != q.storage_offset() + q.shape[1] * head_dim):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], head_dim), q.stride(), q.storage_offset())


def rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The family's RMSNorm module applied as one `F.rms_norm` call (its weight and epsilon)."""
    return torch.nn.functional.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _residual_norm(norm: torch.nn.Module, hidden: torch.Tensor, residual: torch.Tensor):
    residual = hidden + residual
    return rms_norm(norm, residual), residual


def _mlp_block(block: torch.nn.Module, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
               attn: torch.Tensor, residual: torch.Tensor):
    """o_proj, residual add, post-attention norm, MLP (gate and up as one GEMM) -> (hidden, residual)."""
    residual = block.self_attn.o_proj(attn) + residual
    x = rms_norm(block.post_attention_layernorm, residual)
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
