"""Prototype: a static-shaped verification forward (static KV buffers, device-side write positions, full-width 4D
mask) captured in a CUDA graph, against the same forward run eagerly. 8B shape, random bf16 weights."""
import json, os, sys, time
import torch
from transformers.cache_utils import Cache, DynamicLayer
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), ".gpu"))
DEV = os.environ.get("DEV", "cuda"); OUT = os.environ.get("OUT", "/tmp")
os.environ.setdefault("SMALL", "0")
from transformers import LlamaConfig, LlamaForCausalLM
SMALL = os.environ.get("SMALL") == "1"

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


class StaticLayer(DynamicLayer):
    is_compileable = True
    def __init__(self, keys, values, write_pos):
        super().__init__()
        self.keys, self.values, self.write_pos = keys, values, write_pos
        self.is_initialized = True
    def update(self, k, v, *args, **kwargs):
        self.keys.index_copy_(2, self.write_pos, k)
        self.values.index_copy_(2, self.write_pos, v)
        return self.keys, self.values
    def get_seq_length(self):
        return 0

def make_cache(model, L, write_pos):
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    layers = []
    for _ in range(cfg.num_hidden_layers):
        k = torch.zeros(1, cfg.num_key_value_heads, L, hd, dtype=torch.bfloat16, device=DEV)
        layers.append(StaticLayer(k, torch.zeros_like(k), write_pos))
    return Cache(layers=layers)

def sync():
    if DEV == "cuda": torch.cuda.synchronize()

def timeit(fn, reps=20):
    for _ in range(3): fn()
    sync(); ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); sync(); ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts)//2] * 1e3

res = {}
for shape in os.environ.get("SHAPES", "llama3-8b").split(","):
    m = big(shape)
    decoder, lm_head = m.get_decoder(), m.get_output_embeddings()
    L, ctx = 1024, 512
    out = {}
    for n in [1, 4, 16, 61, 128]:
        write_pos = (ctx + torch.arange(n, device=DEV))
        cache = make_cache(m, L, write_pos)
        tokens = torch.randint(0, m.config.vocab_size, (1, n), device=DEV)
        positions = write_pos[None].clone()
        cols = torch.arange(L, device=DEV)
        allowed = (cols[None, :] < ctx) | ((cols[None, :] >= ctx) & (cols[None, :] <= ctx + torch.arange(n, device=DEV)[:, None]))
        mask = torch.zeros(1, 1, n, L, dtype=torch.bfloat16, device=DEV).masked_fill_(~allowed, torch.finfo(torch.bfloat16).min)
        @torch.inference_mode()
        def fwd():
            h = decoder(input_ids=tokens, position_ids=positions, attention_mask=mask, past_key_values=cache,
                        cache_position=write_pos, use_cache=True).last_hidden_state
            return lm_head(h[0])
        eager = timeit(fwd)
        row = {"eager_ms": eager}
        if DEV == "cuda":
            try:
                s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3): fwd()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.inference_mode(), torch.cuda.graph(g):
                    static_logits = fwd()
                ref = fwd().float()
                g.replay(); sync()
                row["graph_ms"] = timeit(g.replay)
                row["graph_max_abs_diff"] = (static_logits.float() - ref).abs().max().item()
                row["graph_argmax_equal"] = bool(torch.equal(static_logits.argmax(-1), ref.argmax(-1)))
            except Exception as e:
                row["graph_error"] = repr(e)[:500]
        out[n] = row
        print(shape, n, row, flush=True)
    res[shape] = out
    del m, decoder, lm_head; 
    if DEV == "cuda": torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/graph_proto.json", "w"), indent=1)
