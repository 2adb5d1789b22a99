"""Install layout: kernels/ and integrations/ live under qla_serving, no top-level `kernels`."""

import importlib.util
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_subpackages_import_under_qla_serving():
    import qla_serving.integrations
    import qla_serving.kernels

    assert pathlib.Path(qla_serving.kernels.__file__).parent == ROOT / "kernels"
    assert pathlib.Path(qla_serving.integrations.__file__).parent == ROOT / "integrations"


def test_no_top_level_kernels_module_from_this_project():
    # Outside the checkout (so the working directory is not on the path).
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    origin = out.stdout.strip()
    assert origin == "None" or not origin.startswith(str(ROOT)), origin


def test_every_package_directory_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        top = rel.parts[0]
        if top in mapping:
            found.add(".".join([mapping[top], *rel.parts[1:]]))
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_console_script_is_installed():
    assert importlib.util.find_spec("qla_serving.cli") is not None
    out = subprocess.run(["qla-serving", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "check" in out.stdout


def test_compile_extra_pins_the_tilelang_the_kernels_check_for():
    from qla_serving.backend import TILELANG_VERSION

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"tilelang=={TILELANG_VERSION}" in extras["compile"]
    # serving installs keep the engines' own TileLang: no extra an engine is installed with pins one
    assert not any("tilelang" in req for name in ("vllm", "sglang") for req in extras[name])


def test_shipped_library_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert set(data["qla_serving.kernels"]) == {"shipped/*.so", "shipped/manifest.json"}


def test_license_is_an_spdx_expression_with_its_file():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # a string (PEP 639), not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_commands_print_no_stray_warnings():
    """torch without numpy warns on import ("Failed to initialize NumPy") before any command's
    output: numpy is a dependency, and --help prints nothing on stderr with warnings as errors."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(req.split(">")[0].split("=")[0].strip() == "numpy" for req in project["dependencies"])
    for argv in (["--help"], ["bench", "--help"], ["check", "--help"]):
        out = subprocess.run([sys.executable, "-W", "error", "-m", "qla_serving.cli", *argv], cwd="/",
                             capture_output=True, text=True)
        assert out.returncode == 0 and out.stderr == "", (argv, out.stderr[-500:])


def test_offline_docker_replay_needs_the_from_lines_engine(tmp_path):
    """scripts/docker_replay.sh with QLA_REPLAY_OFFLINE=1 (the GPU machine, no index) takes the
    engine from what the python already sees, and refuses one that is not the FROM line's version
    (here: a fake vLLM of another version on a site directory), naming both."""
    dist, site = tmp_path / "dist", tmp_path / "image-site-packages"
    dist.mkdir()
    (dist / "qla_serving-0.1.0-py3-none-any.whl").write_bytes(b"")  # only looked for before the engine check
    info = site / "vllm-0.25.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.25.1\n")
    env = {"PATH": "/usr/bin:/bin", "QLA_REPLAY_OFFLINE": "1", "QLA_DIST_DIR": str(dist),
           "PYTHON": sys.executable, "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    r = subprocess.run(["bash", str(ROOT / "scripts/docker_replay.sh"), "docker/Dockerfile.vllm", str(tmp_path / "venv")],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "offline replay: vllm here is 0.25.1, the Dockerfile's FROM is 0.26.0" in r.stderr
    env["QLA_DIST_DIR"] = str(tmp_path / "empty")
    r = subprocess.run(["bash", str(ROOT / "scripts/docker_replay.sh"), "docker/Dockerfile.vllm", str(tmp_path / "venv")],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2 and f"no built wheel in {tmp_path / 'empty'}" in r.stderr, r.stdout + r.stderr


def _library_archive(tmp_path, digest, *, so=True):
    """A library directory as `gpu_session.sh library` packs it: tar.xz split into pieces."""
    import io
    import json
    import lzma
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        files = {"manifest.json": json.dumps({"format": 1, "library": "libqla_gdn_sm90a.so", "source_digest": digest,
                                              "kernels": {"k": {}}, "built": "now", "built_with": {}}).encode()}
        if so:
            files["libqla_gdn_sm90a.so"] = bytes(range(256)) * 4000
        for name, data in files.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    packed = lzma.compress(buf.getvalue())
    pieces = []
    for i in range(0, len(packed), max(1, len(packed) // 3)):
        pieces.append(tmp_path / f"qla-lib.tar.xz.{len(pieces):02d}")
        pieces[-1].write_bytes(packed[i:i + max(1, len(packed) // 3)])
    return pieces


def _script(name):
    """One of scripts/*.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_library_unpack_ships_a_library_of_these_sources(tmp_path):
    from qla_serving.kernels import library

    mod = _script("library_unpack")
    digest = library.source_digest()
    assert mod.sources_digest() == digest
    pieces = _library_archive(tmp_path, digest)
    into = tmp_path / "shipped"
    into.mkdir()
    (into / "stale.txt").write_text("the library before")
    m = mod.unpack(list(reversed(pieces)), into, digest)  # pieces are joined in name order
    assert m["source_digest"] == digest
    assert sorted(p.name for p in into.iterdir()) == ["libqla_gdn_sm90a.so", "manifest.json"]
    assert (into / "libqla_gdn_sm90a.so").read_bytes() == bytes(range(256)) * 4000


def test_library_unpack_refuses_other_sources_and_partial_archives(tmp_path):
    mod = _script("library_unpack")
    into = tmp_path / "shipped"
    into.mkdir()
    (into / "manifest.json").write_text("{}")
    pieces = _library_archive(tmp_path, "0123456789abcdef")
    with pytest.raises(ValueError, match="other kernel sources: digest 0123456789abcdef, these sources ffff"):
        mod.unpack(pieces, into, "ffffffffffffffff")
    with pytest.raises(ValueError, match="not a complete xz archive"):
        mod.unpack(pieces[:-1], into, "0123456789abcdef")
    with pytest.raises(ValueError, match="missing archive pieces"):
        mod.unpack(pieces + [tmp_path / "qla-lib.tar.xz.09"], into, "0123456789abcdef")
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ValueError, match="names shared object 'libqla_gdn_sm90a.so', not in the archive"):
        mod.unpack(_library_archive(bare, "0123456789abcdef", so=False), into, "0123456789abcdef")
    assert (into / "manifest.json").read_text() == "{}"  # untouched by every refusal
    assert mod.main([str(p) for p in pieces] + ["--into", str(into)]) == 1


def _fake_dist(site, name, version, requires=()):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                         + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_requirements_gap_lists_every_unsatisfied_requirement_of_the_closure(tmp_path):
    import importlib.metadata as md

    site = tmp_path / "site"
    _fake_dist(site, "engine", "1.0", ["lib-a>=2", "lib-b<1.8,>=1.7", "lib-c", "lib-e; extra == 'serve'",
                                       "lib-f; python_version < '3'"])
    _fake_dist(site, "lib-a", "2.1", ["lib-d==3.0"])
    _fake_dist(site, "lib-b", "1.6.1")
    _fake_dist(site, "lib-d", "3.1")
    mod = _script("requirements_gap")
    installed = {d.metadata["Name"]: d for d in md.distributions(path=[str(site)])}
    got = {(g["requirement"], g["needed_by"], g["installed"]) for g in mod.gaps(["engine==1.0"], installed)}
    assert got == {("lib-b<1.8,>=1.7", "engine 1.0", "1.6.1"), ("lib-c", "engine 1.0", None),
                   ("lib-d==3.0", "lib-a 2.1", "3.1")}
    with_extra = {g["requirement"] for g in mod.gaps(["engine[serve]==1.0"], installed)}
    assert 'lib-e; extra == "serve"' in with_extra
    # --direct: what installing the root asks, not its requirements' requirements
    assert {g["requirement"] for g in mod.gaps(["engine==1.0"], installed, direct=True)} == {"lib-b<1.8,>=1.7", "lib-c"}
    assert [g["installed"] for g in mod.gaps(["engine==2.0"], installed)] == ["1.0"]


def _wheel(path, name, version, requires=()):
    import zipfile

    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                   + "Provides-Extra: vllm\n" + "".join(f"Requires-Dist: {r}\n" for r in requires))
        z.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist_info}/RECORD", "")


def test_offline_docker_replay_on_an_incomplete_image_lists_its_gaps_and_installs_the_resolution(tmp_path):
    """On an image lacking some of the engine's requirements (the GPU machine's bundles) pip cannot
    resolve the Dockerfile's line: the replay names every gap and stops, or, given the line's
    resolution from a complete environment, installs exactly that and checks its own requirements."""
    import json

    dist, site = tmp_path / "dist", tmp_path / "image-site-packages"
    dist.mkdir()
    _wheel(dist / "qla_serving-0.1.0-py3-none-any.whl", "qla-serving", "0.1.0", ['vllm>=0.26; extra == "vllm"'])
    _fake_dist(site, "vllm", "0.26.0", ["llguidance<1.8.0,>=1.7.0", "opencv-python-headless>=4.13.0"])
    _fake_dist(site, "llguidance", "1.6.1")
    env = {"PATH": "/usr/bin:/bin", "QLA_REPLAY_OFFLINE": "1", "QLA_DIST_DIR": str(dist),
           "PYTHON": sys.executable, "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    replay = ["bash", str(ROOT / "scripts/docker_replay.sh"), "docker/Dockerfile.vllm", str(tmp_path / "venv")]
    r = subprocess.run(replay, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "this image lacks 2 of vllm==0.26.0's requirements" in r.stdout
    assert "llguidance<1.8.0,>=1.7.0  (has 1.6.1; needed by vllm 0.26.0)" in r.stdout
    assert "opencv-python-headless>=4.13.0  (missing; needed by vllm 0.26.0)" in r.stdout
    assert "give QLA_REPLAY_RESOLVED=" in r.stderr
    resolution = {"dockerfile": "docker/Dockerfile.sglang", "engine": "vllm==0.26.0", "line": "pip install ...",
                  "install": [{"name": "qla-serving", "version": "0.1.0", "requested_extras": ["vllm"]}]}
    res = tmp_path / "resolution.json"
    res.write_text(json.dumps(resolution))
    r = subprocess.run(replay, env={**env, "QLA_REPLAY_RESOLVED": str(res)}, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 2 and "is of docker/Dockerfile.sglang with vllm==0.26.0, not docker/Dockerfile.vllm" in r.stderr
    res.write_text(json.dumps({**resolution, "dockerfile": "docker/Dockerfile.vllm",
                               "install": [{"name": "qla-serving", "version": "0.2.0", "requested_extras": []}]}))
    r = subprocess.run(replay, env={**env, "QLA_REPLAY_RESOLVED": str(res)}, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 2 and "resolution names qla-serving 0.2.0: no such wheel in" in r.stderr
    res.write_text(json.dumps({**resolution, "dockerfile": "docker/Dockerfile.vllm"}))
    r = subprocess.run(replay, env={**env, "QLA_REPLAY_RESOLVED": str(res)}, capture_output=True, text=True,
                       timeout=300, check=False)
    assert "resolved elsewhere: qla-serving[vllm] from" in r.stdout, r.stdout + r.stderr
    assert "0 requirement(s) of qla-serving[vllm] not satisfied here" in r.stdout
    assert "pip check: 2 line(s) about the image's gaps, 0 about what went in" in r.stdout
    # (the replay then imports the plugin, which this fake wheel does not hold)
    assert r.returncode != 0 and "qla-serving's entry point is not installed" in r.stderr
