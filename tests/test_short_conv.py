"""The short convolution: ``causal_conv1d`` / ``causal_conv1d_update`` (Triton under the interpreter and
PyTorch) against the float64 reference with every gradient, varlen, window states, decoding, strided
inputs, errors, and ``ShortConvolution`` against nn.Conv1d (fla checkpoints: test_fla_module_parity.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lamina.layers.short_conv import ShortConvolution
from lamina.ops.short_conv import causal_conv1d, causal_conv1d_update
from lamina.reference.short_conv import causal_conv1d_ref, causal_conv1d_update_ref
from tests.tolerances import assert_close

# D = 40: not a multiple of the channel tiles (masked columns); T = 20: two interpreter tiles of 16
# tokens, the second partial, so windows reach across a tile edge.
B, T, D = 2, 20, 40
# Packed lengths: an empty sequence and sequences shorter than the window, next to longer ones.
CU_SEQLENS = (0, 3, 20, 20, 21, 45)
GRAD_NAMES = ("dx", "dweight", "dbias", "dresidual", "dinitial_state")


def make_inputs(shape, W, dtype, bias=True, residual=True, state=True, n_seq=None, seed=0):
    """x, weight, bias, residual, initial_state; weight and bias in float32 (module parameters)."""
    g = torch.Generator().manual_seed(seed)
    n_seq = shape[0] if n_seq is None else n_seq
    x = torch.randn(shape, generator=g).to(dtype)
    w = torch.randn(shape[-1], W, generator=g) / W ** 0.5
    b = torch.randn(shape[-1], generator=g) if bias else None
    r = torch.randn(shape, generator=g).to(dtype) if residual else None
    s = torch.randn(n_seq, shape[-1], W, generator=g).to(dtype) if state else None
    return x, w, b, r, s


def run(fn, inputs, activation, cu_seqlens, cotangents=None, **kwargs):
    """(y, final_state, gradients, cotangents) of ``fn`` for the loss ``<y, dy> + <final, dht>``;
    random cotangents in the outputs' dtype unless given."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    y, final = fn(*leaves, output_final_state=True, activation=activation, cu_seqlens=cu_seqlens, **kwargs)
    if cotangents is None:
        g = torch.Generator().manual_seed(1)
        cotangents = (torch.randn(y.shape, generator=g).to(y.dtype),
                      torch.randn(final.shape, generator=g).to(final.dtype))
    dy, dht = cotangents
    loss = (y.double() * dy.double()).sum() + (final.double() * dht.double()).sum()
    loss.backward()
    return y, final, [t.grad if t is not None else None for t in leaves], cotangents


def check(inputs, backend, activation="silu", cu_seqlens=None):
    dtype = inputs[0].dtype
    y, final, grads, cotangents = run(causal_conv1d, inputs, activation, cu_seqlens, backend=backend)
    inputs64 = [t.double() if t is not None else None for t in inputs]
    y_ref, final_ref, grads_ref, _ = run(causal_conv1d_ref, inputs64, activation, cu_seqlens, cotangents)
    assert y.dtype == dtype and final.dtype == dtype
    assert_close("y", y, y_ref, kind="elementwise", dtype=dtype)
    assert_close("final_state", final, final_ref, kind="elementwise", dtype=dtype)
    for name, grad, grad_ref, inp in zip(GRAD_NAMES, grads, grads_ref, inputs):
        if inp is None:
            assert grad is None, name
            continue
        assert grad.dtype == inp.dtype and grad.shape == inp.shape, name
        if name == "dresidual":  # dy itself
            assert_close(name, grad, grad_ref, kind="elementwise", dtype=dtype)
        elif name in ("dweight", "dbias"):  # sums over every token, accumulated in float32
            assert_close(name, grad, grad_ref, kind="recurrence", dtype=torch.float32)
        else:  # sums of W products of either sign (cancellation): RMS error ratio
            assert_close(name, grad, grad_ref, kind="recurrence", dtype=dtype)


# (W, activation, bias, residual, initial state, dtype)
CASES = [
    (4, "silu", True, True, True, torch.float32),
    (4, "silu", True, True, True, torch.bfloat16),
    (2, None, False, False, True, torch.float32),
    (3, "swish", True, False, False, torch.float16),
    (8, "silu", False, True, True, torch.float32),
    # the kernels take W at run time (one compiled kernel for every window): the narrowest and widest
    (1, "silu", True, False, True, torch.float32),
    (16, "silu", True, True, True, torch.float32),
]


