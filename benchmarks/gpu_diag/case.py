"""One case of the first look (first_look.sh): a Triton vector add, fla's chunk_gated_delta_rule, or one of
lamina's delta-rule ops (chunked with its backward, or token by token) on the GPU; prints ok or the traceback."""
import sys
import time
import traceback

import torch

sys.path.insert(0, "tests")
what, var, dt, shape = sys.argv[1], sys.argv[2], sys.argv[3], [int(x) for x in sys.argv[4].split("x")]
B, T, H, K = shape
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
RECURRENT = {"delta": "fused_recurrent_delta_rule", "gdn": "fused_recurrent_gated_delta_rule",
             "kda": "fused_recurrent_kda", "gdn2": "fused_recurrent_gdn2"}
CHUNKED = {"delta": "chunk_delta_rule", "gdn": "chunk_gated_delta_rule", "kda": "chunk_kda", "gdn2": "chunk_gdn2"}


def vector_add() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def add(x, y, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + o, tl.load(x + o, mask=o < n) + 1, mask=o < n)

    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    add[(8,)](x, y, 1000, BLOCK=128)
    torch.cuda.synchronize()
    assert torch.equal(y, x + 1)
    print("vecadd ok")


t0 = time.time()
try:
    if what == "vecadd":
        vector_add()
        sys.exit(0)
    from test_delta_fwd import make_inputs

    xs = [None if x is None else x.cuda() for x in make_inputs(var, B, T, H, H, K, K, dtype)]
    q, k, v, g, b, w = [None if x is None else x.requires_grad_() for x in xs[:6]]
    if what == "fla":
        import fla.ops.gated_delta_rule as fla_gdn

        o, s = fla_gdn.chunk_gated_delta_rule(q, k, v, g=g, beta=b, output_final_state=True)
    else:
        import lamina

        gates = {"delta": dict(beta=b), "gdn": dict(g=g, beta=b), "kda": dict(g=g, beta=b),
                 "gdn2": dict(g=g, b=b, w=w)}[var]
        fn = getattr(lamina, (RECURRENT if what == "rec" else CHUNKED)[var])
        o, s = fn(q, k, v, **gates, output_final_state=True, backend="triton")
    torch.cuda.synchronize()
    print(what, var, dt, shape, "fwd ok", flush=True)
    if what != "rec":
        (o.float().sum() + s.sum()).backward()
        torch.cuda.synchronize()
        print(what, var, dt, shape, "bwd ok", round(time.time() - t0, 1), flush=True)
except Exception:
    print(what, var, dt, shape, "FAILED")
    traceback.print_exc(limit=-6)
    sys.exit(1)
