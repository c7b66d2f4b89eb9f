"""τ of the shipped heads' lineages against tokens seen, beside the EAGLE-3-generation heads' (issue 33).

    python benchmarks/results/recipe3-tau/shipped-curve.py            # extract, measure (resumes), tabulate, plot
    python benchmarks/results/recipe3-tau/shipped-curve.py --table    # only the table and plot, from the files

The shipped GRIFFIN and EAGLE-2 heads were trained by ``training.recipe`` over 36 chunks, the first 18 as the stage-1
heads ``griffin-s1`` and ``eagle-s1``, then forked into ``griffin`` and ``eagle2``. Their work-in-progress weights
were committed along the way (``checkpoints/smollm2-135m-instruct-wip/wip-*``; each card says how many chunks it has
seen), so every clone holds them in its history. This script takes the versions after 1, 4, 9, 18 and 25 chunks out
of git (``git archive`` into ``work/shipped-curve/``), adds the shipped heads (36 chunks), and measures all twelve
with ``inference.tau`` on the same settings as the EAGLE-3-generation chunk files beside it (MT-Bench T=0, first 40
questions, 24-node tree). Tokens seen per chunk: ``benchmarks/results/recipe/recipe.json``. The table and the plot put
those curves beside ``eagle3`` and ``griffin3`` (the ``chunk-*.json`` files here), with a least-squares slope of τ
per doubling of tokens over the points after 1M tokens, and the paired differences of the EAGLE-3-generation heads
(each chunk against the one before, eagle3 against griffin3) over their files' per-prompt records. Writes
``shipped-curve.{json,md}`` (the τ run) and ``tau-curve.{json,md,png}`` beside this file.
"""

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy

from griffin.report import fill_section, markdown_table, paired_difference, pooled_tau, write_benchmark

HERE = Path("benchmarks/results/recipe3-tau")  # run from the repository root: the paths below are relative to it
WORK = Path("work/shipped-curve")
WIP = "checkpoints/smollm2-135m-instruct-wip"
# (lineage, chunks seen) -> (commit, folder); the shipped heads (36 chunks) are in the working tree
VERSIONS = {
    ("griffin", 1): ("9303a89", f"{WIP}/wip-griffin-s1"),
    ("griffin", 4): ("f9aac36", f"{WIP}/wip-griffin-s1"),
    ("griffin", 9): ("f29c637", f"{WIP}/wip-griffin-s1"),
    ("griffin", 18): ("d603adc", f"{WIP}/wip-griffin-s1"),
    ("griffin", 25): ("fde5419", f"{WIP}/wip-griffin"),
    ("eagle2", 1): ("3255fde", f"{WIP}/wip-eagle-s1"),
    ("eagle2", 4): ("f7a2db4", f"{WIP}/wip-eagle-s1"),
    ("eagle2", 9): ("f29c637", f"{WIP}/wip-eagle-s1"),
    ("eagle2", 18): ("d603adc", f"{WIP}/wip-eagle-s1"),
    ("eagle2", 25): ("fde5419", f"{WIP}/wip-eagle2"),
}
SHIPPED = {"griffin": "checkpoints/smollm2-135m-instruct-griffin", "eagle2": "checkpoints/smollm2-135m-instruct-eagle2"}
STAGE1 = {"griffin": "griffin-s1", "eagle2": "eagle-s1"}  # the recipe's name of each lineage before the fork
FORK = 18  # chunks the stage-1 heads trained before the fork
TAU_ARGS = ["--bench", "mt_bench", "--temperatures", "0", "--limit", "40", "--threads", "1", "--max-new-tokens",
            "128", "--depth", "5", "--top-k", "8", "--total-tokens", "24"]
FIT_FROM = 1_000_000


def head_path(line: str, chunks: int) -> str:
    return SHIPPED[line] if chunks == 36 else str(WORK / f"{line}-c{chunks:02d}")


def extract() -> None:
    """Each committed version into ``work/shipped-curve/<lineage>-c<chunks>``, checked against its card."""
    for (line, chunks), (commit, folder) in VERSIONS.items():
        dest = Path(head_path(line, chunks))
        if (dest / "model.safetensors").is_file():
            continue
        tmp = dest.with_name(dest.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit, folder], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp), "--strip-components", str(folder.count("/") + 1)],
                       input=archive, check=True)
        card = (tmp / "README.md").read_text()
        if f"{chunks} chunks so far" not in card:
            sys.exit(f"{commit}:{folder} is not the head after {chunks} chunks (its card disagrees)")
        tmp.rename(dest)


