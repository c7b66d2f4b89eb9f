"""inference.tau: the offline replay gives the engine's τ (same cycles at T=0, same distribution at T>0), the
continuation cache resumes and feeds MT-Bench's second turn, and the CLI fails in one line on bad input."""

from __future__ import annotations

import itertools
import json
import random
import statistics

import pytest
import torch
from scipy.stats import chisquare

from griffin import DraftConfig, DraftModel, SpecGenerator, load_target
from griffin.drafters import HeadDrafter
from griffin.plain import plain_generate
from griffin.report import paired_difference, pooled_tau
from griffin.sampling import SamplingConfig, warp
from inference import tau
from inference.tau import PromptTau, Sample, TauResult, continuations, evaluate, prepare_head, replay, target_features
from tests.conftest import run_main, tiny_model

# float64 throughout: the engine takes features from tree-verification forwards and the replay from a causal one;
# in fp64 their rounding cannot flip a draft score tie, so the cycles must agree exactly
F64 = torch.float64


class NoTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def head_for(target, arch: str = "griffin", seed: int = 1) -> DraftModel:
    torch.manual_seed(seed)
    return DraftModel(DraftConfig.from_target(target.config, arch=arch))


@pytest.mark.parametrize("arch", ["griffin", "eagle", "eagle3", "griffin3"])
def test_greedy_replay_has_the_engines_cycles(arch):
    # a 16-token vocabulary: an untrained head's top-k trees still hit the target's choices, at every depth
    target = tiny_model("llama", vocab_size=16).to(F64)
    head = head_for(target, arch)
    draft = prepare_head(head, target, F64)
    lengths = set()
    shapes = [(5, 4, 12), (3, 3, 7)] if arch == "griffin" else [(4, 6, 20)]
    for depth, top_k, total in shapes:
        gen = SpecGenerator(target, NoTokenizer(), head, depth=depth, top_k=top_k, total_tokens=total, draft_dtype=F64)
        samples, stats = [], []
        for seed in range(3):
            prompt = torch.randint(0, 16, (5 + seed,), generator=torch.Generator().manual_seed(seed))
            eos = [3] if seed % 2 else None  # some runs stop at EOS, possibly inside an accepted path
            out = gen.generate(prompt, max_new_tokens=30 + seed, eos_token_id=eos)
            samples.append(Sample(seed, 0, prompt.tolist(), out.sequences[0, len(prompt):].tolist()))
            stats.append(out.stats)
        result = evaluate({"head": draft}, target, samples, depth, top_k, total, progress=False)["head"]
        for ours, engine in zip(result.prompts, stats):
            assert (ours.new_tokens, ours.cycles, ours.tau) == (engine.new_tokens, engine.cycles, engine.tau)
            lengths |= {d + 1 for d in ours.depths}
        engine_hist: dict[int, int] = {}
        for s in stats:
            for k, v in s.accepted_hist.items():
                engine_hist[k] = engine_hist.get(k, 0) + v
        assert result.accepted_hist() == dict(sorted(engine_hist.items()))
    assert {1, 2, 3} <= lengths  # paths of several lengths were accepted: a shifted feature or token would show


def test_sampled_replay_has_the_engines_cycles_on_the_engines_own_samples():
    # the emitted token at a node continues the walk iff it is a child, so the engine's own sampled output
    # determines its cycles: replaying that output must give them back exactly
    target = tiny_model("llama", vocab_size=12, seed=2).to(F64)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)  # spread-out distributions: sampled paths differ from greedy ones
    head = head_for(target)
    gen = SpecGenerator(target, NoTokenizer(), head, depth=4, top_k=4, total_tokens=12, draft_dtype=F64)
    draft = prepare_head(head, target, F64)
    prompt = torch.tensor([1, 7, 3, 9])
    lengths = set()
    for seed in range(8):
        out = gen.generate(prompt, max_new_tokens=24, temperature=1.0, seed=seed)
        cont = out.sequences[0, 4:]
        ours = replay(HeadDrafter(draft, 4, 4, 12, 40), prompt, cont, target_features(target, prompt, cont))
        assert (ours.cycles, ours.tau) == (out.stats.cycles, out.stats.tau), seed
        lengths |= {d + 1 for d in ours.depths}
    assert {1, 2, 3} <= lengths


