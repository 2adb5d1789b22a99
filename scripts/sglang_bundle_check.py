"""CPU-side check of the SGLang bundle (run by ``scripts/sglang_bundle.sh --check``).

    sglang_bundle_check.py image OUT_DIR PACKAGE_LIST SITE...   # emulate the GPU image
    python3.11 -S sglang_bundle_check.py import SITE...          # import what the GPU run needs
    python3 sglang_bundle_check.py gpu                           # the same imports on the GPU machine

``image`` links into OUT_DIR the top-level entries of every distribution that PACKAGE_LIST (the
image's package names, as KINDS.md lists them) names, taking each from the first SITE that has
it, so an import that works here does not lean on a package the GPU machine lacks.

``import`` puts the SITEs on ``sys.path`` in the given order (first wins, as the stacked bundles
do on the GPU machine), pretends an SM90 GPU so the import-time ``if _is_cuda:`` branches of
SGLang and sgl_kernel run, and imports :data:`MODULES`. Exit status 1 names each failure.

``gpu`` imports :data:`MODULES` as they are (bundles loaded, real GPU) and says which sgl_kernel
library loaded.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
import traceback
import types

# What tests/sglang/test_sglang_gpu.py and the adapter import from SGLang, and what SGLang's own
# plugin loader and argument parser (conftest.py's fixtures) import.
MODULES = [
    "sgl_kernel",
    "xgrammar",  # SGLang imports it inside try/except in places: a broken build would hide there
    "flashinfer",
    "sglang.srt.layers.attention.linear.kernels.gdn_triton",
    "sglang.srt.layers.attention.linear.gdn_backend",
    "sglang.srt.layers.attention.linear.utils",
    "sglang.srt.layers.attention.linear.kernels.kernel_backend",
    "sglang.srt.server_args",
    "sglang.srt.runtime_context",
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
    "qla_serving.integrations.sglang.kernel",
    "qla_serving.integrations.sglang.patch",
    # what an offline sglang.Engine of a Qwen3.5-shaped model imports (e2e_bench/sglang_offline.py)
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.qwen3_5_text",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.hybrid_linear_attn_backend",
    "sglang.srt.layers.attention.linear.kernels.gdn_flashinfer",
]
VERSIONS = [
    "torch",
    "triton",
    "tilelang",
    "sglang",
    "sglang-kernel",
    "transformers",
    "tokenizers",
    "apache-tvm-ffi",
    "flashinfer-python",
]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def build_image(out_dir: str, package_list: str, sites: list[str]) -> None:
    with open(package_list) as f:
        text = f.read()
    names, _, pinned = text.partition("\n")
    wanted = {_norm(n) for n in re.findall(r"[A-Za-z0-9_.-]+", names)}
    # versions seen on the machine ("name version, ..."): a site holding that version wins
    seen = {_norm(n): v for n, v in re.findall(r"([A-Za-z0-9_.-]+) ([0-9][^,\s]*)", pinned)}
    dists = [(d, s) for s in sites for d in importlib.metadata.distributions(path=[s])]
    dists.sort(key=lambda ds: seen.get(_norm(ds[0].metadata["Name"])) != ds[0].version)  # stable
    found: set[str] = set()
    for dist, site_dir in dists:
        name = _norm(dist.metadata["Name"])
        if name not in wanted or name in found:
            continue
        found.add(name)
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}
        for top in tops:
            src, dst = os.path.join(site_dir, top), os.path.join(out_dir, top)
            if os.path.exists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
    print(f"image emulation: {len(found)} of {len(wanted)} listed packages found locally")


def _pretend_sm90() -> None:
    """Make torch report one H100, for import-time branches only (nothing runs on it)."""
    import torch

    props = types.SimpleNamespace(
        major=9,
        minor=0,
        name="NVIDIA H100 80GB HBM3",
        total_memory=80 << 30,
        multi_processor_count=132,
        L2_cache_size=50 << 20,
        gcnArchName="",
        warp_size=32,
        shared_memory_per_block_optin=232448,
        uuid="0",
    )
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.get_device_properties = lambda *a, **k: props


def check_imports(sites: list[str] | None) -> int:
    """Import :data:`MODULES`; ``sites`` None: as the interpreter is set up (the GPU machine)."""
    import site

    if sites is not None:
        sys.path[:] = [p for p in sys.path if "site-packages" not in p and "dist-packages" not in p]
        for site_dir in reversed(sites):  # addsitedir appends; insert so the first SITE wins
            before = list(sys.path)
            site.addsitedir(site_dir)
            added = [p for p in sys.path if p not in before]
            sys.path[:] = added + before
        _pretend_sm90()
    failures = 0
    for module in MODULES:
        try:
            importlib.import_module(module)
            print(f"ok    {module}")
        except BaseException as e:  # noqa: BLE001 -- report every failure, keep going
            failures += 1
            print(f"FAIL  {module}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=-4)
    for dist in VERSIONS:
        try:
            print(f"      {dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"      {dist} (not found)")
    ops = getattr(sys.modules.get("sgl_kernel"), "common_ops", None)
    print(f"      sgl_kernel library: {getattr(ops, '__file__', None)}")
    if sites is None:
        import torch

        print(f"      GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
    print(f"{len(MODULES) - failures} of {len(MODULES)} modules import")
    return 1 if failures else 0


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "image":
        build_image(args[0], args[1], args[2:])
    elif mode == "import":
        sys.exit(check_imports(args))
    elif mode == "gpu":
        sys.exit(check_imports(None))
    else:
        sys.exit(f"unknown mode {mode!r}: image | import")
