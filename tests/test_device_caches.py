"""The device machine's JIT caches kept between sessions: scripts/gpu_session.sh caches-save on one
machine, scripts/device_caches.sh store here, caches-restore on the next machine (here: three HOME
folders standing in for the machines, the repository copied as the device gets it)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("xz") is None or shutil.which("split") is None,
                                reason="needs xz and split")


def _session(repo: pathlib.Path, home: pathlib.Path, out: pathlib.Path, step: str, **env) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    e = {**os.environ, "HOME": str(home), "OUT": str(out), "QLA_STAGE": str(home / "stage"),
         "QLA_JIT_PIECES": str(home.parent / "pieces"), **env}
    return subprocess.run(["bash", str(repo / "scripts/gpu_session.sh"), step], env=e, capture_output=True,
                          text=True, timeout=300, check=False)


def test_jit_caches_travel_to_a_fresh_machine(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns(".git", ".device", "build", "dist", "*.egg-info",
                                                              ".pytest_cache", "__pycache__", "shipped"))
    first, fresh = tmp_path / "first", tmp_path / "fresh"
    rng = os.urandom
    files = {".triton/cache/ab12/kernel.cubin": rng(300_000), ".triton/cache/cd34/kernel.json": b"{}",
             ".cache/flashinfer/90a/trtllm_comm.so": rng(200_000)}
    for rel, data in files.items():
        (first / rel).parent.mkdir(parents=True, exist_ok=True)
        (first / rel).write_bytes(data)

    # random bytes do not compress: 500 kB make 4 pieces of 150 kB, two folders of at most three
    saved = _session(repo, first, tmp_path / "out1", "caches-save", QLA_CACHE_PIECE="150k")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert (tmp_path / "out1/jit-caches.count").read_text().split()[0] == "4"
    stored = subprocess.run(["bash", str(repo / "scripts/device_caches.sh"), "store", str(tmp_path / "out1")],
                            capture_output=True, text=True, check=False)
    assert stored.returncode == 0, stored.stderr
    assert "carry .device/jit-caches/1" in stored.stdout and "carry .device/jit-caches/2" in stored.stdout
    assert len(list((repo / ".device/jit-caches/1").glob("jit-caches.tar.xz.*"))) == 3

    # the next machine gets one folder per call: after the first, nothing is unpacked yet
    keep = repo / ".device/jit-caches"
    shutil.move(keep / "2", tmp_path / "later")
    r = _session(repo, fresh, tmp_path / "out2", "caches-restore")
    assert r.returncode == 0 and "3 of 4 pieces here" in r.stdout, r.stdout + r.stderr
    assert not (fresh / ".triton").exists()
    shutil.rmtree(keep / "1")
    shutil.move(tmp_path / "later", keep / "2")
    r = _session(repo, fresh, tmp_path / "out3", "caches-restore")
    assert r.returncode == 0 and "JIT caches restored" in r.stdout, r.stdout + r.stderr
    for rel, data in files.items():
        assert (fresh / rel).read_bytes() == data, rel


def test_caches_too_large_for_a_call_are_not_kept(tmp_path):
    home = tmp_path / "home"
    (home / ".triton/cache").mkdir(parents=True)
    (home / ".triton/cache/big.cubin").write_bytes(os.urandom(400_000))
    r = _session(REPO, home, tmp_path / "out", "caches-save", QLA_CACHE_PIECE="50k", QLA_CACHE_MAX_PIECES="5")
    assert r.returncode != 0 and "not kept" in r.stdout
    assert not list((tmp_path / "out").glob("jit-caches.*"))
    r = _session(REPO, tmp_path / "empty", tmp_path / "out", "caches-save")
    assert r.returncode != 0 and "no JIT cache" in r.stdout


def test_the_library_comes_out_of_a_carried_wheel(tmp_path):
    """library-from-wheel: the shipped library of a built wheel, unpacked where QLA_KERNEL_LIBRARY
    can point, the wheel kept for the install step; a wheel without one is an error."""
    import json
    import zipfile

    wheel = tmp_path / "qla_serving-0.1.0-py3-none-linux_x86_64.whl"
    lib = os.urandom(1000)
    manifest = {"source_digest": "abc123", "configs": [{}, {}], "kernels": [{}, {}, {}], "built_with": {"tilelang": "0.1.15"}}
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("qla_serving-0.1.0.data/purelib/qla_serving/kernels/shipped/libqla_gdn_sm90a.so", lib)
        z.writestr("qla_serving-0.1.0.data/purelib/qla_serving/kernels/shipped/manifest.json", json.dumps(manifest))
        z.writestr("qla_serving/__init__.py", "")
    out = tmp_path / "lib"
    r = _session(REPO, tmp_path / "home", tmp_path / "out", "library-from-wheel", QLA_WHEEL=str(wheel),
                 QLA_LIBRARY_OUT=str(out), QLA_DIST_DIR=str(tmp_path / "dist"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "dist" / wheel.name).read_bytes() == wheel.read_bytes()
    assert (out / "libqla_gdn_sm90a.so").read_bytes() == lib and json.loads((out / "manifest.json").read_text()) == manifest
    assert "library abc123 from qla_serving-0.1.0-py3-none-linux_x86_64.whl: 2 configurations, 3 kernels" in r.stdout
    bare = tmp_path / "bare.whl"
    with zipfile.ZipFile(bare, "w") as z:
        z.writestr("qla_serving/__init__.py", "")
    r = _session(REPO, tmp_path / "home", tmp_path / "out2", "library-from-wheel", QLA_WHEEL=str(bare),
                 QLA_LIBRARY_OUT=str(tmp_path / "lib2"), QLA_DIST_DIR=str(tmp_path / "dist"))
    assert r.returncode != 0 and "no kernels/shipped/manifest.json" in r.stdout