def test_sampled_replay_has_the_engines_tau_distribution():
    """Exact τ distribution of the replay over every 4-token continuation (weighted by the target's probability)
    against the engine's τ over many seeds."""
    target = tiny_model("llama", vocab_size=3, hidden=16, layers=1, seed=11).to(F64)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)
    head = head_for(target, "eagle", seed=3)
    draft = prepare_head(head, target, F64)
    cfg = SamplingConfig(temperature=1.0)
    prompt = torch.tensor([1, 2, 0])
    exact: dict[float, float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(3), repeat=4):
            ids = torch.cat((prompt, torch.tensor(seq)))
            probs = warp(target(ids[None]).logits[0, 2:-1], cfg)  # [4, V] distributions of the 4 new tokens
            p = float(probs[torch.arange(4), torch.tensor(seq)].prod())
            cont = torch.tensor(seq)
            tau = replay(HeadDrafter(draft, 3, 2, 4, 10), prompt, cont, target_features(target, prompt, cont)).tau
            exact[tau] = exact.get(tau, 0.0) + p
    assert len(exact) == 3 and abs(sum(exact.values()) - 1) < 1e-6  # τ = 4, 2 or 4/3
    gen = SpecGenerator(target, NoTokenizer(), head, depth=3, top_k=2, total_tokens=4, draft_dtype=F64)
    runs = 200
    counts = {tau: 0 for tau in exact}
    for seed in range(runs):
        counts[gen.generate(prompt, max_new_tokens=4, temperature=1.0, seed=seed).stats.tau] += 1
    total = sum(exact.values())  # 1 up to warp's float32 rounding
    assert chisquare([counts[t] for t in exact], [exact[t] / total * runs for t in exact]).pvalue > 0.001


def test_alpha_and_histogram():
    result = TauResult(3, [PromptTau(0, 0, 9, [0, 1, 3, 2], [False, False, False, True]),
                           PromptTau(1, 0, 3, [1], [True])])
    # depth 1: reached by all 5 cycles, passed by 4; depth 2: reached by the 4 cycles of depth >= 1 less the one
    # censored at depth 1 (unknown), passed by 2; depth 3: reached by the 2 of depth >= 2 less the one censored at 2
    assert result.alpha() == [4 / 5, 2 / 3, 1 / 1]
    # emitted per cycle: 1, 2, 4, then the final cycle cut to the 9 - 1 - 7 = 1 token left; 2 (cut from 2 to 2)
    assert result.accepted_hist() == {1: 2, 2: 2, 4: 1}
    assert result.tau == 12 / 5 and [p.tau for p in result.prompts] == [9 / 4, 3.0]


def test_continuations_resume_and_feed_the_second_turn(tmp_path, tiny_target_dir):
    model, tokenizer = load_target(tiny_target_dir)
    bench = tmp_path / "prompts.jsonl"
    bench.write_text(json.dumps({"question_id": 5, "turns": ["Hi there.", "And again?"]}) + "\n" +
                     json.dumps({"prompt": "Name a colour."}) + "\n")
    folder = tmp_path / "cont"
    greedy = continuations(model, tokenizer, str(bench), max_new_tokens=6, folder=folder, progress=False)
    assert [(s.question_id, s.turn) for s in greedy] == [(5, 0), (5, 1), (1, 0)]
    for s in greedy:  # the target's own greedy continuation
        ref = plain_generate(model, torch.tensor(s.prompt), 6, SamplingConfig(), torch.tensor([tokenizer.eos_token_id]))
        assert s.continuation == ref.tolist()
    first_answer = tokenizer.decode(greedy[0].continuation, skip_special_tokens=True)
    second = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there."},
                                            {"role": "assistant", "content": first_answer},
                                            {"role": "user", "content": "And again?"}],
                                           tokenize=False, add_generation_prompt=True)
    assert greedy[1].prompt == tokenizer(second, add_special_tokens=False)["input_ids"]
    # a killed run leaves an incomplete file: the next run keeps what is there and generates only the rest
    path = next(folder.iterdir())
    header, *records = path.read_text().splitlines()
    kept = json.loads(records[0]) | {"continuation": [7, 7, 7]}
    path.write_text(json.dumps(json.loads(header) | {"complete": False}) + "\n" + json.dumps(kept) + "\n")
    resumed = continuations(model, tokenizer, str(bench), max_new_tokens=6, folder=folder, progress=False)
    assert resumed[0].continuation == [7, 7, 7] and len(resumed) == 3
    assert json.loads(path.read_text().splitlines()[0])["complete"]
    sampled = continuations(model, tokenizer, str(bench), temperature=1.0, seed=4, max_new_tokens=6, folder=folder,
                            limit=1, progress=False)
    again = continuations(model, tokenizer, str(bench), temperature=1.0, seed=4, max_new_tokens=6,
                          folder=tmp_path / "other", limit=1, progress=False)
    assert len(sampled) == 2 and [s.continuation for s in sampled] == [s.continuation for s in again]


