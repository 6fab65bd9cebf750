"""Host cost of the opaque custom op `opsd::mm_plus_mm` against the plain in-place `addmm_` under torch.compile (CPU,
a tiny 4-layer model, median ms per forward + backward). Needs `custom_op_vs_6809bbd.diff` applied (opsd.kernels then
has `_mm_plus_mm`; the code kept in the repo does not). Output of 2026-12-06 (2 cores, two rounds):
  {'custom op': [9.96, 5.67], 'plain addmm_': [8.15, 4.65]} ms per fwd+bwd"""
import torch, time, statistics, sys
sys.path.insert(0, '.')
from opsd import kernels
from opsd.kernels import fuse_lora, apply_kernels
from transformers import Qwen3Config, Qwen3ForCausalLM
from peft import LoraConfig, get_peft_model
torch.set_num_threads(1)
def build():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    lc = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"])
    m = get_peft_model(Qwen3ForCausalLM(cfg), lc); fuse_lora(m); apply_kernels(m, "compile"); return m
ids = torch.randint(0,128,(2,9))
def timeit(m, n=60):
    ts = []
    for i in range(n):
        m.zero_grad(set_to_none=True); t = time.perf_counter()
        m(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean().backward()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[10:])
orig = kernels._mm_plus_mm
res = {}
for rnd in range(2):
  for name, f in (("custom op", orig), ("plain addmm_", lambda a, b, c, d, s: torch.mm(a, b).addmm_(c, d, alpha=s))):
    kernels._mm_plus_mm = f; torch._dynamo.reset(); m = build(); res.setdefault(name, []).append(timeit(m))
print({k: [round(x * 1e3, 2) for x in v] for k, v in res.items()}, "ms per fwd+bwd; calls per step: 4 layers x 7 fwd + bwd")
