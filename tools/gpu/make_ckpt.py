"A random-init Qwen3-1.7B-shaped checkpoint with the offline Qwen3 tokenizer, 64 problems, a run folder with one LoRA."
import json, sys, time
from pathlib import Path
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from opsd.data import qwen3_tokenizer
out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/w")
t0 = time.perf_counter()
tok = qwen3_tokenizer()
cfg = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype="bfloat16")
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
n = sum(p.numel() for p in model.parameters())
model.save_pretrained(out / "qwen3-1.7b-random"); tok.save_pretrained(out / "qwen3-1.7b-random")
print(f"checkpoint: {n / 1e9:.3f} B parameters, built and saved in {time.perf_counter() - t0:.1f} s "
      f"-> {out / 'qwen3-1.7b-random'}")
rows = []
for i in range(64):
    a, b, c = 3 + 7 * i % 91, 11 + 13 * i % 97, 2 + i % 9
    rows.append(dict(id=f"p{i}", problem=f"Compute ${a} \\times {b} + {c}$.",
                     solution=f"${a} \\times {b} = {a * b}$, plus {c} is $\\boxed{{{a * b + c}}}$.",
                     answer=str(a * b + c)))
(out / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
# a run folder: config + one LoRA checkpoint (random, non-zero) of the released shape (r 64, alpha 128, all linears)
from peft import LoraConfig, get_peft_model
from opsd.runs import RunDir
run = RunDir(out / "runs" / "rand17")
run.write_config(dict(model=str(out / "qwen3-1.7b-random"), dtype="bfloat16", name="rand17", seed=0))
torch.manual_seed(1)
lora = LoraConfig(r=64, lora_alpha=128, init_lora_weights=False,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
pm = get_peft_model(model, lora)
with torch.no_grad():
    for nme, p in pm.named_parameters():
        if "lora_B" in nme: p.mul_(0.01)  # a small update, as after some training
pm.save_pretrained(run.checkpoints_dir / "step-10")
print(f"run folder {run.path} with checkpoints {[p.name for p in run.checkpoints_dir.iterdir()]}; "
      f"total {time.perf_counter() - t0:.1f} s")
