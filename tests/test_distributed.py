"""Context parallelism (lamina.distributed) over 2 and 4 gloo processes on the CPU.

Every rank builds the same full-sequence inputs, runs the op once in one process in float64 (the
expected result), then its shard with ``cp_context`` in float32 (the delta rule on a GPU's Triton kernels:
bfloat16), and checks outputs, writes, final states
and every gradient: shards against the matching slice, replicated leaves (initial state, gate
parameters) summed over the ranks, as data parallelism would sum them. The loss is the same in both
runs: every rank's outputs and writes, and the final states once (rank 0).

Bad input: calls that differ between ranks raise the same ValueError on every rank, within the
group's 60 s timeout.
"""

from __future__ import annotations

import copy
import datetime
import gc
import os
import subprocess
import sys
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lamina
from lamina.distributed import LAYOUTS, ContextParallel
from lamina.testing import assert_close, gradient_scale

L, H, HV, K, V = 24, 2, 4, 16, 8  # 24 local tokens: one and a half chunks of 16; GVA; K != V
VARIANTS = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda", "chunk_gdn2")
# Packed sequences whose boundaries fall inside ranks and which cross ranks (with 4 ranks one spans three).
PACKS = {1: [0, 5, 20, 21, 24], 2: [0, 5, 30, 31, 48], 4: [0, 5, 60, 61, 90, 96]}


# The layout the scenarios' contexts use and the device of the ranks' tensors (set in each worker from the
# test's parameters; the expected results are computed on the CPU).
LAYOUT = ["contiguous"]
DEVICE = ["cpu"]


def _context(cu_seqlens=None) -> ContextParallel:
    return ContextParallel(cu_seqlens=cu_seqlens, layout=LAYOUT[0])


def _inputs(op: str, world: int, varlen: bool, gen: torch.Generator) -> tuple[dict, dict]:
    """Full-sequence leaves (float64) and the op's other keyword arguments."""
    B, T = (1, world * L) if varlen else (2, world * L)
    n = len(PACKS[world]) - 1 if varlen else B
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    leaves = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, HV, V), "initial_state": r(n, HV, K, V) * 0.5}
    extra = {"use_qk_l2norm_in_kernel": True, "chunk_size": 16}
    if op == "chunk_delta_rule":
        leaves["beta"] = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    elif op == "chunk_gated_delta_rule":
        leaves.update(g=r(B, T, HV), beta=r(B, T, HV), A_log=r(HV) * 0.3, dt_bias=r(HV) * 0.3)
        extra.update(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    elif op == "chunk_kda":
        leaves.update(g=-torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) * 0.3,
                      beta=torch.rand(B, T, HV, generator=gen, dtype=torch.float64))
    else:
        leaves.update(g=-torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) * 0.3,
                      b=torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64),
                      w=torch.rand(B, T, HV, V, generator=gen, dtype=torch.float64))
    return leaves, extra


REPLICATED = ("initial_state", "A_log", "dt_bias")


def _run(op, leaves, extra, **kw):
    args = dict(leaves)
    return getattr(lamina, op)(**args, **extra, output_final_state=True, output_v_new=True, **kw)


