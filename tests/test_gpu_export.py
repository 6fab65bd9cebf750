"""vLLM loads what `opsd export` writes (markers `gpu` and `vllm`; skipped where there is no CUDA GPU or no vllm).

A tiny Qwen3 base with a non-zero LoRA adapter saved as a run's checkpoint is exported; in a fresh process (vLLM does not
free an engine cleanly inside one) `vllm.LLM(folder)` generates greedily, and its completions equal HF greedy of the same
folder loaded with `from_pretrained` (rows may part only at a near-tie of HF's logits).
"""
import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

_VLLM = r"""
import json, sys
from vllm import LLM, SamplingParams
folder, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(folder, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True, max_model_len=512, seed=0)
outs = llm.generate([dict(prompt_token_ids=p) for p in prompts], SamplingParams(temperature=0, max_tokens=24))
print("ROWS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_vllm_loads_export(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from opsd.data import qwen3_tokenizer, student_prompt_ids
    from opsd.export import export_run
    from opsd.runs import RunDir

    tok = qwen3_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True, initializer_range=0.1, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    base = tmp_path / "base"
    Qwen3ForCausalLM(cfg).save_pretrained(base), tok.save_pretrained(base)
    run = RunDir(tmp_path / "run")
    run.write_config(dict(model=str(base), dtype="float32", name="run", seed=0, clip="entry", tau=0.05, steps=1))
    torch.manual_seed(1)
    lora = LoraConfig(r=8, lora_alpha=32, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(run.checkpoints_dir / "step-1")
    folder = export_run(run.path)
    prompts = [student_prompt_ids(tok, f"What is {a} + {b}?") for a, b in [(1, 2), (10, 5), (12, 30), (2, 9)]]
    r = subprocess.run([sys.executable, "-c", _VLLM, str(folder), json.dumps(prompts)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("ROWS="))[5:])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    parted = 0
    for p, g in zip(prompts, got):
        ids = torch.tensor([p], device="cuda")
        want = model.generate(ids, max_new_tokens=len(g), do_sample=False)[0, len(p):].tolist()
        if want == g: continue
        d = next(i for i, (x, y) in enumerate(zip(want, g)) if x != y)
        with torch.no_grad():
            z = model(torch.tensor([p + want[:d]], device="cuda")).logits[0, -1]
        assert float(z[want[d]] - z[g[d]]) < 1e-3, f"vLLM and HF part at step {d} without a near-tie"
        parted += 1
    assert parted <= 1
