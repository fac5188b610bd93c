"""ModelAdapter: the few per-layer calls the fusor needs from a decoder-only model.

Imports only torch and cachefuse.rope. Both engines (transformers in adapters/hf.py, vLLM in
cachefuse/vllm/adapters.py) implement it by calling the model's own modules, so the blend pass
never re-implements a norm, projection, rotary or MLP.

The residual stream follows vLLM's convention: a layer's output is `(hidden, residual)` and the
true stream is `hidden + residual`; the first layer gets `residual=None`.

```
attention_input -> project_qkv -> rotate -> (fusor: attention over merged K/V) -> attention_output
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cachefuse.rope import RopeSpec


@dataclass(frozen=True)
class ModelShape:
    """Geometry the fusor and the store need; identical for every layer of the supported families, but for
    the sliding window, which may differ per layer (alternating local and global layers)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    scaling: float
    """Softmax scale of the attention (head_dim ** -0.5 for every supported family)."""
    dtype: torch.dtype
    layer_windows: tuple[int | None, ...] = ()
    """Per layer, its sliding window (a row at p sees keys p - window + 1 .. p) or None (full causal);
    empty when no layer has one."""

    def window(self, layer: int) -> int | None:
        """`layer`'s sliding window, None for full causal attention."""
        return self.layer_windows[layer] if self.layer_windows else None


class ModelAdapter(Protocol):
    shape: ModelShape
    rope_spec: RopeSpec
    """The model's RoPE, `inv_freq` on `device`."""
    device: torch.device
    """Where the model's weights live: the fusor, selectors and loader allocate every tensor of a pass here."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> hidden [num_tokens, hidden_size]."""
        ...

    def attention_input(
        self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds the residual and applies the layer's input norm -> (x [T, hidden_size], residual)."""
        ...

    def project_qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden_size] -> q_nope [T, num_heads, head_dim], k_nope [T, num_kv_heads, head_dim],
        v [T, num_kv_heads, head_dim]; after any q/k norm, before RoPE."""
        ...

    def rotate(
        self, layer: int, positions: torch.Tensor, q_nope: torch.Tensor, k_nope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own rotary embedding at `positions` [T] -> (q, k), same shapes; inputs untouched."""
        ...

    def attention_output(
        self, layer: int, attn: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [T, num_heads * head_dim] -> o_proj, residual add, post-attention norm, MLP ->
        (hidden, residual)."""
        ...

    def final_logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on the given rows only: [T, hidden_size] -> [T, vocab_size] fp32."""
        ...
