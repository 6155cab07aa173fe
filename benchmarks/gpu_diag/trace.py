"""check.py with every autotuned launch logged (kernel, config) and, with MODE, the autotune configs
filtered: ALL, S1 (num_stages 1 only), W8S1 (8 warps, 1 stage), W4S1 (4 warps, 1 stage)."""
import os
import sys
import traceback

import triton
import triton.runtime.autotuner as at

mode = os.environ.get("MODE", "ALL")
_orig_autotune = triton.autotune


def _filtered(configs, key, **kw):
    keep = [c for c in configs if (mode == "ALL" or
            (c.num_stages == 1 and (mode == "S1" or (mode == "W8S1" and c.num_warps == 8) or
                                    (mode == "W4S1" and c.num_warps == 4))))]
    return _orig_autotune(configs=keep or list(configs)[:1], key=key, **kw)


triton.autotune = _filtered
_bench = at.Autotuner._bench


def _logged(self, *args, config, **kw):
    print(f"[autotune] {self.fn.__name__} warps={config.num_warps} stages={config.num_stages} {config.kwargs}",
          file=sys.stderr, flush=True)
    return _bench(self, *args, config=config, **kw)


at.Autotuner._bench = _logged
_pe = traceback.print_exc
traceback.print_exc = lambda limit=None, **kw: _pe(limit=None, **kw)
exec(compile(open(os.path.join(os.path.dirname(__file__), "check.py")).read(), "check.py", "exec"))