def tokens_seen(curve: list[dict], line: str, chunks: int) -> int:
    name = STAGE1[line] if chunks <= FORK else line
    return next(p["tokens_seen"] for p in curve if p["head"] == name and p["chunk"] == chunks - 1)


def slope(points: list[tuple[int, float]]) -> float | None:
    """τ gained per doubling of tokens: least squares over the points after ``FIT_FROM`` tokens (None under 3)."""
    pts = [(t, y) for t, y in points if t > FIT_FROM]
    if len(pts) < 3:
        return None
    return float(numpy.polyfit([math.log(t) for t, _ in pts], [y for _, y in pts], 1)[0]) * math.log(2)


def tau_of(result: dict, path: str) -> tuple[float, float]:
    """-> τ at T=0 and its standard error of the head at ``path`` (a result names heads by folder). The error is
    recomputed from the per-prompt records: files written before ``inference.tau`` pooled it give the spread of
    per-prompt τ in ``tau_se``."""
    name = {p: n for n, p in result.get("head_paths", {}).items()}.get(path, path)
    run = result["heads"][name]["0"]
    return run["tau"], pooled_tau(run["per_prompt"])["se"]


def gen3_line(where: str) -> str | None:
    """The EAGLE-3-generation lineage a measured head belongs to (None: the shipped head measured beside chunks 0-2)."""
    return "eagle3" if "eagle3" in where else "griffin3" if "griffin3" in where else None


def gen3_runs(files: list[tuple[Path, dict]], n: int) -> Iterator[tuple[str, int, Path, dict, str]]:
    """(lineage, chunk, file, its result, the head's name in it) of every EAGLE-3-generation head measured on ``n``
    prompts."""
    for path, result in files:
        if result["n_prompts"]["0"] != n:
            continue
        for name in result["heads"]:
            where = result.get("head_paths", {}).get(name, name)  # a head measured alone is named by its last folder
            if (line := gen3_line(where)) is not None:
                yield line, chunk_of(where, path), path, result, name


def paired_rows(files: list[tuple[Path, dict]], n: int) -> list[dict]:
    """Over the files of ``n`` prompts, per chunk: each EAGLE-3-generation head against itself after the chunk
    measured before (``eagle3_step``, ``griffin3_step``) and eagle3 against griffin3 (``gap``)."""
    prompts: dict[tuple[str, int], list[dict]] = {}  # (lineage, chunk) -> its per-prompt records at T=0
    names: dict[int, set[str]] = {}  # chunk -> the files its points come from
    for line, chunk, path, result, name in gen3_runs(files, n):
        prompts[(line, chunk)] = result["heads"][name]["0"]["per_prompt"]
        names.setdefault(chunk, set()).add(path.name)
    chunks = sorted(names)
    rows = []
    for prev, chunk in zip([None, *chunks], chunks):
        row = {"chunk": chunk, "files": sorted(names[chunk])}
        for line in ("eagle3", "griffin3"):
            if (line, prev) in prompts and (line, chunk) in prompts:
                row[f"{line}_step"] = paired_difference(prompts[(line, chunk)], prompts[(line, prev)])
        if ("eagle3", chunk) in prompts and ("griffin3", chunk) in prompts:
            row["gap"] = paired_difference(prompts[("eagle3", chunk)], prompts[("griffin3", chunk)])
        rows.append(row)
    return rows


def paired_table(rows: list[dict], what: str) -> str:
    def cell(d: dict | None) -> str | None:
        return None if d is None else f"{d['diff']:+.3f} ± {d['se']:.3f}"

    return (f"\nPaired over {what}: each head against itself after the chunk measured before, and eagle3 against "
            "griffin3 after the same chunk (difference of the two τ ± its standard error, paired per prompt).\n\n"
            + markdown_table(["after chunk", "eagle3 − the chunk before", "griffin3 − the chunk before",
                              "eagle3 − griffin3", "files"],
                             [[r["chunk"], cell(r.get("eagle3_step")), cell(r.get("griffin3_step")), cell(r.get("gap")),
                               ", ".join(r["files"])] for r in rows]))


def chunk_of(where: str, path: Path) -> int:
    """The chunk a recipe head was measured after: its run folder's, or for chunk-7.json (the ``wip-*`` heads,
    named without their chunk) the file's."""
    suffix = where.split("-")[-1]
    return int(suffix) if suffix.isdigit() else int(path.stem.split("-")[1])


