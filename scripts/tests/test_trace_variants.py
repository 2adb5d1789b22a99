"""scripts/trace/variants.py against the real kernel source: every stamp finds its anchor.

The stamped kernels only exist on the GPU machine, so a kernel edit that moves or renames an
anchor would otherwise surface there as a silently missing stamp. These tests read the source
and the transformed source as text (and parse them); no TileLang or GPU needed.
"""

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("trace_variants", ROOT / "scripts" / "trace" / "variants.py")
variants = importlib.util.module_from_spec(spec)
sys.modules["trace_variants"] = variants
spec.loader.exec_module(variants)


def _slots(src, pattern):
    return sorted(int(s) for s in re.findall(pattern, src))


def _stamps_in_macros(src):
    """Stamp calls inside the kernels' own T.macro bodies: there the stamp's arguments (trace,
    the block and chunk indices) are not defined, which only the GPU machine would report."""
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name != "stamp" and any(
                ast.unparse(d) == "T.macro" for d in node.decorator_list):
            found += [node.name for call in ast.walk(node)
                      if isinstance(call, ast.Call) and ast.unparse(call.func) == "stamp"]
    return found


def test_every_stamp_lands_in_the_current_kernels(capsys):
    src = variants.traced_source()
    assert "skipped" not in capsys.readouterr().err
    ast.parse(src)
    assert _stamps_in_macros(src) == []
    fwd = _slots(src, r"stamp\(trace, wi, hv, c, (\d+)\)")
    prep = _slots(src, r"stamp\(trace, ic, hv, (\d+)\)")
    assert fwd == sorted(slot for _, slot, _, _ in variants.FWD_STAMPS)
    assert sorted(variants.FWD_NAMES) == sorted(set(fwd))
    assert prep == list(range(len(variants.PREP_NAMES)))
    # both kernels take the trace buffer, and the launcher passes one to each
    assert src.count('trace: T.Tensor((NTR,), "int64")') == 2
    assert "TRACE['prep'])" in src and "TRACE['fwd'])" in src


def test_a_missing_anchor_is_named():
    with pytest.raises(variants.AnchorError, match="no such statement"):
        variants._insert("a = 1\nb = 2\n", "no such statement", "stamp()")


def test_a_stamp_after_a_multiline_statement_goes_after_its_last_line():
    body = "    x = f(1,\n          2)\n    y = 3\n"
    out = variants._insert(body, "x = f(1,", "stamp()")
    assert out == "    x = f(1,\n          2)\n    stamp()\n    y = 3\n"


def test_the_baseline_is_the_revision_s_source_with_absolute_imports(tmp_path):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, check=False).returncode:
        pytest.skip("not a git checkout")
    src = variants.baseline_source("HEAD", "248,112,128,24")
    assert "from .." not in src and "from .configs" not in src
    assert "fwd_role_nregs=(248,112,128,24)" in src
    ast.parse(src)
    saved = tmp_path / "base.py"
    saved.write_text(subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:kernels/chunk_prefill_program.py",
                                     "HEAD:kernels/chunk_prefill.py"], capture_output=True, text=True, check=True).stdout)
    assert variants.baseline_source(str(saved)) == variants.baseline_source("HEAD")


def test_the_state_timeline_stamps_each_state_warpgroup_apart(capsys):
    spec = importlib.util.spec_from_file_location("trace_state_timeline", ROOT / "scripts" / "trace" / "state_timeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    saved = list(variants.FWD_STAMPS)
    src = mod.source()
    assert "skipped" not in capsys.readouterr().err
    assert variants.FWD_STAMPS == saved  # the shared table is left as it was
    ast.parse(src)
    assert _stamps_in_macros(src) == []
    slots = _slots(src, r"stamp\(trace, wi, hv, c, (\d+) \+ 16 \* \(tx // WG\)\)")
    assert slots == sorted(slot for _, slot, _, _ in mod.STAMPS)
    assert max(slots) < 16 and set(slots) <= set(mod.NAMES)
    # no stamp without a warpgroup offset is left in the state role's slots
    assert not re.search(r"stamp\(trace, wi, hv, c, \d+\)", src)
