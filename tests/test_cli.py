"""`qla-serving check` runs the ops and compares them with the oracle."""

import pytest

from qla_serving import cli


def test_check_small_batch_passes(capsys):
    rc = cli.main(["check", "--heads", "2/6", "--lengths", "1,64,70", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "prefill o" in out and "decode states" in out and "FAIL" not in out
    assert "8 passed, 0 failed" in out


def test_check_rows_fail_on_wrong_results():
    rows = cli.run_check((1, 2), (5, 70), device="cpu")
    assert all(r.ok for r in rows)
    bad = cli.CheckRow("x", "y", "z", float("nan"), 1.0, 0.0)
    assert not bad.ok and "FAIL" in cli.format_table([bad])


def test_bench_needs_an_op():
    with pytest.raises(SystemExit):
        cli.main(["bench"])


@pytest.mark.parametrize("heads,message", [("3/8", "HV must be a positive multiple of H"), ("16x48", "expected Hqk/Hv")])
def test_heads_argument_names_the_constraint(capsys, heads, message):
    with pytest.raises(SystemExit):
        cli.main(["check", "--heads", heads])
    assert message in capsys.readouterr().err
