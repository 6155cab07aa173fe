"""KDA and GDN-2 through lamina's Triton kernels against fla's naive recurrences, gradients included.

fla's naive references compute in float32 internally, so the float32 row of the table applies.
Independent of lamina's own references: a mistake shared by lamina's reference and kernels shows here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

import lamina

B, T, H, K, V = 1, 40, 2, 32, 48


def _inputs(seed: int, gdn2: bool):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    g = F.logsigmoid(r(B, T, H, K) + 2) * 3  # per-channel decays, some strong
    h0 = r(B, H, K, V)
    if gdn2:
        return dict(q=q, k=k, v=v, g=g, b=torch.sigmoid(r(B, T, H, K)), w=torch.sigmoid(r(B, T, H, V)), h0=h0)
    return dict(q=q, k=k, v=v, g=g, beta=torch.sigmoid(r(B, T, H)), h0=h0)


@pytest.mark.interpret
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_triton_matches_fla_naive_with_gradients(variant):
    from fla.ops.gdn2.naive import naive_recurrent_gdn2
    from fla.ops.kda.naive import naive_recurrent_kda

    gdn2 = variant == "gdn2"
    ours = {n: x.clone().requires_grad_(True) for n, x in _inputs(3, gdn2).items()}
    theirs = {n: x.clone().requires_grad_(True) for n, x in _inputs(3, gdn2).items()}
    if gdn2:
        o, s = lamina.chunk_gdn2(ours["q"], ours["k"], ours["v"], ours["g"], ours["b"], ours["w"],
                                 initial_state=ours["h0"], output_final_state=True, chunk_size=16, backend="triton")
        ro, rs = naive_recurrent_gdn2(theirs["q"], theirs["k"], theirs["v"], theirs["g"], theirs["b"], theirs["w"],
                                      scale=K ** -0.5, initial_state=theirs["h0"], output_final_state=True)
    else:
        o, s = lamina.chunk_kda(ours["q"], ours["k"], ours["v"], ours["g"], ours["beta"], initial_state=ours["h0"],
                                output_final_state=True, chunk_size=16, backend="triton")
        ro, rs = naive_recurrent_kda(theirs["q"], theirs["k"], theirs["v"], theirs["g"], theirs["beta"],
                                     scale=K ** -0.5, initial_state=theirs["h0"], output_final_state=True)
    assert_close("o", o, ro)
    assert_close("final_state", s, rs)
    gen = torch.Generator().manual_seed(99)
    do, ds = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    torch.autograd.backward((o, s), (do, ds))
    torch.autograd.backward((ro, rs), (do, ds))
    for name in ours:
        assert_close(f"d{name}", ours[name].grad, theirs[name].grad)