@pytest.mark.parametrize("args,message", [
    (["--heads", "/nonexistent/head"], "not a draft head folder"),
    (["--bench", "no_such_bench"], "unknown bench"),
    (["--depth", "0"], "--depth must be at least 1"),
])
def test_cli_errors_are_one_line(args, message):
    code, err = run_main("inference.tau", *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_journal_drops_a_cut_line_so_later_results_survive(tmp_path):
    path = tmp_path / ".run.partial.jsonl"
    settings = {"bench": "b"}
    first = {"key": ["replay", "h", "0", 1, 0], "value": {"tau": 2.0}}
    path.write_text("\n".join(json.dumps(x) for x in [settings, first]) + '\n{"key": ["replay", "h"')
    journal = tau.Journal(path, settings)
    assert list(journal.done) == [tuple(first["key"])]
    journal.add(("replay", "h", "0", 2, 0), {"tau": 3.0})
    journal.handle.close()
    journal = tau.Journal(path, settings)
    journal.handle.close()
    assert len(journal.done) == 2
    path.write_text('{"bench"')  # a header cut by a kill: started again
    journal = tau.Journal(path, settings)
    journal.handle.close()
    assert journal.done == {} and json.loads(path.read_text()) == settings


def test_cli_engine_check_resume_and_reference(tmp_path, tiny_target_dir, monkeypatch):
    model, _ = load_target(tiny_target_dir)
    head = tmp_path / "head"
    head_for(model).save_pretrained(head)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hello.\nCount to three.\n")
    common = ["--target", str(tiny_target_dir), "--heads", str(head), "--bench", str(prompts), "--max-new-tokens",
              "12", "--draft-dtype", "fp32", "--total-tokens", "10", "--depth", "4", "--top-k", "4",
              "--continuations", str(tmp_path / "cont")]
    # killed after the replays: they are kept in the journal and reused (a tampered one shows it), not recomputed
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tau, "engine_check", interrupt)
    code, _ = run_main("inference.tau", *common, "--engine-check", "2", "--out", str(tmp_path / "first"))
    monkeypatch.undo()
    journal = tmp_path / ".first.partial.jsonl"
    assert code == 130 and not (tmp_path / "first.json").exists()
    header, *records = journal.read_text().splitlines()
    assert [json.loads(r)["key"][3:] for r in records] == [[0, 0], [1, 0]]
    tampered = json.loads(records[0])
    tampered["value"]["new_tokens"] += 1000
    journal.write_text("\n".join([header, json.dumps(tampered), records[1]]) + "\n")
    code, err = run_main("inference.tau", *common, "--engine-check", "2", "--out", str(tmp_path / "first"))
    assert code == 0, err
    assert not journal.exists()
    first = json.loads((tmp_path / "first.json").read_text())
    from griffin.io import weights_digest

    assert first["head_digests"] == {"head": weights_digest(head)}
    run = first["heads"]["head"]["0"]
    assert run["per_prompt"][0]["new_tokens"] > 1000
    run["per_prompt"][0]["tau"] = run["engine_check"][0]["replay_tau"]  # undo the tampering for the checks below
    run["per_prompt"][0]["new_tokens"] -= 1000
    assert [(r["engine_tau"], r["same_output"]) for r in run["engine_check"]] == \
        [(r["replay_tau"], True) for r in run["engine_check"]]
    assert [r["replay_tau"] for r in run["engine_check"]] == [p["tau"] for p in run["per_prompt"]]
    # a speed run's JSON as the reference: its temperature and questions are taken, per-prompt τ compared
    reference = {"bench": first["bench"], "max_new_tokens": 12, "tree": first["tree"], "temperature": 0.0,
                 "n_questions": 2, "tau": run["tau"], "command": "python -m inference.speed ...",
                 "per_prompt": [{"question_id": r["question_id"], "turn": r["turn"], "tau": r["engine_tau"],
                                 "ours": {"new_tokens": p["new_tokens"]}, "cycles": p["cycles"]}
                                for r, p in zip(run["engine_check"], run["per_prompt"])]}
    (tmp_path / "speed.json").write_text(json.dumps(reference))
    code, err = run_main("inference.tau", *common, "--references", str(tmp_path / "speed.json"), "--out",
                         str(tmp_path / "second"))
    assert code == 0, err
    compared = json.loads((tmp_path / "second.json").read_text())["heads"]["head"]["0"]["reference"]
    assert (compared["same_tau"], compared["n_prompts"]) == (2, 2)
    assert compared["speed_run_tau_se"] == pytest.approx(compared["replay_tau_se"])  # the same passes, pooled alike
    assert "Against speed runs" in (tmp_path / "second.md").read_text()
    reference["tree"] = {"depth": 5, "top_k": 8, "total_tokens": 24}
    (tmp_path / "speed.json").write_text(json.dumps(reference))
    code, err = run_main("inference.tau", *common, "--references", str(tmp_path / "speed.json"))
    assert code == 2 and "--total-tokens" in err


