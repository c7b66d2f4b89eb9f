"""Training tokens/s of two checkouts of this repository, interleaved on the same batches of a feature store.

    python ab.py FEATURES HEAD K CHECKOUT [CHECKOUT ...]

Each checkout's ``training.train.Trainer`` runs one warm-up update and then 5 timed updates (batch 4, draft
vocabulary 8192, bf16 autocast, K passes, top-3 alignment mask) on the first batches of the store's first epoch,
starting from HEAD; prints wall and process-CPU tokens/s and the 5 losses (equal losses: the same computation).
Run it once per checkout in a fresh process (the checkout goes first on sys.path).
"""

import sys
import tempfile
import time

checkout = sys.argv[4]
sys.path.insert(0, checkout)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from griffin.target import load_target_head  # noqa: E402
from training import train as T  # noqa: E402
from training.store import FeatureStore  # noqa: E402

torch.set_num_threads(1)
features, head, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
args = T.parse_args(["--features", features, "--out", tempfile.mkdtemp(prefix="ab-"), "--arch", "griffin",
                     "--steps", str(steps), "--topk", "3", "--lr", "6e-4", "--batch-size", "4", "--draft-vocab", "8192",
                     "--mixed-precision", "bf16", "--init-from", head])
store = FeatureStore(features)
acc = Accelerator(cpu=True, step_scheduler_with_optimizer=False, mixed_precision="bf16")
trainer = T.Trainer(args, acc, store, load_target_head(store.manifest["target"], device=acc.device))
batches = T.epoch_batches(store, trainer.train_idx, 4, 0, 0)
generator = torch.Generator().manual_seed(0)


def update(i: int) -> tuple[int, float]:
    out, tokens = trainer.run_batch(batches[i], generator)
    loss = (out["loss_sums"] / out["counts"].clamp(min=1)).mean()
    acc.backward(loss)
    acc.clip_grad_norm_(trainer.objective.parameters(), 0.5)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return tokens, loss.item()


update(0)
tokens, losses = 0, []
t0, c0 = time.perf_counter(), time.process_time()
for i in range(1, 6):
    n, loss = update(i)
    tokens += n
    losses.append(round(loss, 5))
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
print(f"{checkout} K={steps}: {tokens} tokens, {tokens / wall:.0f} tokens/s wall, {tokens / cpu:.0f} tokens/s CPU, "
      f"losses {losses}")
