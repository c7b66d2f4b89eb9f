"""Exploratory GPU run: environment, tiny identity, 8B-shape forward-cost curve and engine cycle split (current code)."""
import json, os, sys, time, traceback
import torch
sys.path.insert(0, os.getcwd())
OUT = os.environ.get("OUT", "/tmp")
DEV = os.environ.get("DEV", "cuda")
SMALL = os.environ.get("SMALL") == "1"
res = {}
def section(name):
    def deco(fn):
        t0 = time.time()
        try:
            res[name] = fn()
        except Exception as e:
            res[name] = {"error": repr(e), "tb": traceback.format_exc()[-2000:]}
        print(f"== {name} ({time.time()-t0:.1f}s):", json.dumps(res[name], default=str)[:1500], flush=True)
        json.dump(res, open(f"{OUT}/explore.json", "w"), indent=1, default=str)
    return deco

@section("env")
def _():
    import transformers, accelerate
    try:
        import flash_attn; fa = flash_attn.__version__
    except Exception as e:
        fa = repr(e)
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
            "transformers": transformers.__version__, "accelerate": accelerate.__version__, "flash_attn": fa,
            "python": sys.version}

from griffin import DraftConfig, DraftModel, SpecGenerator
from griffin.drafters import OracleDrafter
from griffin.plain import plain_generate
from griffin.sampling import SamplingConfig
from transformers import LlamaConfig, LlamaForCausalLM

class NoTok:
    eos_token_id = None
    def decode(self, ids, skip_special_tokens=True): return ""

def tiny(dtype, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    m = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad(): m.lm_head.weight.mul_(8.0)
    return m.to(DEV, dtype)

@section("tiny_identity")
def _():
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        t = tiny(dtype); ok = 0; n = 0
        for (d, k, tot) in [(5, 8, 24), (3, 4, 7), (6, 10, 60)]:
            torch.manual_seed(1)
            head = DraftModel(DraftConfig.from_target(t.config, arch="griffin"))
            gen = SpecGenerator(t, NoTok(), head, depth=d, top_k=k, total_tokens=tot, draft_dtype=dtype)
            for s in range(4):
                ids = torch.randint(0, 96, (6 + s,), generator=torch.Generator().manual_seed(s)).to(DEV)
                ours = gen.generate(ids, max_new_tokens=32, eos_token_id=[])
                ref = t.generate(ids[None], max_new_tokens=32, do_sample=False, eos_token_id=None, attention_mask=torch.ones_like(ids[None]))
                n += 1; ok += int(torch.equal(ours.sequences, ref))
        out[str(dtype)] = f"{ok}/{n}"
    return out

def big(shape):
    if SMALL:
        cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    elif shape == "llama3-8b":
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=8192)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    m = m.to_empty(device=DEV).to(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1: p.fill_(1.0)
            else: p.normal_(0, 0.02)
        m.lm_head.weight.mul_(5)
    for mod in m.modules():  # rotary buffers were on meta
        if hasattr(mod, "inv_freq") and hasattr(mod, "compute_default_rope_parameters"):
            inv, sc = mod.compute_default_rope_parameters(mod.config)
            mod.inv_freq = inv.to(DEV); mod.original_inv_freq = inv.to(DEV); mod.attention_scaling = sc
    return m.eval().requires_grad_(False)

def sync():
    if DEV == 'cuda': torch.cuda.synchronize()

def sync_time(fn, reps=10):
    fn(); sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); sync(); ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]

for shape in ["llama3-8b", "llama2-7b"]:
    state = {}
    @section(f"{shape}_load")
    def _():
        t0 = time.time(); state["m"] = big(shape); return {"load_s": time.time() - t0,
            "mem_gb": torch.cuda.memory_allocated() / 1e9 if DEV == "cuda" else 0}
    m = state.get("m")
    if m is None: continue
    torch.manual_seed(2)
    head = DraftModel(DraftConfig.from_target(m.config, arch="griffin"))
    gen = SpecGenerator(m, NoTok(), head, depth=6, top_k=10, total_tokens=60, draft_dtype=torch.bfloat16)

    @section(f"{shape}_forward_cost")
    def _():
        from griffin.autotune import cached_context_forward
        fwd = cached_context_forward(gen, 512, 128)
        base = sync_time(lambda: fwd(1))
        return {n: round(sync_time(lambda n=n: fwd(n)) / base, 3) for n in [1, 2, 4, 8, 16, 32, 61, 64, 128]} | {"t1_ms": base * 1e3}

    ids = torch.randint(0, m.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).to(DEV)
    @section(f"{shape}_plain")
    def _():
        cfg = SamplingConfig()
        eos = torch.tensor([], dtype=torch.long, device=DEV)
        plain_generate(m, ids, 8, cfg, eos); sync()
        t0 = time.perf_counter(); new = plain_generate(m, ids, 128, cfg, eos); sync()
        dt = time.perf_counter() - t0
        state["cont"] = new.tolist()
        t0 = time.perf_counter(); ref = m.generate(ids[None], max_new_tokens=128, do_sample=False, eos_token_id=None, attention_mask=torch.ones_like(ids[None])); sync()
        dt_hf = time.perf_counter() - t0
        return {"plain_tok_s": 128 / dt, "hf_tok_s": 128 / dt_hf, "plain_equals_hf": ref[0, 64:].tolist() == new.tolist()}

    @section(f"{shape}_untrained_cycle")
    def _():
        gen.generate(ids, max_new_tokens=16, eos_token_id=[])
        r = gen.generate(ids, max_new_tokens=64, eos_token_id=[])
        s = r.stats
        return {"cycles": s.cycles, "tau": s.tau, "draft_ms": s.draft_s / s.cycles * 1e3,
                "verify_ms": s.verify_s / s.cycles * 1e3, "other_ms": s.other_s / s.cycles * 1e3}

    @section(f"{shape}_oracle")
    def _():
        out = {}
        cont = state["cont"]
        for mode, d, k, tot in [("chain", 6, 1, 6), ("tree", 6, 10, 60)]:
            dr = OracleDrafter(cont, depth=d, top_k=k, total_tokens=tot, mode=mode, vocab_size=m.config.vocab_size)
            gen.generate(ids, max_new_tokens=16, eos_token_id=[], drafter=OracleDrafter(cont, depth=d, top_k=k, total_tokens=tot, mode=mode, vocab_size=m.config.vocab_size))
            sync(); t0 = time.perf_counter()
            r = gen.generate(ids, max_new_tokens=128, eos_token_id=[], drafter=dr)
            sync(); dt = time.perf_counter() - t0
            s = r.stats
            out[f"{mode}{tot}"] = {"tok_s": 128 / dt, "tau": s.tau, "identical": r.sequences[0, 64:].tolist() == cont,
                                   "draft_ms": s.draft_s / s.cycles * 1e3, "verify_ms": s.verify_s / s.cycles * 1e3,
                                   "other_ms": s.other_s / s.cycles * 1e3}
        return out
    del gen, m, state; torch.cuda.empty_cache() if DEV == "cuda" else None
print("done", flush=True)
