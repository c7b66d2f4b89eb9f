"""What a clone of the repository costs on disk: a full clone, ``--depth 1`` and ``--filter=blob:none``.

    python -m benchmarks.clone_cost
    python -m benchmarks.clone_cost --repo ../other-checkout --out clone-cost-other

Clones ``--repo`` (default: this checkout's committed history; uncommitted changes are not part of it) through a
``file://`` URL into a temporary folder, as a user's ``git clone`` of the published repository fetches it, and
measures each clone's ``.git`` folder and its checked-out files. The full clone's file versions are then split into
those the checked-out tree holds and earlier ones, by folder (checkpoints by head folder): what the history costs,
and where. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from griffin.cli import run_cli
from griffin.report import command_line, markdown_table, write_benchmark

MB = 1e6
KINDS = {"full": [], "depth 1": ["--depth", "1"], "blobless": ["--filter=blob:none"]}  # kind -> git clone options


def git(*args: str, cwd: Path | None = None, stdin: str | None = None) -> str:
    """Run git -> its stdout (raises with git's message on failure)."""
    res = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True)
    if res.returncode:
        raise ValueError(f"git {' '.join(args[:2])} failed: {res.stderr.strip()}")
    return res.stdout


def folder_bytes(folder: Path, skip: str | None = None) -> int:
    """Bytes of the files under ``folder`` (apparent sizes), leaving out its top-level entry ``skip``."""
    return sum(p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and not p.is_symlink() and p.relative_to(folder).parts[0] != skip)


def group(path: str) -> str:
    """A file's folder in the history table: ``checkpoints/<head>``, else its top-level folder (or the file)."""
    parts = path.split("/")
    return "/".join(parts[:2]) if parts[0] == "checkpoints" and len(parts) > 2 else parts[0]


def history(clone: Path) -> dict[str, dict[str, int]]:
    """Packed bytes of the clone's file versions by folder: ``present`` (in the checked-out tree) and ``earlier``
    (only in older commits). A version is counted once, under the first path git lists it at."""
    present = {line.split()[2] for line in git("ls-tree", "-r", "HEAD", cwd=clone).splitlines()}
    paths = dict(line.split(" ", 1) for line in git("rev-list", "--objects", "--all", cwd=clone).splitlines()
                 if " " in line)  # object -> path (commits have none)
    checked = git("cat-file", "--batch-check=%(objectname) %(objecttype) %(objectsize:disk)", cwd=clone,
                  stdin="\n".join(paths) + "\n")
    out = {"present": Counter(), "earlier": Counter()}
    for line in checked.splitlines():
        obj, kind, size = line.split()
        if kind == "blob" and paths[obj]:
            out["present" if obj in present else "earlier"][group(paths[obj])] += int(size)
    return {k: dict(v.most_common()) for k, v in out.items()}


def measure(repo: Path, work: Path) -> dict:
    """Clone ``repo`` each way under ``work`` -> sizes per kind, the full clone's history split and its HEAD."""
    url = f"file://{repo.resolve()}"
    clones = {}
    for kind, options in KINDS.items():
        dest = work / kind.replace(" ", "-")
        # shallow and partial clones are served by the full clone, which allows filters (the source is left as is)
        git("clone", "-q", *options, url if kind == "full" else f"file://{work / 'full'}", str(dest))
        if kind == "full":
            git("config", "uploadpack.allowFilter", "true", cwd=dest)
        clones[kind] = {"git_bytes": folder_bytes(dest / ".git"), "tree_bytes": folder_bytes(dest, skip=".git"),
                        "options": options}
        clones[kind]["total_bytes"] = clones[kind]["git_bytes"] + clones[kind]["tree_bytes"]
    full = work / "full"
    return {"commit": git("rev-parse", "HEAD", cwd=full).strip(),
            "commits": int(git("rev-list", "--count", "HEAD", cwd=full)), "clones": clones,
            "history": history(full)}


def report(result: dict) -> str:
    """The markdown page of a result."""
    rows = [[f"`{' '.join(['git clone', *c['options']])}`",
             f"{c['total_bytes'] / MB:.0f}", f"{c['git_bytes'] / MB:.0f}", f"{c['tree_bytes'] / MB:.0f}"]
            for c in result["clones"].values()]
    earlier, present = result["history"]["earlier"], result["history"]["present"]
    folders = sorted(set(earlier) | set(present), key=lambda f: -earlier.get(f, 0) - present.get(f, 0))
    split = [[f"`{f}`", f"{earlier.get(f, 0) / MB:.1f}", f"{present.get(f, 0) / MB:.1f}"] for f in folders
             if earlier.get(f, 0) + present.get(f, 0) >= 0.5 * MB]
    small = [f for f in folders if earlier.get(f, 0) + present.get(f, 0) < 0.5 * MB]
    if small:
        split.append([f"{len(small)} others, each under 0.5 MB", f"{sum(earlier.get(f, 0) for f in small) / MB:.1f}",
                      f"{sum(present.get(f, 0) for f in small) / MB:.1f}"])
    split.append(["**all**", f"**{sum(earlier.values()) / MB:.1f}**", f"**{sum(present.values()) / MB:.1f}**"])
    return (f"# What a clone costs\n\nThe repository at `{result['commit'][:10]}` ({result['commits']} commits), "
            f"cloned three ways through a `file://` URL on {result['date']} (git {result['git']}). MB = 10^6 bytes; "
            "files at their apparent size.\n\n"
            + markdown_table(["clone", "on disk, MB", ".git, MB", "checked-out files, MB"], rows)
            + "\nA blobless clone has every commit and fetches a file's earlier versions from the remote when a "
            "command needs them (`git checkout` of an old commit, `git log -p`).\n\nThe full clone's packed file "
            "versions by folder: the earlier ones (only in older commits) and those the checked-out tree holds.\n\n"
            + markdown_table(["folder", "earlier versions, MB", "present versions, MB"], split)
            + f"\nCommand: `{result['command']}`\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.clone_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=Path("."), help="the repository to clone (default: this checkout)")
    p.add_argument("--out", default="benchmarks/results/clone-cost", help="path without suffix")
    args = p.parse_args(argv)
    if not (args.repo / ".git").exists():
        raise ValueError(f"{args.repo} is not a git checkout (no .git): pass --repo with the repository root")
    with tempfile.TemporaryDirectory(prefix="clone-cost-") as work:
        result = measure(args.repo, Path(work))
    result.update(command=command_line("benchmarks.clone_cost", argv), git=git("--version").split()[-1],
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    out = Path(args.out)
    write_benchmark(out.parent, out.name, result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
