"""RoPE geometry and strip / apply / shift / gather_rotate in pure torch: the specification for
csrc_triton/rope.py and csrc_triton/gather_rotate.py.

Imports only torch and cachefuse.errors (never transformers or vllm: the constructors read the live
rotary module by duck typing). `apply_rope(k_nope, positions, spec)` equals the engine's own rotary
embedding at `positions` to fp32 rounding, because the angle is computed the way both engines do
(`positions.float() ⊗ inv_freq`, one fp32 multiply per element); `strip_rope` inverts it.

Layouts, for one head of `head_dim` dims of which the first `rotary_dim` rotate:

```
NeoX (rotate-half):  | x1 = d[0 : R/2] | x2 = d[R/2 : R] | pass d[R : D] |
GPT-J (interleaved): | x1 = d[0::2], x2 = d[1::2] over [0, R)   | pass d[R : D] |
```

and every pair (x1_i, x2_i) turns by angle `position * inv_freq[i]`, scaled by `attention_scaling`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachefuse.errors import ConfigError, UnsupportedModelError

# transformers' families whose modeling code rotates the whole head in the NeoX (rotate-half) layout.
_HF_FAMILIES = ("llama", "mistral", "ministral", "qwen2", "qwen3")
_HF_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# vLLM rotary classes whose cos_sin_cache is `cos/sin(t * inv_freq) * mscale` for one inv_freq.
_VLLM_CLASSES = (
    "RotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
)
# Rows of vLLM's cos_sin_cache checked against the recomputed geometry, and the tolerance per cache
# dtype (vLLM stores the cache in the model dtype; linear scaling rounds t / factor first).
_CACHE_CHECK_ROWS = 256
_CACHE_ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """The RoPE geometry of one model, read from its live rotary module.

    Attributes:
        head_dim: dims per attention head.
        rotary_dim: the leading dims of each head that rotate (partial rotary when < head_dim).
        is_neox_style: True for the rotate-half layout, False for GPT-J's interleaved pairs.
        inv_freq: fp32 `[rotary_dim // 2]`, frequency scaling (linear / llama3 / yarn) included.
        attention_scaling: YaRN's mscale, multiplied into cos and sin (rotary dims only); else 1.0.
    """

    head_dim: int
    rotary_dim: int
    is_neox_style: bool
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(
                f"rotary_dim={self.rotary_dim!r}, expected an even number in 2..head_dim={self.head_dim}"
            )
        if self.inv_freq.dtype != torch.float32 or tuple(self.inv_freq.shape) != (self.rotary_dim // 2,):
            raise ConfigError(
                f"inv_freq has shape {tuple(self.inv_freq.shape)} and dtype {self.inv_freq.dtype}, "
                f"expected ({self.rotary_dim // 2},) float32"
            )
        if not self.attention_scaling > 0.0:
            raise ConfigError(f"attention_scaling={self.attention_scaling!r}, expected > 0")

    def to(self, device: torch.device | str) -> RopeSpec:
        """Returns the same geometry with `inv_freq` on `device` (avoids a copy per call)."""
        return RopeSpec(self.head_dim, self.rotary_dim, self.is_neox_style,
                        self.inv_freq.to(device), self.attention_scaling)

    @classmethod
    def from_hf(cls, model: torch.nn.Module) -> RopeSpec:
        """Reads the geometry of a transformers CausalLM (Llama, Mistral, Qwen2, Qwen3 families).

        Args:
            model: e.g. `LlamaForCausalLM`; its `model.rotary_emb` holds the scaled `inv_freq`
                and `attention_scaling`; `config.rope_parameters` names the RoPE type.

        Raises:
            UnsupportedModelError: another family, a RoPE type other than default / linear / llama3 /
                yarn, or a rotary module that does not rotate the whole head.
        """
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in _HF_FAMILIES:
            raise UnsupportedModelError(f"model_type={model_type!r}, expected one of {_HF_FAMILIES}")
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in _HF_ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type={rope_type!r}, expected one of {_HF_ROPE_TYPES}")
        rotary = getattr(model, "model", model).rotary_emb
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = rotary.inv_freq.detach().to("cpu", torch.float32).clone()
        # NOTE: these families' apply_rotary_pos_emb rotates the whole head; a shorter inv_freq
        # (partial_rotary_factor with a scaled type) would not even broadcast there.
        if 2 * inv_freq.numel() != head_dim:
            raise UnsupportedModelError(
                f"{model_type} rotary_emb.inv_freq has {inv_freq.numel()} entries, expected head_dim/2 = "
                f"{head_dim // 2} (partial rotary is not used by this family)"
            )
        return cls(head_dim, head_dim, True, inv_freq, float(rotary.attention_scaling))

    @classmethod
    def from_vllm(cls, rotary_emb: torch.nn.Module) -> RopeSpec:
        """Reads the geometry of a vLLM rotary embedding module (a layer's `rotary_emb`).

        Recomputes inv_freq through the module's own `_compute_inv_freq` and checks it against the
        module's `cos_sin_cache`, so a subclass that computes its cache differently cannot slip by.

        Args:
            rotary_emb: `RotaryEmbedding`, `LinearScalingRotaryEmbedding` (one factor),
                `Llama3RotaryEmbedding` or `YaRNScalingRotaryEmbedding`.

        Raises:
            UnsupportedModelError: another class (dynamic NTK, longrope, mrope, ...), several
                linear factors, or a cache that disagrees with the recomputed geometry.
        """
        name = type(rotary_emb).__name__
        if name not in _VLLM_CLASSES:
            raise UnsupportedModelError(f"vLLM rotary embedding {name}, expected one of {_VLLM_CLASSES}")
        scaling = 1.0
        if name == "YaRNScalingRotaryEmbedding":
            inv_freq = rotary_emb._compute_inv_freq(rotary_emb.scaling_factor)
            scaling = float(rotary_emb.mscale)
        else:
            inv_freq = rotary_emb._compute_inv_freq(rotary_emb.base)
        if name == "LinearScalingRotaryEmbedding":
            factors = list(rotary_emb.scaling_factors)
            if len(factors) != 1:
                raise UnsupportedModelError(f"linear RoPE with scaling_factors={factors}, expected one")
            # vLLM divides t by the factor, transformers divides inv_freq: the same angle up to
            # fp32 rounding (|t| * 2**-24 rad; exact for power-of-two factors).
            inv_freq = inv_freq / factors[0]
        spec = cls(int(rotary_emb.head_size), int(rotary_emb.rotary_dim), bool(rotary_emb.is_neox_style),
                   inv_freq.detach().to("cpu", torch.float32), scaling)
        _check_cos_sin_cache(spec, rotary_emb.cos_sin_cache, name)
        return spec


def _check_cos_sin_cache(spec: RopeSpec, cos_sin_cache: torch.Tensor, name: str) -> None:
    """Raises UnsupportedModelError unless `cos_sin_cache` rows equal `spec`'s cos | sin."""
    num_rows = min(_CACHE_CHECK_ROWS, cos_sin_cache.shape[0])
    cache = cos_sin_cache[:num_rows].detach().to("cpu", torch.float32)  # [num_rows, rotary_dim]
    cos, sin = rope_cos_sin(torch.arange(num_rows), spec)
    expected = torch.cat((cos, sin), dim=-1) * spec.attention_scaling
    atol = _CACHE_ATOL.get(cos_sin_cache.dtype, 1e-2)
    if cache.shape != expected.shape or not torch.allclose(cache, expected, rtol=0.0, atol=atol):
        raise UnsupportedModelError(
            f"{name}.cos_sin_cache (shape {tuple(cos_sin_cache.shape)}, {cos_sin_cache.dtype}) does not "
            f"match the recomputed RoPE geometry (rotary_dim={spec.rotary_dim})"
        )


def rope_cos_sin(positions: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, without attention_scaling.

    Args:
        positions: int64 `[num_tokens]`, may be negative.
        spec: the geometry.

    Returns:
        (cos, sin), each fp32 `[num_tokens, rotary_dim // 2]` on `positions.device`.
    """
    inv_freq = spec.inv_freq.to(positions.device)
    # Same single fp32 multiply as vLLM's einsum("i,j->ij") and HF's position_ids[..., None] * inv_freq.
    angle = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [num_tokens, rotary_dim // 2]
    return angle.cos(), angle.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Turns each pair of `x` by (cos, sin); returns a new tensor of x's shape and dtype.

    Args:
        x: `[num_tokens, num_heads, head_dim]`, any float dtype.
        cos, sin: fp32 `[num_tokens, rotary_dim // 2]`, scaling already folded in.
    """
    _check_args(x, cos.shape[0], spec)
    rot = x[..., : spec.rotary_dim].to(torch.float32)  # [num_tokens, num_heads, rotary_dim]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [num_tokens, 1, rotary_dim // 2]
    if spec.is_neox_style:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if spec.is_neox_style:
        rot = torch.cat((o1, o2), dim=-1)
    else:
        rot = torch.stack((o1, o2), dim=-1).flatten(-2)
    # A fresh output: the input (often a shared stored cache) is never written.
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out[..., : spec.rotary_dim] = rot
    out[..., spec.rotary_dim :] = x[..., spec.rotary_dim :]
    return out


def _check_args(x: torch.Tensor, num_tokens: int, spec: RopeSpec) -> None:
    if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[-1] != spec.head_dim:
        raise ValueError(
            f"expected k of shape [num_tokens={num_tokens}, num_heads, head_dim={spec.head_dim}], "
            f"got {tuple(x.shape)}"
        )
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point k, got {x.dtype}")


def _check_positions(positions: torch.Tensor) -> None:
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise ValueError(f"expected int64 positions [num_tokens], got {positions.dtype} {tuple(positions.shape)}")


def apply_rope(k_nope: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotates RoPE-free keys to their absolute positions, as the model's rotary embedding does.

    Args:
        k_nope: `[num_tokens, num_heads, head_dim]`, any float dtype; not modified.
        positions: int64 `[num_tokens]`, absolute, may be negative.
        spec: the geometry.

    Returns:
        k: `[num_tokens, num_heads, head_dim]`, k_nope's dtype; rotary dims turned and multiplied by
        attention_scaling, the others copied. Math in fp32.
    """
    _check_positions(positions)
    cos, sin = rope_cos_sin(positions, spec)  # [num_tokens, rotary_dim // 2]
    s = spec.attention_scaling
    return _rotate(k_nope, cos * s, sin * s, spec)


def strip_rope(k: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """The inverse of apply_rope: turns back by `positions` and divides by attention_scaling.

    Args:
        k: `[num_tokens, num_heads, head_dim]`, rotated at `positions`; not modified.
        positions: int64 `[num_tokens]`, the positions `k` was rotated at.
        spec: the geometry.

    Returns:
        k_nope: `[num_tokens, num_heads, head_dim]`, k's dtype.
    """
    _check_positions(positions)
    cos, sin = rope_cos_sin(positions, spec)  # [num_tokens, rotary_dim // 2]
    s = spec.attention_scaling
    # R(-a) = (cos a, -sin a): the same angles as apply_rope, so strip undoes it to fp32 rounding.
    return _rotate(k, cos / s, -sin / s, spec)


def shift_rope(k: torch.Tensor, offsets: torch.Tensor | int, spec: RopeSpec) -> torch.Tensor:
    """Turns rotated keys by `offsets` positions, without attention_scaling.

    shift_rope(apply_rope(x, p), q - p) equals apply_rope(x, q) up to the fp32 rounding of the
    angles `p * inv_freq` and `q * inv_freq` (about |p| * 2**-24 rad): for bit-level agreement with
    the engine, strip and re-apply instead.

    Args:
        k: `[num_tokens, num_heads, head_dim]`; not modified.
        offsets: an int, or int64 `[num_tokens]`; may be negative.
        spec: the geometry.

    Returns:
        `[num_tokens, num_heads, head_dim]`, k's dtype.
    """
    if isinstance(offsets, int):
        offsets = torch.full((k.shape[0],), offsets, dtype=torch.int64, device=k.device)
    _check_positions(offsets)
    cos, sin = rope_cos_sin(offsets, spec)  # [num_tokens, rotary_dim // 2]
    return _rotate(k, cos, sin, spec)


def gather_rotate(src: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor, dst_positions: torch.Tensor,
                  spec: RopeSpec, src_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Writes `src` rotated at `dst_positions` into rows `dst_rows` of `dst` (the loader's gather).

    `dst[dst_rows[i]] = apply_rope(src, dst_positions)[i]` for RoPE-free `src`; with `src_positions`
    (keys stored rotated, e.g. read back from a paged cache) `src` is first stripped at
    `src_positions`: `apply_rope(strip_rope(src, src_positions), dst_positions)`, both turns in fp32
    and one rounding to dst's dtype at the end. Strip + apply rather than shift_rope by
    `dst_positions - src_positions`: its angles are the engine's own (see shift_rope), and it
    undoes attention_scaling before applying it again.

    Args:
        src: `[num_tokens, num_heads, head_dim]` keys, any float dtype; not modified.
        dst: `[num_dst_rows, num_heads, head_dim]`, any float dtype and strides; written in place,
            rows outside `dst_rows` untouched.
        dst_rows: int64 `[num_tokens]`, distinct, in [0, num_dst_rows).
        dst_positions: int64 `[num_tokens]`, the absolute positions row i is rotated to.
        spec: the geometry.
        src_positions: None (src is RoPE-free), or int64 `[num_tokens]`, the positions src is rotated at.

    Returns:
        dst.
    """
    _check_positions(dst_rows)
    if src_positions is None and src.dtype == dst.dtype:
        k = apply_rope(src, dst_positions, spec)  # the fp32 path's bits: apply_rope rounds once
    else:
        k = src.to(torch.float32)  # [num_tokens, num_heads, head_dim]
        if src_positions is not None:
            k = strip_rope(k, src_positions, spec)
        k = apply_rope(k, dst_positions, spec).to(dst.dtype)
    return dst.index_copy_(0, dst_rows, k)
