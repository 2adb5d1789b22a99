"""``qla-serving bench summary``: targets and split bounds read off prefill result files."""

import json
import math
import random

import pytest

from qla_serving import cli
from qla_serving.bench import prefill, summary


def _write(path, gpu, rows, copy_gbs=3000.0, command="qla-serving bench prefill"):
    meta = dict(gpu=gpu, versions={}, command=command, copy_gbs=copy_gbs, bf16_tflops=800.0)
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))
    return path


def _rows(hqk, hv, times):
    """times: {(batch, impl): ms} -> graph rows."""
    return [dict(op="prefill", hqk=hqk, hv=hv, batch=b, impl=i, mode="graph", ms=ms) for (b, i), ms in times.items()]


def test_split_bytes_counts_each_intermediate():
    lens = [100, 64]  # 2 + 1 chunks
    T, chunks, hqk, hv = 164, 3, 2, 6
    # ours: q and k read again by prep; T diag(beta) bf16 64x64, g's cumsum fp32 64, 1/|q| and
    # 1/|k| fp32 2x64, each written once and read once
    ours = T * hqk * 128 * 2 * 2 + 2 * chunks * (hv * 64 * 64 * 2 + hv * 64 * 4 + hqk * 2 * 64 * 4)
    assert prefill.split_bytes(lens, hqk, hv) == ours
    # least: k and bf16 beta read again, T's lower triangle (2080 of 4096 entries) in bf16 both ways
    least = T * hqk * 128 * 2 + T * hv * 2 + 2 * chunks * hv * 2080 * 2
    assert prefill.split_bytes(lens, hqk, hv, least=True) == least
    assert prefill.min_bytes(lens, hqk, hv) == T * (2 * hqk * 256 + hv * 512 + hv * 6) + 2 * hv * 128 * 128 * 8


def test_summary_targets_and_cells_below_flashinfer(tmp_path):
    rng = random.Random(0)
    cells = [(2, 8, b) for b in ("1x32768", "8x1024", "1x2048")] + [(16, 16, b) for b in ("8x4096", "1x2048")]
    times = {}
    for hqk, hv, b in cells:
        times[(hqk, hv, b)] = {i: rng.uniform(0.05, 1.0) for i in ("qla", "fla", "flashinfer")}
    times[(16, 16, "8x4096")].update(qla=0.35, flashinfer=0.2)  # a >= 8192-token cell below FlashInfer
    times[(2, 8, "1x32768")].update(qla=0.1, flashinfer=0.3)
    f1 = _write(tmp_path / "a.json", "H", _rows(2, 8, {(b, i): t for (h, hv, b), ti in times.items() if h == 2
                                                        for i, t in ti.items()}), copy_gbs=3000.0)
    f2 = _write(tmp_path / "b.json", "H", _rows(16, 16, {(b, i): t for (h, hv, b), ti in times.items() if h == 16
                                                          for i, t in ti.items()}), copy_gbs=3100.0)
    s = summary.summarize(*summary.load_runs([f1, f2]))
    fla = [t["fla"] / t["qla"] for t in times.values()]
    assert s["fla_geomean"] == pytest.approx(math.exp(sum(map(math.log, fla)) / len(fla)))
    assert s["fla_min"] == pytest.approx(min(fla))
    big = [t["flashinfer"] / t["qla"] for (h, hv, b), t in times.items() if b in ("1x32768", "8x1024", "8x4096")]
    assert s["fi_big_cells"] == 3  # 1x2048 cells are below 8192 tokens
    assert s["fi_big_geomean"] == pytest.approx(math.exp(sum(map(math.log, big)) / 3))
    below = {(b["hqk"], b["hv"], b["batch"]) for b in s["below"]}
    want = {c for c, t in times.items() if c[2] != "1x2048" and t["flashinfer"] < t["qla"]}
    assert below == want and (16, 16, "8x4096") in below
    row = next(b for b in s["below"] if b["batch"] == "8x4096")
    lens = [4096] * 8
    to_ms = 1e3 / (3050.0 * 1e9)  # the runs' mean copy bandwidth
    assert row["floor"] == pytest.approx(prefill.min_bytes(lens, 16, 16) * to_ms)
    assert row["split"] == pytest.approx((prefill.min_bytes(lens, 16, 16) + prefill.split_bytes(lens, 16, 16)) * to_ms)
    assert row["floor"] < row["least"] < row["split"]
    assert row["least_extra_mb"] == pytest.approx(prefill.split_bytes(lens, 16, 16, least=True) / 1e6)
    # slack: the bytes beyond the floor's that FlashInfer's 0.2 ms leave at the copy bandwidth
    assert row["slack_mb"] == pytest.approx((0.2e-3 * 3050e9 - prefill.min_bytes(lens, 16, 16)) / 1e6)
    text = summary.render(s)
    assert "| 16/16 | 8x4096 | 0.350 | 0.200 | 0.57x |" in text


def test_summary_lists_missing_times_instead_of_guessing(tmp_path):
    rows = _rows(2, 8, {("8x4096", "qla"): 0.1, ("8x4096", "fla"): 0.5})  # FlashInfer failed in this run
    s = summary.summarize(*summary.load_runs([_write(tmp_path / "a.json", "H", rows)]))
    assert s["missing"] == [(2, 8, "8x4096", "flashinfer")] and s["fi_big_cells"] == 0
    assert "2/8 8x4096 flashinfer" in summary.render(s)


@pytest.mark.parametrize("problem", ["twice", "gpus", "op"])
def test_summary_refuses_inputs_it_cannot_read_one_way(tmp_path, problem):
    rows = _rows(2, 8, {("8x4096", "qla"): 0.1})
    f1 = _write(tmp_path / "a.json", "H100", rows)
    if problem == "op":
        rows = [dict(rows[0], op="decode")]
    f2 = _write(tmp_path / "b.json", "H200" if problem == "gpus" else "H100",
                rows if problem != "gpus" else _rows(4, 16, {("8x4096", "qla"): 0.1}))
    files = [f2] if problem == "op" else [f1, f2]
    match = {"twice": "earlier file", "gpus": "different GPUs", "op": "decode"}[problem]
    with pytest.raises(ValueError, match=match):
        summary.load_runs(files)


def test_cli_bench_summary_writes_markdown(tmp_path, capsys):
    rows = _rows(2, 8, {("8x4096", "qla"): 0.2, ("8x4096", "fla"): 0.5, ("8x4096", "flashinfer"): 0.1})
    f = _write(tmp_path / "a.json", "H", rows)
    out = tmp_path / "s.md"
    assert cli.main(["bench", "summary", str(f), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text() == printed and "| 2/8 | 8x4096 | 0.200 | 0.100 | 0.50x |" in printed
    assert cli.main(["bench", "summary", str(tmp_path / "none.json")]) == 2
