"""The layout's import rules (docs/architecture.md, "What may import what"), read from the source files.

Each rule runs on the real tree and, as its negative control, on a small tree written here that breaks
it: a rule that cannot fail would prove nothing. Imports inside functions count; imports under
`if TYPE_CHECKING:` never run and count only where a rule says so (the cycle rule counts them: a reader
still goes round).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.helpers.import_graph import (
    cycles,
    forbidden_edges,
    heavy_on_import,
    import_graph,
    imports_of_outside,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "vllm", "triton")
SCHEDULER_MODULES = ("cachefuse.request", "cachefuse.chunks", "cachefuse.rag_prompt", "cachefuse.config",
                     "cachefuse.metadata", "cachefuse.metadata.base", "cachefuse.metadata.scores",
                     "cachefuse.metadata.sqlite", "cachefuse.metadata.index", "cachefuse.metadata.refresher",
                     "cachefuse.metadata.redis", "cachefuse.loading.controller", "cachefuse.loading.figures",
                     "cachefuse.redis_client", "cachefuse.vllm.scheduler_side.gate",
                     "cachefuse.vllm.scheduler_side.outcomes")
"""What the scheduler plans with inside `schedule()`: none of it may load torch (docs/architecture.md, "What may import what")."""


@pytest.fixture(scope="module")
def graph():
    return import_graph(REPO_ROOT)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A package tree under `root` from {relative path: source}; every folder gets an __init__.py."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    for folder in {p.parent for p in root.rglob("*.py")}:
        (folder / "__init__.py").touch(exist_ok=True)
    return root


def test_the_graph_sees_every_kind_of_import(tmp_path):
    root = write_tree(tmp_path, {
        "cachefuse/a.py": """
            from typing import TYPE_CHECKING
            import cachefuse.b
            from cachefuse.pkg import sub
            from cachefuse.pkg import helper
            from . import b
            if TYPE_CHECKING:
                from cachefuse import c
            def later():
                import vllm.config
            """,
        "cachefuse/b.py": "",
        "cachefuse/c.py": "",
        "cachefuse/pkg/__init__.py": "def helper(): ...\n",
        "cachefuse/pkg/sub.py": "",
    })
    edges = {(e.target, e.lazy, e.type_only) for e in import_graph(root)["cachefuse.a"]}
    assert edges == {("typing", False, False), ("cachefuse.b", False, False), ("cachefuse.pkg.sub", False, False),
                     ("cachefuse.pkg", False, False), ("cachefuse.c", False, True), ("vllm.config", True, False)}


def test_the_real_graph_is_read(graph):
    assert len(graph) > 60
    targets = {e.target for e in graph["cachefuse.vllm.connector"]}
    assert "cachefuse.vllm.scheduler_side.hooks" in targets  # imported inside __init__: lazy edges count
    assert "cachefuse.vllm.worker_side" in targets


# --------------------------------------------------------------------------- no cycles


def test_no_import_cycles(graph):
    assert cycles(graph) == []


def test_a_cycle_through_a_lazy_import_is_found(tmp_path):
    root = write_tree(tmp_path, {
        "cachefuse/cli.py": "from cachefuse.command import add\n",
        "cachefuse/command.py": "def add():\n    from cachefuse.cli import helper\n",  # closed inside a function
        "cachefuse/leaf.py": "import cachefuse.cli\n",
    })
    assert cycles(import_graph(root)) == [["cachefuse.cli", "cachefuse.command"]]


def test_a_cycle_through_a_type_only_import_is_found(tmp_path):
    root = write_tree(tmp_path, {
        "cachefuse/fusor.py": "from cachefuse.loader import Loaded\n",
        "cachefuse/loader.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cachefuse.fusor import R\n",
    })
    assert cycles(import_graph(root)) == [["cachefuse.fusor", "cachefuse.loader"]]


def test_a_package_init_that_imports_its_own_modules_is_a_cycle(tmp_path):
    root = write_tree(tmp_path, {
        "cachefuse/metadata/__init__.py": "from cachefuse.metadata.base import MetaStore\n",
        "cachefuse/metadata/base.py": "from cachefuse.metadata import scores\n",  # runs metadata/__init__ first
        "cachefuse/metadata/scores.py": "",
        "cachefuse/select/__init__.py": '"""A docstring only: no edges."""\n',
        "cachefuse/select/base.py": "from cachefuse.select import registry\n",
        "cachefuse/select/registry.py": "from cachefuse.select.base import Selector\n",
    })
    assert cycles(import_graph(root)) == [  # scores imports nothing, yet importing it runs metadata/__init__
        ["cachefuse.metadata", "cachefuse.metadata.base", "cachefuse.metadata.scores"],
        ["cachefuse.select.base", "cachefuse.select.registry"]]


def test_every_package_init_imports_nothing_of_its_own(graph):
    """The rule behind the cycle check's parent edges, said plainly: a package's `__init__` is its map."""
    found = [str(e) for m, edges in graph.items() if m in {s.rsplit(".", 1)[0] for s in graph if "." in s}
             for e in edges if e.target.startswith(m + ".")]
    assert found == []


# --------------------------------------------------------------------------- vllm only under cachefuse/vllm/


def test_vllm_is_imported_only_under_cachefuse_vllm(graph):
    assert imports_of_outside(graph, "vllm", allowed="cachefuse.vllm") == []


def test_a_vllm_import_outside_is_found(tmp_path):
    root = write_tree(tmp_path, {
        "cachefuse/vllm/connector.py": "import vllm\n",
        "cachefuse/offline/precompute.py": "def run():\n    from vllm import SamplingParams\n",
        "cachefuse/vllm_helpers.py": "import cachefuse.vllm.connector\n",  # a name that only looks like it
    })
    found = imports_of_outside(import_graph(root), "vllm", allowed="cachefuse.vllm")
    assert found == ["cachefuse.offline.precompute:2 imports vllm (in a function)"]


# --------------------------------------------------------------------------- forbidden edges

FORBIDDEN = {
    # the K/V bytes know nothing of variants; both reach Redis through cachefuse.redis_client
    "store never imports metadata": ("cachefuse.store", "cachefuse.metadata"),
    # two processes: what both halves need lives below them (e.g. chunks.dtype_name)
    "worker_side never imports scheduler_side": ("cachefuse.vllm.worker_side", "cachefuse.vllm.scheduler_side"),
    # offline/ holds the jobs that fill the store (cli/, eval/ and benchmarks run them); what serving reads
    # of their output (layer profiles, anchors) lives in metadata/ and select/
    "the blend core never imports offline": ("cachefuse.fusion", "cachefuse.offline"),
    "the vllm package never imports offline": ("cachefuse.vllm", "cachefuse.offline"),
    "loading never imports offline": ("cachefuse.loading", "cachefuse.offline"),
    "select never imports offline": ("cachefuse.select", "cachefuse.offline"),
    "metadata never imports offline": ("cachefuse.metadata", "cachefuse.offline"),
}
BREAKING_TREES = {
    "the blend core never imports offline": {
        "cachefuse/fusion/saving.py": "from cachefuse.offline.anchors import choose_anchors\n",
        "cachefuse/offline/anchors.py": "def choose_anchors(): ...\n",
    },
    "the vllm package never imports offline": {
        "cachefuse/vllm/scheduler_side/gate.py": "def f():\n    from cachefuse.offline import layer_profile\n",
        "cachefuse/offline/layer_profile.py": "",
    },
    "loading never imports offline": {
        "cachefuse/loading/controller.py": "from typing import TYPE_CHECKING\nimport cachefuse.offline.precompute\n",
        "cachefuse/offline/precompute.py": "",
    },
    "select never imports offline": {
        "cachefuse/select/qcfuse.py": "from cachefuse.offline.anchors import RANKINGS\n",
        "cachefuse/offline/anchors.py": "RANKINGS = ()\n",
    },
    "metadata never imports offline": {
        "cachefuse/metadata/layer_profiles.py": "from cachefuse.offline.layer_profile import profile_layers\n",
        "cachefuse/offline/layer_profile.py": "def profile_layers(): ...\n",
    },
    "store never imports metadata": {
        "cachefuse/store/redis.py": "def client():\n    from cachefuse.metadata.redis import redis_client\n",
        "cachefuse/metadata/redis.py": "def redis_client(): ...\n",
    },
    "worker_side never imports scheduler_side": {
        "cachefuse/vllm/worker_side.py": "from cachefuse.vllm.scheduler_side.gate import dtype_bytes\n",
        "cachefuse/vllm/scheduler_side/gate.py": "def dtype_bytes(d): ...\n",
    },
}
FOUND_IN_BREAKING_TREES = {
    "the blend core never imports offline": ["cachefuse.fusion.saving:1 imports cachefuse.offline.anchors"],
    "the vllm package never imports offline": [
        "cachefuse.vllm.scheduler_side.gate:2 imports cachefuse.offline.layer_profile (in a function)"],
    "loading never imports offline": ["cachefuse.loading.controller:2 imports cachefuse.offline.precompute"],
    "select never imports offline": ["cachefuse.select.qcfuse:1 imports cachefuse.offline.anchors"],
    "metadata never imports offline": ["cachefuse.metadata.layer_profiles:1 imports cachefuse.offline.layer_profile"],
    "store never imports metadata": ["cachefuse.store.redis:2 imports cachefuse.metadata.redis (in a function)"],
    "worker_side never imports scheduler_side": [
        "cachefuse.vllm.worker_side:1 imports cachefuse.vllm.scheduler_side.gate"],
}


@pytest.mark.parametrize("rule", FORBIDDEN)
def test_forbidden_edges_are_absent(graph, rule):
    source, target = FORBIDDEN[rule]
    assert forbidden_edges(graph, source, target) == []


@pytest.mark.parametrize("rule", FORBIDDEN)
def test_a_forbidden_edge_is_found(tmp_path, rule):
    source, target = FORBIDDEN[rule]
    graph = import_graph(write_tree(tmp_path, BREAKING_TREES[rule]))
    assert forbidden_edges(graph, source, target) == FOUND_IN_BREAKING_TREES[rule]


# --------------------------------------------------------------------------- the package root and the scheduler load nothing heavy


def test_package_root_loads_no_torch_vllm_or_triton(graph):
    assert heavy_on_import(graph, "cachefuse", HEAVY) == []


@pytest.mark.parametrize("module", SCHEDULER_MODULES)
def test_scheduler_planning_modules_load_no_torch(graph, module):
    assert module in graph
    assert heavy_on_import(graph, module, HEAVY) == []


def test_a_heavy_import_reached_through_the_root_is_found(tmp_path):
    root = write_tree(tmp_path, {
        "cachefuse/__init__.py": "from cachefuse.config import Config\n",
        "cachefuse/config.py": "from cachefuse import rope\n",
        "cachefuse/rope.py": "import torch\n",
        "cachefuse/lazy.py": "def f():\n    import triton\n",
    })
    graph = import_graph(root)
    assert heavy_on_import(graph, "cachefuse", HEAVY) == ["cachefuse -> cachefuse.config -> cachefuse.rope -> torch"]
    assert heavy_on_import(graph, "cachefuse.lazy", HEAVY) == []  # a lazy import loads nothing on import


# --------------------------------------------------------------------------- only ops.py reaches the kernels


def test_only_ops_imports_csrc_triton(graph):
    found = [line for line in imports_of_outside(graph, "csrc_triton", allowed="cachefuse.ops")]
    assert found == []


def test_a_kernel_import_outside_ops_is_found(tmp_path):
    root = write_tree(tmp_path, {
        "cachefuse/ops.py": "def f():\n    from csrc_triton import rope\n",
        "cachefuse/fusor.py": "from csrc_triton.rope import apply_rope\n",
    })
    assert imports_of_outside(import_graph(root), "csrc_triton", allowed="cachefuse.ops") == [
        "cachefuse.fusor:1 imports csrc_triton.rope"]
