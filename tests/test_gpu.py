"""GPU checks of the vLLM backend (markers `gpu` and `vllm`; skipped where there is no CUDA GPU or no vllm).

One engine serves the whole module (vLLM does not free an engine cleanly inside one process):
* after `sync_weights` of a peft student with non-zero LoRA, vLLM's greedy completions equal HF greedy of the merged
  student, and the first token's log-probability agrees (rows may part only at a near-tie of the HF logits);
* seeded sampling repeats, another seed differs;
* sleep (level 2: weights discarded) then `sync_weights` gives the same greedy completions; generate after a sleep
  reloads the weights from the source model by itself;
* evaluation through vLLM of a tiny run (base + one LoRA checkpoint) in the same engine;
* a sleeping engine wakes only where its memory fits: torch's cached blocks are handed back first, and live tensors
  that leave no room raise before vLLM maps anything (the engine then wakes normally once they are freed);
* on SmolLM2's real weights (opsd.smollm2), in a fresh process with its own engine: vLLM greedy after `sync_weights`
  equals HF greedy of the merged student.
"""
import copy
import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from opsd.rollout import HFRollout, SamplingConfig, make_rollout, resolve_backend  # noqa: E402

DTYPE = "float32"  # exact comparison; bf16 kernels of the two engines differ by rounding (near-ties then part ways)
TIE = 1e-3 if DTYPE == "float32" else 0.25  # HF logit gap under which two tokens count as tied
LP_TOL = 5e-3 if DTYPE == "float32" else 0.1
PROBLEMS = [dict(problem=f"What is {a} + {b}?", answer=str(a + b), solution=f"{a} + {b} = {a + b}.") for a, b in
            [(1, 2), (3, 4), (10, 5), (7, 7), (12, 30), (2, 9)]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opsd.data import qwen3_tokenizer, student_prompt_ids

    tok = qwen3_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True,
                      initializer_range=0.1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    base = Qwen3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("base")
    base.save_pretrained(path), tok.save_pretrained(path)
    torch.manual_seed(1)
    lora = LoraConfig(r=8, lora_alpha=32, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    student = get_peft_model(copy.deepcopy(base), lora).to(getattr(torch, DTYPE)).cuda().eval()
    ro = make_rollout("vllm", student, tok, str(path), max_model_len=512, gpu_memory_utilization=0.25, sleep=True,
                      seed=0, progress=False, dtype=DTYPE, enforce_eager=True)
    prompts = [student_prompt_ids(tok, p["problem"]) for p in PROBLEMS]
    return dict(tok=tok, base=base, path=path, student=student, ro=ro, prompts=prompts)


def test_auto_picks_vllm():
    assert resolve_backend("auto") == "vllm"


def _check_greedy_equal(model, prompts, got, eos, tok):
    "vLLM's greedy rows equal HF's, except where they part at a near-tie of HF's logits."
    sc = SamplingConfig(temperature=0, max_new_tokens=len(max(got, key=len)) or 1)
    want = HFRollout(model, tok, fast=False, progress=False).generate(prompts, sc).completion_ids
    parted = 0
    for p, a, b in zip(prompts, want, got):
        if a == b: continue
        d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert d < min(len(a), len(b)), f"one row is a prefix of the other: {a} vs {b}"
        with torch.no_grad():
            z = model(torch.tensor([p + a[:d]], device="cuda")).logits[0, -1].float()
        gap = float(z[a[d]] - z[b[d]])
        assert gap < TIE, f"rows part at step {d} where HF prefers {a[d]} over {b[d]} by {gap:.4g} (not a tie)"
        parted += 1
    assert parted <= len(prompts) // 3, f"{parted} of {len(prompts)} rows part"
    return want


def test_sync_weights_then_greedy_equals_merged_hf(setup):
    s = setup
    ro, student, tok = s["ro"], s["student"], s["tok"]
    sc = SamplingConfig(temperature=0, max_new_tokens=48)
    base_rows = ro.generate(s["prompts"], sc).completion_ids  # the engine holds the base weights from disk
    ro.sync_weights(student)
    out = ro.generate(s["prompts"], sc, logprobs=True)
    assert out.completion_ids != base_rows, "non-zero LoRA must change the greedy completions"
    merged = copy.deepcopy(student).merge_and_unload().eval()
    _check_greedy_equal(merged, s["prompts"], out.completion_ids, tok.eos_token_id, tok)
    # the first token's log-probability under the merged student
    for p, c, lp in zip(s["prompts"], out.completion_ids, out.logprobs):
        with torch.no_grad():
            z = merged(torch.tensor([p], device="cuda")).logits[0, -1].float()
        ref = torch.log_softmax(z, -1)[c[0]].item()
        assert abs(lp[0] - ref) < LP_TOL, (lp[0], ref)


def test_seeded_sampling_repeats(setup):
    ro = setup["ro"]
    ro.sync_weights(setup["student"])
    sc = SamplingConfig(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=32, seed=5)
    a = ro.generate(setup["prompts"], sc).completion_ids
    b = ro.generate(setup["prompts"], sc).completion_ids
    sc6 = SamplingConfig(temperature=1.1, top_p=0.95, top_k=20, max_new_tokens=32, seed=6)
    c = ro.generate(setup["prompts"], sc6).completion_ids
    assert a == b
    assert a != c


def test_sleep_and_sync(setup):
    ro, student = setup["ro"], setup["student"]
    sc = SamplingConfig(temperature=0, max_new_tokens=24)
    ro.sync_weights(student)
    ref = ro.generate(setup["prompts"], sc).completion_ids
    free0 = torch.cuda.mem_get_info()[0]
    ro.sleep()  # level 2: the source model can refill the weights
    assert ro.asleep == 2 and not ro.weights_valid
    freed = torch.cuda.mem_get_info()[0] - free0
    assert freed > 0, "sleep should free GPU memory"
    ro.sync_weights(student)  # the trainer's order: sleep, train, sync
    assert ro.asleep == 0 and ro.weights_valid
    assert ro.generate(setup["prompts"], sc).completion_ids == ref
    ro.sleep()
    assert ro.generate(setup["prompts"], sc).completion_ids == ref  # generate after a sleep reloads from the source
    print(f"sleep freed {freed / 2**30:.2f} GiB")


def test_eval_through_vllm_one_engine(setup, tmp_path):
    from opsd.eval import eval_runs, evaluate
    from opsd.runs import RunDir, read_eval

    s = setup
    run = RunDir(tmp_path / "tiny-run")
    run.write_config(dict(model=str(s["path"]), dtype=DTYPE, name="tiny-run", seed=0))
    s["student"].save_pretrained(run.checkpoints_dir / "step-1")
    raw = lambda text: text.strip() or None
    greedy = SamplingConfig(temperature=0, max_new_tokens=16)
    summary = eval_runs([run.path], PROBLEMS, k=2, seeds=(0,), backend=s["ro"], grade_mode="exact", sampling=greedy,
                        extract_fn=raw, progress=False)
    assert summary["step"].to_list() == [0, 1]
    rows = read_eval(run.path)
    assert rows.height == 2 * len(PROBLEMS) * 2
    # step 1 in the shared engine = the student synced directly
    s["ro"].sync_weights(s["student"])
    direct = evaluate(s["student"], s["tok"], PROBLEMS, k=2, seed=0, backend=s["ro"], sampling=greedy, extract_fn=raw)
    step1 = rows.filter(rows["step"] == 1).sort("problem_id", "sample")
    assert step1["pred"].to_list() == direct.sort("problem_id", "sample")["pred"].to_list()
    assert step1["pred"].to_list() != rows.filter(rows["step"] == 0).sort("problem_id", "sample")["pred"].to_list()
    # a seeded sampled evaluation repeats in the same engine
    a = evaluate(s["student"], s["tok"], PROBLEMS, k=3, seed=4, backend=s["ro"], max_new_tokens=16, extract_fn=raw)
    b = evaluate(s["student"], s["tok"], PROBLEMS, k=3, seed=4, backend=s["ro"], max_new_tokens=16, extract_fn=raw)
    assert a.equals(b)


SMOLLM2_CHILD = r'''
import copy, json, sys
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from opsd.data import student_prompt_ids
from opsd.rollout import HFRollout, SamplingConfig, make_rollout
from opsd.smollm2 import SMOLLM2_PROMPT, smollm2_base, word_problems

path = str(smollm2_base())
tok = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
torch.manual_seed(1)
lora = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
student = get_peft_model(copy.deepcopy(base), lora)
with torch.no_grad():  # non-zero LoRA, small enough that the model still writes sensible text
    for n, p in student.named_parameters():
        if "lora_B" in n: p.mul_(0.02)
student = student.cuda().eval()
prompts = [student_prompt_ids(tok, w["problem"], SMOLLM2_PROMPT) for w in word_problems(8, seed=0, split="test")]
ro = make_rollout("vllm", student, tok, path, max_model_len=1024, gpu_memory_utilization=0.2, sleep=False, seed=0,
                  progress=False, dtype="float32", enforce_eager=True)
sc = SamplingConfig(temperature=0, max_new_tokens=64)
before = ro.generate(prompts, sc).completion_ids  # the engine holds the base weights read from the folder
ro.sync_weights(student)
got = ro.generate(prompts, sc).completion_ids
merged = copy.deepcopy(student).merge_and_unload().eval()
want = HFRollout(merged, tok, fast=False, progress=False).generate(prompts, sc).completion_ids
base_hf = HFRollout(base.cuda(), tok, fast=False, progress=False).generate(prompts, sc).completion_ids
gaps = []
for p, a, b in zip(prompts, want, got):
    if a == b: gaps.append(None); continue
    d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if d >= min(len(a), len(b)): gaps.append("prefix"); continue
    with torch.no_grad():
        z = merged(torch.tensor([p + a[:d]], device="cuda")).logits[0, -1].float()
    gaps.append(float(z[a[d]] - z[b[d]]))
print("RESULT " + json.dumps(dict(want=want, got=got, before=before, base_hf=base_hf, gaps=gaps,
                                  text=tok.decode(got[0], skip_special_tokens=True))))
'''


def test_wake_makes_room_or_refuses(setup):
    """A sleeping engine wakes only where its memory fits. Torch's cached blocks (training's peak, reserved after the
    step) are handed back first: the case that lost an engine for good on an H100 at micro-batch 16 (vLLM maps its
    blocks back one by one; out of memory half-way, every later wake fails). Live tensors that leave no room make
    the wake raise before vLLM maps anything, and the engine wakes normally once they are freed."""
    ro, student = setup["ro"], setup["student"]
    sc = SamplingConfig(temperature=0, max_new_tokens=24)
    ro.sync_weights(student)
    ref = ro.generate(setup["prompts"], sc).completion_ids
    ro.sleep()
    need = ro.sleep_bytes
    assert need > 2**20, f"the sleep should have freed the engine's memory, measured {need} bytes"
    block = torch.empty(torch.cuda.mem_get_info()[0] - need // 2, dtype=torch.uint8, device="cuda")
    del block  # now torch's cache: reserved, so less than `need` is free to the engine
    assert torch.cuda.mem_get_info()[0] < need
    emptied = ro.room_emptied
    assert ro.generate(setup["prompts"], sc).completion_ids == ref
    assert ro.room_emptied == emptied + 1
    ro.sleep()
    hold = torch.empty(torch.cuda.mem_get_info()[0] - need // 2, dtype=torch.uint8, device="cuda")
    with pytest.raises(torch.OutOfMemoryError, match="stays asleep"):
        ro.generate(setup["prompts"], sc)
    assert ro.asleep
    del hold
    torch.cuda.empty_cache()
    assert ro.generate(setup["prompts"], sc).completion_ids == ref
    print(f"engine {need / 2**30:.2f} GiB; wakes that emptied torch's cache: {ro.room_emptied}")


def test_smollm2_vllm_greedy_after_sync_equals_merged_hf(tmp_path):
    """On SmolLM2's real weights, vLLM greedy after `sync_weights` of a student with non-zero LoRA equals HF greedy of
    the merged student, token for token (8 prompts x 64 tokens, float32). Random weights made near-ties likely; real
    weights do not, so at most one row may part, and only at a near-tie of HF's logits. Runs in a fresh process:
    this module's engine cannot be freed, and a second engine in one process is not reliable.
    Break: skip `sync_weights` (the engine keeps the base weights) -> the rows equal the base's, not the student's."""
    import os
    import subprocess
    import sys

    pytest.importorskip("peft")
    from opsd.smollm2 import smollm2_gguf
    try:
        smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    script = tmp_path / "smollm2_vllm.py"
    script.write_text(SMOLLM2_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, f"child failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    out = json.loads(line[len("RESULT "):])
    want, got, gaps = out["want"], out["got"], out["gaps"]
    print("first completion:", out["text"])
    assert out["base_hf"] == out["before"] or sum(a != b for a, b in zip(out["base_hf"], out["before"])) <= 1, \
        "the engine's base weights (from the cached folder) should give HF's base greedy rows"
    assert got != out["before"], "non-zero LoRA must change the greedy completions"
    parted = [(i, g) for i, g in enumerate(gaps) if g is not None]
    assert len(parted) <= 1, f"{len(parted)} of {len(want)} rows part from HF greedy of the merged student: {parted}"
    for i, g in parted:
        assert isinstance(g, float) and g < TIE, f"row {i} parts where HF's logits are not tied (gap {g})"
    assert sum(len(c) for c in got) >= 8 * 16, "completions too short to compare"


FP8_CHILD = r'''
import json, sys, torch
from transformers import AutoModelForCausalLM
from opsd.data import qwen3_tokenizer
from opsd.rollout import SamplingConfig, make_rollout
base_dir, student_dir, mode = sys.argv[1:4]
tok = qwen3_tokenizer()
prompts = [[int(t) for t in torch.randint(100, 5000, (n,), generator=torch.Generator().manual_seed(n))]
           for n in (5, 9, 17, 33)]
ro = make_rollout("vllm", None, tok, base_dir if mode == "sync" else student_dir, max_model_len=256,
                  gpu_memory_utilization=0.2, sleep=True, seed=0, progress=False, quantization="fp8",
                  kv_cache_dtype="fp8")
sc = SamplingConfig(temperature=0, max_new_tokens=48)
out = dict(quantization=ro.quantization, kv=ro.kv_cache_dtype, first=ro.generate(prompts, sc).completion_ids)
if mode == "sync":
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.bfloat16).cuda()
    ro.sync_weights(student)
    out["synced"] = ro.generate(prompts, sc).completion_ids
    ro.sleep(2)                                  # weights dropped; generate reloads them from the source
    out["after_sleep"] = ro.generate(prompts, sc).completion_ids
print("RESULT " + json.dumps(out))
'''


def test_fp8_rollout_sync_equals_fresh_fp8_engine(tmp_path):
    """`vllm.quantization='fp8'` with an fp8 KV cache: vLLM quantizes the weights as it loads them, so
    `sync_weights` goes through vLLM's layerwise reload (`reload_weights`), which quantizes the new bf16 weights again
    into the same storage (the CUDA graphs keep reading it). Greedy completions of an fp8 engine started on the base
    and synced to a student equal those of an fp8 engine started on the student's own folder, token for token, also
    after a level-2 sleep and reload; and they differ from the base's. Two processes: one engine each."""
    import os
    import subprocess
    import sys

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opsd.data import qwen3_tokenizer
    tok = qwen3_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      initializer_range=0.2)
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    student = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():                                    # the student: the base moved by a few percent
        for (n, p), q in zip(student.named_parameters(), base.parameters()): p.copy_(q * 1.05 + 0.01 * torch.randn_like(q))
    for m, d in ((base, tmp_path / "base"), (student, tmp_path / "student")):
        m.save_pretrained(d); tok.save_pretrained(d)
    script = tmp_path / "fp8_child.py"
    script.write_text(FP8_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    res = {}
    for mode in ("sync", "fresh"):
        r = subprocess.run([sys.executable, str(script), str(tmp_path / "base"), str(tmp_path / "student"), mode],
                           capture_output=True, text=True, timeout=600, env=env)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        assert r.returncode == 0 and line, f"{mode} child failed (rc {r.returncode}):\n{r.stderr[-6000:]}"
        res[mode] = json.loads(line[len("RESULT "):])
    assert (res["sync"]["quantization"], res["sync"]["kv"]) == ("fp8", "fp8")
    assert res["sync"]["synced"] == res["fresh"]["first"], "fp8 reload of the student != an fp8 engine on the student"
    assert res["sync"]["after_sleep"] == res["fresh"]["first"]
    assert res["sync"]["first"] != res["fresh"]["first"], "the student must sample differently from the base"
