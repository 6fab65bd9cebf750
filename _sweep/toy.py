import hashlib, json, math, random, time, os
from dataclasses import dataclass, asdict, field, replace
from pathlib import Path
import torch, torch.nn.functional as F
from opsd.data import PromptConfig, student_prompt, teacher_prompt, QWEN3_CHAT_TEMPLATE, last_boxed, user_cache_dir

def _split_of(text, test_permille=200):
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return "test" if h % 1000 < test_permille else "train"

OPS = {"+": lambda a,b: a+b, "-": lambda a,b: a-b, "*": lambda a,b: a*b}

def _one(rng, min_ops, max_ops, max_start, max_operand, max_value):
    k = rng.randint(min_ops, max_ops)
    v = rng.randint(1, max_start); expr = str(v); steps = []
    while len(steps) < k:
        op = rng.choice("+-*"); b = rng.randint(2 if op=="*" else 1, max_operand)
        r = OPS[op](v, b)
        if r < 0 or r > max_value: continue
        steps.append((v, op, b, r)); expr = f"({expr}{op}{b})" if len(steps) < k else f"{expr}{op}{b}"
        v = r
    return expr, steps

def solution_text(steps):
    return "\n".join(f"{a}{op}{b}={r}" for a,op,b,r in steps) + f"\n\\boxed{{{steps[-1][3]}}}"

def make_problems(n, seed=0, split="train", min_ops=2, max_ops=3, max_start=20, max_operand=9, max_value=999, test_permille=200):
    rng = random.Random(f"{seed}-{split}"); out, seen = [], set(); tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50*n + 1000: raise ValueError("too few distinct problems")
        expr, steps = _one(rng, min_ops, max_ops, max_start, max_operand, max_value)
        if expr in seen or _split_of(expr, test_permille) != split: continue
        seen.add(expr)
        out.append(dict(problem=expr, solution=solution_text(steps), answer=str(steps[-1][3]), id=f"{split}-{len(out)}", steps=steps))
    return out

def slipped_solution(steps, rng, deltas=(-1,1)):
    i = rng.randrange(len(steps)); out = []; v = None
    for j,(a,op,b,r) in enumerate(steps):
        if j > 0: a = v
        r = OPS[op](a,b)
        if j == i: r = r + rng.choice(deltas)
        if r < 0: r = 0
        out.append((a,op,b,r)); v = r
    return solution_text(out)

TOY_PROMPT = PromptConfig(student_template="Problem: {problem}\n{instruction}",
    teacher_template="Problem: {problem}\n{begin}\n{solution}\n{end}\n{guard}\n{instruction}",
    instruction="Solve step by step. Answer in \\boxed{}.", begin="=== Reference Begin ===", end="=== Reference End ===",
    guard="Derive it yourself; do not copy.")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
def toy_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=400, min_frequency=2, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    P = TOY_PROMPT
    corpus = [P.instruction, P.begin, P.end, P.guard, "Problem: ", "user", "assistant", "system"]*20
    tk.train_from_iterator(corpus, tr)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN3_CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    return tok

@dataclass
class ToyConfig:
    min_ops:int=2; max_ops:int=3; max_start:int=20; max_operand:int=9; max_value:int=999
    hidden_size:int=128; intermediate_size:int=384; num_hidden_layers:int=4; num_attention_heads:int=4; num_key_value_heads:int=2; head_dim:int=32
    sft_steps:int=600; batch_size:int=32; lr:float=3e-3; warmup_steps:int=30; weight_decay:float=0.0; teacher_frac:float=0.5; slip_frac:float=0.35
    seed:int=0; n_eval:int=200