@pytest.mark.interpret
@pytest.mark.parametrize("W, activation, bias, residual, state, dtype", CASES)
def test_triton_matches_reference(W, activation, bias, residual, state, dtype):
    check(make_inputs((B, T, D), W, dtype, bias, residual, state), "triton", activation)


@pytest.mark.parametrize("W, activation, bias, residual, state, dtype", CASES)
def test_torch_matches_reference(W, activation, bias, residual, state, dtype):
    check(make_inputs((B, T, D), W, dtype, bias, residual, state), "torch", activation)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "torch"])
@pytest.mark.parametrize("state", [True, False])
def test_varlen_matches_reference(backend, state):
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    inputs = make_inputs((1, CU_SEQLENS[-1], D), 4, torch.float32, state=state, n_seq=len(CU_SEQLENS) - 1)
    check(inputs, backend, "silu", cu)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "torch"])
def test_varlen_equals_separate_sequences(backend):
    cu = torch.tensor(CU_SEQLENS)
    x, w, b, r, s = make_inputs((1, CU_SEQLENS[-1], D), 4, torch.float32, n_seq=len(CU_SEQLENS) - 1)
    y, final = causal_conv1d(x, w, b, r, s, True, "silu", backend, cu, cu_seqlens_cpu=cu.clone())
    for n, (bos, eos) in enumerate(zip(CU_SEQLENS[:-1], CU_SEQLENS[1:])):
        y_n, f_n = causal_conv1d(x[:, bos:eos], w, b, r[:, bos:eos], s[n:n + 1], True, "silu", backend)
        torch.testing.assert_close(y[:, bos:eos], y_n, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(final[n:n + 1], f_n, rtol=0, atol=0)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "torch"])
def test_decoding_and_chunked_prefill_equal_the_full_sequence(backend):
    """Prefill a prefix (final state out), continue from it (initial state in), then decode token by
    token with the in-place cache: every output and the last window equal one full-sequence call."""
    T_ = 14
    x, w, b, r, s = make_inputs((B, T_, D), 4, torch.float32)
    y_full, final_full = causal_conv1d(x, w, b, r, s, True, "silu", backend)
    y1, state = causal_conv1d(x[:, :5], w, b, r[:, :5], s, True, "silu", backend)
    y2, state = causal_conv1d(x[:, 5:9], w, b, r[:, 5:9], state, True, "silu", backend)
    ys = [y1, y2]
    cache = state.clone()
    for t in range(9, T_):
        y_t, out = causal_conv1d_update(x[:, t:t + 1], cache, r[:, t:t + 1], w, b, "silu", backend=backend)
        assert out is cache and y_t.shape == (B, 1, D)
        ys.append(y_t)
    torch.testing.assert_close(torch.cat(ys, dim=1), y_full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache, final_full, rtol=0, atol=0)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.interpret), "torch"])
@pytest.mark.parametrize("layout", ["n d", "n 1 d", "1 n d"])
def test_update_matches_reference(backend, layout):
    N, W = 3, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g).to(torch.bfloat16)
    cache = torch.randn(N, D, W, generator=g)
    w, b = torch.randn(D, W, generator=g), torch.randn(D, generator=g)
    res = torch.randn(N, D, generator=g).to(torch.bfloat16)
    y_ref, cache_ref = causal_conv1d_update_ref(x, cache, w, b, res, "silu")
    shape = {"n d": (N, D), "n 1 d": (N, 1, D), "1 n d": (1, N, D)}[layout]
    y, out = causal_conv1d_update(x.view(shape), cache, res.view(shape), w, b, "silu", backend=backend)
    assert y.shape == shape and y.dtype == torch.bfloat16 and out is cache
    assert_close("y", y.view(N, D), y_ref, kind="elementwise", dtype=torch.bfloat16)
    assert_close("cache", cache, cache_ref, kind="elementwise", dtype=torch.float32)


