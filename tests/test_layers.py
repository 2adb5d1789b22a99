"""The layers import one way (docs/design.md, Layers): no import cycle among qla_serving, its
kernels and its engine adapters, the kernels import nothing above themselves but the constants,
and the constants module imports nothing of the package. The graph comes from
scripts/import_graph.py, which reads every import statement, deferred ones included."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool, tool.edges(tool.modules())


def test_no_import_cycle():
    tool, graph = _graph()
    assert "qla_serving.kernels.chunk_prefill" in graph and "qla_serving.integrations.vllm.layer" in graph
    assert tool.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert tool.cycles(graph) == []


def test_kernels_import_only_kernels_and_constants():
    _, graph = _graph()
    allowed = ("qla_serving.kernels", "qla_serving.constants")
    for module, targets in graph.items():
        if module.startswith("qla_serving.kernels"):
            assert all(t.startswith(allowed) for t in targets), (module, sorted(targets))


def test_constants_is_a_leaf():
    _, graph = _graph()
    assert graph["qla_serving.constants"] == set()


def test_planner_imports_only_constants():
    _, graph = _graph()
    assert graph["qla_serving.plan"] == {"qla_serving.constants"}