def taus_of(files: list[tuple[Path, dict]], n: int) -> dict[tuple[str, int], tuple[float, float, str]]:
    """(lineage, chunk) -> τ, its standard error and the file, over the files of ``n`` prompts."""
    return {(line, chunk): (*tau_of(result, name), path.stem)
            for line, chunk, path, result, name in gen3_runs(files, n)}


def signed(d: dict | None) -> str | None:
    """A paired difference as the README prints it (a true minus sign)."""
    return None if d is None else f"{d['diff']:+.3f} ± {d['se']:.3f}".replace("-", "−")


def readme_tables(files: list[tuple[Path, dict]], paired80: list[dict], paired160: list[dict]) -> str:
    """The README's curve section: τ after each chunk on the 80 and the 160 prompts, and fixed-set top-1, from the
    chunk files and ``recipe.json`` (tokens, learning rates, data of each chunk)."""
    record = json.loads(Path("checkpoints/smollm2-135m-instruct-recipe3/recipe.json").read_text())
    kind = {t["chunk"]: {"sharegpt": "ShareGPT", "regen": "answers"}[t["kind"]] for t in record["timings"]}
    point = {(p["head"], p["chunk"]): p for p in record["curve"]}
    tau80, tau160 = taus_of(files, 80), taus_of(files, 160)
    gap80, gap160 = ({r["chunk"]: r.get("gap") for r in rows} for rows in (paired80, paired160))

    def tau(taus: dict, line: str, chunk: int) -> str | None:
        return f"{taus[(line, chunk)][0]:.2f} ± {taus[(line, chunk)][1]:.2f}" if (line, chunk) in taus else None

    def top1(line: str, chunk: int) -> str:
        fixed = point[(line, chunk)]["fixed"]
        return " / ".join(f"{next(p['top1'] for p in fixed[s] if p['pass'] == 1):.3f}" for s in ("sharegpt", "regen"))

    chunks = sorted({c for _, c in tau80})
    curve = markdown_table(
        ["after chunk", "data", "tokens seen", "peak lr", "eagle3 τ", "griffin3 τ", "eagle3 − griffin3, paired",
         "fixed-set top-1 eagle3, ShareGPT / answers", "griffin3"],
        [[c, kind[c], f"{point[('eagle3', c)]['tokens_seen']:,}", f"{point[('eagle3', c)]['lr']:.1e}",
          tau(tau80, "eagle3", c), tau(tau80, "griffin3", c), signed(gap80.get(c)), top1("eagle3", c),
          top1("griffin3", c)] for c in chunks])
    chunks160 = sorted({c for _, c in tau160})
    all160 = markdown_table(
        ["after chunk", "eagle3 τ", "griffin3 τ", "eagle3 − griffin3, paired", "files"],
        [[c, tau(tau160, "eagle3", c), tau(tau160, "griffin3", c), signed(gap160.get(c)),
          ", ".join(f"[{f}]({f}.md)" for f in sorted({tau160[(ln, c)][2] for ln in ("eagle3", "griffin3")
                                                       if (ln, c) in tau160}))] for c in chunks160])
    return (curve + "\nFixed-set top-1: pass 1 of the training-time test on the recipe's held-out ShareGPT "
            "conversations and answers (`fixed` in recipe.json).\n\nOn all 160 prompts, the issue's measure:\n\n"
            + all160)


