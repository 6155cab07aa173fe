"""The dispatch contract and the boundary validators."""

from __future__ import annotations

import pytest
import torch

from lamina._dispatch import BACKENDS, interpreter_enabled, select_backend
from lamina._validate import check_cu_seqlens, check_same_device, check_shape, check_tensor


def test_auto_on_cpu_follows_interpreter(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter_enabled()
    assert select_backend("op", "auto", [x]) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_backend("op", "auto", [x]) == "torch"
    assert select_backend("op", "torch", [x]) == "torch"


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("my_op", "triton", [torch.zeros(1)])


def test_unknown_backend_and_cuda_backend_errors():
    with pytest.raises(ValueError, match="backend must be one of"):
        select_backend("my_op", "tpu", [torch.zeros(1)])
    with pytest.raises(ValueError, match="no CUDA C\\+\\+ kernel"):
        select_backend("my_op", "cuda", [torch.zeros(1)])
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        select_backend("my_op", "cuda", [torch.zeros(1)], has_cuda_kernel=True)
    assert set(BACKENDS) == {"auto", "triton", "cuda", "torch"}


def test_validators_name_the_argument():
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        check_tensor("q", [1, 2])
    with pytest.raises(ValueError, match="q must have 4 dimensions, got shape \\(2, 3\\)"):
        check_tensor("q", torch.zeros(2, 3), ndim=4)
    with pytest.raises(ValueError, match="k must have dtype"):
        check_tensor("k", torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="v must have shape \\(1, 2\\)"):
        check_shape("v", torch.zeros(2, 1), (1, 2))
    assert check_same_device(a=torch.zeros(1), b=None).type == "cpu"


@pytest.mark.parametrize(
    "offsets, batch, total, message",
    [
        ([0, 3, 5], 2, 5, "batch size 1"),
        ([1, 3, 5], 1, 5, "must start at 0"),
        ([0, 4, 3, 5], 1, 5, "non-decreasing"),
        ([0, 3, 6], 1, 5, "must end at the packed length"),
        ([0], 1, 0, "at least 2 offsets"),
    ],
)
def test_cu_seqlens_errors(offsets, batch, total, message):
    with pytest.raises(ValueError, match=message):
        check_cu_seqlens(torch.tensor(offsets, dtype=torch.int32), batch, total)


def test_cu_seqlens_ok_and_dtype():
    assert check_cu_seqlens(torch.tensor([0, 3, 3, 7]), 1, 7) == 3
    assert check_cu_seqlens(None, 4, 100) == 4
    with pytest.raises(ValueError, match="cu_seqlens must have dtype"):
        check_cu_seqlens(torch.tensor([0.0, 7.0]), 1, 7)
