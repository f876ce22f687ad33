"""The import graph of python/ and kernels/ (scripts/import_graph.py, read with ast): no cycle, no
import up the layer order, nothing but the launcher imports the plugin, and the modules whose
docstrings say "no sglang import" have none."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"
_spec = importlib.util.spec_from_file_location("import_graph", _SCRIPT)
import_graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = import_graph  # dataclasses look their module up
_spec.loader.exec_module(import_graph)

MODULES, EDGES = import_graph.graph()

SGLANG_FREE = (
    "sglang_minima.config",
    "sglang_minima.codec",
    "sglang_minima.ops",
    "sglang_minima.layers.attention.plan",
    "sglang_minima.mem_cache.page_table",
    "sglang_minima.mem_cache.physical_pool",
    "sglang_minima.mem_cache.stats",
    "sglang_minima.mem_cache.tier_store",
    "sglang_minima.mem_cache.controller",
    "minima_kernels",
)


def test_every_module_has_a_layer():
    assert [name for name in MODULES if import_graph.layer_of(name) is None] == []


def test_no_import_cycle():
    assert import_graph.cycles(MODULES, EDGES) == []


def test_no_upward_import():
    assert [f"{e.source}:{e.line} -> {e.target}" for e in import_graph.upward(EDGES)] == []


def test_only_the_launcher_imports_the_plugin():
    assert {e.source for e in EDGES if e.target == "sglang_minima.plugin"} <= {"sglang_minima.launch_server"}


@pytest.mark.parametrize("prefix", SGLANG_FREE)
def test_no_sglang_import(prefix: str):
    files = [path for name, path in MODULES.items() if name == prefix or name.startswith(prefix + ".")]
    assert files
    assert [str(p) for p in files if "sglang" in import_graph.external_imports(p)] == []


def test_the_graph_sees_function_local_imports():
    # launch_server imports the plugin inside build_server_args (after SGLang's CPU setup)
    local = [e for e in EDGES if e.source == "sglang_minima.launch_server" and e.target == "sglang_minima.plugin"]
    assert local and all(e.local for e in local)
