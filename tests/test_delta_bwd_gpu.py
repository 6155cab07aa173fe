"""The chunked delta-rule backward kernels on a CUDA device (skipped without one).

Same oracle as tests/test_delta_bwd.py (autograd through the float64 recurrence, run on the device),
at the production shape: bf16, B=2, T=2048, H=4, K=V=128. Gradients are checked on the GPU itself:
Triton miscompiles on Hopper have hit delta-rule backward kernels before (fla issue #640).
"""

from __future__ import annotations

import pytest
import torch
from test_delta_bwd import DELTANET, GDN, GDN2, GRAD_NAMES, KDA, build_case, check_case, run_bwd
from tolerances import assert_close

VARIANTS = [DELTANET, GDN, KDA, GDN2]
IDS = ["deltanet", "gdn", "kda", "gdn2"]


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", VARIANTS, ids=IDS)
def test_bwd_gpu_bf16_production_shape(kinds):
    check_case(*build_case(2, 2048, 4, 4, 128, 128, kinds, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kinds", VARIANTS, ids=IDS)
def test_bwd_gpu_gva_varlen(kinds, dtype):
    check_case(*build_case(1, 700, 2, 4, 64, 96, kinds, dtype=dtype, seqlens=[300, 1, 399], device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("K,V", [(256, 256), (192, 48), (48, 192)])
def test_bwd_gpu_wide_and_odd_heads(K, V):
    check_case(*build_case(1, 300, 2, 2, K, V, GDN2, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", VARIANTS, ids=IDS)
def test_bwd_gpu_keys_of_512(kinds):
    # the reverse scan with dH in memory (its barriers order the block reads and writes across threads,
    # which the interpreter cannot check), varlen, and deterministic
    case = build_case(1, 700, 2, 2, 512, 512, kinds, dtype=torch.bfloat16, seqlens=[300, 1, 399], device="cuda")
    first = check_case(*case)
    second = run_bwd(case[0], 512**-0.5, *case[1:], 64)
    for name, a, c in zip(GRAD_NAMES, first, second):
        assert (a is None and c is None) or torch.equal(a, c), f"{name} differs between two runs"


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", VARIANTS, ids=IDS)
def test_bwd_gpu_mma_sync_tiles(kinds, monkeypatch):
    # the narrower dqk key blocks of every GPU without warpgroup products, run on this one
    import lamina.kernels.delta_chunk_bwd as bwd

    monkeypatch.setattr(bwd, "has_warpgroup_mma", lambda device: False)
    check_case(*build_case(1, 1000, 2, 4, 128, 128, kinds, dtype=torch.bfloat16, seqlens=[600, 400], device="cuda"))


@pytest.mark.gpu
def test_bwd_gpu_finite_at_minus_20():
    inputs, cu, do, dfinal = build_case(1, 4096, 2, 2, 128, 128, KDA, dtype=torch.bfloat16, device="cuda")
    g = inputs[3]
    g[..., ::3] = -20.0
    got = run_bwd(inputs, 128**-0.5, cu, do, dfinal, 64)
    for name, x in zip(GRAD_NAMES, got):
        if x is not None:
            assert bool(torch.isfinite(x).all()), f"{name} has NaN/inf"


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", [GDN, GDN2], ids=["gdn", "gdn2"])
def test_bwd_gpu_deterministic(kinds):
    inputs, cu, do, dfinal = build_case(1, 1024, 4, 8, 128, 128, kinds, dtype=torch.bfloat16,
                                        seqlens=[500, 524], device="cuda")
    first = run_bwd(inputs, 0.1, cu, do, dfinal, 64)
    second = run_bwd(inputs, 0.1, cu, do, dfinal, 64)
    for name, a, c in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, c), f"{name} differs between two runs"


@pytest.mark.gpu
def test_float32_training_takes_the_torch_path_on_cuda():
    # float32 with backend="auto" runs the PyTorch path on CUDA, training and inference (the float32 chunked Triton
    # kernels gave wrong gradients and illegal memory accesses), right against float64; backend="triton" refuses it
    # with the reason
    import lamina
    from lamina.reference import delta_rule_family_recurrent_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, v = (torch.randn(1, 100, 2, 32, device="cuda", generator=gen) for _ in range(2))
    k = torch.nn.functional.normalize(torch.randn(1, 100, 2, 32, device="cuda", generator=gen), dim=-1)
    g = -torch.rand(1, 100, 2, device="cuda", generator=gen)
    beta = torch.rand(1, 100, 2, device="cuda", generator=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, _ = lamina.chunk_gated_delta_rule(*leaves[:3], g=leaves[3], beta=leaves[4], scale=0.2, backend="auto")
    o.sum().backward()
    ref = [x.double().requires_grad_() for x in (q, k, v, g, beta)]
    ro, _ = delta_rule_family_recurrent_ref(ref[0], ref[1], ref[2], ref[3], ref[4], ref[4], 0.2, None, False, None)
    ro.sum().backward()
    for name, a, r in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], [o] + [x.grad for x in leaves],
                          [ro] + [x.grad for x in ref]):
        assert_close(name, a, r, dtype=torch.float32)
    with pytest.raises(ValueError, match="float32"):
        lamina.chunk_gated_delta_rule(*leaves[:3], g=leaves[3], beta=leaves[4], backend="triton")
    # the chunked forward alone too (an illegal memory access of the float32 KDA forward on an H100)
    with torch.no_grad():
        o, _ = lamina.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=0.2, backend="auto")
        assert_close("o (no gradients)", o, ro.detach(), dtype=torch.float32)
        with pytest.raises(ValueError, match="float32 inputs in the chunked forward"):
            lamina.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("device_tiles", [True, False], ids=["device-tiles", "mma-sync-tiles"])
@pytest.mark.parametrize("kinds", [KDA, GDN2], ids=["kda", "gdn2"])
def test_bwd_gpu_channel_dots(kinds, device_tiles, monkeypatch):
    # DeltaTuning.channel_dots: the per-channel intra-chunk products on tensor cores, at the production shape
    # and varlen, and finite at g = -20; with the device's tiles (on Hopper, dk's transposes as grams of their
    # own) and with those of GPUs without warpgroup products (tl.trans of dP and dM: on Hopper, the shape of the
    # Triton 3.4-3.6 miscompile, a transposed product result fed to a product)
    import lamina.kernels.delta_chunk_bwd as bwd
    from lamina.kernels.delta_tuning import delta_tuning

    if not device_tiles:
        monkeypatch.setattr(bwd, "has_warpgroup_mma", lambda device: False)
    with delta_tuning(channel_dots=True):
        check_case(*build_case(2, 2048, 4, 4, 128, 128, kinds, dtype=torch.bfloat16, device="cuda"))
        check_case(*build_case(1, 700, 2, 4, 64, 96, kinds, dtype=torch.bfloat16, seqlens=[300, 1, 399],
                               device="cuda"))
        inputs, cu, do, dfinal = build_case(1, 4096, 2, 2, 128, 128, kinds, dtype=torch.bfloat16, device="cuda")
        inputs[3][..., ::3] = -20.0
        got = run_bwd(inputs, 128**-0.5, cu, do, dfinal, 64)
    for name, x in zip(GRAD_NAMES, got):
        if x is not None:
            assert bool(torch.isfinite(x).all()), f"{name} has NaN/inf"