def _check_equal_to_one_process(rank: int, world: int, backend: str) -> None:
    # the layout itself: rank r holds segment r of R (contiguous) or segments r and 2R - 1 - r of 2R (zigzag)
    segments = [rank] if LAYOUT[0] == "contiguous" else [rank, 2 * world - 1 - rank]
    part = world * L // (world * len(segments))
    positions = _context().shard(torch.arange(world * L), dim=0)
    assert positions.tolist() == [t for g in segments for t in range(g * part, (g + 1) * part)], positions
    cases = [(op, varlen) for op in VARIANTS for varlen in (False, True)]
    if backend == "triton" and DEVICE[0] == "cpu":  # the interpreter is slow: one packed case (every variant's code)
        cases = [("chunk_gdn2", True)]
    for op, varlen in cases:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{op} {varlen} {world}".encode()))
        full, extra = _inputs(op, world, varlen, gen)
        cu = PACKS[world] if varlen else None
        seq = {n for n in full if n not in REPLICATED}
        do, dvn = torch.randn(full["v"].shape, generator=gen, dtype=torch.float64), torch.randn(
            full["v"].shape, generator=gen, dtype=torch.float64)
        dht = torch.randn(full["initial_state"].shape, generator=gen, dtype=torch.float64)

        ref_leaves = {n: x.clone().requires_grad_() for n, x in full.items()}
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        o, ht, vn = _run(op, ref_leaves, extra, cu_seqlens=cu_t, backend="torch")
        loss = (o * do).sum() + (vn * dvn).sum() + (ht * dht).sum()
        ref_grads = dict(zip(ref_leaves, torch.autograd.grad(loss, list(ref_leaves.values()))))

        cp = _context(cu)
        dev = DEVICE[0]
        dt = _shard_dtype(dev, backend)
        mine = {n: (cp.shard(x).to(dev, dt) if n in seq else x.to(dev, torch.float32)).requires_grad_()
                for n, x in full.items()}
        o_cp, ht_cp, vn_cp = _run(op, mine, extra, cp_context=cp, backend=backend)
        loss_cp = (o_cp * cp.shard(do).to(dev, dt)).sum() + (vn_cp * cp.shard(dvn).to(dev, dt)).sum()
        if rank == 0:
            loss_cp = loss_cp + (ht_cp * dht.to(dev, ht_cp.dtype)).sum()
        grads = dict(zip(mine, torch.autograd.grad(loss_cp, list(mine.values()))))
        gathered = cp.gather(o_cp.detach()).cpu()
        o_cp, ht_cp, vn_cp = o_cp.cpu(), ht_cp.cpu(), vn_cp.cpu()

        where = f"{op} {'packed' if varlen else 'dense'} rank {rank}/{world} {backend}"
        assert_close(f"{where}: o", o_cp, cp.shard(o.detach()), dtype=dt)
        assert_close(f"{where}: v_new", vn_cp, cp.shard(vn.detach()), dtype=dt)
        assert_close(f"{where}: final_state", ht_cp, ht.detach(), dtype=dt)
        assert_close(f"{where}: gathered o", gathered, o.detach(), dtype=dt)
        for name, grad in grads.items():
            want = ref_grads[name]
            if name in REPLICATED:
                dist.all_reduce(grad)
            else:
                want = cp.shard(want)
            assert_close(f"{where}: d{name}", grad.cpu(), want, dtype=dt, scale=gradient_scale(want))


def _shard_dtype(device: str, backend: str) -> torch.dtype:
    """The sequence shards' dtype: float32, but bfloat16 for the Triton kernels on a GPU, where the ops refuse float32
    on the chunked kernels (``lamina.ops.delta_rule_core.training_path``); the replicated leaves stay float32."""
    return torch.bfloat16 if device == "cuda" and backend == "triton" else torch.float32


