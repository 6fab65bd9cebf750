"""ATen calls the trainer's `backward_all` dispatches per micro-batch, on CPU (a 28-layer Qwen3 of tiny width, batch 32,
packed, 16-token completions), at micro-batches of 8, 16 and 32. Run: .venv/bin/python count_dispatch.py (about 2 min).
2026-12-05 output: mb 8: 421,355 calls (4 micro-batches); mb 16: 343,987 (2); mb 32: 304,186 (1), i.e. about 39,000
per micro-batch independent of its rows plus about 8,300 per row (CPU's per-row packed-attention fallback)."""
import time
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
                 ).save_pretrained("/tmp/count_dispatch/ck28")
tok.save_pretrained("/tmp/count_dispatch/ck28")
for mb in (8, 16, 32):
    cfg = OPSDConfig.toy(model="/tmp/count_dispatch/ck28", run_dir=f"/tmp/count_dispatch/run-{mb}", steps=10,
                         batch_size=32, micro_batch_size=mb, max_completion_length=16, log_positions=0, dtype="float32",
                         padding="aligned", fused=True, checkpointing=0.0, lora_r=64, lora_alpha=128, clip="entry",
                         teacher="fixed", save_every=1000, rollout="hf", packed=True)
    tr = OPSDTrainer(cfg, make_problems(64, seed=0, split="train"), progress=False)
    tr.step(1)
    back, n, wall = tr.backward_all, [0], [0.0]
    def counted(*a, **k):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            t = time.perf_counter(); out = back(*a, **k); wall[0] += time.perf_counter() - t
        n[0] += sum(e.count for e in p.key_averages() if e.key.startswith("aten::"))
        return out
    tr.backward_all = counted
    tr.step(2)
    print(f"micro-batch {mb}: {32 // mb} micro-batches, {n[0]} aten calls in backward_all "
          f"({n[0] / (32 // mb):.0f} each), wall {wall[0]:.2f} s under the profiler (CPU)", flush=True)
