"""Import boundaries at run time: cachefuse imports without vllm or triton, touching no device.

The same rules read from the source files, imports inside functions included: tests/test_import_graph.py.
"""

import subprocess
import sys

BLOCKED_IMPORT = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "triton"):
            raise ImportError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, Blocker())
import cachefuse, cachefuse.config, cachefuse.rope, cachefuse.chunks, cachefuse.rag_prompt, cachefuse.ops
import cachefuse.fusion.fusor, cachefuse.fusion.engine, cachefuse.select, cachefuse.store.tiered, cachefuse.adapters.hf
import cachefuse.cli.main, cachefuse.metadata.index, cachefuse.metadata.sqlite, cachefuse.loading.placement
import cachefuse.offline.precompute, cachefuse.eval.harness, cachefuse.eval.vllm_backend, cachefuse.store_report
import torch
from cachefuse.select.registry import make_selector
from cachefuse.config import CacheFuseConfig
for name in ("full_prefill", "full_reuse", "cacheblend", "epic", "random"):
    make_selector(name, CacheFuseConfig())
assert not any(m.split(".")[0] in ("vllm", "triton") for m in sys.modules)
print("ok")
"""


def test_cachefuse_imports_without_vllm_or_triton():
    out = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_package_root_imports_nothing_heavy():
    code = "import sys, cachefuse; print(sorted(m for m in ('torch', 'vllm', 'triton', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