def _check_bad_input(rank: int, world: int, backend: str) -> None:
    gen = torch.Generator().manual_seed(7)
    full, extra = _inputs("chunk_kda", world, False, gen)
    cp = ContextParallel()
    local = {n: (cp.shard(x) if n not in REPLICATED else x).float() for n, x in full.items()}
    # a different local length on one rank
    short = dict(local, **{n: local[n][:, : L - 4] for n in ("q", "k", "v", "g", "beta")}) if rank == 1 else local
    with pytest.raises(ValueError, match=r"disagree \(T \(local\): rank 0 24, rank 1 20"):
        _run("chunk_kda", short, extra, cp_context=cp, backend=backend)
    # a different operation on one rank (same shapes)
    other = dict(local)
    op = "chunk_kda" if rank == 0 else "chunk_gdn2"
    if op == "chunk_gdn2":
        beta = other.pop("beta")
        other.update(b=beta[..., None].expand(*beta.shape, K), w=beta[..., None].expand(*beta.shape, V))
    with pytest.raises(ValueError, match="not running the same operation"):
        _run(op, other, extra, cp_context=cp, backend=backend)
    # a layout whose length is not world x local
    packed = ContextParallel(cu_seqlens=[0, 10, world * L + 2])
    one = {n: x[:1] if n not in REPLICATED else x[:2] for n, x in local.items()}
    with pytest.raises(ValueError, match=f"pack {world * L + 2} tokens, but {world} ranks x {L} local tokens"):
        _run("chunk_kda", one, extra, cp_context=packed, backend=backend)
    # a sequence length the ranks cannot share
    with pytest.raises(ValueError, match=f"shard: x has {world * L + 1} positions along dim 1, not divisible"):
        cp.shard(torch.zeros(1, world * L + 1, 2))
    # contexts of different layouts on the ranks
    mixed = ContextParallel(layout="contiguous" if rank == 0 else "zigzag")
    with pytest.raises(ValueError, match="disagree \\(layout: rank 0 0, rank 1 1"):
        _run("chunk_kda", local, extra, cp_context=mixed, backend=backend)
    # zigzag: two segments of equal length per rank
    zigzag = ContextParallel(layout="zigzag")
    odd = {n: x[:, :L - 1] if n not in REPLICATED else x for n, x in local.items()}
    with pytest.raises(ValueError, match="two segments of equal length, so its token count must be even, got 23"):
        _run("chunk_kda", odd, extra, cp_context=zigzag, backend=backend)
    with pytest.raises(ValueError, match="not divisible by the context's 4 segments"):
        zigzag.shard(torch.zeros(1, 2 * 4 + 2, 2))
    with pytest.raises(ValueError, match="layout must be one of"):
        ContextParallel(layout="ring")
    # malformed layouts and arguments the context cannot take: local errors, before any exchange
    for bad, match in (([0, 5, 5, world * L], "strictly increasing"), ([3, world * L], "starting at 0"),
                       (torch.tensor([[0, world * L]]), "1-d integer tensor"), ([0.0, 4.0], "must be integer offsets")):
        with pytest.raises(ValueError, match=match):
            ContextParallel(cu_seqlens=bad)
    x = local["q"]
    with pytest.raises(ValueError, match="cu_seqlens_q cannot be combined with cp_context"):
        lamina.prism_attention(x, x, x, cp_context=cp, cu_seqlens_q=torch.tensor([0, L], dtype=torch.int32))
    with pytest.raises(ValueError, match="sliding window needs causal=True"):
        lamina.prism_attention(x, x, x, causal=False, window_size=(4, 4), cp_context=cp)
    from lamina.layers import GatedDeltaNet

    layer = GatedDeltaNet(hidden_size=32, num_heads=2)
    hidden = torch.randn(2, L, 32)
    with pytest.raises(ValueError, match="attention_mask cannot be combined with cp_context"):
        layer(hidden, attention_mask=torch.ones(2, L, dtype=torch.bool), cp_context=cp)
    with pytest.raises(ValueError, match="use_cache cannot be combined with cp_context"):
        layer(hidden, use_cache=True, cp_context=cp)
    with pytest.raises(ValueError, match="with cp_context every segment needs at least 4 tokens"):
        layer(hidden[:, :3], cp_context=cp)
    # after every error the ranks still agree: a good call runs
    o, _, _ = _run("chunk_kda", local, extra, cp_context=cp, backend=backend)
    assert o.shape == local["v"].shape


