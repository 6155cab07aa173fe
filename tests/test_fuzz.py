"""`lamina fuzz`: cases pass against the references, and a wrong kernel is reported with its seed."""

from __future__ import annotations

import pytest

import lamina
from lamina import fuzz


@pytest.mark.parametrize("op", ["delta_rule", "hrm_gated_update", "prism_attention"])
def test_fuzz_torch_path_passes(op):
    lines: list[str] = []
    assert fuzz.main(["--op", op, "--iters", "2", "--seed", "3", "--backend", "torch", "--device", "cpu"],
                     log=lines.append) == 0, "\n".join(lines)
    assert lines[-1] == "2 passed, 0 failed"


@pytest.mark.interpret
def test_fuzz_triton_kernels_under_interpreter():
    lines: list[str] = []
    code = fuzz.main(["--op", "gated_delta_rule", "--iters", "1", "--seed", "5", "--backend", "triton",
                      "--device", "cpu"], log=lines.append)
    assert code == 0, "\n".join(lines)


def test_fuzz_reports_a_wrong_op_with_a_reproducer(monkeypatch):
    real = lamina.hrm_gated_update

    def off_by_a_bit(*args, **kwargs):
        return real(*args, **kwargs) * (1 + 1e-2)

    monkeypatch.setattr(lamina, "hrm_gated_update", off_by_a_bit)
    lines: list[str] = []
    code = fuzz.main(["--op", "hrm_gated_update", "--iters", "1", "--seed", "11", "--backend", "torch",
                      "--device", "cpu", "--no-grad"], log=lines.append)
    assert code == 1
    text = "\n".join(lines)
    assert "FAIL" in text and "--seed 11" in text and lines[-1] == "0 passed, 1 failed"


def test_fuzz_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        fuzz.main(["--op", "nope"])
    with pytest.raises(SystemExit):
        fuzz.main(["--iters", "0"])


def test_fuzz_cases_are_reproducible():
    assert fuzz.run_case("hrm_gated_update", 7, "cpu", "torch", False) == \
        fuzz.run_case("hrm_gated_update", 7, "cpu", "torch", False)
