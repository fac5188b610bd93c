"""QCFuse's critical layers as the store keeps them: `<store>/profiles/<model fingerprint>.json`.

`cachefuse profile-layers` (cachefuse.offline.layer_profile) measures a model's profile and writes it
here; serving reads it: an engine whose `qcfuse_critical_layers` is null uses the stored profile of its
model (`with_profiled_layers`, in the scheduler for the controller's estimate and in the worker for the
pass). A profile of another model, of another depth or damaged is ignored with a warning (the default
layers, `select.qcfuse.default_critical_layers`, then apply).

Imports only the standard library: the scheduler process reads it (no torch).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PROFILE_VERSION = 1
PROFILES_DIR = "profiles"


@dataclass(frozen=True)
class LayerProfile:
    """What `profile_layers` measured, and the critical layers it chose."""

    fingerprint: str
    """The model's fingerprint (cachefuse.chunks.model_fingerprint): a profile serves that model only."""
    num_layers: int
    ratio: float
    """The Recall@ratio budget."""
    view: str
    """"anchors" (QCFuse's probe) or "full" (every cached row)."""
    anchor_ratio: float
    num_items: int
    """Prompts with evidence that were profiled."""
    recall: tuple[float, ...]
    """R(l) per layer: mean Recall@ratio of layer l's scores alone."""
    top_k_recall: tuple[float, ...]
    """Mean Recall@ratio of the summed scores of the k best layers, for k = 1..len."""
    critical_layers: tuple[int, ...]
    """The chosen set, sorted."""
    version: int = PROFILE_VERSION

    @property
    def ranked_layers(self) -> tuple[int, ...]:
        """Layers by R(l), best first (ties: the shallower layer, cheaper to probe)."""
        return tuple(sorted(range(self.num_layers), key=lambda layer: (-self.recall[layer], layer)))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerProfile:
        """Raises ValueError for anything but a profile this version wrote."""
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"not a version-{PROFILE_VERSION} layer profile")
        try:
            profile = cls(str(data["fingerprint"]), int(data["num_layers"]), float(data["ratio"]), str(data["view"]),
                          float(data["anchor_ratio"]), int(data["num_items"]),
                          tuple(float(x) for x in data["recall"]), tuple(float(x) for x in data["top_k_recall"]),
                          tuple(int(x) for x in data["critical_layers"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a layer profile without a valid {exc}") from None
        layers = profile.critical_layers
        if (len(profile.recall) != profile.num_layers or not layers or list(layers) != sorted(set(layers))
                or layers[0] < 0 or layers[-1] >= profile.num_layers):
            raise ValueError(f"critical_layers {list(layers)} or {len(profile.recall)} recalls do not fit "
                             f"{profile.num_layers} layers")
        return profile


def profile_path(store_dir: str | Path, fingerprint: str) -> Path:
    return Path(store_dir) / PROFILES_DIR / f"{fingerprint}.json"


def save_profile(profile: LayerProfile, path: str | Path) -> Path:
    """Writes atomically (a reader never sees half a profile)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    tmp.replace(path)
    return path


def load_profile(store_dir: str | Path, fingerprint: str, num_layers: int) -> LayerProfile | None:
    """The stored profile of this model, or None (none stored; damaged, of another model or depth: warned)."""
    path = profile_path(store_dir, fingerprint)
    if not path.exists():
        return None
    try:
        profile = LayerProfile.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError, RecursionError) as exc:
        # whatever a damaged or hand-edited file makes of the parse ([Infinity] layers, deep nesting): the
        # engine starts without the profile, as the default layers promise
        logger.warning("cachefuse: layer profile %s ignored (%s); qcfuse uses its default layers", path, exc)
        return None
    if profile.fingerprint != fingerprint or profile.num_layers != num_layers:
        logger.warning("cachefuse: layer profile %s is of another model (%s, %d layers); ignored",
                       path, profile.fingerprint, profile.num_layers)
        return None
    return profile


def with_profiled_layers(config, store_dir: str | Path, fingerprint: str, num_layers: int):
    """`config` with `qcfuse_critical_layers` from the stored profile when the field is null and a
    profile of this model exists; else `config` itself (a set field always wins)."""
    if config.qcfuse_critical_layers is not None:
        return config
    profile = load_profile(store_dir, fingerprint, num_layers)
    if profile is None:
        return config
    logger.info("cachefuse: qcfuse critical layers %s from %s", list(profile.critical_layers),
                profile_path(store_dir, fingerprint))
    return dataclasses.replace(config, qcfuse_critical_layers=tuple(profile.critical_layers))