def make_model(cfg, tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    V = -(-len(tok)//64)*64
    c = Qwen3Config(vocab_size=V, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(c)

def sft_examples(cfg, tok, n):
    rng = random.Random(cfg.seed + 1)
    probs = make_problems(n, cfg.seed, "train", cfg.min_ops, cfg.max_ops, cfg.max_start, cfg.max_operand, cfg.max_value)
    prompts, comps = [], []
    for p in probs:
        if rng.random() < cfg.teacher_frac:
            ref = slipped_solution(p["steps"], rng) if rng.random() < cfg.slip_frac else p["solution"]
            prompts.append(teacher_prompt(tok, p["problem"], ref, TOY_PROMPT))
        else: prompts.append(student_prompt(tok, p["problem"], TOY_PROMPT))
        comps.append(p["solution"] + tok.eos_token)
    P = tok(prompts, add_special_tokens=False)["input_ids"]; C = tok(comps, add_special_tokens=False)["input_ids"]
    return P, C

def batch(P, C, pad):
    L = max(len(p)+len(c) for p,c in zip(P,C))
    ids = torch.full((len(P), L), pad); lab = torch.full((len(P), L), -100); am = torch.zeros((len(P), L), dtype=torch.long)
    for i,(p,c) in enumerate(zip(P,C)):
        n = len(p)+len(c); ids[i,:n] = torch.tensor(p+c); lab[i,len(p):n] = torch.tensor(c); am[i,:n] = 1
    return ids, am, lab

def train(cfg, tok, log=50, device='cpu'):
    model = make_model(cfg, tok).to(device); model.train()
    n = cfg.sft_steps*cfg.batch_size
    P, C = sft_examples(cfg, tok, n)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s+1)/cfg.warmup_steps) * 0.5*(1+math.cos(math.pi*min(s,cfg.sft_steps)/cfg.sft_steps)))
    g = torch.Generator().manual_seed(cfg.seed); order = torch.randperm(n, generator=g).tolist()
    t0=time.time(); self_losses=[]
    for s in range(cfg.sft_steps):
        idx = order[s*cfg.batch_size:(s+1)*cfg.batch_size]
        ids, am, lab = [x.to(device) for x in batch([P[i] for i in idx], [C[i] for i in idx], tok.pad_token_id)]
        out = model(input_ids=ids, attention_mask=am)
        logits = out.logits[:, :-1].float(); loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab[:,1:].reshape(-1))
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); sched.step(); self_losses.append(loss.item())
        if s % log == 0 or s == cfg.sft_steps-1: print(s, round(loss.item(),4), round(time.time()-t0,1), flush=True)
    model.eval(); model.losses=self_losses; return model

@torch.no_grad()
def generate(model, tok, prompts, max_new_tokens=40, do_sample=False, temperature=1.0, bs=256):
    outs = []
    for i in range(0, len(prompts), bs):
        enc = tok(prompts[i:i+bs], add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt").to(model.device)
        kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
        g = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
        outs += [r[enc["input_ids"].shape[1]:].tolist() for r in g]
    return outs

def strip(ids, eos, pad):
    out = []
    for t in ids:
        out.append(t)
        if t == eos: break
    return [t for t in out if t != pad] if out and out[-1]!=eos else out

@torch.no_grad()
def measure(model, tok, cfg, n=200, seed=1234):
    probs = make_problems(n, seed, "test", cfg.min_ops, cfg.max_ops, cfg.max_start, cfg.max_operand, cfg.max_value)
    sp = [student_prompt(tok, p["problem"], TOY_PROMPT) for p in probs]
    tp = [teacher_prompt(tok, p["problem"], p["solution"], TOY_PROMPT) for p in probs]
    res = {}
    for name, prompts in [("student", sp), ("teacher", tp)]:
        outs = generate(model, tok, prompts)
        res[name+"_acc"] = sum(last_boxed(tok.decode(o, skip_special_tokens=True)) == p["answer"] for o,p in zip(outs, probs))/n
    torch.manual_seed(seed)
    outs = generate(model, tok, sp, do_sample=True)
    comps = [strip(o, tok.eos_token_id, tok.pad_token_id) for o in outs]
    res["student_sampled_acc"] = sum(last_boxed(tok.decode(o, skip_special_tokens=True)) == p["answer"] for o,p in zip(comps, probs))/n
    # teacher top prob on the student's sampled completions
    tids = tok(tp, add_special_tokens=False)["input_ids"]
    tops = []; tacc_tf = []
    for i in range(0, n, 100):
        rows = [t+c for t,c in zip(tids[i:i+100], comps[i:i+100])]
        L = max(map(len, rows)); ids = torch.full((len(rows), L), tok.pad_token_id); am = torch.zeros_like(ids)
        for j,r in enumerate(rows): ids[j, L-len(r):] = torch.tensor(r); am[j, L-len(r):] = 1
        pos = (am.cumsum(-1)-1).clamp(min=0)
        lp = model(input_ids=ids.to(model.device), attention_mask=am.to(model.device), position_ids=pos.to(model.device)).logits.float().softmax(-1)
        for j,c in enumerate(comps[i:i+100]):
            k = len(c)
            if k == 0: continue
            pr = lp[j, L-k-1:L-1]
            tops.append(pr.max(-1).values.mean().item())
    res["teacher_top_prob"] = sum(tops)/len(tops)
    return res