def table() -> None:
    curve = json.loads(Path("benchmarks/results/recipe/recipe.json").read_text())["curve"]
    shipped = json.loads((HERE / "shipped-curve.json").read_text())
    lines: dict[str, list[dict]] = {}
    for line in SHIPPED:
        for chunks in sorted({c for (ln, c) in VERSIONS if ln == line} | {36}):
            tau, se = tau_of(shipped, head_path(line, chunks))
            lines.setdefault(line, []).append({"chunks": chunks, "tokens": tokens_seen(curve, line, chunks),
                                               "tau": tau, "se": se, "file": "shipped-curve.json"})
    recipe3 = json.loads(Path("checkpoints/smollm2-135m-instruct-recipe3/recipe.json").read_text())["curve"]
    files = [(path, json.loads(path.read_text())) for path in sorted(HERE.glob("chunk*.json"), key=lambda p: p.name)]
    # the curve's measure: 40 questions (chunk-*-160 took all 160 prompts)
    for (line, chunk), (tau, se, stem) in taus_of(files, 80).items():
        tokens = next(p["tokens_seen"] for p in recipe3 if p["head"] == line and p["chunk"] == chunk)
        lines.setdefault(line, []).append({"chunks": chunk + 1, "tokens": tokens, "tau": tau, "se": se,
                                           "file": f"{stem}.json"})
    for pts in lines.values():
        pts.sort(key=lambda p: p["tokens"])
    slopes = {line: slope([(p["tokens"], p["tau"]) for p in pts]) for line, pts in lines.items()}
    for pts in lines.values():  # the local slope: τ gained per doubling since the previous point
        for prev, p in zip(pts, pts[1:]):
            p["per_doubling"] = (p["tau"] - prev["tau"]) / math.log2(p["tokens"] / prev["tokens"])
    rows = [[line, p["chunks"], f"{p['tokens']:,}", f"{p['tau']:.2f} ± {p['se']:.2f}",
             f"{p['per_doubling']:+.2f}" if "per_doubling" in p else None, p["file"]]
            for line, pts in lines.items() for p in pts]
    fits = [[line, len([p for p in pts if p["tokens"] > FIT_FROM]),
             None if slopes[line] is None else f"{slopes[line]:+.3f}",
             f"{pts[-1]['tokens']:,}", f"{pts[-1]['tau']:.2f}"] for line, pts in lines.items()]
    paired80, paired160 = paired_rows(files, 80), paired_rows(files, 160)
    text = ("# τ against tokens seen: the shipped heads' lineages and the EAGLE-3 generation\n\n"
            "Offline τ (`inference.tau`) on the fixed 24-node tree (depth 5, top-k 8), MT-Bench T=0, the first 40 "
            "questions (80 prompts); τ pooled over the prompts, ± its standard error over prompts (delta method; "
            "recomputed from each file's per-prompt records, so every point uses the same estimator). `griffin` and "
            "`eagle2`: the shipped heads' lineages (their stage-1 heads up to 18 chunks), measured in one run from "
            "the versions committed along the way ([shipped-curve.md](shipped-curve.md)); `eagle3` and `griffin3`: "
            "the recipe's chunk files here. Slope: least squares of τ on ln(tokens) over the points after 1M tokens, "
            "per doubling.\n\n"
            + markdown_table(["lineage", "fitted points", "τ per doubling", "tokens seen (last)", "τ (last)"], fits)
            + "\n" + markdown_table(["lineage", "chunks seen", "tokens seen", "τ", "τ per doubling since the point "
                                      "before", "file"], rows)
            + paired_table(paired80, "the curve's 80 prompts")
            + paired_table(paired160, "all 160 prompts (the issue's measure)")
            + "\nCommand: `python benchmarks/results/recipe3-tau/shipped-curve.py --table`\n\n"
            "![τ against tokens seen](tau-curve.png)\n")
    fill_section(HERE / "README.md", "curve", readme_tables(files, paired80, paired160))
    write_benchmark(HERE, "tau-curve", {"lines": lines, "slopes": slopes, "fit_from": FIT_FROM,
                                          "paired": {"80": paired80, "160": paired160}}, text)
    plot(lines, slopes)


def plot(lines: dict[str, list[dict]], slopes: dict[str, float | None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for line, pts in lines.items():
        s = slopes[line]
        label = line if s is None else f"{line} ({s:+.2f} per doubling)"
        ax.errorbar([p["tokens"] for p in pts], [p["tau"] for p in pts], yerr=[p["se"] for p in pts], marker="o",
                    capsize=3, label=label, linestyle="--" if line in SHIPPED else "-")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("τ, 24-node tree, MT-Bench T=0 (80 prompts)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = HERE / ".tau-curve.tmp.png"
    fig.savefig(tmp, dpi=110)
    tmp.rename(HERE / "tau-curve.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="only tabulate and plot the measured files")
    args = parser.parse_args()
    if not args.table:
        extract()
        heads = [head_path(line, c) for line in SHIPPED for c in sorted({c for (ln, c) in VERSIONS if ln == line})]
        heads += list(SHIPPED.values())
        subprocess.run([sys.executable, "-m", "inference.tau", "--heads", *heads, *TAU_ARGS,
                        "--out", str(HERE / "shipped-curve")], check=True)
    table()


if __name__ == "__main__":
    main()
