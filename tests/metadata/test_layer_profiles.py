"""Stored layer profiles (cachefuse/metadata/layer_profiles.py): a stored profile round-trips, and is used
only for its own model and depth, only when the config leaves `qcfuse_critical_layers` null; a damaged
one is ignored with a warning and never stops start-up. Profiling itself: tests/offline/test_layer_profile.py."""

import dataclasses
import json
import logging

from cachefuse.config import CacheFuseConfig
from cachefuse.metadata.layer_profiles import (
    LayerProfile,
    load_profile,
    profile_path,
    save_profile,
    with_profiled_layers,
)


def _profile(**changes) -> LayerProfile:
    base = LayerProfile("fp", 4, 0.1, "anchors", 0.1, 3, (0.1, 0.5, 0.4, 0.2), (0.5, 0.6), (1, 2))
    return dataclasses.replace(base, **changes)


def test_a_stored_profile_serves_its_own_model_only(tmp_path, caplog):
    profile = _profile()
    save_profile(profile, profile_path(tmp_path, "fp"))
    assert load_profile(tmp_path, "fp", 4) == profile
    config = with_profiled_layers(CacheFuseConfig(), tmp_path, "fp", 4)
    assert config.qcfuse_critical_layers == (1, 2)
    explicit = CacheFuseConfig(qcfuse_critical_layers=(0,))
    assert with_profiled_layers(explicit, tmp_path, "fp", 4) is explicit  # a set field wins
    with caplog.at_level(logging.WARNING, logger="cachefuse.metadata.layer_profiles"):
        assert load_profile(tmp_path, "fp", 6) is None  # another depth (the same name: a renamed copy)
        assert load_profile(tmp_path, "other", 4) is None  # nothing stored for that model: no warning
        save_profile(_profile(fingerprint="x"), profile_path(tmp_path, "y"))
        assert load_profile(tmp_path, "y", 4) is None
        profile_path(tmp_path, "broken").write_text("{not json")
        assert load_profile(tmp_path, "broken", 4) is None
        data = profile.to_dict() | {"critical_layers": [1, 9]}
        profile_path(tmp_path, "oob").write_text(json.dumps(data))
        assert load_profile(tmp_path, "oob", 4) is None
    assert len(caplog.records) == 4 and all("ignored" in r.getMessage() for r in caplog.records)
    assert with_profiled_layers(CacheFuseConfig(), tmp_path, "broken", 4).qcfuse_critical_layers is None


def test_a_damaged_profile_never_stops_start_up(tmp_path):
    """Read at every engine's start (qcfuse_critical_layers unset, whatever the selector): int(inf), deep
    nesting or a list for an object once raised out of start-up instead of being ignored."""
    data = _profile().to_dict()
    profile_path(tmp_path, "inf").parent.mkdir(parents=True)
    profile_path(tmp_path, "inf").write_text(json.dumps(data | {"critical_layers": [1e999]}))
    profile_path(tmp_path, "deep").write_text("[" * 100_000 + "]" * 100_000)
    profile_path(tmp_path, "list").write_text("[1, 2]")
    for name in ("inf", "deep", "list"):
        assert load_profile(tmp_path, name, 4) is None, name
