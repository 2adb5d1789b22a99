"""Tests of the vLLM plugin against the real installed vLLM (run in vLLM's own venv).

The main test run has no vLLM: this directory is skipped there. ``QLA_REQUIRE_VLLM=1`` (set by
scripts/ci_vllm.sh) turns a failing vLLM import into an error instead, so CI cannot pass by
skipping everything.

On a machine without a GPU the CUDA build of vLLM detects no platform; the tests select
vLLM's real CPU platform through vLLM's platform-plugin entry point group.
"""

from __future__ import annotations

import os
import socket

import pytest

_REQUIRE = os.environ.get("QLA_REQUIRE_VLLM", "0") == "1"

import torch  # noqa: E402


def _register_cpu_platform() -> None:
    """Make vLLM resolve its real CPU platform on a machine without a GPU.

    The CUDA build of vLLM finds no platform here ("unspecified", which cannot even build a
    config). The GPU harness's ``select_cpu_platform`` writes a ``vllm.platform_plugins``
    entry point into a private metadata directory on ``sys.path`` before vLLM is first
    imported (vLLM's own seam for choosing a platform). Nothing is installed.
    """
    import importlib.util
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[2] / "e2e_bench" / "vllm_offline.py"
    spec = importlib.util.spec_from_file_location("qla_e2e_vllm_offline_platform", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # standard library imports only; vLLM is not imported
    module.select_cpu_platform()


def _vllm_installed() -> bool:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # not this directory as a namespace package


if _vllm_installed() and not torch.cuda.is_available():
    _register_cpu_platform()

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


from qla_vllm_helpers import QWEN35_TEXT, engine_config  # noqa: E402


@pytest.fixture(scope="session")
def qwen35_model_dir(tmp_path_factory):
    """A directory holding only the config.json of a tiny Qwen3.5 model (no weights needed:
    vLLM's config and layer construction read the config)."""
    from transformers import Qwen3_5Config

    path = tmp_path_factory.mktemp("qwen35")
    cfg = Qwen3_5Config(
        text_config=QWEN35_TEXT,
        vision_config=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=256),
    )
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def registered():
    """The plugin registered in this process, as vLLM's plugin loader would do it."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from qla_serving.integrations.vllm.layer import QlaGatedDeltaNetAttention
    from vllm.model_executor.custom_op import op_registry_oot

    if op_registry_oot.get("QwenGatedDeltaNetAttention") is not QlaGatedDeltaNetAttention:
        # vLLM's loader found no entry point (package metadata without it): register directly
        # so the remaining tests still exercise the plugin; test_entry_point reports the gap.
        from qla_serving.integrations.vllm import register

        register()
    return True


@pytest.fixture(scope="session")
def flashqla_config(registered, qwen35_model_dir):
    return engine_config(qwen35_model_dir, gdn_prefill_backend="flashqla")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def distributed(flashqla_config):
    """vLLM's tensor-parallel groups for one CPU process (gloo), as its own CPU tests set up."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(flashqla_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ensure_model_parallel_initialized(1, 1)
    return True
