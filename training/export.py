"""Export a trained head for shipping: fp16 weights, its validation report and a model card.

    python -m training.export heads/griffin checkpoints/smollm2-135m-instruct-griffin --name GRIFFIN
    python -m training.export heads/eagle exports/eagle-official --format official   # for vLLM / SGLang
    python -m training.export heads/eagle3 exports/eagle3 --format eagle3   # EAGLE-3 heads, for vLLM / SGLang

``--format griffin`` (the default) writes this package's layout. ``--format official`` writes the official EAGLE /
GRIFFIN layout that other engines load: a Llama ``config.json`` and ``model.safetensors`` with keys ``fc.*``,
``layers.0.*`` and ``embed_tokens.weight`` (the target's input embedding, read from ``--target``); a reduced draft
vocabulary is expanded to the target's full lm_head (no ``d2t`` mapping is written), as the card says.
``--format eagle3`` writes an ``eagle3`` head in the layout vLLM and SGLang serve EAGLE-3 heads from
(``LlamaForCausalLMEagle3``, ``midlayer.*``, ``fc``, ``norm``, ``lm_head`` over the draft vocabulary, ``d2t``); a
``griffin3`` head is refused (its Token-Guided Fusion and dual heads have no place there).

The card is rebuilt from the files alone: the training run (``validation.json``), and every speed run of this head
found under ``benchmarks/results`` (files named ``<bench>-<head folder name>[-<tag>]-T<temp>.json`` whose
``draft_digest`` is the exported weights': runs of an earlier head exported to the same folder, and of other heads
whose folder name starts with this one's, are left out), and every offline τ replay of these weights there
(``inference.tau`` files ``tau-*.json``, as the ablation writes them, matched by ``head_digests``). Rerun after new
runs to refresh it: with the head's own folder as both source and destination the weights are left as they are.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from griffin.cli import run_cli
from griffin.hub import model_argument
from griffin.io import atomic_write, atomic_write_json, atomic_write_text, read_json, weights_digest
from griffin.report import fastest_plain, markdown_table, pooled_tau, tree_text

if TYPE_CHECKING:
    from griffin.draft import DraftModel


STAGES = "stages.json"  # the validation reports of every training stage, oldest first


def objective_text(run: dict) -> str:
    """The training objective of a run, in words (runs from before ``--token-loss`` used soft cross-entropy)."""
    loss = run.get("token_loss", "soft-ce")
    words = {"soft-ce": "soft cross-entropy", "fkl": "forward KL", "rkl": "reverse KL", "tvd": "total variation",
             "tvdpp": "TVD++", "jsd": f"JSD(β={run.get('jsd_beta')})"}[loss]
    if run.get("ttt_steps"):
        mask = f"GRIFFIN's alignment mask (top-{run['topk']})" if run.get("topk") else "no alignment mask"
        return (f"Loss: training-time test over {run['ttt_steps']} passes, each reading the previous pass's outputs, "
                f"pass i+1 weighted 0.8^i, {words} (`--token-loss {loss}`) between the target's and the head's "
                f"distributions over the draft vocabulary, no feature loss, {mask}.")
    text = (f"Loss: SmoothL1 feature regression plus {run.get('w_token', 0.1):g} × {words} (`--token-loss {loss}`) "
            "between the target's and the head's token distributions.")
    if run.get("select") == "adaspec":
        text += (f" AdaSPEC token selection: each batch trains on the {run['select_frac']:g} of positions where the "
                 f"head's per-token forward KL exceeds the frozen reference `{run['reference']}`'s the most.")
    return text


def layout_text(head: DraftModel, fmt: str, dtype: str) -> list[str]:
    """The card's paragraph on the checkpoint's layout."""
    cfg = head.config
    size = f"`{cfg.arch}` ({head.num_parameters() / 1e6:.2f} M parameters"
    if cfg.parts_ablated:
        size += f"; an ablation head, built without {' and '.join(cfg.parts_ablated)}"
    if fmt == "griffin" and cfg.fused:
        kept = " and ".join(name for name, on in cfg.griffin_parts.items() if on)
        serving = ("vLLM and SGLang serve the `eagle3` arch from `--format eagle3`" if cfg.arch == "eagle3" else
                   f"vLLM and SGLang cannot run its {kept}, so it has no EAGLE-3 export: "
                   "serve it with this package")
        return [f"Architecture {size}; reads the inputs of target layers {cfg.feature_layers} fused by `fc`, scores "
                f"a draft vocabulary of {cfg.output_vocab_size} tokens with its own norm and lm_head; the target's "
                f"embedding is shared at run time), weights in {dtype}; {serving}.", ""]
    if fmt == "griffin":
        return [f"Architecture {size}; the target's embedding and lm_head are shared at run time), draft vocabulary "
                f"{cfg.draft_vocab_size or cfg.vocab_size} tokens, weights in {dtype}.", ""]
    if fmt == "eagle3":
        return [f"Architecture {size}) in the EAGLE-3 layout vLLM and SGLang load (`LlamaForCausalLMEagle3`: "
                f"`midlayer.*`, `fc`, `norm`, `lm_head` over {cfg.output_vocab_size} draft tokens, `d2t`, `t2d`; no "
                f"`embed_tokens`, the target's is shared), weights in {dtype}; it reads the inputs of target layers "
                f"{cfg.feature_layers}, both engines' default.", ""]
    keys = "`fc.fc.*`, `fc.post_attention_layernorm`, `fc.mlp.*` (Token-Guided Fusion)" if cfg.is_griffin else "`fc.*`"
    readers = ("the official GRIFFIN code and this package read it; vLLM's and SGLang's EAGLE loaders have no "
               "Token-Guided Fusion" if cfg.is_griffin else "EAGLE-1/2 loaders (the `eagle` method of vLLM and "
               "SGLang, the official EAGLE code) and this package read it")
    vocab = (f"The head was trained with a reduced draft vocabulary of {cfg.draft_vocab_size} tokens; the official "
             f"layout has none, so it is expanded to the target's full lm_head ({cfg.vocab_size} tokens): drafts are "
             "scored over every token (no EAGLE-3 `d2t` mapping is written), which may change acceptance from the "
             "figures below, never the output." if cfg.draft_vocab_size else
             f"Drafts are scored over the target's full lm_head ({cfg.vocab_size} tokens).")
    return [f"Architecture {size}) in the official {'GRIFFIN' if cfg.is_griffin else 'EAGLE'} layout: a Llama "
            f"`config.json` and `model.safetensors` with keys {keys}, `layers.0.*` and the target's input embedding "
            f"as `embed_tokens.weight`, weights in {dtype}; {readers}. {vocab}", ""]


def replays(folders: list[str], digest: str) -> list[dict]:
    """The offline τ replays of the weights with ``digest`` among the ``tau-*.json`` files of ``folders``: one row per
    bench, temperature, tree and drafting dtype, from the file that measured it on the most prompts, the first of
    those (the same weights replay alike: later studies that replay them beside other heads leave the card as it
    is)."""
    best: dict[tuple, dict] = {}
    for path in sorted(f for folder in folders for f in Path(folder).glob("tau-*.json")):
        run = json.loads(path.read_text())
        for head, head_digest in run.get("head_digests", {}).items():
            if head_digest != digest:
                continue
            for temperature, scored in run.get("heads", {}).get(head, {}).items():
                row = {"bench": run["bench"], "temperature": float(temperature), "tree": run["tree"],
                       "draft_dtype": run.get("draft_dtype", "-"), **pooled_tau(scored["per_prompt"]),
                       "date": run["machine"]["date"], "command": run["command"]}
                key = (row["bench"], row["temperature"], tree_text(row["tree"]), row["draft_dtype"])
                if key not in best or (-row["n_prompts"], row["date"]) < (-best[key]["n_prompts"], best[key]["date"]):
                    best[key] = row
    return [best[k] for k in sorted(best)]


def card(name: str, dst: Path, head: DraftModel, report: dict, results: list[dict], stages: list[dict],
         notes: str = "", fmt: str = "griffin", dtype: str = "fp16", replayed: Sequence[dict] = ()) -> str:
    cfg = head.config
    run = report["run"]
    lines = [
        f"# {name} draft head for {cfg.target.get('name') or 'its target'}",
        "",
        *layout_text(head, fmt, dtype),
        "## Training",
        "",
    ]
    rows = []
    for stage in stages:
        r = stage["run"]
        last = stage["epochs"][-1]
        rows.append([r["steps"], r["topk"], f"{r['lr']:g}", r["total_updates"], r["global_batch"], last["tokens"],
                     f"{last['train_seconds'] / 3600:.2f}", r["mixed_precision"]])
    lines.append(markdown_table(["K (passes)", "top-k mask", "lr", "updates", "batch", "tokens seen", "hours",
                                 "autocast"], rows))
    lines += [f"Data: the feature store `{run['features']}` ({run['train_conversations']} training and "
              f"{run['val_conversations']} held-out conversations, the target's own hidden states). Optimiser AdamW "
              "(0.9, 0.95), cosine schedule with warm-up, gradient clipping 0.5, feature noise "
              f"{run['noise']}. {objective_text(run)}{' ' + notes if notes else ''}", "",
              "## Validation (held-out conversations, last epoch)", ""]
    passes = report["epochs"][-1]["passes"]
    topk_key = next((k for k in passes[0] if k.startswith("top") and k != "top1"), "top1")
    lines.append(markdown_table(["pass", "top-1", topk_key.replace("top", "top-"), "kept", "loss"],
                                [[p["pass"], p["top1"], p[topk_key], p["kept"], p["loss"]] for p in passes]))
    lines += ["`kept`: fraction of positions still in the loss at that pass (the alignment mask).", ""]
    if results:
        lines += ["## Measured acceptance length and speed", ""]
        rows = []
        for r in results:
            best = fastest_plain(r)
            rows.append([r["bench"], r["temperature"], r.get("dtype", "fp32"), r["n_prompts"], r["max_new_tokens"],
                         tree_text(r["tree"]), r["tau"], f"{best[0]:.2f} ({best[1]})" if best else "-",
                         r.get("speedup", "-"), r.get("identical_fraction", "-"), r["machine"]["date"]])
        lines.append(markdown_table(["bench", "T", "dtype", "prompts", "max new", "tree", "τ",
                                     "speedup vs fastest plain", "speedup vs HF generate", "identical", "measured"],
                                    rows))
        commands = dict.fromkeys(r["command"] for r in results)  # in order, once (`--bench all` writes several)
        lines += ["Commands:", ""] + [f"- `{c}`" for c in commands] + [""]
    if replayed:
        lines += ["## Acceptance length on a fixed tree (offline replay)", "",
                  "`inference.tau` replays the engine's cycles against the target's stored greedy continuations: no "
                  "timing, the same tree for every head. τ pooled over the prompts, ± its standard error.", ""]
        lines.append(markdown_table(["bench", "T", "prompts", "tree", "drafting", "τ", "measured"],
                                    [[r["bench"], r["temperature"], r["n_prompts"], tree_text(r["tree"]),
                                      r["draft_dtype"], f"{r['tau']:.2f} ± {r['se']:.2f}", r["date"]]
                                     for r in replayed]))
        commands = dict.fromkeys(r["command"] for r in replayed)
        lines += ["Commands:", ""] + [f"- `{c}`" for c in commands] + [""]
    lines += ["## Use", "", "```python", "from griffin import SpecGenerator",
              f'gen = SpecGenerator.from_pretrained("{cfg.target.get("name")}", "{dst.as_posix()}")', "```", ""]
    return "\n".join(lines)


def stage_reports(src: Path) -> list[dict]:
    """The validation reports of a head and of the earlier stages it was initialised from, oldest first."""
    from .train import VALIDATION

    reports: list[dict] = []
    folder: Path | None = src
    while folder is not None and (folder / VALIDATION).is_file() and len(reports) < 16:
        report = json.loads((folder / VALIDATION).read_text())
        reports.insert(0, report)
        init = report["run"].get("init_from")
        folder = Path(init) if init else None
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=model_argument("draft head"),
                   help="trained head folder (output of training.train) or its Hugging Face Hub id")
    p.add_argument("dst", help="destination folder, e.g. checkpoints/<target>-<method>")
    p.add_argument("--name", default=None, help="the method's name in the card")
    p.add_argument("--results", nargs="+", default=["benchmarks/results", "benchmarks/results/ablation"],
                   help="folders of speed-run results")
    p.add_argument("--notes", default="", help="a sentence for the card's training section (e.g. the recipe)")
    p.add_argument("--format", default="griffin", choices=["griffin", "official", "eagle3"],
                   help="griffin: this package's layout; official: the EAGLE / GRIFFIN layout vLLM and SGLang read; "
                        "eagle3: the EAGLE-3 layout they read (eagle3 heads)")
    p.add_argument("--target", default=None, help="official format: the target (name or folder) whose input "
                   "embedding is stored as embed_tokens.weight (default: the target the head records)")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"], help="dtype of the written weights")
    args = p.parse_args(argv)
    from griffin.draft import DraftModel
    from griffin.hub import resolve
    from griffin.official import save_eagle3, save_official
    from griffin.target import load_target_head, resolve_dtype

    from .train import VALIDATION

    src, dst = resolve(args.src, kind="draft head"), Path(args.dst)
    head = DraftModel.from_pretrained(src)
    report = read_json(src / VALIDATION, "validation report")
    stages = json.loads((src / STAGES).read_text()) if (src / STAGES).is_file() else stage_reports(src)
    dtype = resolve_dtype(args.dtype)
    if args.format != "griffin" and src.resolve() == dst.resolve():
        raise ValueError(f"--format {args.format} writes a new folder: pass a destination other than the head's own")
    if args.format == "eagle3":
        save_eagle3(head, dst, dtype)
    elif args.format == "official":
        target = args.target or head.config.target.get("name")
        if not target:
            raise ValueError("the head records no target: pass --target (its input embedding is stored)")
        save_official(head, dst, load_target_head(target).get_input_embeddings().weight, dtype)
    elif src.resolve() != dst.resolve():
        head.save_pretrained(dst, dtype=dtype)
    if src.resolve() != dst.resolve():
        atomic_write(dst / VALIDATION, lambda path: shutil.copyfile(src / VALIDATION, path))
        atomic_write_json(dst / STAGES, stages)
    # untagged runs and those of `inference.speed --tag` (the headline runs: `<bench>-<name>-lookup10-T0.json`)
    files = [f for folder in args.results for f in Path(folder).glob(f"*-{dst.name}-*T*.json")]
    found = [json.loads(f.read_text()) for f in files]
    digest = weights_digest(dst)
    results = sorted((r for r in found if r.get("draft_digest") == digest),
                     key=lambda r: (r["bench"], r["temperature"], r.get("dtype", "fp32"), r["tree"]["total_tokens"]))
    replayed = replays(args.results, digest)
    text = card(args.name or head.config.arch, dst, head, report, results, stages, args.notes, args.format,
                args.dtype, replayed)
    atomic_write_text(dst / "README.md", text)
    other = len(found) - len(results)
    print(f"exported {src} -> {dst} in the {args.format} layout ({len(results)} speed runs and {len(replayed)} "
          "replays in the card"
          + (f"; {other} of other weights under this name left out" if other else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
