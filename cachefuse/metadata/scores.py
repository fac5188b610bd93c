"""Chunk-variant metadata and Cache-Craft's reuse scores: CCI, beta, gamma, beta', CFO, f_r.

Imports only the standard library: the scheduler scores variants without torch. A variant is one
stored computation of a chunk under an ordered prefix of other chunks (Cache-Craft, SIGMOD'25,
Eqs. 3-12 and §3.3); its attention statistics are plain floats computed by the worker.

    CCI   = sigmoid(a / b)                                           Eq. 11, in [0.5, 1)
    a     = sum_j inter(C_j, C_i) / (|C_i| |C_j|),  b = intra(C_i) / |C_i|^2    Eq. 9
    beta  = sum_{j in S_old & S_new} inter(j) / sum_{j in S_old} inter(j)   Eq. 6
    gamma = discordant pairs / C(m, 2) over the m chunks common to both       Eq. 7
    beta' = beta (1 - gamma)                                                   Eq. 8
    CFO   = clamp(alpha CCI (1 - beta'), 0, 1)                                 Eq. 12
    f_r  += 1 / max(CFO, eps) on every use                                     §3.3

Choices where the paper is ambiguous (each is pinned by a test in tests/metadata/test_scores.py):

1. Direction. `inter[j]` is the attention weight with queries in this chunk and keys in prefix
   chunk j (the causal reading of Eq. 5, whose block inter(C1, C2) sits in row C2); Eq. 3's index
   order would point at masked entries.
2. Diagonal. `intra` is the whole causal block of the chunk, diagonal included (Eq. 5's block,
   which must hold the self weights for the attention output to be right), not Eq. 4's strict
   k < l. So a 1-token chunk has intra = its self weight > 0 and a well-defined CCI.
3. Aggregation over heads and layers. Callers pass per-layer sums averaged over layers (Eq. 10:
   a and b are linear in inter and intra, so averaging the sums averages a and b) and over heads.
   a / b, hence CCI, does not change if both are summed instead of averaged, as long as inter and
   intra are aggregated alike.
4. Which chunks count. Only the chunks in the variant's prefix (its `inter` keys); attention to
   tokens outside declared chunks (the shared system prompt, glue) is not outside influence.
5. Zero intra attention (b = 0, only by underflow under choice 2): CCI = 0.5 when a = 0 too (no
   evidence of outside influence), else the largest float below 1 (fully contextualized).
   CCI is capped there in general: the sigmoid never reaches 1, float rounding would.
6. Empty old prefix (Eq. 6's denominator is 0): beta = 1 when the new prefix is empty too (the
   same context), else 0 (a chunk cached alone shares nothing with any context). A non-empty old
   prefix whose inter weights are all 0 falls back to the unweighted share |S_old & S_new| / |S_old|.
   As in the paper, chunks of the new prefix that are not in the old one do not lower beta.
7. Kendall tau over the common chunks: A_old and A_new list the common chunks in each prefix's
   order; a pair is discordant when the two lists order it differently. gamma = 0 when m < 2
   (no pair to disagree on). A chunk repeated in a prefix counts at its first occurrence.
8. CFO is clamped to [0, 1] (alpha up to 3 in the paper's ablation overshoots 1); alpha must be
   finite and >= 0.
9. Variant choice: the lowest CFO; ties go to the variant stored for exactly the new prefix (scores
   see a repeated chunk once, so [x] and [x, x] tie), then to the higher beta' (the closer prefix,
   which matters when alpha = 0 or CFO is clamped to 1), then to the lower index (the older variant).
10. f_r: CFO = 0 (an exact prefix match) adds 1 / eps instead of dividing by zero.
11. A CFO that is not a number (statistics that overflow: only a damaged or foreign row) is 1: the
    chunk is recomputed in full, and no NaN reaches the scheduler's arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

CCI_MAX = math.nextafter(1.0, 0.0)
"""The largest CCI: the float just below 1 (the sigmoid's supremum, never reached)."""


def _check_nonneg(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name}={value!r}, expected a finite number >= 0")


def cci(a: float, b: float) -> float:
    """Cache Context Impact, sigmoid(a / b) (Eq. 11); choice 5 for b = 0.

    Args:
        a: length-normalised inter-attention from the prefix chunks (Eq. 9), >= 0.
        b: length-normalised intra-attention of the chunk (Eq. 9), >= 0.

    Returns:
        CCI in [0.5, CCI_MAX]; 0.5 when a = 0.
    """
    _check_nonneg("a", a)
    _check_nonneg("b", b)
    if b == 0.0:
        return 0.5 if a == 0.0 else CCI_MAX
    ratio = a / b  # >= 0, so exp(-ratio) <= 1 never overflows; inf on overflow gives CCI_MAX
    return min(1.0 / (1.0 + math.exp(-ratio)), CCI_MAX)


def attention_sums(inter: Mapping[str, float], intra: float, num_tokens: int,
                   prefix_num_tokens: Mapping[str, int]) -> tuple[float, float]:
    """a and b of Eq. 9 from one variant's aggregated attention sums (choices 1-4).

    Args:
        inter: prefix chunk key -> attention weight from this chunk's tokens to that chunk's.
        intra: attention weight within this chunk, diagonal included.
        num_tokens: |C_i|, the chunk's token count (>= 1).
        prefix_num_tokens: prefix chunk key -> |C_j| (>= 1), for every key of `inter`.

    Returns:
        (a, b) with a = sum_j inter[j] / (|C_i| |C_j|) and b = intra / |C_i|^2.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r}, expected >= 1")
    _check_nonneg("intra", intra)
    a = 0.0
    for key, weight in inter.items():
        _check_nonneg(f"inter[{key!r}]", weight)
        length = prefix_num_tokens.get(key, 0)
        if length < 1:
            raise ValueError(f"prefix_num_tokens[{key!r}]={length!r}, expected >= 1")
        a += weight / (num_tokens * length)
    return a, intra / (num_tokens * num_tokens)


def _unique(prefix: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(prefix))  # first occurrences, in order (choice 7)


def prefix_overlap(old_prefix: Sequence[str], new_prefix: Sequence[str],
                   inter: Mapping[str, float]) -> float:
    """beta, the inter-attention-weighted share of the old prefix found in the new one (Eq. 6).

    Args:
        old_prefix: the ordered chunk keys the variant was computed after (S_old).
        new_prefix: the ordered chunk keys before the chunk in the new prompt (S_new).
        inter: old prefix chunk key -> inter-attention weight; a missing key weighs 0.

    Returns:
        beta in [0, 1]; order-invariant; choice 6 for an empty old prefix or zero weights.
    """
    old = _unique(old_prefix)
    if not old:
        return 0.0 if new_prefix else 1.0
    new = set(new_prefix)
    total = sum(inter.get(key, 0.0) for key in old)
    if total <= 0.0:
        return sum(key in new for key in old) / len(old)
    common = sum(inter.get(key, 0.0) for key in old if key in new)
    return min(common / total, 1.0)  # the sums differ in rounding only


def order_penalty(old_prefix: Sequence[str], new_prefix: Sequence[str]) -> float:
    """gamma, the normalised Kendall tau distance between the common chunks' two orders (Eq. 7).

    Args:
        old_prefix: the variant's ordered prefix chunk keys.
        new_prefix: the new prompt's ordered prefix chunk keys.

    Returns:
        gamma = D / (m (m - 1) / 2) in [0, 1]; 0 when fewer than 2 chunks are common.
    """
    new = _unique(new_prefix)
    common = set(old_prefix) & set(new)
    a_old = [key for key in _unique(old_prefix) if key in common]
    rank_new = {key: rank for rank, key in enumerate(key for key in new if key in common)}
    m = len(a_old)
    if m < 2:
        return 0.0
    ranks = [rank_new[key] for key in a_old]  # A_new's rank of each chunk, in A_old's order
    discordant = sum(ranks[i] > ranks[j] for i in range(m) for j in range(i + 1, m))
    return discordant / (m * (m - 1) // 2)


def adjusted_overlap(beta: float, gamma: float) -> float:
    """beta' = beta (1 - gamma) (Eq. 8)."""
    return beta * (1.0 - gamma)


def cfo(alpha: float, cci_value: float, beta: float, gamma: float) -> float:
    """Cache Fix Overhead, the fraction of the chunk's tokens to recompute (Eq. 12, choice 8).

    Args:
        alpha: the recompute scale (finite, >= 0).
        cci_value: the variant's CCI.
        beta: prefix overlap (Eq. 6).
        gamma: order penalty (Eq. 7).

    Returns:
        alpha CCI (1 - beta (1 - gamma)), clamped to [0, 1]; 1 (recompute it all) when the statistics give
        no number (NaN: a damaged or foreign row whose attention sums overflow to inf / inf).
    """
    _check_nonneg("alpha", alpha)
    value = alpha * cci_value * (1.0 - adjusted_overlap(beta, gamma))
    if math.isnan(value):
        return 1.0  # NaN passes min/max unchanged: it would reach the selectors' ceil() in the scheduler
    return min(max(value, 0.0), 1.0)


@dataclass
class Variant:
    """One stored computation of a chunk after an ordered prefix of chunks (no tensors).

    `inter`, `prefix_num_tokens` and the prefix name the same chunks; `f_r` and `access_count`
    change on every use (record_use).
    """

    prefix: tuple[str, ...]
    """Chunk keys before the chunk when it was computed, in prompt order."""
    inter: dict[str, float]
    """Prefix chunk key -> attention weight from this chunk to it (choices 1, 3)."""
    intra: float
    """Attention weight within the chunk, diagonal included (choice 2)."""
    num_tokens: int
    """The chunk's token count."""
    prefix_num_tokens: dict[str, int] = field(default_factory=dict)
    """Prefix chunk key -> its token count (Eq. 9's |C_j|); required when the prefix is not empty."""
    access_count: int = 0
    f_r: float = 0.0
    """Frequency-reuse score, the eviction order under `eviction_policy="f_r"`."""

    def __post_init__(self) -> None:
        self.prefix = tuple(self.prefix)
        keys = set(self.prefix)
        if set(self.inter) != keys or set(self.prefix_num_tokens) != keys:
            raise ValueError(f"Variant: inter keys {sorted(self.inter)} and prefix_num_tokens keys "
                             f"{sorted(self.prefix_num_tokens)} must equal the prefix's {sorted(keys)}")
        self._cci = cci(*attention_sums(self.inter, self.intra, self.num_tokens, self.prefix_num_tokens))

    @property
    def cci(self) -> float:
        """CCI (Eq. 11), computed once: a static property of the stored variant."""
        return self._cci


def score_variant(variant: Variant, new_prefix: Sequence[str], alpha: float) -> tuple[float, float]:
    """(CFO, beta') of `variant` reused after `new_prefix`."""
    beta = prefix_overlap(variant.prefix, new_prefix, variant.inter)
    gamma = order_penalty(variant.prefix, new_prefix)
    return cfo(alpha, variant.cci, beta, gamma), adjusted_overlap(beta, gamma)


def choose_variant(variants: Sequence[Variant], new_prefix: Sequence[str], alpha: float) -> tuple[int, float]:
    """The variant to reuse: the lowest CFO, ties to the one stored for exactly this prefix, then to the
    higher beta', then the lower index (choice 9).

    Args:
        variants: a chunk's stored variants (at least one).
        new_prefix: the chunk keys before the chunk in the new prompt, in order.
        alpha: the recompute scale.

    Returns:
        (index into `variants`, its CFO).
    """
    if not variants:
        raise ValueError("choose_variant: no variants (a chunk without variants is a miss)")
    best_key, best = None, (0, 0.0)
    exact = tuple(new_prefix)
    for index, variant in enumerate(variants):
        value, beta_adj = score_variant(variant, new_prefix, alpha)
        # Scores see a repeated chunk once (choice 7), so [x] and [x, x] tie for a prompt x x x: the
        # variant computed after exactly this prefix must win the tie, not the older one.
        key = (value, tuple(variant.prefix) != exact, -beta_adj, index)
        if best_key is None or key < best_key:
            best_key, best = key, (index, value)
    return best


def record_use(variant: Variant, cfo_value: float, eps: float = 1e-6) -> None:
    """Count one reuse of `variant`: access_count += 1, f_r += 1 / max(CFO, eps) (§3.3, choice 10)."""
    if not eps > 0.0:
        raise ValueError(f"eps={eps!r}, expected > 0")
    variant.access_count += 1
    variant.f_r += 1.0 / max(cfo_value, eps)
