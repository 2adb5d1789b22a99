"""The SGLang offline harness's model (``e2e_bench/sglang_offline.py``) as SGLang's own code reads it.

Both checks stand for failures that first showed on the GPU machine: SGLang's
``Qwen3NextConfig`` lays the layers out from ``full_attention_interval`` (missing: an
AttributeError at model build), and ``Qwen3_5TextConfig`` reads ``rope_theta`` from
``rope_parameters`` (empty: a KeyError at model build).
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "e2e_bench"))

import sglang_offline


def _model_config(tmp_path):
    from sglang.srt.configs import hybrid_arch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    config = sglang_offline.text_model_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    kw = sglang_offline.engine_kwargs(
        str(tmp_path), "triton", prefix_caching=True, cuda_graph=False, seed=0,
        context_length=4096, mem_fraction=0.5, device="cpu",
    )
    model_config = ModelConfig.from_server_args(ServerArgs(**kw))
    return config, hybrid_arch.hybrid_gdn_config(model_config)


def test_sglang_places_the_gdn_layers_where_the_config_says(tmp_path):
    config, text = _model_config(tmp_path)
    assert text is not None, "SGLang does not see a hybrid GDN model"
    built = [i for i, t in enumerate(text.layers_block_type) if t == "linear_attention"]
    assert built == sglang_offline.gdn_layer_ids(config)
    assert len(built) == 6 and len(text.layers_block_type) == 8


def test_sglang_reads_plain_rope_from_the_config(tmp_path):
    from sglang.srt.utils.hf_transformers.common import get_rope_config

    _, text = _model_config(tmp_path)
    theta, params = get_rope_config(text)
    assert theta == 10000000.0
    assert "mrope_section" not in (params or {})  # a text-only model gets no M-RoPE positions


def test_dry_run_accepts_every_backend(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "e2e_bench" / "sglang_offline.py"), "--dry-run", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for backend in sglang_offline.BACKENDS:
        assert f"dry-run {backend}: Qwen3_5ForCausalLM" in run.stdout
