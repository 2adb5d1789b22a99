import os

import pytest
import torch


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs an SM90 GPU, found compute capability {major}.{minor}"
    try:
        import tilelang  # noqa: F401
    except Exception as e:  # an import error here must skip, not fail collection
        return f"TileLang not importable: {e}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs each run, but reproducible from the printed seed on failure."""
    seed = int(os.environ.get("QLA_TEST_SEED", torch.seed() % 2**31))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield
