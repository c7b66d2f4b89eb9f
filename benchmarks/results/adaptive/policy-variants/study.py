"""Study: adaptation variants against the fixed default tree and plain decoding, MT-Bench 2 per category, both turns."""
import json, time, collections, torch
torch.set_num_threads(1)
import griffin.generator as G
from griffin import SpecGenerator
from griffin.adapt import ShapePolicy
N = 128
plain = SpecGenerator.from_pretrained("smollm2-135m-instruct", total_tokens=0, adapt=False)
fixed = SpecGenerator.from_pretrained("smollm2-135m-instruct", total_tokens=6, depth=3, lookup=10, adapt=False)
adaptive = SpecGenerator.from_pretrained("smollm2-135m-instruct", lookup=10)
def policy(start, honour_plain_first):
    return lambda shapes, plain_first=False: ShapePolicy(shapes, plain_first=plain_first and honour_plain_first, start=start)
methods = {"plain": (plain, None), "fixed3x6": (fixed, None), "start1": (adaptive, policy(1, True)),
           "start3": (adaptive, policy(3, True)), "start1-probe4": (adaptive, policy(1, False)),
           "start3-probe4": (adaptive, policy(3, False))}
qs = [json.loads(l) for l in open("inference/data/mt_bench/question.jsonl")]
per = collections.defaultdict(list)
for q in qs:
    if len(per[q["category"]]) < 2: per[q["category"]].append(q)
warm = plain.encode([{"role": "user", "content": "Hi"}])
for g in (plain, fixed, adaptive): g.generate(warm, max_new_tokens=8)
rows = []
for cat, items in per.items():
    for q in items:
        msgs = [{"role": "user", "content": q["turns"][0]}]
        for turn in (0, 1):
            ids = plain.encode(msgs)
            rec = {"q": q["question_id"], "cat": cat, "turn": turn}
            for name, (g, pol) in methods.items():
                if pol is not None: G.ShapePolicy = pol
                t = time.perf_counter(); r = g.generate(ids, max_new_tokens=N); s = time.perf_counter() - t
                rec[name] = (r.stats.new_tokens / s, r.stats.tau, r.stats.plain_steps / max(r.stats.cycles, 1), r.stats.new_tokens, r.stats.plain_steps, dict(r.stats.shapes), r.stats.cycles)
                if name == "plain": answer = r.text
            rows.append(rec); print(json.dumps(rec), flush=True)
            msgs = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": q["turns"][1]}]
def summary(sel, label):
    out = {m: (round(sum(x[m][0] / x["plain"][0] for x in sel) / len(sel), 3), round(sum(x[m][1] for x in sel) / len(sel), 2)) for m in methods if m != "plain"}
    print(label, len(sel), out, flush=True)
summary(rows, "ALL")
for t in (0, 1): summary([r for r in rows if r["turn"] == t], f"turn{t}")
for cat in per: summary([r for r in rows if r["cat"] == cat], cat)
