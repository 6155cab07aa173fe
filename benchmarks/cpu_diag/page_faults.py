"""Minor page faults and time per call of the delta family's torch-path forward, without a graph.

Run each case in a fresh process (the allocator's state is the point)::

    python benchmarks/cpu_diag/page_faults.py delta_rule 2x1024

Prints the median and largest fault count over 20 calls (the first left out of the largest) and the
median time. With glibc's default malloc a count near zero means the call's temporaries stayed in the
process; thousands mean freed memory went back to the OS and was faulted in again
(benchmarks/README.md, "CPU timings and the allocator").
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F

import lamina

CALLS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=["delta_rule", "gated_delta_rule", "kda"])
    parser.add_argument("shape", help="BxT, e.g. 2x1024 (H = 4, K = V = 64, fp32)")
    args = parser.parse_args()
    B, T = (int(x) for x in args.shape.split("x"))
    H, D = 4, 64
    torch.manual_seed(0)
    q, v = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    k = F.normalize(torch.randn(B, T, H, D), dim=-1)
    beta = torch.rand(B, T, H)
    if args.op == "delta_rule":
        call = lambda: lamina.chunk_delta_rule(q, k, v, beta, backend="torch")  # noqa: E731
    elif args.op == "gated_delta_rule":
        g = -torch.rand(B, T, H)
        call = lambda: lamina.chunk_gated_delta_rule(q, k, v, g, beta, backend="torch")  # noqa: E731
    else:
        g = -torch.rand(B, T, H, D) / 4
        call = lambda: lamina.chunk_kda(q, k, v, g, beta, backend="torch")  # noqa: E731
    faults, times = [], []
    with torch.no_grad():
        for _ in range(CALLS):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            out = call()
            times.append((time.perf_counter() - start) * 1e3)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            del out
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"{args.op} {args.shape}: minor faults per call median {median(faults)}, max {max(faults[1:])}; "
          f"median {median(times):.2f} ms ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
