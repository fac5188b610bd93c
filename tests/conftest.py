"""Shared fixtures. Tests run offline: every model and tokenizer is built locally."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from cachefuse.testing.tiny_models import cached_tiny_model  # noqa: E402

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