def test_paired_differences_pair_prompts_by_question_and_turn():
    def run(taus: dict) -> dict:  # τ = new tokens per cycle: 2 cycles a prompt
        rows = [{"question_id": q, "turn": t, "new_tokens": 2 * v, "cycles": 2, "tau": v} for (q, t), v in taus.items()]
        return {"tau": sum(taus.values()) / len(taus), "per_prompt": rows}

    base = {(1, 0): 3.0, (1, 1): 2.0, (2, 0): 4.0}
    other = {(2, 0): 3.5, (1, 1): 1.0, (1, 0): 2.0, (9, 0): 9.0}  # another order, and a prompt the first lacks
    result = {"n_prompts": {"0": 3}, "heads": {"a": {"0": run(base)}, "b": {"0": run(other)}}}
    row = tau.paired_differences(result)["0"]["b"]
    diffs = [1.0, 1.0, 0.5]  # (1,0), (1,1), (2,0); (9,0) is not paired
    assert row["n_prompts"] == 3 and row["diff"] == pytest.approx(2.5 / 3)  # equal cycles: the mean difference
    assert row["se"] == pytest.approx(statistics.stdev(diffs) / 3 ** 0.5)
    assert row["ratio"] == pytest.approx(3.0 / (15.5 / 4))
    assert tau.paired_differences({"n_prompts": {"0": 3}, "heads": {"a": {"0": run(base)}}}) == {}


def test_pooled_tau_and_paired_difference_standard_errors_match_a_bootstrap():
    rng = random.Random(0)
    first, other = [], []
    for i in range(120):  # the same answers (T=0); the other head needs a few more passes on some of them
        cycles = rng.choice([rng.randint(2, 6), rng.randint(20, 64)])  # short answers weigh less in pooled τ
        tokens = round(cycles * rng.uniform(1.4, 3.4))
        first.append({"question_id": i, "turn": 0, "new_tokens": tokens, "cycles": cycles})
        other.append({"question_id": i, "turn": 0, "new_tokens": tokens, "cycles": cycles + rng.randint(0, 5)})

    def pooled(rows: list[dict]) -> float:
        return sum(r["new_tokens"] for r in rows) / sum(r["cycles"] for r in rows)

    boot_tau, boot_diff = [], []
    for _ in range(3000):
        pick = [rng.randrange(120) for _ in range(120)]
        boot_tau.append(pooled([first[i] for i in pick]))
        boot_diff.append(boot_tau[-1] - pooled([other[i] for i in pick]))
    single, pair = pooled_tau(first), paired_difference(first, other)
    assert single["tau"] == pooled(first) and single["n_prompts"] == 120
    assert single["se"] == pytest.approx(statistics.stdev(boot_tau), rel=0.08)
    assert pair["diff"] == pytest.approx(pooled(first) - pooled(other)) and pair["n_prompts"] == 120
    assert pair["se"] == pytest.approx(statistics.stdev(boot_diff), rel=0.08)
    # a speed run's record gives its passes as new tokens / τ where it predates the stored count
    assert pooled_tau([{"ours": {"new_tokens": 10}, "tau": 2.5}, {"ours": {"new_tokens": 6}, "tau": 1.5, "cycles": 4}])[
        "tau"] == pytest.approx(16 / 8)


def test_tau_by_category_pools_tokens_over_cycles_and_needs_two_categories():
    rows = [{"question_id": 1, "turn": 0, "new_tokens": 10, "cycles": 5, "tau": 2.0},
            {"question_id": 1, "turn": 1, "new_tokens": 8, "cycles": 2, "tau": 4.0},
            {"question_id": 2, "turn": 0, "new_tokens": 9, "cycles": 3, "tau": 3.0},
            {"question_id": 3, "turn": 0, "new_tokens": 7, "cycles": 7, "tau": 1.0}]
    categories = {2: "math", 1: "writing", 3: None, 4: "coding"}  # 3: no category; coding: no prompt ran
    assert tau.by_category(rows, categories) == {"math": {"tau": 3.0, "n_prompts": 1},
                                                 "writing": {"tau": 18 / 7, "n_prompts": 2}}
    assert list(tau.by_category(rows, categories)) == ["math", "writing"]  # the bench's order
    assert tau.by_category(rows, {1: "writing", 2: "writing"}) == {}
    result = {"bench": "b", "tree": {"depth": 1, "top_k": 1, "total_tokens": 1}, "max_new_tokens": 8, "target": "t",
              "dtype": "fp32", "draft_dtype": "fp32", "n_prompts": {"0": 4}, "command": "c", "seconds": 1.0,
              "machine": {"cpu": "x", "cores": 1, "torch_threads": 1, "torch": "2", "date": "d"},
              "heads": {"h": {"0": {"tau": 2.0, "tau_se": 0.1, "alpha": [0.5], "per_prompt": rows,
                                    "categories": tau.by_category(rows, categories)}}}}
    text = tau.table(result)
    assert "## τ by category, T=0" in text and "| h | 3.00 | 2.57 |" in text
