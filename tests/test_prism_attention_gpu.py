"""Prism attention on a CUDA device: bf16/fp16, larger shapes, every head-dim bucket, all gradients.

Same bound as the interpreter tests (tests/tolerances.py): at most 2x (outputs) / 3x (gradients)
PyTorch's own low-precision error against a float64 reference computed on the device.
"""

from __future__ import annotations

import pytest
import torch

from lamina import prism_attention
from lamina.reference.attention import attention_ref
from tests.tolerances import assert_attention_close

pytestmark = pytest.mark.gpu

HEAD_DIMS = [16, 48, 64, 96, 128, 192, 256, 320, 384, 512]


def _check(b, t, s, h, hk, d, dtype, causal, cu_q=None, cu_k=None, **options):
    dev = "cuda"
    q64 = torch.randn(b, t, h, d, dtype=torch.float64, device=dev)
    k64 = torch.randn(b, s, hk, d, dtype=torch.float64, device=dev)
    v64 = torch.randn(b, s, hk, d, dtype=torch.float64, device=dev)
    do = torch.randn(b, t, h, d, dtype=torch.float64, device=dev)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)  # options: window_size, softcap
    low = [x.to(dtype) for x in (q64, k64, v64)]

    def run(fn, ins, out_dtype):
        ins = [x.clone().requires_grad_() for x in ins]
        o = fn(*ins)
        return o, torch.autograd.grad(o, ins, do.to(out_dtype))

    ours = run(lambda *a: prism_attention(*a, causal=causal, backend="triton", **varlen), low, dtype)
    ref = run(lambda *a: attention_ref(*a, causal=causal, **varlen), [x.double() for x in low], torch.float64)
    ref_low = run(lambda *a: attention_ref(*a, causal=causal, **varlen), low, dtype)
    assert_attention_close("o", ours[0], ref[0], ref_low[0])
    for name, a, r, p in zip(("dq", "dk", "dv"), ours[1], ref[1], ref_low[1]):
        assert_attention_close(name, a, r, p, grad=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_every_head_dim_bf16(d, causal):
    _check(2, 512, 512, 4, 2, d, torch.bfloat16, causal)


@pytest.mark.parametrize("d", [64, 256, 512])
@pytest.mark.parametrize("t, s", [(300, 700), (700, 300)])
def test_unequal_lengths_fp16(d, t, s):
    _check(1, t, s, 2, 1, d, torch.float16, True)


@pytest.mark.parametrize("d", [128, 320])
def test_varlen_bf16(d):
    lens_q, lens_k = [130, 511, 64], [200, 300, 64]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    _check(1, sum(lens_q), sum(lens_k), 4, 1, d, torch.bfloat16, True, cu(lens_q), cu(lens_k))


@pytest.mark.parametrize("d", [128, 512])
def test_float32_full_precision(d):
    _check(1, 256, 256, 2, 2, d, torch.float32, True)


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_long_sequence_bf16(d):
    _check(1, 2048, 2048, 2, 2, d, torch.bfloat16, True)


@pytest.mark.parametrize("d", [64, 96, 128, 256, 320, 512])
@pytest.mark.parametrize("causal, window, softcap", [(True, (200, -1), 0.0), (False, (100, 37), 0.0),
                                                     (True, (-1, -1), 30.0), (False, (64, 0), 20.0)])
def test_window_and_softcap_bf16(d, causal, window, softcap):
    _check(2, 512, 512, 4, 2, d, torch.bfloat16, causal, window_size=window, softcap=softcap)


@pytest.mark.parametrize("path", ["flash-attn", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_outside_paths_equal_the_reference(path, d):
    """Each outside path the dispatcher may choose, through ``attention_dispatch.run``, against the float64
    reference (bf16, causal, GQA; FlashAttention also with a window and softcapping): the semantics the
    dispatcher promises. A path this installation or card lacks is skipped with its reason."""
    from lamina.ops import attention_dispatch as dispatch

    if path not in dispatch.available("cuda"):
        pytest.skip(f"{path} is not installed")
    options = [{}] + ([{"window_size": (100, 0), "softcap": 20.0}] if path == "flash-attn" else [])
    for extra in options:
        low = [torch.randn(2, 384, h, d, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2)]
        ins = [x.clone().requires_grad_() for x in low]
        try:
            o = dispatch.run(path, *ins, True, d ** -0.5, **extra)
        except RuntimeError as err:  # a backend that does not take this head dim on this card
            pytest.skip(f"{path} at D={d}: {str(err).splitlines()[0][:200]}")
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, ins, do)
        refs64 = [x.double().requires_grad_() for x in low]
        ref = attention_ref(*refs64, causal=True, **extra)
        ref_grads = torch.autograd.grad(ref, refs64, do.double())
        low_ins = [x.clone().requires_grad_() for x in low]
        ref_low = attention_ref(*low_ins, causal=True, **extra)
        low_grads = torch.autograd.grad(ref_low, low_ins, do)
        assert_attention_close("o", o, ref, ref_low)
        for name, a, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
            assert_attention_close(name, a, r, p, grad=True)
