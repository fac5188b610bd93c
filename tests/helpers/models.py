"""Model families for test parametrisation: `@pytest.mark.parametrize("family", ALL_FAMILIES)`.

Checkpoints come from the `tiny_model_dir` fixture (tests/conftest.py).
"""

from cachefuse.testing.tiny_models import FAMILIES

ALL_FAMILIES: tuple[str, ...] = FAMILIES
