"""scripts/ncu_hot.py on a page shaped like Nsight Compute's `--page source --csv` output."""

import lzma
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "ncu_hot.py"
PAGE = (
    "prep_kernel\n"
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"\n'
    '"0x10","LDS R4, [R2]","30","10"\n'
    '"0x20","FFMA R1, R2, R3, R4","10","0"\n'
    "\n"
    "chunk_fwd_kernel\n"
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"\n'
    '"0x10","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ","1,200","1,000"\n'
    '"0x20","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3","2,800","2,790"\n'
    '"0x30","FFMA R1, R2, R3, R4","0","0"\n'
)


def _run(*args, stdin=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], input=stdin, capture_output=True, text=True, check=False)


def test_hottest_lines_per_kernel_in_order(tmp_path):
    path = tmp_path / "page.csv.xz"
    with lzma.open(path, "wt") as f:
        f.write(PAGE)
    r = _run(str(path), "--top", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    k = out.index(next(line for line in out if line.startswith("== chunk_fwd_kernel")))
    assert "4000 samples" in out[k]
    assert out[k + 1].lstrip().startswith("70.0%") and "SYNCS.PHASECHK" in out[k + 1]
    assert out[k + 2].lstrip().startswith("30.0%") and "(Not-issued Samples)=1,000" in out[k + 2]
    assert len(out) == k + 3  # --top 2, and the zero-sample line is not listed
    assert out[0].startswith("== prep_kernel") and "75.0%" in out[1]


def test_not_a_source_page_fails():
    r = _run(stdin="ID,Kernel Name,Duration\n1,prep,3\n")
    assert r.returncode == 1 and "no sample columns" in r.stdout


# The shape ncu 2025 (the device image's) prints: a "Kernel Name" row before each table, and
# per-reason stall columns; abridged from a real page.
PAGE_2025 = (
    '"Kernel Name","prep_kernel",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"# Samples","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"\n'
    '"0x7efbff7c4700","      LDC R1, c[0x0][0x28]","408","342","408","0","407","0"\n'
    '"0x7efbff7d0c10","@P4   BRA 0x7efbff7d1800","9500","9400","9500","9500","0","9400"\n'
    '"Kernel Name","chunk_fwd_kernel",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"# Samples","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"\n'
    '"0x7efbf7410600","@!P0  BRA 0x7efbf7421160","29820","29000","29820","0","29820","0"\n'
)


def test_pages_with_kernel_name_rows_and_stall_columns():
    r = _run("-", "--top", "1", stdin=PAGE_2025)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "== prep_kernel: 2 lines, 9908 samples in 'Warp Stall Sampling (All Samples)'"
    assert out[1].strip() == "by reason: barrier 95.9%, long_sb 4.1%"  # Not Issued columns left out
    assert out[2].lstrip().startswith("95.9%") and "BRA 0x7efbff7d1800" in out[2] and "barrier 9500" in out[2]
    assert out[3].startswith("== chunk_fwd_kernel: 1 lines") and "long_sb 100.0%" in out[4]

