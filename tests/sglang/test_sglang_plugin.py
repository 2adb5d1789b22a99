"""The plugin's wiring into the real SGLang: entry point, CLI flags, dispatcher, start-up checks."""

import importlib.metadata
import inspect

import pytest

ENTRY_POINT = "qla_serving.integrations.sglang:register"


def test_entry_point_is_installed_and_loads():
    eps = [
        ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "qla_serving"
    ]
    assert len(eps) == 1, (
        "no 'qla_serving' entry point in group sglang.srt.plugins: pyproject.toml needs "
        f'[project.entry-points."sglang.srt.plugins"] qla_serving = "{ENTRY_POINT}"'
    )
    assert eps[0].value == ENTRY_POINT
    from qla_serving.integrations.sglang import register

    assert eps[0].load() is register


def test_sglang_loader_runs_the_plugin(sglang_plugins):
    from qla_serving.integrations.sglang import patch
    from sglang.srt.layers.attention.linear import gdn_backend
    from sglang.srt.plugins import load_plugins_by_group
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert "qla_serving" in load_plugins_by_group("sglang.srt.plugins")
    # SGLang applied our hooks: the patched functions wrap the originals.
    for target in (patch.DISPATCHER_INIT, patch.BACKEND_INIT, patch.BACKEND_METADATA):
        assert target in HookRegistry._patched, target
    assert hasattr(gdn_backend.GDNKernelDispatcher.__init__, "__wrapped__")
    assert hasattr(gdn_backend.GDNAttnBackend.init_forward_metadata, "__wrapped__")


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--linear-attn-backend", "flashqla"], "linear_attn_backend"),
        (["--linear-attn-prefill-backend", "flashqla"], "linear_attn_prefill_backend"),
        (["--linear-attn-decode-backend", "flashqla"], "linear_attn_decode_backend"),
    ],
)
def test_flags_accept_flashqla_and_reach_server_args(parse_args, flags, field):
    args = parse_args(*flags)
    assert getattr(args, field) == "flashqla"


def test_unknown_backend_name_is_still_rejected(sglang_plugins, tiny_model_dir):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", tiny_model_dir, "--linear-attn-backend", "flashqla_typo"])


@pytest.mark.parametrize(
    "flags, ours",
    [
        (["--linear-attn-backend", "flashqla"], {"decode", "extend", "verify"}),
        (["--linear-attn-prefill-backend", "flashqla"], {"extend"}),
        (["--linear-attn-decode-backend", "flashqla"], {"decode", "verify"}),
        (
            ["--linear-attn-backend", "flashqla", "--linear-attn-verify-backend", "triton"],
            {"decode", "extend"},
        ),
        ([], set()),
    ],
)
def test_dispatcher_returns_our_kernel_for_the_phases_asked(publish_args, build_dispatcher, flags, ours):
    from qla_serving.integrations.sglang.kernel import FlashQLAGDNKernel
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    backends, d = build_dispatcher(publish_args(*flags))
    if "extend" in ours:
        assert backends.prefill is LinearAttnKernelBackend.CUSTOM
    kernels = {"decode": d.decode_kernel, "extend": d.extend_kernel, "verify": d.verify_kernel}
    for phase, kernel in kernels.items():
        expected = FlashQLAGDNKernel if phase in ours else TritonGDNKernel
        assert type(kernel) is expected, (phase, type(kernel).__name__)
    # One object serves all our phases; trees always go to triton; packed decode only on triton.
    assert len({id(k) for p, k in kernels.items() if p in ours}) <= 1
    assert type(d.tree_verify_kernel) is TritonGDNKernel
    assert d.supports_packed_decode == (type(d.decode_kernel) is TritonGDNKernel)
    assert not d.verify_kernel_is_flashinfer
    # SGLang's dispatcher routes a call to the kernel it picked.
    ours_kernel = next((k for p, k in kernels.items() if p in ours), None)
    if ours_kernel is not None:
        assert ours_kernel.fallback is d.tree_verify_kernel


