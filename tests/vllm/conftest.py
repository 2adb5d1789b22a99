"""Tests of the vLLM plugin against the real installed vLLM (run in vLLM's own venv).

The main test run has no vLLM: this directory is skipped there. ``QLA_REQUIRE_VLLM=1`` (set by
scripts/ci_vllm.sh) turns a failing vLLM import into an error instead, so CI cannot pass by
skipping everything.

On a machine without a GPU the CUDA build of vLLM detects no platform; the tests select
vLLM's real CPU platform through vLLM's platform-plugin entry point group.
"""

from __future__ import annotations

import os

import pytest

_REQUIRE = os.environ.get("QLA_REQUIRE_VLLM", "0") == "1"

import torch  # noqa: E402


def _vllm_installed() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # not this directory as a namespace package


if _vllm_installed() and not torch.cuda.is_available():
    # the CUDA build of vLLM finds no platform without a GPU: select its real CPU platform
    from qla_vllm_helpers import register_cpu_platform

    register_cpu_platform()

_vllm_error: Exception | None = None
try:
    if not _vllm_installed():
        raise ModuleNotFoundError("vllm is not installed in this environment")
    import vllm.platforms as _platforms

    _platforms.current_platform  # noqa: B018 - resolve it now, through the plugin above
except Exception as _e:  # any import failure: a missing or a broken vLLM
    _vllm_error = _e
    if _REQUIRE:
        raise RuntimeError(f"QLA_REQUIRE_VLLM=1 but vllm does not import: {_e!r}") from _e


def pytest_collection_modifyitems(config, items):
    """Without vLLM every test here is skipped (visibly), not failed."""
    if _vllm_error is None:
        return
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason=f"vllm is not importable: {_vllm_error}")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


from qla_vllm_helpers import (  # noqa: E402
    engine_config,
    init_cpu_distributed,
    register_plugin,
    write_qwen35_model_dir,
)


@pytest.fixture(scope="session")
def qwen35_model_dir(tmp_path_factory):
    """A directory holding only the config.json of a tiny Qwen3.5 model (no weights needed:
    vLLM's config and layer construction read the config)."""
    return write_qwen35_model_dir(tmp_path_factory.mktemp("qwen35"))


@pytest.fixture(scope="session")
def registered():
    """The plugin registered in this process, as vLLM's plugin loader would do it."""
    register_plugin()
    return True


@pytest.fixture(scope="session")
def flashqla_config(registered, qwen35_model_dir):
    return engine_config(qwen35_model_dir, gdn_prefill_backend="flashqla")


@pytest.fixture(scope="session")
def distributed(flashqla_config):
    """vLLM's tensor-parallel groups for one CPU process (gloo), as its own CPU tests set up."""
    init_cpu_distributed(flashqla_config)
    return True