def _check_layers(rank: int, world: int, backend: str) -> None:
    """The four fla layers (short convolutions on) and PrismAttention (rotary) with ``cp_context`` against one
    process in float64: outputs,
    the input's gradient, every parameter's gradient (summed over the ranks); dense rows and packed sequences."""
    from lamina.layers import DeltaNet, GatedDeltaNet, GatedDeltaNet2, KimiDeltaAttention, PrismAttention

    for cls in (DeltaNet, GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2, PrismAttention):
        for varlen in (False, True):
            torch.manual_seed(zlib.crc32(cls.__name__.encode()))  # the same weights and inputs on every rank
            if cls is PrismAttention:  # rotary positions: the whole sequences'
                ref = cls(d_model=32, n_heads=2, n_kv_heads=1).double()
            else:
                ref = cls(hidden_size=32, num_heads=2).double()
            layer = copy.deepcopy(ref).float()
            cu = PACKS[world] if varlen else None
            x = torch.randn(1 if varlen else 2, world * L, 32, dtype=torch.float64)
            do = torch.randn_like(x)
            x_ref = x.clone().requires_grad_()
            first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731  (fla layers: a tuple)
            o = first(ref(x_ref, cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32)))
            ref_grads = torch.autograd.grad((o * do).sum(), [x_ref, *ref.parameters()])

            cp = _context(cu)
            x_cp = cp.shard(x).float().requires_grad_()
            o_cp = first(layer(x_cp, cp_context=cp))
            grads = torch.autograd.grad((o_cp * cp.shard(do).float()).sum(), [x_cp, *layer.parameters()])
            where = f"{cls.__name__} {'packed' if varlen else 'dense'} rank {rank}/{world}"
            assert_close(f"{where}: o", o_cp, cp.shard(o.detach()))
            assert_close(f"{where}: dx", grads[0], cp.shard(ref_grads[0]))
            names = ["x", *(n for n, _ in ref.named_parameters())]
            for name, grad, want in zip(names[1:], grads[1:], ref_grads[1:]):
                dist.all_reduce(grad)
                assert_close(f"{where}: d{name}", grad, want, scale=gradient_scale(want))


def _same_training(wrap, config: dict, labels_of, world: int, steps: int) -> None:
    """A LinearLM trained with SGD (a wrong gradient scale shows) in one process and, wrapped by ``wrap``
    (FSDP2 or DDP), with context parallelism over the ranks: the whole sequence's loss (the mean of the
    ranks' shares) equals the one-process loss at every step. float32 both ways; the context-parallel run
    sums in another order, which 1e-5 relative covers; a wrong gradient (a missing rank's share, a wrong
    shift at a boundary) moves the curve by far more."""
    from lamina.distributed import all_reduce_sum
    from lamina.models import LinearLM, LinearLMConfig

    torch.manual_seed(0)
    ref = LinearLM(LinearLMConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, **config))
    model = wrap(copy.deepcopy(ref))
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    cp = _context()
    ids = torch.randint(0, 64, (2, world * L), generator=torch.Generator().manual_seed(1))
    labels = labels_of(ids)
    curve_ref, curve = [], []
    for _ in range(steps):
        for net, optimizer, args, losses in ((ref, opt_ref, {"input_ids": ids, "labels": labels}, curve_ref),
                                             (model, opt, {"input_ids": cp.shard(ids), "labels": cp.shard(labels),
                                                           "cp_context": cp}, curve)):
            loss = net(**args).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item() if net is ref else all_reduce_sum(cp, loss).item() / world)
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(curve_ref), rtol=1e-5, atol=0)
    assert curve[-1] < curve[0], curve


def _check_fsdp_training(rank: int, world: int, backend: str) -> None:
    """FSDP2 (fully_shard) and context parallelism, a hybrid model (a GatedDeltaNet block, then a
    PrismAttention block)."""
    from torch.distributed.fsdp import fully_shard

    def wrap(model):
        for block in model.blocks:  # the modules LinearLM calls (it runs each block's parts in turn)
            fully_shard(block.mixer)
            fully_shard(block.mlp)
        return fully_shard(model)

    _same_training(wrap, {"layer": "GatedDeltaNet", "attention_every": 2}, lambda ids: ids, world, steps=4)


def _check_ddp_training(rank: int, world: int, backend: str) -> None:
    """DistributedDataParallel over the context's ranks, a KDA model, an ignored target on the first rank (the
    loss counts targets over all ranks)."""
    from torch.nn.parallel import DistributedDataParallel

    def ignore_one(ids):
        labels = ids.clone()
        labels[:, 5] = -100
        return labels

    _same_training(DistributedDataParallel, {"layer": "KimiDeltaAttention"}, ignore_one, world, steps=3)


