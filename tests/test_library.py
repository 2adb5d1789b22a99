"""Precompiled kernel libraries (qla_serving.kernels.library): manifests, lookup, the ctypes
calls, the choice between a library, TileLang and the fallback; on a GPU, the library's kernels
bit-identical to TileLang's JIT-built ones.

The CPU cases call a real shared object built here with the C compiler, with the entry points a
library's kernels have, and read back what it received.
"""

import contextlib
import ctypes
import json
import logging
import os
import shutil
import subprocess

import pytest
import torch
from helpers import RecordingLib, recorded_kernel
from qla_serving.kernels import chunk_prefill, decode, library
from qla_serving.kernels.decode_tiles import DecodeTile

from qla_serving import backend

# The entry point TileLang generates for the decode kernel (its parameters verbatim).
DECODE_SIGNATURE = (
    'extern "C" TL_EXPORT int call(bfloat16_t* __restrict__ q, bfloat16_t* __restrict__ k, '
    "bfloat16_t* __restrict__ v, bfloat16_t* __restrict__ a, bfloat16_t* __restrict__ b, "
    "float* __restrict__ A_log, float* __restrict__ dt_bias, float* __restrict__ pool, "
    "int* __restrict__ state_indices, bfloat16_t* __restrict__ o, float* __restrict__ inter, "
    "int64_t slot_stride_vec, float scale, int N, int pool_len, int inter_len, "
    "cudaStream_t stream=cudaStreamDefault) {"
)

RECORDER_C = r"""
#include <stdint.h>
#include <string.h>
static char err[64];
int64_t got[8]; float got_scale; int inits;
const char* k_get_last_error(void) { return err; }
int k_init(void) { inits++; return 0; }
int k_call(void* x, void* y, int64_t stride, float scale, int n, int len, void* stream) {
  if (n < 0) { strcpy(err, "negative n"); return -1; }
  got[0] = (int64_t)x; got[1] = (int64_t)y; got[2] = stride; got[3] = n; got[4] = len;
  got[5] = (int64_t)stream; got_scale = scale; return 0;
}
"""


def test_parse_signature_reads_tilelang_host_entry():
    params = library.parse_signature(DECODE_SIGNATURE)
    assert [n for _, n in params][:3] == ["q", "k", "v"] and len(params) == 16
    assert params[10] == ("ptr", "inter") and params[11] == ("int64_t", "slot_stride_vec")
    assert params[12] == ("float", "scale") and params[13:] == [("int", "N"), ("int", "pool_len"), ("int", "inter_len")]
    with pytest.raises(ValueError, match="no `extern"):
        library.parse_signature("int main() {}")
    with pytest.raises(ValueError, match="C type 'half'"):
        library.parse_signature('extern "C" TL_EXPORT int call(half x, cudaStream_t stream) {')


