"""The selector registry (cachefuse/select/registry.py), table-driven over every selector name: each builds
its own module's selector; an unknown name is refused with the list."""

import pytest

from cachefuse.config import CacheFuseConfig
from cachefuse.select.registry import make_selector

NAMES = ("full_prefill", "full_reuse", "cacheblend", "epic", "random", "cachecraft", "fusionrag", "qcfuse")


@pytest.mark.parametrize("name", NAMES)
def test_each_name_builds_a_fresh_selector_from_its_module(name):
    selector = make_selector(name, CacheFuseConfig())
    assert selector.name == name and type(selector).__module__ == f"cachefuse.select.{name}"
    assert make_selector(name, CacheFuseConfig()) is not selector


def test_an_unknown_name_is_refused_naming_the_selectors():
    with pytest.raises(ValueError, match="expected one of full_prefill, full_reuse, cacheblend"):
        make_selector("nope", CacheFuseConfig())
