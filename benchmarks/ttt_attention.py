"""Training-time test's attention: the chain form training uses against two other ways to write the same attention.

    python -m benchmarks.ttt_attention --out benchmarks/results/ttt-attention

Pass ``k`` of training-time test has, per query, the version-0 keys of its prefix and one key of each later version
(its own draft chain). Three ways to compute it, timed forward and backward:

- *masked SDPA*: one ``scaled_dot_product_attention`` over every version's keys behind a boolean mask; a query scores
  ``(k-1) T + Tq`` keys.
- *explicit chain*: ``T`` prefix keys and ``k-1`` chain keys per query, scores and softmax written out in fp32
  ([B, nkv, g, Tq, T + k - 1] tensors), training's form until the sentinel form replaced it.
- *sentinel chain*: ``training.objective.chain_attention``, the prefix in one fused SDPA call and the chain joined as
  one sentinel key scored by its log-sum-exp.

On the embedded target's head shape (9 query heads, 3 key heads of 64) and the recipe's batch (4 conversations of
1023 positions, 800 queries per pass), one thread, in fp32 and bf16, interleaved, each checked against the masked SDPA
call first. Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from functools import partial
from unittest import mock


def masked_sdpa(q, keys, values, k_new, v_new, mask):
    """Pass k as one SDPA call: keys of versions 0..k-2 at every position, then the queries' own new keys."""
    import torch
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, torch.cat(keys + [k_new], 2), torch.cat(values + [v_new], 2),
                                          attn_mask=mask, enable_gqa=True)


def explicit_chain(q, keys0, values0, chain_keys, chain_values, limit):
    """The chain form with its scores written out: [B, nkv, g, Tq, T + C] fp32 probabilities per pass."""
    import torch

    b, nh, tq, d = q.shape
    nkv, t = keys0.shape[1], keys0.shape[2]
    q = q.reshape(b, nkv, nh // nkv * tq, d) * d**-0.5
    prefix = (q @ keys0.transpose(-1, -2)).view(b, nkv, -1, tq, t)  # [B, nkv, g, Tq, T]
    prefix = prefix.masked_fill(~(torch.arange(t) <= limit[..., None])[:, None, None], -torch.inf)
    chain = torch.einsum("bngqd,bnqcd->bngqc", q.view(b, nkv, -1, tq, d), chain_keys)  # [B, nkv, g, Tq, C]
    weights = torch.cat((prefix, chain), dim=-1).softmax(-1)
    out = (weights[..., :t].flatten(2, 3) @ values0).view(b, nkv, -1, tq, d)
    out = out + torch.einsum("bngqc,bnqcd->bngqd", weights[..., t:], chain_values)
    return out.reshape(b, nh, tq, d)


def with_attention(attention, run):
    """``run()`` with ``attention`` as training's chain attention (``Rollout.chain`` reads the module's function)."""
    with mock.patch("training.objective.chain_attention", attention):
        return run()


def version_mask(index, k: int, t: int):
    """bool [B, 1, Tq, (k-1) T + Tq]: query at ``t`` sees key ``s`` of version ``max(k-1-(t-s), 0)``."""
    import torch

    pos = torch.arange(t)
    d = index[..., None] - pos  # [B, Tq, T]
    blocks = [(d >= 0) & ((k - 1 - d).clamp(min=0) == j) for j in range(k - 1)]
    own = torch.eye(index.shape[1], dtype=torch.bool).expand(index.shape[0], -1, -1)
    return torch.cat(blocks + [own], dim=-1)[:, None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", default="2,3,4,5,6,7", help="pass numbers k to time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/ttt-attention", help="results stem (.json and .md)")
    args = p.parse_args(argv)
    import torch

    from griffin.io import atomic_write_json, atomic_write_text
    from griffin.kernels import cpu_name
    from griffin.report import markdown_table
    from training.objective import Rollout

    torch.set_num_threads(1)
    b, t, tq, nh, nkv, d = 4, 1023, 800, 9, 3, 64
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for k in [int(x) for x in args.passes.split(",")]:
            torch.manual_seed(k)
            index = (torch.arange(tq) + (t - tq))[None].expand(b, tq)  # [B, Tq] the last Tq positions
            q = torch.randn(b, nh, tq, d, dtype=dtype, requires_grad=True)
            keys = [torch.randn(b, nkv, t, d, dtype=dtype) for _ in range(k - 1)]
            values = [torch.randn(b, nkv, t, d, dtype=dtype) for _ in range(k - 1)]
            k_new = torch.randn(b, nkv, tq, d, dtype=dtype, requires_grad=True)
            v_new = torch.randn(b, nkv, tq, d, dtype=dtype, requires_grad=True)
            mask = version_mask(index, k, t)
            chain = partial(Rollout.chain(index, k, keys, values), q, k_new, v_new)
            methods = {"masked SDPA": partial(masked_sdpa, q, keys, values, k_new, v_new, mask),
                       "explicit chain": partial(with_attention, explicit_chain, chain), "sentinel chain": chain}
            with torch.no_grad():
                reference = methods["masked SDPA"]().float()
                gap = {name: (run().float() - reference).abs().max().item() for name, run in methods.items()
                       if name != "masked SDPA"}
            seconds = {name: [] for name in methods}
            for _ in range(args.repeats):
                for name, run in methods.items():
                    t0 = time.perf_counter()
                    run().float().sum().backward()
                    seconds[name].append(time.perf_counter() - t0)
            median = {name: statistics.median(s) for name, s in seconds.items()}
            rows.append({"dtype": str(dtype).removeprefix("torch."), "pass": k,
                         "max_abs_diff": gap["sentinel chain"], "explicit_max_abs_diff": gap["explicit chain"],
                         "masked_sdpa_s": median["masked SDPA"], "explicit_chain_s": median["explicit chain"],
                         "chain_s": median["sentinel chain"],
                         "speedup": median["masked SDPA"] / median["sentinel chain"],
                         "speedup_over_explicit": median["explicit chain"] / median["sentinel chain"]})
            print(rows[-1], flush=True)
    command = "python -m benchmarks.ttt_attention " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = {"cpu": cpu_name(), "threads": 1, "torch": torch.__version__, "python": platform.python_version()}
    shape = {"batch": b, "positions": t, "queries": tq, "heads": nh, "kv_heads": nkv, "head_dim": d}
    atomic_write_json(f"{args.out}.json", {"command": command.strip(), "machine": machine, "shape": shape,
                                          "repeats": args.repeats, "rows": rows})
    table = markdown_table(["dtype", "pass k", "masked SDPA s", "explicit chain s", "sentinel chain s",
                            "over masked SDPA", "over explicit chain", "max |diff| (explicit, sentinel)"],
                           [[r["dtype"], r["pass"], f"{r['masked_sdpa_s']:.3f}", f"{r['explicit_chain_s']:.3f}",
                             f"{r['chain_s']:.3f}", f"{r['speedup']:.2f}x", f"{r['speedup_over_explicit']:.2f}x",
                             f"{r['explicit_max_abs_diff']:.1e}, {r['max_abs_diff']:.1e}"] for r in rows])
    atomic_write_text(f"{args.out}.md", f"# Training-time test's attention, forward + backward\n\n`{command.strip()}`"
                      f" on {machine['cpu']}, one thread, torch {machine['torch']}; median of {args.repeats} "
                      f"interleaved repeats. Shape: {shape}.\n\n{__doc__.split(chr(10) + chr(10), 1)[1]}\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