def test_kernel_key_is_stable_for_both_config_kinds():
    dkey = decode._key(2, 8, 1, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32,
                       torch.int32, True, False, True, DecodeTile.parse("16x64s"))
    assert json.loads(library.kernel_key("decode", dkey)) == [
        "decode", [2, 8, 1, "bfloat16", "bfloat16", "float32", "bfloat16", "float32", "int32", True, False, True,
                   [16, 64, 8, 0, True]]]
    pcfg = chunk_prefill.PrefillStaticConfig(2, 8, "bfloat16", "float32", "float32", False)
    assert json.loads(library.kernel_key("prep", pcfg)) == ["prep", [2, 8, "bfloat16", "float32", "float32", False, None]]
    packed = chunk_prefill.PrefillStaticConfig(2, 8, "bfloat16", "float32", "float32", True, ("float32", "bfloat16"))
    assert json.loads(library.kernel_key("chunk_fwd", packed)) == [
        "chunk_fwd", [2, 8, "bfloat16", "float32", "float32", True, ["float32", "bfloat16"]]]


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / "librec.so"
    (tmp_path / "rec.c").write_text(RECORDER_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(tmp_path / "rec.c")], check=True)
    monkeypatch.setattr(library, "_on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(library, "_current_stream", lambda device: 0x5EED)
    lib = ctypes.CDLL(str(so))
    entry = dict(symbol="k", num_args=4,
                 params=[["ptr", "x"], ["ptr", "y"], ["int64_t", "stride"], ["float", "scale"], ["int", "n"],
                         ["int", "len"]],
                 dynamic=[["n", 0, 0], ["len", 1, 1]])
    return lib, entry


def test_library_kernel_passes_pointers_scalars_shapes_and_stream(recorder):
    lib, entry = recorder
    kernel = library.LibraryKernel(lib, entry, "test")
    x, y = torch.zeros(5, 3), torch.zeros(2, 7)
    kernel(x, y, 12, 0.25)
    kernel(x, y, 12, 0.25)
    got = (ctypes.c_int64 * 8).in_dll(lib, "got")
    assert list(got[:6]) == [x.data_ptr(), y.data_ptr(), 12, 5, 7, 0x5EED]
    assert ctypes.c_float.in_dll(lib, "got_scale").value == 0.25
    assert ctypes.c_int.in_dll(lib, "inits").value == 1  # once per device
    with pytest.raises(TypeError, match="3 arguments, the kernel takes 4"):
        kernel(x, y, 12)


def test_library_kernel_reports_the_host_codes_error(recorder):
    lib, entry = recorder
    # n as a scalar argument this time, so that the test can make it negative
    kernel = library.LibraryKernel(lib, dict(entry, num_args=5, dynamic=[["len", 1, 1]]), "test")
    with pytest.raises(RuntimeError, match="k: launch failed: negative n"):
        kernel(torch.zeros(1), torch.zeros(2, 2), 1, 1.0, -1)


def test_manifest_parameter_count_must_match(recorder):
    lib, entry = recorder
    with pytest.raises(ValueError, match="6 C parameters for 4 arguments and 1 shape variables"):
        library.LibraryKernel(lib, dict(entry, dynamic=[["n", 0, 0]]), "test")


def _write_library(path, kernels, digest=None, fmt=library.FORMAT):
    path.mkdir(parents=True, exist_ok=True)
    (path / "lib.so").write_bytes(b"")
    (path / library.MANIFEST).write_text(json.dumps(dict(
        format=fmt, library="lib.so", source_digest=digest or library.source_digest(), kernels=kernels)))


@pytest.fixture
def search(tmp_path, monkeypatch):
    monkeypatch.setattr(library, "USER_DIR", tmp_path / "user")
    monkeypatch.setattr(library, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.delenv("QLA_KERNEL_LIBRARY_OFF", raising=False)
    monkeypatch.setenv("QLA_KERNEL_LIBRARY", str(tmp_path / "extra"))
    library.reset()
    yield tmp_path
    library.reset()


PCFG = chunk_prefill.PrefillStaticConfig(2, 8, "bfloat16", "float32", "float32", False)


def test_search_order_and_stale_libraries(search, caplog):
    key = library.kernel_key("prep", PCFG)
    _write_library(search / "shipped", {key: {}})
    _write_library(search / "user", {}, digest="0" * 16)
    _write_library(search / "extra", {}, fmt=99)
    assert library.search_path() == [search / "extra", search / "user", search / "shipped"]
    with caplog.at_level(logging.WARNING, logger="qla_serving"):
        libs = library.libraries()
    assert [lib.path for lib in libs] == [search / "shipped"]
    assert "was built from other kernel sources" in caplog.text and "format 99" in caplog.text
    assert library.has("prep", PCFG) and not library.has("chunk_fwd", PCFG)
    assert "(none)" in library.describe_search_path() and str(search / "shipped") in library.describe_search_path()


def test_source_digest_follows_the_kernel_sources(tmp_path):
    files = [tmp_path / name for name in (*library.SOURCE_FILES, "constants.py")]
    for f in files:
        f.write_text(f"# {f.name}\n")
    before = library.source_digest(files)
    assert library.source_digest(files) == before
    files[1].write_text("# decode_program.py, edited\n")
    assert library.source_digest(files) == before  # comments are not code
    files[1].write_text("X = 1  # decode_program.py\n\n")
    code = library.source_digest(files)
    assert code != before
    files[1].write_text("X = 1  # another comment\n")
    assert library.source_digest(files) == code
    files[1].write_text("X = 2\n")
    assert library.source_digest(files) != code
    assert library.source_digest() == library.source_digest()  # the installed sources


def test_missing_kernels_need_tilelang_or_fall_back(search, monkeypatch):
    from qla_serving.warmup import WarmupConfig, kernel_warmup_specs

    cfg = WarmupConfig(2, 8, torch.bfloat16, torch.float32, bias_dtype=torch.bfloat16, prefill_qk_l2norm=False)
    specs = kernel_warmup_specs(cfg)
    monkeypatch.setattr(library, "tilelang_unsupported_reason", lambda: None)
    assert backend.missing_kernels_reason(specs) is None  # TileLang compiles what no library holds
    monkeypatch.setattr(library, "tilelang_unsupported_reason", lambda: "TileLang is not installed")
    reason = backend.missing_kernels_reason(specs)
    assert "is in no precompiled kernel library" in reason and "TileLang is not installed" in reason
    assert "qla-serving compile" in reason
    decode_keys = decode._warmup_keys(2, 8, 1, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, None,
                                      torch.int32, True, False, True)
    _write_library(search / "shipped", {library.kernel_key(kind, PCFG): {} for kind in ("prep", "chunk_fwd")}
                   | {library.kernel_key("decode", k): {} for k in decode_keys})
    library.reset()
    assert backend.missing_kernels_reason(specs) is None


def test_no_library_and_no_tilelang_names_the_configuration(search, monkeypatch):
    monkeypatch.setattr(library, "tilelang_unsupported_reason", lambda: "TileLang 0.1.9 is installed but ...")
    monkeypatch.setattr(decode, "_cache", {})
    key = decode._key(2, 8, 1, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32,
                      torch.int32, True, False, True, DecodeTile.parse("16x128"))
    with pytest.raises(backend.KernelUnavailable, match=r"decode kernel .*num_qk_heads=2.* TileLang 0\.1\.9"):
        decode._get_kernel(key)
    assert backend.kernel_source_unsupported_reason().startswith("no precompiled kernel library")


def test_a_library_kernel_is_used_without_compiling(search, monkeypatch):
    monkeypatch.setattr(library, "tilelang_unsupported_reason", lambda: "TileLang is not installed")
    monkeypatch.setattr(chunk_prefill, "_kernels", {})
    sentinel = object()
    monkeypatch.setattr(library, "lookup", lambda kind, cfg: (kind, sentinel))
    before = chunk_prefill.compile_count()
    assert chunk_prefill._kernel_set(PCFG) == (("prep", sentinel), ("chunk_fwd", sentinel))
    assert chunk_prefill.compile_count() == before


def test_object_command_keeps_tilelangs_flags():
    from qla_serving.library_build import _object_command

    tl = ["nvcc", "-std=c++20", "-w", "-lineinfo", "--shared", "/tmp/x.cu", "-L/usr/local/lib", "-lcuda",
          "-gencode", "arch=compute_90a,code=sm_90a", "--compiler-options", "-fPIC", "--use_fast_math", "-I/inc",
          "-ftz=true", "-o", "/tmp/x.so"]
    assert _object_command(tl, "/w/k.cu", "/w/k.o") == [
        "nvcc", "-std=c++20", "-w", "-lineinfo", "-gencode", "arch=compute_90a,code=sm_90a", "--compiler-options",
        "-fPIC", "--use_fast_math", "-I/inc", "-ftz=true", "-c", "/w/k.cu", "-o", "/w/k.o"]


def test_a_rebuild_takes_unchanged_objects_from_the_cache(tmp_path, monkeypatch):
    """The build's object cache: the same source (text and file name) through the same command and
    compiler is not compiled again (the stand-in compiler counts its runs); another text, name,
    flag or compiler version is; QLA_BUILD_CACHE=off keeps nothing."""
    import sys as _sys

    from qla_serving import library_build

    runs = tmp_path / "runs"
    compiler = tmp_path / "fake-nvcc"
    version = tmp_path / "version"
    version.write_text("release 13.0")
    # copies -c SRC to -o OBJ with its flags appended; --version prints the version file
    compiler.write_text(f"""#!{_sys.executable}
import sys, pathlib
a = sys.argv[1:]
if a == ["--version"]:
    print(pathlib.Path({str(version)!r}).read_text()); sys.exit(0)
with open({str(runs)!r}, "a") as f: f.write("x")
src, obj = a[a.index("-c") + 1], a[a.index("-o") + 1]
flags = [x for x in a if x.startswith("-f")]
pathlib.Path(obj).write_bytes(pathlib.Path(src).read_bytes() + " ".join(flags).encode())
""")
    compiler.chmod(0o755)
    monkeypatch.setenv("QLA_BUILD_CACHE", str(tmp_path / "cache"))
    library_build._compiler_version.cache_clear()

    def build(build_dir, source, flag="-fPIC", name="k"):
        d = tmp_path / build_dir
        d.mkdir(exist_ok=True)
        src, obj = d / f"{name}.cu", d / f"{name}.o"
        src.write_text(source)
        cached = library_build._compile_object([str(compiler), flag, "-c", str(src), "-o", str(obj)], str(src), str(obj), "k")
        return cached, obj.read_bytes()

    assert build("b1", "kernel A") == (False, b"kernel A-fPIC")
    assert build("b2", "kernel A") == (True, b"kernel A-fPIC")  # another build directory, the same object
    assert build("b3", "kernel B") == (False, b"kernel B-fPIC")
    assert build("b4", "kernel A", flag="-fno-PIC") == (False, b"kernel A-fno-PIC")
    assert build("b4", "kernel A", name="k2")[0] is False  # another source name: its cubins are named after it
    version.write_text("release 13.1")
    library_build._compiler_version.cache_clear()
    assert build("b5", "kernel A")[0] is False
    monkeypatch.setenv("QLA_BUILD_CACHE", "off")
    assert library_build.object_cache_dir() is None
    assert build("b6", "kernel A")[0] is False
    assert runs.read_text() == "x" * 6


# ------------------------------------------------------------------ GPU: library == JIT


def _library_or_skip():
    libs = library.libraries()
    if not libs:
        pytest.skip(f"no precompiled kernel library ({library.describe_search_path()})")
    return libs


def _library_keys(kind, limit, where=lambda fields: True):
    keys = []
    for lib in _library_or_skip():
        keys += [f for k in lib.manifest["kernels"] if json.loads(k)[0] == kind and where(f := json.loads(k)[1])]
    # a spread over the library: every head count and dtype appears in the first few
    keys.sort(key=lambda f: (f[1] != 32, f[0] != 16, str(f)))
    return keys[:limit]


@pytest.mark.gpu
def test_library_decode_kernels_match_jit_bit_for_bit():
    from test_decode_kernel import make_inputs

    checked = 0
    for fields in _library_keys("decode", 8):
        key = decode.DecodeStaticConfig(*fields[:-1], DecodeTile(*fields[-1]))
        H, HV, T = key.num_qk_heads, key.num_v_heads, key.tokens
        act = getattr(torch, key.q_dtype)
        pool_dtype = getattr(torch, key.pool_dtype)
        N = 3 if key.tile == decode._tile_for(3 * HV, pool_dtype) else max(4, 256 // HV + 1)
        q, k, v, a, b, A_log, dt_bias = make_inputs(N, T, H, HV, act, getattr(torch, key.alog_dtype))
        dt_bias = dt_bias.to(getattr(torch, key.bias_dtype))
        a, b = a.to(getattr(torch, key.ab_dtype)), b.to(getattr(torch, key.ab_dtype))
        pool0 = torch.randn(N + 2, HV, 128, 128, device="cuda").to(pool_dtype)
        idx = torch.randperm(N + 2, device="cuda")[:N].to(getattr(torch, key.idx_dtype))
        results = []
        for kernel in (library.lookup("decode", key), _compile_decode(key)):
            pool = pool0.clone()
            out = torch.empty(N, T, HV, 128, device="cuda", dtype=act)
            inter = torch.zeros(N, T, HV, 128, 128, device="cuda", dtype=pool_dtype) if key.has_inter else None
            saved = decode._cache.get(key)
            decode._cache[key] = kernel
            try:
                with decode.force_tile(key.tile):
                    decode.gated_delta_rule_decode_fwd(q, k, v, a, b, A_log, dt_bias, state_pool=pool,
                                                       state_indices=idx, scale=128**-0.5,
                                                       use_qk_l2norm=key.use_l2, out=out, intermediate_states=inter,
                                                       inplace_final_state=key.inplace)
            finally:
                decode._cache.pop(key)
                if saved is not None:
                    decode._cache[key] = saved
            results.append((out, pool, inter))
        (o1, p1, i1), (o2, p2, i2) = results
        assert torch.equal(o1, o2) and torch.equal(p1, p2), f"decode {key}: library and JIT differ"
        assert i1 is None or torch.equal(i1, i2)
        checked += 1
    assert checked


def _compile_decode(key):
    import tilelang

    return tilelang.compile(decode._build(key), target={"kind": "cuda", "arch": "sm_90a"},
                            pass_configs={"tl.disable_safe_memory_legalize": True})


@pytest.mark.gpu
def test_library_prefill_kernels_match_jit_bit_for_bit():
    import tilelang
    from test_prefill_kernel import _make_case, _run

    checked = 0
    # the classic inputs' kernels (the packed ones' last field is their gate dtypes)
    for fields in _library_keys("prep", 3, where=lambda f: len(f) < 7 or f[6] is None):
        cfg = chunk_prefill.PrefillStaticConfig(*fields)
        lib_set = (library.lookup("prep", cfg), library.lookup("chunk_fwd", cfg))
        if None in lib_set:
            continue
        jit_set = chunk_prefill._compile_set(cfg, tilelang)
        case = _make_case([700, 3, 129, 64], cfg.num_qk_heads, cfg.num_v_heads, dtype=getattr(torch, cfg.dtype),
                          beta_dtype=getattr(torch, cfg.beta_dtype), pool_dtype=getattr(torch, cfg.pool_dtype),
                          l2=cfg.use_qk_l2norm)
        pool0 = case["pool"].clone()
        outs = []
        for kernels in (lib_set, jit_set):
            case["pool"].copy_(pool0)
            saved = chunk_prefill._kernels.get(cfg)
            chunk_prefill._kernels[cfg] = kernels
            try:
                outs.append((_run(case), case["pool"].clone()))
            finally:
                chunk_prefill._kernels.pop(cfg)
                if saved is not None:
                    chunk_prefill._kernels[cfg] = saved
        (o1, p1), (o2, p2) = outs
        assert torch.equal(o1, o2) and torch.equal(p1, p2), f"prefill {cfg}: library and JIT differ"
        checked += 1
    assert checked


# The decode kernel's C parameters in the entry's argument order (11 buffers, then its scalars),
# and a shape variable for the leading dimension of every buffer whose length TileLang reads.
_DECODE_BUFFERS = ["q", "k", "v", "a", "b", "A_log", "dt_bias", "pool", "state_indices", "o", "inter"]
_DECODE_SCALARS = [["int64_t", "slot_stride_vec"], ["int", "q_stride"], ["int", "k_stride"], ["int", "v_stride"],
                   ["int", "a_stride"], ["int", "b_stride"], ["int", "min_slot"], ["float", "scale"]]
_DECODE_DYNAMIC = [[f"{n}_len", i, 0] for i, n in enumerate(_DECODE_BUFFERS)] + [["q_heads", 0, 1], ["k_heads", 1, 1]]


def _recording_decode_kernel(monkeypatch):
    """A library decode kernel with the entry's C parameters whose launches record their arguments
    (on the CPU: no device context, a fixed stream handle)."""
    monkeypatch.setattr(library, "_on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(library, "_current_stream", lambda device: 0x5EED)
    entry = dict(symbol="decode", num_args=len(_DECODE_BUFFERS) + len(_DECODE_SCALARS), dynamic=_DECODE_DYNAMIC,
                 params=[["ptr", n] for n in _DECODE_BUFFERS] + _DECODE_SCALARS + [["int", d[0]] for d in _DECODE_DYNAMIC])
    lib = RecordingLib()
    return lib, library.LibraryKernel(lib, entry, "test")


@pytest.mark.parametrize("N,T,inter", [(5, 1, False), (1, 1, False), (3, 4, True)])
def test_decode_entry_hands_a_library_kernel_spans_with_the_views_arguments(monkeypatch, N, T, inter):
    """The decode entry gives a library kernel pointer-and-shape spans where a TileLang kernel gets
    strided views of the engine's buffers: the launcher must receive the same C arguments."""
    lib, kernel = _recording_decode_kernel(monkeypatch)
    H, HV, K = 2, 8, 128
    # The engine's layout: q, k, v column ranges of one packed conv output, a and b halves of one
    # gate projection, a pool whose slots are padded apart.
    packed = torch.randn(N * T, (2 * H + HV) * K, dtype=torch.bfloat16)
    q, k, v = (x.view(N, T, -1, K) for x in packed.split([H * K, H * K, HV * K], dim=-1))
    a, b = (x.view(N, T, HV) for x in torch.randn(N * T, 2 * HV, dtype=torch.bfloat16).split([HV, HV], dim=-1))
    pool = torch.zeros(7, HV * K * K + 64, dtype=torch.float32)[:, : HV * K * K].view(7, HV, K, K)
    out = torch.empty(N, T, HV, K, dtype=torch.bfloat16)
    states = torch.empty(N, T, HV, K, K, dtype=torch.float32) if inter else None
    slots = torch.randperm(7)[:N].to(torch.int32)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)

    def run(k_obj, strides):
        monkeypatch.setattr(decode, "_get_kernel", lambda key: k_obj)
        decode.gated_delta_rule_decode_fwd(q, k, v, a, b, A_log, dt_bias, state_pool=pool, state_indices=slots,
                                           scale=0.125, use_qk_l2norm=True, out=out, intermediate_states=states,
                                           inplace_final_state=not inter, min_slot=1, token_strides=strides)
        return lib.calls.pop()

    spans = run(kernel, None)
    views = run(lambda *args: kernel(*args), None)  # not a LibraryKernel: the entry builds views
    assert spans == views
    strides = tuple(decode.token_stride(x, inner, rows) for x, inner, rows in
                    ((q, (H, K), H * K), (k, (H, K), H * K), (v, (HV, K), 1), (a, (HV,), 1), (b, (HV,), 1)))
    assert run(kernel, strides) == spans  # the op's strides, passed down, are the entry's own
    assert spans[0] == q.data_ptr() and spans[1] == k.data_ptr() and spans[7] == pool.data_ptr()
    if N * T > 1:  # the token strides the kernel reads: one packed row apart
        row = (2 * H + HV) * K
        assert spans[12:17] == (row // (H * K), row // (H * K), row, 2 * HV, 2 * HV)


def _prefill_spans_and_views(monkeypatch, call, fresh):
    """Run a prefill entry (``call()``) three times with ``chunk_prefill._kernel_set`` stubbed:
    with probes (the view path's arguments, which lay out the C parameters), then with library
    kernels recording their C arguments, then with the same kernels behind lambdas (not
    LibraryKernels: the entry builds views). Returns the probes' arguments and the C arguments of
    the span and the view runs, per kernel, without the ``fresh`` ones (workspaces and AutoCP's
    snapshot: allocated per call; their shapes are among the shape variables)."""
    monkeypatch.setattr(library, "_on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(library, "_current_stream", lambda device: 0x5EED)
    seen = {}

    def run(kernels):
        monkeypatch.setattr(chunk_prefill, "_kernel_set", lambda cfg: kernels)
        call()

    run(tuple((lambda name: lambda *args: seen.__setitem__(name, args))(name) for name in ("prep", "fwd")))
    lib = RecordingLib()
    prep, fwd = (recorded_kernel(lib, name, seen[name]) for name in ("prep", "fwd"))

    def c_args():
        (p_args, f_args) = lib.calls[-2:]
        del lib.calls[:]
        return tuple([a for i, a in enumerate(c) if i not in fresh[name]] for name, c in (("prep", p_args), ("fwd", f_args)))

    run((prep, fwd))
    spans = c_args()
    run((lambda *a: prep(*a), lambda *a: fwd(*a)))
    return seen, spans, c_args()


def _cpu_plan(lens, HV, cp):
    """``(T, cu_seqlens, plan)`` of sequences of ``lens`` on the CPU as an H100 plans them, with
    AutoCP (1024-token segments) or without."""
    from qla_serving.plan import plan_prefill

    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    plan = plan_prefill(cu, device="cpu", num_v_heads=HV, sm_count=132, cp_segment_tokens=1024 if cp else 0)
    assert (plan.context_parallel is not None) == cp
    return cu[-1], cu, plan


@pytest.mark.parametrize("lens,cp", [([700, 3, 129, 64], False), ([4096], True)])
def test_prefill_entry_hands_library_kernels_spans_with_the_views_arguments(monkeypatch, lens, cp):
    """Like the decode entry: the prefill kernels get spans of the pool, the has-initial flags and
    the AutoCP snapshot where TileLang kernels get views, and the same C arguments arrive."""
    H, HV, K = 2, 8, 128
    T, cu, plan = _cpu_plan(lens, HV, cp)
    q, k = torch.randn(T, H, K, dtype=torch.bfloat16), torch.randn(T, H, K, dtype=torch.bfloat16)
    v, out = torch.randn(T, HV, K, dtype=torch.bfloat16), torch.empty(T, HV, K, dtype=torch.bfloat16)
    g, beta = -torch.rand(T, HV), torch.rand(T, HV)
    pool = torch.zeros(9, HV * K * K + 32, dtype=torch.float32)[:, : HV * K * K].view(9, HV, K, K)
    slots = torch.randperm(9)[: len(lens)].to(torch.int32)
    has_initial = torch.rand(len(lens)) < 0.5
    _, spans, views = _prefill_spans_and_views(
        monkeypatch, lambda: chunk_prefill.chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, scale=K**-0.5, plan=plan, state_pool=pool, state_indices=slots,
            has_initial_state=has_initial, use_qk_l2norm=True, out=out),
        {"prep": (5, 6, 7), "fwd": (3, 4, 5, 12) if cp else (3, 4, 5)})
    assert views == spans
    assert pool.data_ptr() in spans[1] and has_initial.data_ptr() in spans[1]


def test_packed_prefill_entry_hands_library_kernels_spans_with_the_views_arguments(monkeypatch):
    """The packed-inputs entry: the conv output as one ``[T, (2H + HV) K]`` buffer to both kernels
    (chunk_fwd's q, k and v), a and b as flat spans from their first element with their token
    strides; the same C arguments as the TileLang views, workspaces aside."""
    from qla_serving.plan import plan_prefill

    H, HV, K, lens = 2, 8, 128, [700, 3, 129]
    T = sum(lens)
    plan = plan_prefill([0, 700, 703, 832], device="cpu", num_v_heads=HV, sm_count=132)
    qkv = torch.randn(T, (2 * H + HV) * K, dtype=torch.bfloat16)
    ab = torch.randn(T, 2 * HV, dtype=torch.bfloat16)
    a, b = ab[:, :HV], ab[:, HV:]
    A_log, dt_bias = torch.randn(HV), torch.randn(HV, dtype=torch.bfloat16)
    out = torch.empty(T, HV, K, dtype=torch.bfloat16)
    pool = torch.zeros(5, HV, K, K)
    slots, has_initial = torch.tensor([4, 0, 2], dtype=torch.int32), torch.tensor([True, False, True])
    seen, spans, views = _prefill_spans_and_views(
        monkeypatch, lambda: chunk_prefill.chunk_gated_delta_rule_fwd_packed(
            qkv, a, b, A_log, dt_bias, num_qk_heads=H, a_stride=2 * HV, b_stride=2 * HV, scale=K**-0.5, plan=plan,
            state_pool=pool, state_indices=slots, has_initial_state=has_initial, out=out),
        {"prep": (8, 9, 10), "fwd": (3, 4, 5)})
    assert seen["prep"][0] is qkv and seen["fwd"][:3] == (qkv, qkv, qkv)
    assert seen["prep"][1].shape == ((T - 1) * 2 * HV + HV,) and seen["prep"][5:7] == (2 * HV, 2 * HV)
    assert views == spans
    assert spans[0][:3] == [qkv.data_ptr(), a.data_ptr(), b.data_ptr()] and spans[1][:3] == [qkv.data_ptr()] * 3


def _engine_decode_inputs(N, H, HV, K, slots_total=7):
    """One layer's decode inputs in vLLM's layout: q, k, v column ranges of one conv output, a and
    b halves of one gate projection, a pool with padded slots, an output buffer."""
    packed = torch.randn(N, (2 * H + HV) * K, dtype=torch.bfloat16)
    q, k, v = (x.view(N, 1, -1, K) for x in packed.split([H * K, H * K, HV * K], dim=-1))
    a, b = (x.view(N, 1, HV) for x in torch.randn(N, 2 * HV, dtype=torch.bfloat16).split([HV, HV], dim=-1))
    pool = torch.randn(slots_total, HV * K * K + 64)[:, : HV * K * K].view(slots_total, HV, K, K)
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=torch.randn(HV), dt_bias=torch.randn(HV), state_pool=pool,
                out=torch.empty(N, 1, HV, K, dtype=torch.bfloat16))


def test_bound_decode_launch_gives_a_later_layer_the_arguments_of_its_own_call(monkeypatch):
    """The decode entry's ``bind``: the first layer's launch rerun with a second layer's addresses
    passes the kernel exactly the C arguments the entry passes for that layer's own call."""
    lib, kernel = _recording_decode_kernel(monkeypatch)
    monkeypatch.setattr(decode, "_get_kernel", lambda key: kernel)
    N, H, HV, K = 5, 2, 8, 128
    slots = torch.randperm(7)[:N].to(torch.int32)
    layers = [_engine_decode_inputs(N, H, HV, K) for _ in range(2)]

    def call(t, bind=None):
        decode.gated_delta_rule_decode_fwd(t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"],
                                           state_pool=t["state_pool"], state_indices=slots, scale=0.125,
                                           use_qk_l2norm=True, out=t["out"], min_slot=1, bind=bind)
        return lib.calls.pop()

    holder = {}
    first = call(layers[0], holder)
    own = call(layers[1])
    holder["decode"]([layers[1][name].data_ptr() for name in decode.DECODE_BOUND_INPUTS])
    assert lib.calls.pop() == own != first
    # a bound launch leaves nothing of the first layer's but the step's slots
    assert slots.data_ptr() in own and not {layers[0][n].data_ptr() for n in decode.DECODE_BOUND_INPUTS} & set(own)
    holder2 = {}
    decode.gated_delta_rule_decode_fwd(*(layers[0][n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")),
                                       state_pool=layers[0]["state_pool"], state_indices=slots, scale=0.125,
                                       use_qk_l2norm=True, out=layers[0]["out"], min_slot=1, bind=holder2,
                                       intermediate_states=torch.empty(N, 1, HV, K, K), inplace_final_state=False)
    assert holder2 == {}  # intermediates (speculative verify) are not bound
    with pytest.raises(ValueError, match="argument 11 is not a pointer"):
        kernel.bind((), {11: 0})


def test_ops_bind_only_launches_that_read_their_inputs_in_place(monkeypatch):
    """A launch bound to a copy the op made (an input the kernel cannot read in place) would read
    that copy in every later layer: the ops hand the entry ``bind`` only when nothing was copied."""
    import qla_serving
    from qla_serving import backend
    from qla_serving.plan import plan_prefill

    got = []
    monkeypatch.setattr(backend, "kernel_entry", lambda *a, **k: (lambda *args, **kw: got.append(kw["bind"])))
    N, H, HV, K = 3, 2, 4, 128
    t = _engine_decode_inputs(N, H, HV, K)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32)
    args = [t[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_pool")]
    holder = {}
    qla_serving.gated_delta_rule_decode(*args, slots, out=t["out"], min_slot=1, bind=holder)
    args[2] = t["v"].transpose(2, 3).contiguous().transpose(2, 3)  # [HV, V] not contiguous: the op copies v
    qla_serving.gated_delta_rule_decode(*args, slots, out=t["out"], min_slot=1, bind=holder)
    assert got == [holder, None]
    got.clear()
    plan = plan_prefill([0, 40, 100], device="cpu", num_v_heads=HV)
    ab = torch.randn(100, 2 * HV, dtype=torch.bfloat16)
    qkv = torch.randn(100, (2 * H + HV) * K, dtype=torch.bfloat16)
    for a in (ab[:, :HV], ab[:, :HV].t().contiguous().t()):  # a column range is read in place; a transposed copy is not
        qla_serving.chunk_gated_delta_rule_pool_packed(
            qkv, a, ab[:, HV:], torch.randn(HV), torch.randn(HV), torch.zeros(4, HV, K, K),
            torch.tensor([0, 2], dtype=torch.int32), num_qk_heads=H, plan=plan, bind=holder)
    assert got == [holder, None]


@pytest.mark.parametrize("lens,cp", [([700, 3, 129], False), ([4096], True)])
def test_bound_packed_prefill_gives_a_later_layer_the_arguments_of_its_own_call(monkeypatch, lens, cp):
    """The packed prefill entry's ``bind``: prep and chunk_fwd rerun with a second layer's addresses
    get that layer's own C arguments, the step's workspaces and tables kept (allocated once, not
    per layer); under AutoCP the start-state snapshot is refreshed from the second layer's pool."""
    from qla_serving.plan import plan_prefill

    H, HV, K = 2, 8, 128
    T, cu, plan = _cpu_plan(lens, HV, cp)
    slots = torch.randperm(5)[: len(lens)].to(torch.int32)
    has_initial = torch.rand(len(lens)) < 0.5

    def layer():
        ab = torch.randn(T, 2 * HV, dtype=torch.bfloat16)
        return dict(qkv=torch.randn(T, (2 * H + HV) * K, dtype=torch.bfloat16), a=ab[:, :HV], b=ab[:, HV:],
                    A_log=torch.randn(HV), dt_bias=torch.randn(HV, dtype=torch.bfloat16),
                    state_pool=torch.randn(5, HV, K, K), out=torch.empty(T, HV, K, dtype=torch.bfloat16))

    layers = [layer(), layer()]

    def call(t, bind=None):
        chunk_prefill.chunk_gated_delta_rule_fwd_packed(
            t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], num_qk_heads=H, a_stride=2 * HV, b_stride=2 * HV,
            scale=K**-0.5, plan=plan, state_pool=t["state_pool"], state_indices=slots, has_initial_state=has_initial,
            out=t["out"], bind=bind)

    monkeypatch.setattr(library, "_on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(library, "_current_stream", lambda device: 0x5EED)
    seen = {}
    monkeypatch.setattr(chunk_prefill, "_kernel_set",
                        lambda cfg: tuple((lambda n: lambda *args: seen.__setitem__(n, args))(n) for n in ("prep", "fwd")))
    call(layers[0])
    lib = RecordingLib()
    kernels = tuple(recorded_kernel(lib, name, seen[name]) for name in ("prep", "fwd"))
    monkeypatch.setattr(chunk_prefill, "_kernel_set", lambda cfg: kernels)
    holder = {}
    call(layers[0], holder)
    first = lib.calls[-2:]
    call(layers[1])
    own = lib.calls[-2:]
    bound = holder["prefill"]
    assert (bound.snapshot is not None) == cp
    bound([layers[1][n].data_ptr() for n in chunk_prefill.PREFILL_BOUND_INPUTS], layers[1]["state_pool"])
    replayed = lib.calls[-2:]
    # fresh per call in the entry, once per step in the bound launch: prep's workspaces (its last
    # three buffers), chunk_fwd's first three after q, k, v, and AutoCP's snapshot
    fresh = {"prep": (8, 9, 10), "fwd": (3, 4, 5, 12) if cp else (3, 4, 5)}
    for i, name in enumerate(("prep", "fwd")):
        keep = [j for j in range(len(own[i])) if j not in fresh[name]]
        assert [replayed[i][j] for j in keep] == [own[i][j] for j in keep]
        assert [replayed[i][j] for j in fresh[name]] == [first[i][j] for j in fresh[name]]
    if cp:
        assert torch.equal(bound.snapshot, layers[1]["state_pool"][slots.long()])
    # what a bound launch cannot rerun is not bound: checkpoints
    ck_plan = plan_prefill(cu, device="cpu", num_v_heads=HV, sm_count=132, checkpoint_every=64)
    holder = {}
    chunk_prefill.chunk_gated_delta_rule_fwd_packed(
        layers[0]["qkv"], layers[0]["a"], layers[0]["b"], layers[0]["A_log"], layers[0]["dt_bias"], num_qk_heads=H,
        a_stride=2 * HV, b_stride=2 * HV, scale=K**-0.5, plan=ck_plan, state_pool=layers[0]["state_pool"],
        state_indices=slots, has_initial_state=has_initial, out=layers[0]["out"],
        checkpoints=torch.empty(ck_plan.num_checkpoints, HV, K, K), bind=holder)
    assert holder == {}


def _bound_or_skip(holder: dict, key: str):
    """The bound launch of an op call, which exists only for library kernels: an error where a
    library was named (``QLA_KERNEL_LIBRARY``, as the GPU session runs the suite), else a skip."""
    if key not in holder:
        if os.environ.get("QLA_KERNEL_LIBRARY"):
            pytest.fail(f"the op bound no {key} launch although QLA_KERNEL_LIBRARY is set")
        pytest.skip("the kernels came from TileLang, not a library: nothing is bound")
    return holder[key]


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_bound_decode_on_the_gpu_writes_what_the_op_writes(pool_dtype):
    """A later layer's decode on the launch the first layer bound: output and pool bit for bit what
    the op writes for that layer (engine layout: packed conv output, gate halves, a padded row)."""
    import qla_serving

    N, H, HV, K = 6, 4, 16, 128
    dev = "cuda"
    slots = torch.tensor([3, 0, 7, 1, 5, 8], dtype=torch.int32, device=dev)  # 0: vLLM's null block

    def layer():
        packed = torch.randn(N, (2 * H + HV) * K, device=dev).to(torch.bfloat16)
        q, k, v = (x.view(N, -1, K) for x in packed.split([H * K, H * K, HV * K], dim=-1))
        a, b = torch.randn(N, 2 * HV, device=dev).to(torch.bfloat16).split([HV, HV], dim=-1)
        # (vLLM's parameter dtypes, the shipped library's: A_log float32, dt_bias the activations')
        return dict(q=q, k=k, v=v, a=a, b=b, A_log=torch.rand(HV, device=dev),
                    dt_bias=torch.randn(HV, device=dev).to(torch.bfloat16),
                    state_pool=(0.3 * torch.randn(9, HV, K, K, device=dev)).to(pool_dtype),
                    out=torch.full((N, HV, K), float("nan"), device=dev, dtype=torch.bfloat16))

    def op(t, bind=None):
        qla_serving.gated_delta_rule_decode(*(t[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_pool")),
                                            slots, out=t["out"], min_slot=1, bind=bind)

    first, second = layer(), layer()
    holder = {}
    op(first, holder)
    bound = _bound_or_skip(holder, "decode")
    ref = {**second, "state_pool": second["state_pool"].clone(), "out": second["out"].clone()}
    op(ref)
    bound([second[n].data_ptr() for n in decode.DECODE_BOUND_INPUTS])
    torch.cuda.synchronize()
    assert torch.equal(second["out"], ref["out"]) and torch.equal(second["state_pool"], ref["state_pool"])
    assert not second["out"][1].any()  # the padded row: zero output


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,cp", [([700, 3, 129], False), ([9000, 300], True)])
def test_bound_packed_prefill_on_the_gpu_writes_what_the_op_writes(pool_dtype, lens, cp):
    """A later layer's packed prefill on the launches the first layer bound (the step's workspaces
    reused; under AutoCP the snapshot refreshed from this layer's pool): output and pool bit for
    bit what the op writes for that layer."""
    import qla_serving
    from qla_serving.plan import plan_prefill

    H, HV, K = 2, 8, 128
    dev, T = "cuda", sum(lens)
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    plan = plan_prefill(cu, device=dev, num_v_heads=HV, cp_segment_tokens=1024 if cp else 0)
    assert (plan.context_parallel is not None) == cp
    slots = torch.tensor([4, 1, 6][: len(lens)], dtype=torch.int32, device=dev)
    has_initial = torch.tensor([True, False, True][: len(lens)], device=dev)

    def layer():
        ab = torch.randn(T, 2 * HV, device=dev).to(torch.bfloat16)
        return dict(qkv=torch.randn(T, (2 * H + HV) * K, device=dev).to(torch.bfloat16), a=ab[:, :HV], b=ab[:, HV:],
                    A_log=torch.empty(HV, device=dev).uniform_(0.0, 1.5),
                    dt_bias=torch.empty(HV, device=dev).uniform_(-3.0, 0.0).to(torch.bfloat16),
                    state_pool=(0.3 * torch.randn(8, HV, K, K, device=dev)).to(pool_dtype),
                    out=torch.full((T, HV, K), float("nan"), device=dev, dtype=torch.bfloat16))

    def op(t, bind=None):
        qla_serving.chunk_gated_delta_rule_pool_packed(
            t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], t["state_pool"], slots, num_qk_heads=H, plan=plan,
            has_initial_state=has_initial, out=t["out"], bind=bind)

    first, second = layer(), layer()
    holder = {}
    op(first, holder)
    bound = _bound_or_skip(holder, "prefill")
    assert (bound.snapshot is not None) == cp
    ref = {**second, "state_pool": second["state_pool"].clone(), "out": second["out"].clone()}
    op(ref)
    bound([second[n].data_ptr() for n in chunk_prefill.PREFILL_BOUND_INPUTS], second["state_pool"])
    torch.cuda.synchronize()
    assert torch.isfinite(second["out"]).all()
    assert torch.equal(second["out"], ref["out"]) and torch.equal(second["state_pool"], ref["state_pool"])


def test_ops_hand_the_kernels_packed_slots(monkeypatch):
    """A speculative vLLM server's state indices are a block-table column (stride 1 + drafts): the
    kernels read slots as a packed array from their address, so the ops pass packed copies of the
    same values (and bind nothing to them)."""
    import qla_serving
    from qla_serving import backend
    from qla_serving.plan import plan_prefill

    got = []
    monkeypatch.setattr(backend, "kernel_entry",
                        lambda *a, **k: (lambda *args, **kw: got.append((kw["state_indices"], kw["bind"]))))
    N, H, HV, K = 3, 2, 4, 128
    t = _engine_decode_inputs(N, H, HV, K)
    table = torch.tensor([[1, 9, 10], [2, 11, 12], [3, 13, 14]], dtype=torch.int32)
    args = [t[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_pool")]
    t["state_pool"] = torch.zeros(16, HV, K, K)
    args[7] = t["state_pool"]
    qla_serving.gated_delta_rule_decode(*args, table[:, 0], out=t["out"], min_slot=1, bind={})
    (slots, bind), = got
    assert slots.is_contiguous() and slots.tolist() == [1, 2, 3] and bind is None
    got.clear()
    plan = plan_prefill([0, 40, 100, 130], device="cpu", num_v_heads=HV)
    ab = torch.randn(130, 2 * HV, dtype=torch.bfloat16)
    qkv = torch.randn(130, (2 * H + HV) * K, dtype=torch.bfloat16)
    qla_serving.chunk_gated_delta_rule_pool_packed(
        qkv, ab[:, :HV], ab[:, HV:], torch.randn(HV), torch.randn(HV), torch.zeros(16, HV, K, K), table[:, 0],
        num_qk_heads=H, plan=plan, bind={})
    (slots, bind), = got
    assert slots.is_contiguous() and slots.tolist() == [1, 2, 3] and bind is None
