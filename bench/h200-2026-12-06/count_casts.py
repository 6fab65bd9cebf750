"""Per step of the trainer's backward_all on CPU, bf16 model with float32 adapters (bf16_adapters=True), fused LoRA,
packed, micro-batches of 8: which ATen calls serve only the adapters' dtype (casts) and gradient accumulation.
Run: .venv/bin/python bench/h200-2026-12-06/count_casts.py (about 3 min on 2 cores). Output of 2026-12-06 (CPU; CPU paths
such as HF's float32 RMSNorm add casts of their own that Liger or compiled layers fuse on a GPU):
  392 LoRA parameters; 494,107 ATen calls in backward_all for one step of 4 micro-batches;
  1,568 AccumulateGrad (392 x 4), 1,176 of them an aten::add_ (micro-batches 2-4);
  6,036 ToCopyBackward0 (the casts' backward; 1,568 of them the adapters' float32 <- bf16);
  30,269 aten::to (the adapters' float32 -> bf16 for each projection in each micro-batch's student pass among them).
So about 4,300 calls a step (1,568 + 1,568 casts and 1,176 adds) serve only float32 adapters under bf16 compute and their
accumulation across micro-batches; casting once per optimizer step and accumulating with one foreach add per
micro-batch would remove most of them (not built; a lead for the host-bound training half)."""
import time, collections
import torch
from torch.profiler import profile, ProfilerActivity
from transformers import Qwen3Config, Qwen3ForCausalLM
from opsd.toy import toy_tokenizer, make_problems
from opsd.train import OPSDConfig, OPSDTrainer
torch.set_num_threads(2)
tok = toy_tokenizer(); torch.manual_seed(0)
Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=28,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                             tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                 ).save_pretrained("/tmp/cd/ck28")
tok.save_pretrained("/tmp/cd/ck28")
cfg = OPSDConfig.toy(model="/tmp/cd/ck28", run_dir="/tmp/cd/run", steps=10, batch_size=32, micro_batch_size=8,
                     max_completion_length=16, log_positions=0, dtype="bfloat16", bf16_adapters=True,
                     padding="aligned", fused=True, checkpointing=0.0, lora_r=64, lora_alpha=128, clip="entry",
                     teacher="fixed", save_every=1000, rollout="hf", packed=True, fused_lora=True)
tr = OPSDTrainer(cfg, make_problems(64, seed=0, split="train"), progress=False)
p0 = next(p for n, p in tr.unwrapped.named_parameters() if "lora_A" in n)
print("adapter dtype", p0.dtype, "n lora params", sum(1 for n, p in tr.unwrapped.named_parameters() if p.requires_grad))
tr.step(1)
back, C = tr.backward_all, collections.Counter()
def counted(*a, **k):
    with profile(activities=[ProfilerActivity.CPU]) as p:
        out = back(*a, **k)
    for e in p.events():
        par = getattr(e.cpu_parent, "name", "")
        if e.name in ("aten::_to_copy", "aten::add_", "aten::add", "aten::copy_"):
            C[(e.name, par[:60])] += 1
        if e.name.startswith("aten::"): C["all aten"] += 1
        if "AccumulateGrad" in e.name or "ToCopyBackward" in e.name: C[e.name[:70]] += 1
    return out
tr.backward_all = counted
tr.step(2)
for k, v in C.most_common(25): print(v, k)