@pytest.mark.interpret
@pytest.mark.parametrize("layout", ["slice of a fused projection", "head split"])
def test_strided_and_head_split_inputs(layout):
    x, w, b, _, s = make_inputs((B, 20, D), 4, torch.float32, residual=False)
    if layout == "head split":
        leaf = x.view(B, 20, 4, D // 4).clone().requires_grad_()
        xin = leaf
    else:  # stride 3 * D along T
        leaf = torch.cat([torch.randn(B, 20, D), x, torch.randn(B, 20, D)], dim=-1).requires_grad_()
        xin = leaf[..., D:2 * D]
    y, _ = causal_conv1d(xin, w, b, None, s, activation="silu", backend="triton")
    assert y.shape == xin.shape
    dy = torch.randn(y.shape)
    y.backward(dy)
    dx = leaf.grad if layout == "head split" else leaf.grad[..., D:2 * D]
    x64 = x.double().requires_grad_()
    y_ref, _ = causal_conv1d_ref(x64, w.double(), b.double(), None, s.double(), activation="silu")
    y_ref.backward(dy.reshape(B, 20, D).double())
    assert_close("y", y.reshape(B, 20, D), y_ref, kind="elementwise", dtype=torch.float32)
    assert_close("dx", dx.reshape(B, 20, D), x64.grad, kind="recurrence", dtype=torch.float32)


@pytest.mark.interpret
def test_triton_backward_is_deterministic():
    inputs = make_inputs((1, 20, D), 4, torch.float32)
    first = run(causal_conv1d, inputs, "silu", None, backend="triton")[2]
    second = run(causal_conv1d, inputs, "silu", None, backend="triton")[2]
    for name, a, b in zip(GRAD_NAMES, first, second):
        assert a is None or torch.equal(a, b), name


class _LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel: records each launch's keyword arguments, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.interpret
def test_launches_use_the_static_reports_options(monkeypatch):
    """The forward, backward and state kernels run with the tiles, warps, stages and register budget that
    the static report compiles for them (BLOCK_T aside: the interpreter's is smaller)."""
    from lamina.kernels import short_conv as sc
    from lamina.kernels._utils import registered_aot

    names = ("_causal_conv1d_fwd_kernel", "_causal_conv1d_bwd_kernel", "_causal_conv1d_bwd_state_kernel",
             "_causal_conv1d_final_state_kernel")
    recorders = {name: _LaunchRecorder(getattr(sc, name)) for name in names}
    for name, recorder in recorders.items():
        monkeypatch.setattr(sc, name, recorder)
    check(make_inputs((B, T, D), 4, torch.bfloat16), "triton")
    for name, recorder in recorders.items():
        specs = [s for s in registered_aot() if s.name == name]
        assert specs and recorder.launches, name
        for kwargs in recorder.launches:
            for spec in specs:
                assert kwargs["BLOCK_D"] == spec.constexprs["BLOCK_D"], (name, spec.config)
                assert kwargs["num_warps"] == spec.num_warps, (name, spec.config)
                assert kwargs["num_stages"] == spec.num_stages, (name, spec.config)
                assert kwargs.get("maxnreg") == spec.maxnreg, (name, spec.config)


@pytest.mark.versions
@pytest.mark.interpret
def test_custom_ops_pass_opcheck():
    """Schema, autograd registration, fake implementations and AOT dispatch of the Triton path's ops."""
    from lamina.kernels.short_conv import tile_table

    x, w, b, r, s = (t.requires_grad_() for t in make_inputs((1, 9, 16), 4, torch.float32, n_seq=2))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    args = (x, w, b, r, s, cu, tile_table([4, 5], x.device), True, True)
    checks = [torch.library.opcheck(torch.ops.lamina.causal_conv1d_fwd.default, args)]
    step_args = (torch.randn(2, 16), torch.randn(2, 16, 4), w.detach(), None, None, True)
    checks.append(torch.library.opcheck(torch.ops.lamina.causal_conv1d_update.default, step_args))
    for results in checks:
        assert all(v == "SUCCESS" for v in results.values()), results


# --- the layer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("bias, activation", [(True, "silu"), (False, None)])
def test_layer_is_a_causal_nn_conv1d(backend, bias, activation):
    """The module's output is nn.Conv1d's (padding W - 1, first T outputs), through the activation."""
    layer = ShortConvolution(D, 4, bias=bias, activation=activation, backend=backend)
    x = torch.randn(B, 12, D)
    y, cache = layer(x)
    assert cache is None
    with torch.no_grad():
        expected = F.conv1d(x.transpose(1, 2), layer.weight, layer.bias, padding=3, groups=D)[..., :12]
    expected = expected.transpose(1, 2)
    expected = F.silu(expected) if activation else expected
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_layer_mask_multiplies_a_copy():
    layer = ShortConvolution(D, 4, backend="torch")
    x = torch.randn(B, 9, D)
    x_before = x.clone()
    mask = torch.ones(B, 9, dtype=torch.bool)
    mask[1, :3] = False
    y, _ = layer(x, mask=mask)
    assert torch.equal(x, x_before)
    torch.testing.assert_close(y, layer(x * mask[..., None])[0])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_layer_decodes_in_place_without_grad(backend):
    """Prefill with output_final_state, then one token per call under no_grad: the step path updates
    the cache in place and the outputs equal the full-sequence forward; varlen single tokens too."""
    layer = ShortConvolution(D, 4, bias=True, backend=backend)
    x = torch.randn(B, 10, D)
    with torch.no_grad():
        y_full, _ = layer(x)
        y, cache = layer(x[:, :6], output_final_state=True)
        ys = [y]
        for t in range(6, 10):
            y_t, out = layer(x[:, t:t + 1], cache=cache, output_final_state=True)
            assert out is cache
            ys.append(y_t)
        torch.testing.assert_close(torch.cat(ys, 1), y_full, rtol=1e-5, atol=1e-6)
        # packed: one token per sequence, B == 1 with cu_seqlens
        cache2 = layer(x[:, :6], output_final_state=True)[1]
        cu = torch.arange(B + 1, dtype=torch.int32)
        y6, _ = layer(x[:, 6][None], cache=cache2, cu_seqlens=cu)
        torch.testing.assert_close(y6[0], y_full[:, 6], rtol=1e-5, atol=1e-6)


# --- bad inputs -----------------------------------------------------------------------------------

def _good():
    return make_inputs((B, 6, D), 4, torch.float32)


@pytest.mark.parametrize("change, error, message", [
    (dict(weight=None), TypeError, "weight must be a torch.Tensor"),
    (dict(weight=torch.randn(D)), ValueError, "weight must have 2 dimensions"),
    (dict(x=torch.randn(6, D)), ValueError, r"x must have shape \[B, T, D\]"),
    (dict(x=torch.randn(B, 6, D + 1)), ValueError, r"x must have shape \[B, T, D\] with D = 40"),
    (dict(bias=torch.randn(D - 1)), ValueError, r"bias must have shape \(40,\)"),
    (dict(residual=torch.randn(B, 5, D)), ValueError, "residual must have the shape of x"),
    (dict(initial_state=torch.randn(B, D, 3)), ValueError, r"initial_state must have shape \[N, D, W\]"),
    (dict(activation="relu"), ValueError, "activation must be one of"),
    (dict(backend="cudnn"), ValueError, "backend must be one of"),
    (dict(output_final_state="yes"), TypeError, "output_final_state must be a bool"),
    (dict(cu_seqlens=torch.tensor([0, 6])), ValueError, "cu_seqlens needs batch size 1"),
    (dict(cu_seqlens=torch.tensor([0.0, 6.0])), ValueError, "cu_seqlens must have dtype"),
    (dict(x=torch.randn(1, 6, D), residual=None, initial_state=None, cu_seqlens=torch.tensor([0, 5])),
     ValueError, "cu_seqlens must end at the packed length T=6"),
    (dict(x=torch.randn(1, 6, D), residual=None, initial_state=None, cu_seqlens=torch.tensor([0, 6]),
          cu_seqlens_cpu=torch.tensor([0, 3, 6])), ValueError, "cu_seqlens_cpu must be a CPU copy"),
    (dict(chunk_indices=[0, 1]), TypeError, "chunk_indices must be a torch.Tensor"),
])
def test_causal_conv1d_rejects_bad_inputs(change, error, message):
    x, w, b, r, s = _good()
    kwargs = dict(x=x, weight=w, bias=b, residual=r, initial_state=s, activation="silu", backend="torch")
    kwargs.update(change)
    with pytest.raises(error, match=message):
        causal_conv1d(**kwargs)


@pytest.mark.parametrize("change, message", [
    (dict(cache=torch.zeros(3, D, 3)), r"cache must have shape \[N, D, W\]"),
    (dict(x=torch.randn(2, D)), "one token for each of the N = 3 sequences"),
    (dict(x=torch.randn(3, 2, D)), "one token per sequence"),
    (dict(residual=torch.randn(3, D)), "residual must have the shape of x"),
    (dict(activation="gelu"), "activation must be one of"),
])
def test_causal_conv1d_update_rejects_bad_inputs(change, message):
    kwargs = dict(x=torch.randn(3, 1, D), cache=torch.zeros(3, D, 4), weight=torch.randn(D, 4),
                  residual=torch.randn(3, 1, D), activation="silu", backend="torch")
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        causal_conv1d_update(**kwargs)


def test_layer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="activation must be one of"):
        ShortConvolution(D, 4, activation="relu")
    with pytest.raises(ValueError, match="backend must be one of"):
        ShortConvolution(D, 4, backend="mix")
    layer = ShortConvolution(D, 4, backend="torch")
    with pytest.raises(ValueError, match="mask and cu_seqlens"):
        layer(torch.randn(1, 4, D), mask=torch.ones(1, 4), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"mask must have shape \[B, T\]"):
        layer(torch.randn(2, 4, D), mask=torch.ones(2, 5))
