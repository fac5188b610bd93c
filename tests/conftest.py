"""Shared fixtures. Tests run offline: every model and tokenizer is built locally.

Tiny models (cachefuse.testing.tiny_models; `build_tiny_model`'s keyword arguments, e.g. `num_layers`):

- `tiny_model_dir(family, **kwargs) -> Path` (session): the cached checkpoint directory.
- `tiny_adapter(family="llama", **kwargs) -> HFAdapter` (module): an HFAdapter over that checkpoint,
  one per distinct arguments within a test module; a module that compiles or patches an adapter cannot
  leak it into another module.
- `adapter` (module): the module's HFAdapter, `HFAdapter.from_pretrained(str(tiny_model_dir("llama")))`
  unless the module names another checkpoint with `pytestmark = pytest.mark.tiny_model("llama",
  num_layers=4)` (the marker's arguments are `tiny_model_dir`'s). A module runs over several families
  with `pytestmark = pytest.mark.parametrize("adapter", FAMILIES, indirect=True)` (one adapter per
  family, tests grouped by family); a param replaces the marker's family, keeping its other arguments.
- `model_dir` (module): the checkpoint directory of the module's `tiny_model` marker (default llama).

The `tiny_model` marker marks a whole module: the fixtures that read it are module-scoped, so a test
or class carrying it is refused at collection rather than silently given the module's model.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import pytest  # noqa: E402

from cachefuse.testing.tiny_models import cached_tiny_model  # noqa: E402

if TYPE_CHECKING:
    from cachefuse.adapters.hf import HFAdapter

pytest_plugins = ["tests.helpers.redis_server"]
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_cache_root() -> Path:
    """Where tiny checkpoints are cached across runs: $CACHEFUSE_TEST_MODEL_CACHE or .cache/test-models."""
    return Path(os.environ.get("CACHEFUSE_TEST_MODEL_CACHE") or REPO_ROOT / ".cache" / "test-models")


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache_root: Path) -> Callable[..., Path]:
    """`make(family, **kwargs) -> Path`: a cached tiny checkpoint (see cachefuse.testing.tiny_models)."""

    def make(family: str, **kwargs) -> Path:
        return cached_tiny_model(family, model_cache_root, **kwargs)

    return make


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "tiny_model(family='llama', **kwargs): the module's tiny checkpoint "
                            "for the `adapter` and `model_dir` fixtures (tests/conftest.py); module level only")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for node in item.listchain():
            if isinstance(node, pytest.Function | pytest.Class) and any(m.name == "tiny_model" for m in node.own_markers):
                raise pytest.UsageError(f"{item.nodeid}: the tiny_model marker marks a module (pytestmark), "
                                        "not a test or class: the fixtures reading it are module-scoped")


def _tiny_model_spec(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """(family, kwargs) from the module's `tiny_model` marker; ("llama", {}) without one."""
    marker = request.node.get_closest_marker("tiny_model")
    if marker is None:
        return "llama", {}
    return (marker.args[0] if marker.args else "llama"), dict(marker.kwargs)


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir: Callable[..., Path]) -> Callable[..., HFAdapter]:
    """`make(family="llama", **kwargs) -> HFAdapter` over `tiny_model_dir(family, **kwargs)`, one per
    distinct arguments in the module (fresh in each module)."""
    from cachefuse.adapters.hf import HFAdapter

    made: dict[str, HFAdapter] = {}

    def make(family: str = "llama", **kwargs: Any) -> HFAdapter:
        key = json.dumps([family, kwargs], sort_keys=True)
        if key not in made:
            made[key] = HFAdapter.from_pretrained(str(tiny_model_dir(family, **kwargs)))
        return made[key]

    return make


@pytest.fixture(scope="module")
def adapter(request: pytest.FixtureRequest, tiny_adapter: Callable[..., HFAdapter]) -> HFAdapter:
    """The module's HFAdapter: the `tiny_model` marker's checkpoint (default llama), or the family of an
    indirect param."""
    family, kwargs = _tiny_model_spec(request)
    return tiny_adapter(getattr(request, "param", family), **kwargs)


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest, tiny_model_dir: Callable[..., Path]) -> Path:
    """The module's tiny checkpoint directory (the `tiny_model` marker's, default llama)."""
    family, kwargs = _tiny_model_spec(request)
    return tiny_model_dir(family, **kwargs)