def _check_compiled_training(rank: int, world: int, backend: str) -> None:
    """torch.compile over DDP and context parallelism, a hybrid model (a GatedDeltaNet block, then a
    PrismAttention block): the collectives break the graph, the parts between them are compiled, and the
    loss curve is the one process's. aot_eager: Dynamo and AOTAutograd trace, no C++ compiler on the path."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    torch._dynamo.reset()
    counters.clear()
    _same_training(lambda m: torch.compile(DistributedDataParallel(m), backend="aot_eager"),
                   {"layer": "GatedDeltaNet", "attention_every": 2}, lambda ids: ids, world, steps=3)
    assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])  # it compiled, not only fell back
    if rank == 0 and os.environ.get("LAMINA_SHOW_GRAPH_BREAKS"):
        print(dict(counters["stats"]), dict(counters["graph_break"]), flush=True)


def _check_attention(rank: int, world: int, backend: str) -> None:
    """prism_attention with ``cp_context`` against the float64 reference on the whole sequences: o, lse, and
    the gradients of q, k, v through both; D in {64, 192, 320}, causal or not, GQA, dense rows (ring
    attention) and packed sequences (all-gather), a causal sliding window (all-gather) and softcapping. The
    ring computes exactly the visible blocks: causal, a query segment's keys up to it (with zigzag the same
    2R + 1 blocks on every rank); otherwise every block."""
    from lamina.ops import prism_attention as module
    from lamina.reference import attention_ref

    blocks = []
    module.attention_block = lambda *args, run=module.attention_block: blocks.append(args[3]) or run(*args)
    cases = [(64, True, {}), (192, False, {}), (320, True, {"window_size": (20, 0), "softcap": 5.0}),
             (64, False, {"softcap": 3.0}), (320, True, {"softcap": 2.0})]
    if backend == "triton" and DEVICE[0] == "cpu":  # the interpreter is slow: the ring's block kinds, softcap
        cases = [(64, True, {"softcap": 2.0}), (64, False, {})]
    for (D, causal, options), varlen in ((c, p) for c in cases for p in (False, True)):
        gen = torch.Generator().manual_seed(D * 2 + causal + 7 * varlen)
        B, T = (1, world * L) if varlen else (2, world * L)
        q, k, v = (torch.randn(B, T, h, D, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
        do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
        dlse = torch.randn(B, 4, T, generator=gen, dtype=torch.float64)
        cu = PACKS[world] if varlen else None
        ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        o, lse = attention_ref(*ref_in, causal=causal, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, return_lse=True,
                               **options)
        ref_grads = torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), ref_in)

        cp = _context(cu)
        dev = DEVICE[0]
        mine = [cp.shard(x).float().to(dev).requires_grad_() for x in (q, k, v)]
        blocks.clear()
        o_cp, lse_cp = lamina.prism_attention(*mine, causal=causal, return_lse=True, backend=backend,
                                              cp_context=cp, **options)
        loss = (o_cp * cp.shard(do).float().to(dev)).sum() + (lse_cp * cp.shard(dlse, 2).float().to(dev)).sum()
        grads = [grad.cpu() for grad in torch.autograd.grad(loss, mine)]
        o_cp, lse_cp = o_cp.cpu(), lse_cp.cpu()
        where = f"D={D} causal={causal} {options} {'packed' if varlen else 'dense'} rank {rank}/{world}"
        assert_close(f"{where}: o", o_cp, cp.shard(o.detach()))
        assert_close(f"{where}: lse", lse_cp, cp.shard(lse.detach(), dim=2))
        for name, grad, want in zip("qkv", grads, ref_grads):
            assert_close(f"{where}: d{name}", grad, cp.shard(want), scale=gradient_scale(want))
        if varlen or "window_size" in options:
            assert not blocks, f"{where}: ran {len(blocks)} ring blocks, expected the all-gather path"
        elif causal:
            assert len(blocks) == sum(s + 1 for s in cp.segments), f"{where}: {len(blocks)} ring blocks"
            assert blocks.count(True) == len(cp.segments), f"{where}: {blocks.count(True)} diagonal blocks"
            if cp.layout == "zigzag":
                assert len(blocks) == 2 * world + 1, f"{where}: zigzag unbalanced, {len(blocks)} blocks"
        else:
            assert blocks == [False] * (len(cp.segments) * cp.n_segments), f"{where}: {len(blocks)} ring blocks"


SCENARIOS = {"attention": _check_attention, "ddp": _check_ddp_training, "compile": _check_compiled_training,
             "equal": _check_equal_to_one_process, "bad": _check_bad_input, "layers": _check_layers,
             "fsdp": _check_fsdp_training}


def _worker(rank: int, world: int, init_file: str, scenario: str, backend: str, layout: str, device: str) -> None:
    torch.set_num_threads(1)
    LAYOUT[0], DEVICE[0] = layout, device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        SCENARIOS[scenario](rank, world, backend)
    finally:
        gc.collect()  # FSDP2 models (reference cycles) freed before the group (examples/train_context_parallel.py)
        dist.destroy_process_group()


def _spawn(tmp_path, world: int, scenario: str, backend: str = "torch", layout: str = "contiguous",
           device: str = "cpu") -> None:
    # the children's "auto" backend on the CPU
    env = {"TRITON_INTERPRET": "1" if backend == "triton" and device == "cpu" else "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.spawn(_worker, args=(world, str(tmp_path / "rendezvous"), scenario, backend, layout, device), nprocs=world,
                 join=True)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_process(tmp_path, world, layout):
    _spawn(tmp_path, world, "equal", layout=layout)


@pytest.mark.grid  # the chunk kernels under the interpreter run in the other interpret tests too
@pytest.mark.interpret
def test_context_parallel_on_the_triton_kernels(tmp_path):
    _spawn(tmp_path, 2, "equal", backend="triton")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 4])
def test_attention_with_context_parallel_equals_the_reference(tmp_path, world, layout):
    _spawn(tmp_path, world, "attention", layout=layout)


@pytest.mark.interpret
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_attention_on_the_triton_kernels(tmp_path, layout):
    _spawn(tmp_path, 2, "attention", backend="triton", layout=layout)


@pytest.mark.parametrize("scenario", ["equal", "attention"])
def test_one_rank_holding_two_segments_equals_one_process(tmp_path, scenario):
    """One rank with the zigzag layout (the GPU test's form on the one-GPU device machine), on the CPU."""
    _spawn(tmp_path, 1, scenario, layout="zigzag")


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["equal", "attention"])
def test_context_parallel_over_nccl_on_the_gpus(tmp_path, scenario):
    """NCCL with one rank per GPU (at most 4; the device machine has one), on lamina's Triton kernels; the
    zigzag layout, so that even one rank holds two segments: the delta rule folds one segment's state map
    into the next one's start, ring attention merges a full block and two diagonal ones."""
    if not dist.is_nccl_available():
        pytest.skip("this PyTorch build has no NCCL")
    world = 4 if torch.cuda.device_count() >= 4 else min(torch.cuda.device_count(), 2)
    _spawn(tmp_path, world, scenario, backend="triton", layout="zigzag", device="cuda")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layers_with_context_parallel_equal_one_process(tmp_path, layout):
    _spawn(tmp_path, 2, "layers", layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp2_training_with_context_parallel_follows_one_process(tmp_path, layout):
    _spawn(tmp_path, 2, "fsdp", layout=layout)


def test_ddp_training_with_context_parallel_follows_one_process(tmp_path):
    _spawn(tmp_path, 2, "ddp")


@pytest.mark.versions
def test_compiled_training_with_context_parallel_follows_one_process(tmp_path):
    _spawn(tmp_path, 2, "compile")


def test_importing_the_module_leaves_dynamo_unloaded():
    # every rank imports it: torch.compiler.disable at import time loaded torch._dynamo (about 2 s)
    code = "import sys, torch, lamina.distributed; print('torch._dynamo' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stdout + proc.stderr


@pytest.mark.versions
def test_collective_wrappers_run_eagerly_between_compiled_graphs():
    """An ``_eager`` function first called inside a compiled region runs eagerly (never traced: ``.item()``
    there would be a graph break of its own), and Dynamo breaks the graph at its call, as at a function
    decorated with ``torch.compiler.disable``; the compiled caller gives the eager caller's result."""
    import torch._dynamo

    from lamina.distributed import _eager

    seen = []

    def total_times(x):
        seen.append(torch.compiler.is_compiling())
        return x.sum().item() * x

    def caller(fn):
        return lambda x: fn(x * 2) + 1

    x = torch.randn(5, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(caller(_eager(total_times)), backend="eager")
    assert torch.equal(compiled(x), caller(total_times)(x)) and seen == [False, False]
    for fn in (_eager(total_times), torch.compiler.disable(total_times)):
        explained = torch._dynamo.explain(caller(fn))(x)
        assert explained.graph_break_count == 1 and explained.graph_count == 2, explained
        assert "disable" in explained.break_reasons[0].reason, explained.break_reasons
    assert not any(seen)


def test_mismatched_calls_raise_on_every_rank(tmp_path):
    _spawn(tmp_path, 2, "bad")


def test_without_a_process_group_or_with_fla_context():
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            ContextParallel()
    q = torch.randn(1, 8, 1, 4)
    with pytest.raises(TypeError, match="cp_context must be a lamina.distributed.ContextParallel"):
        lamina.chunk_kda(q, q, q, -torch.rand(1, 8, 1, 4), torch.rand(1, 8, 1), cp_context=object())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scaling_benchmark_records_each_rank_count(tmp_path, monkeypatch, capsys, layout):
    """``lamina bench context-parallel`` on CPU (gloo): a record per op and rank count, with the bytes the
    collectives exchanged (none on one rank; the gathered maps on two)."""
    from lamina.bench.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "cp.jsonl"
    assert main(["context-parallel", "--ranks", "1,2", "--tokens", "64", "--heads", "2", "--dim", "16",
                 "--repeats", "1", "--op", "chunk_gated_delta_rule,prism_attention", "--device", "cpu",
                 "--layout", layout, "--out", str(out)]) == 0
    import json

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["op"], r["params"]["ranks"]) for r in records] == [
        ("chunk_gated_delta_rule", 1), ("prism_attention", 1), ("chunk_gated_delta_rule", 2), ("prism_attention", 2)]
    assert all(r["ms"] > 0 for r in records) and {r["layout"] for r in records} == {layout}
    one, two = records[0]["comm_bytes_per_rank"], records[2]["comm_bytes_per_rank"]
    # two ranks: the call's description (2 x 15 int64) and the maps [2, segments per rank, HV=2, K=16, K+V=32]
    # float32, gathered forward and all-reduced backward
    segments = 2 if layout == "zigzag" else 1
    assert one == 0 and two == 2 * 15 * 8 + 2 * (2 * segments * 2 * 16 * 32 * 4)
    assert "vs 1 rank" in capsys.readouterr().out


@pytest.mark.parametrize("options", [[], ["--layout", "zigzag", "--attention-every", "2", "--layers", "2",
                                          "--hidden-size", "64"]], ids=["contiguous", "zigzag-hybrid"])
def test_readme_torchrun_example_trains_on_cpu(options):
    """The README's torchrun command, on CPU with gloo and two ranks: two steps, the whole sequence's loss."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(root / "examples" / "train_context_parallel.py"), "--device", "cpu", "--steps", "2",
                           "--tokens", "128", "--hidden-size", "32", "--layers", "1", *options],
                          capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 1: loss" in done.stdout and "(2 ranks x 64 tokens)" in done.stdout, done.stdout