def test_another_plugins_custom_backend_is_left_alone(publish_args, build_dispatcher):
    """CUSTOM from a name that is not ours reaches SGLang's own error, untouched."""
    from sglang.srt.server_args import add_linear_attn_kernel_backend_choices

    try:
        from sglang.srt.arg_groups.choices import LINEAR_ATTN_KERNEL_BACKEND_CHOICES
    except ImportError:  # SGLang < 0.5.20
        from sglang.srt.server_args import LINEAR_ATTN_KERNEL_BACKEND_CHOICES
    if "someone_else" not in LINEAR_ATTN_KERNEL_BACKEND_CHOICES:
        add_linear_attn_kernel_backend_choices(["someone_else"])
    args = publish_args("--linear-attn-backend", "someone_else")
    with pytest.raises(ValueError, match="Unsupported GDN decode backend"):
        build_dispatcher(args)


def test_version_check_refuses_untested_sglang(monkeypatch):
    import sglang
    from qla_serving.integrations.sglang import patch

    assert patch.check_sglang() == sglang.__version__
    monkeypatch.setattr(sglang, "__version__", "0.6.1")
    monkeypatch.delenv(patch.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(patch.IncompatibleSGLang, match="0.5.17 to 0.5.23, found 0.6.1"):
        patch.check_sglang()
    monkeypatch.setenv(patch.ALLOW_UNTESTED_ENV, "1")
    assert patch.check_sglang() == "0.6.1"


def test_version_check_names_a_missing_seam(monkeypatch):
    from qla_serving.integrations.sglang import patch
    from sglang.srt.layers.attention.linear import gdn_backend

    def changed_init(self, prefill_backend, decode_backend):  # arguments swapped: a layout we do not know
        raise AssertionError("never called")

    monkeypatch.setattr(gdn_backend.GDNKernelDispatcher, "__init__", changed_init)
    with pytest.raises(patch.IncompatibleSGLang, match="GDNKernelDispatcher.__init__ takes"):
        patch.check_sglang()


@pytest.mark.parametrize("backend_flag, allowed", [("triton", True), ("flashqla", True), ("cutedsl", False)])
def test_flashqla_keeps_triton_mamba_cache_strategy(sglang_plugins, tiny_model_dir, backend_flag, allowed):
    """SGLang allows the extra_buffer radix-cache strategy (and overlap scheduling) for triton
    only; flashqla keeps the same state contract and must get the same answer."""
    from qla_serving.integrations.sglang import patch
    from sglang.srt.arg_groups import overrides
    from sglang.srt.server_args import prepare_server_args
    from transformers import AutoConfig

    assert hasattr(overrides.supports_mamba_cache_extra_buffer, "__wrapped__")
    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    args = prepare_server_args(
        [
            "--model-path",
            tiny_model_dir,
            "--device",
            "cpu",
            "--disable-radix-cache",
            "--linear-attn-backend",
            backend_flag,
        ]
    )
    # SGLang <= 0.5.20 passes the architecture name, later versions the HF config.
    second = list(inspect.signature(overrides.supports_mamba_cache_extra_buffer.__wrapped__).parameters)[1]
    model = hf_config.architectures[0] if second == "model_arch" else hf_config
    # Other backends keep SGLang's own answer.
    assert overrides.supports_mamba_cache_extra_buffer(args, model) is allowed
    view = patch._ViewAsTriton(args)
    assert view.linear_attn_backend == "triton" and view.model_path == tiny_model_dir


def test_register_is_idempotent(sglang_plugins):
    """SGLang calls load_plugins() in several places of one process; hooks must not stack."""
    from qla_serving.integrations.sglang import patch, register
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {t: len(HookRegistry._hooks[t]) for t in (patch.DISPATCHER_INIT, patch.BACKEND_INIT)}
    register()
    register()
    assert {t: len(HookRegistry._hooks[t]) for t in before} == before
    try:
        from sglang.srt.arg_groups.choices import LINEAR_ATTN_KERNEL_BACKEND_CHOICES as choices
    except ImportError:  # SGLang < 0.5.20
        from sglang.srt.server_args import LINEAR_ATTN_KERNEL_BACKEND_CHOICES as choices
    assert choices.count("flashqla") == 1
