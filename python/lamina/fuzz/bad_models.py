"""Malformed calls of lamina's models (``PrismDecoder``, ``lamina.models.HRMLM``, ``LinearLM``), for ``run_bad_inputs``:
bad token ids, targets and configuration values must raise ValueError/TypeError naming the argument."""

from __future__ import annotations

import torch

from lamina.fuzz.bad_inputs import (
    _T,
    Kwargs,
    Target,
    add_dim,
    as_list,
    cast,
    cu_seqlens_cases,
    drop_dim,
    move,
    set_arg,
)


def _ids(kw: Kwargs, value: int) -> torch.Tensor:
    return torch.full((1, _T), value, device=kw["_device"])


def _token_cases(vocab: int) -> tuple:
    return (drop_dim("input_ids"), add_dim("input_ids"), as_list("input_ids"), cast("input_ids", torch.float32),
            move("input_ids"), set_arg("input_ids", lambda kw: _ids(kw, vocab)),
            set_arg("input_ids", lambda kw: _ids(kw, -1)))


def _decoder_target() -> Target:
    import lamina.layers as L

    def make(kw: Kwargs) -> object:
        dev = kw.pop("_device")
        fields = {k: kw.pop(k) for k in ("vocab_size", "d_model", "n_layers", "h_base") if k in kw}
        model = L.PrismDecoder(L.PrismDecoderConfig(**fields)).to(dev)
        return model(**kw)

    def base(dev: torch.device) -> Kwargs:
        return {"vocab_size": 11, "d_model": 32, "n_layers": 2, "h_base": 2, "_device": dev,
                "input_ids": torch.randint(0, 11, (1, _T), device=dev)}

    muts = (
        *_token_cases(11), set_arg("cache", "abc"),
        set_arg("attention_mask", lambda kw: torch.ones(1, _T, dtype=torch.int32)),
        *cu_seqlens_cases(_T), set_arg("vocab_size", 0), set_arg("d_model", 30), set_arg("h_base", 0),
        set_arg("n_layers", 0), set_arg("vocab_size", "11"),
    )
    return Target("PrismDecoder", base, make, muts)


def _hrmlm_target() -> Target:
    from lamina.models import HRMLM, HRMLMConfig

    fields = ("vocab_size", "d_model", "n_heads", "mlp_ratio", "max_seq_len", "n_cycles", "steps_per_cycle",
              "grad_steps", "passes", "mode", "gate", "norm", "backend")

    def make(kw: Kwargs) -> object:
        dev = kw.pop("_device")
        config = HRMLMConfig(**{k: kw.pop(k) for k in fields if k in kw})
        return HRMLM(config).to(dev)(**kw)

    def base(dev: torch.device) -> Kwargs:
        return {"vocab_size": 11, "d_model": 16, "n_heads": 2, "max_seq_len": 8, "_device": dev,
                "input_ids": torch.randint(0, 11, (1, _T), device=dev),
                "targets": torch.randint(0, 11, (1, _T), device=dev)}

    muts = (
        *_token_cases(11), set_arg("input_ids", lambda kw: torch.zeros(1, 9, dtype=torch.long, device=kw["_device"])),
        set_arg("targets", lambda kw: torch.zeros(1, _T + 1, dtype=torch.long, device=kw["_device"])),
        cast("targets", torch.float32), move("targets"), set_arg("targets", lambda kw: _ids(kw, 11)),
        set_arg("targets", lambda kw: _ids(kw, -2)),
        set_arg("vocab_size", 0), set_arg("d_model", 15), set_arg("n_heads", 0), set_arg("mlp_ratio", 0),
        set_arg("max_seq_len", 0), set_arg("n_cycles", 0), set_arg("steps_per_cycle", 0), set_arg("grad_steps", -1),
        set_arg("passes", 0), set_arg("mode", "bogus"), set_arg("gate", "bogus"), set_arg("norm", "yes"),
        set_arg("backend", "bogus"), set_arg("vocab_size", "11"),
    )
    return Target("HRMLM", base, make, muts)


def _linear_lm_target() -> Target:
    from lamina.models import LinearLM, LinearLMConfig

    fields = ("vocab_size", "hidden_size", "num_layers", "layer", "num_heads", "head_dim", "attention_every",
              "attention_heads", "mlp_ratio", "layer_kwargs", "backend")

    def make(kw: Kwargs) -> object:
        dev = kw.pop("_device")
        config = LinearLMConfig(**{k: kw.pop(k) for k in fields if k in kw})
        return LinearLM(config).to(dev)(**kw)

    def base(dev: torch.device) -> Kwargs:
        return {"vocab_size": 11, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "attention_every": 2,
                "_device": dev, "input_ids": torch.randint(0, 11, (1, _T), device=dev),
                "labels": torch.randint(0, 11, (1, _T), device=dev)}

    muts = (
        *_token_cases(11), set_arg("labels", lambda kw: torch.zeros(1, _T + 1, dtype=torch.long, device=kw["_device"])),
        cast("labels", torch.float32), move("labels"), set_arg("labels", lambda kw: _ids(kw, 11)),
        set_arg("cache", "abc"), set_arg("attention_mask", lambda kw: torch.ones(1, _T, device=kw["_device"])),
        set_arg("vocab_size", 0), set_arg("hidden_size", "32"), set_arg("attention_heads", 32),
        set_arg("num_layers", 0), set_arg("layer", "Mamba"),
        set_arg("num_heads", 0), set_arg("head_dim", -1), set_arg("attention_every", -1),
        set_arg("attention_heads", 0), set_arg("mlp_ratio", 0), set_arg("layer_kwargs", "abc"),
        set_arg("backend", "bogus"),
    )
    return Target("LinearLM", base, make, muts)


def model_targets() -> list[Target]:
    return [_decoder_target(), _hrmlm_target(), _linear_lm_target()]
