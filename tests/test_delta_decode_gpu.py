"""The decode step on a GPU: a 64-step decode loop captured in a CUDA graph replays to the eager loop's result.

The step allocates nothing when given ``out=`` and ``inplace_final_state=True`` with ``check_indices=False``
(no host read of the slot table), so the loop can be captured.
"""

from __future__ import annotations

import pytest
import torch
from tolerances import assert_close

import lamina

pytestmark = pytest.mark.gpu

B, H, HV, K, V, STEPS = 16, 8, 16, 128, 128, 64


def _inputs(device):
    gen = torch.Generator(device=device).manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    q, k = r(STEPS, B, 1, H, K).bfloat16(), r(STEPS, B, 1, H, K).bfloat16()
    v = r(STEPS, B, 1, HV, V).bfloat16()
    g, beta = r(STEPS, B, 1, HV).bfloat16(), r(STEPS, B, 1, HV).bfloat16()
    A_log, dt_bias = r(HV) * 0.3, r(HV)
    return q, k, v, g, beta, A_log, dt_bias


def _loop(pool, slots, out, x):
    q, k, v, g, beta, A_log, dt_bias = x
    for t in range(STEPS):
        lamina.fused_recurrent_gated_delta_rule(
            q[t], k[t], v[t], g=g[t], beta=beta[t], initial_state=pool, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=True,
            inplace_final_state=True, ssm_state_indices=slots, out=out[t], check_indices=False)


@torch.no_grad()
def test_cuda_graph_of_a_64_step_decode_loop():
    device = torch.device("cuda")
    x = _inputs(device)
    slots = torch.randperm(2 * B, device=device)[:B]
    pool0 = torch.randn(2 * B, HV, V, K, device=device)
    eager_pool, eager_out = pool0.clone(), torch.empty(STEPS, B, 1, HV, V, device=device, dtype=torch.bfloat16)
    _loop(eager_pool, slots, eager_out, x)

    pool, out = pool0.clone(), torch.empty_like(eager_out)
    _loop(pool.clone(), slots, out, x)  # warm-up: compile the kernel before capture (on a scratch pool)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        _loop(pool, slots, out, x)
    torch.cuda.current_stream().wait_stream(stream)
    pool.copy_(pool0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out)
    assert torch.equal(pool, eager_pool)


def _ext_with_cuda() -> bool:
    from lamina._optional import compiled_extension

    ext = compiled_extension()
    return bool(getattr(ext, "WITH_CUDA", False)) and hasattr(torch.ops.lamina_C, "delta_decode_step")


@torch.no_grad()
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize("batch", [1, 64])
def test_decode_step_on_the_gpu_matches_the_pytorch_step(backend, variant, batch):
    """bf16 inputs, fp32 pool [2B, HV, V, K] in place, one token, fla's in-kernel gate options: the GPU step and
    the PyTorch step in float64 on the same inputs agree on the outputs and the updated slots."""
    if backend == "cuda" and not _ext_with_cuda():
        pytest.skip("lamina._C is not built with CUDA (LAMINA_BUILD_CUDA=1)")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(batch)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    hv = 32
    q, k, v = r(batch, 1, hv, K).bfloat16(), r(batch, 1, hv, K).bfloat16(), r(batch, 1, hv, V).bfloat16()
    beta, A_log = r(batch, 1, hv).bfloat16(), r(hv) * 0.3
    pool = r(2 * batch, hv, V, K)
    slots = torch.randperm(2 * batch, device=device)[:batch].to(torch.int32)
    slots[0] = -1  # skipped row
    if variant == "gdn":
        g, dt_bias = r(batch, 1, hv).bfloat16(), r(hv)
        op = lamina.fused_recurrent_gated_delta_rule
        args, kw = (q, k, v), dict(g=g, beta=beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    else:
        g, dt_bias = r(batch, 1, hv, K).bfloat16(), r(hv * K)
        op = lamina.fused_recurrent_kda
        args, kw = (q, k, v, g, beta), dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True)
    common = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                  inplace_final_state=True, ssm_state_indices=slots, **kw)
    ref_pool = pool.double()
    ref_args = tuple(a.double() for a in args)
    ref_kw = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
              for n, x in common.items()}
    ref_pool_f32 = pool.clone()
    o_ref, _ = op(*ref_args, initial_state=ref_pool_f32, backend="torch", **ref_kw)
    del ref_pool
    o, _ = op(*args, initial_state=pool, backend=backend, **common)
    assert_close(f"{variant} {backend} o", o, o_ref, dtype=torch.bfloat16)
    assert_close(f"{variant} {backend} pool", pool, ref_pool_f32, dtype=torch.bfloat16)
