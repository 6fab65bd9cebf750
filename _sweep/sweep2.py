import sys, os, json, time
sys.path.insert(0, os.getcwd())
import torch.multiprocessing as mp

def work(kw):
    import torch; torch.set_num_threads(1)
    from opsd.toy import toy_config, toy_tokenizer, toy_model, train_sft, measure_toy
    kw = dict(kw); preset = kw.pop("preset")
    cfg = toy_config(preset, **kw); tok = toy_tokenizer()
    m = toy_model(cfg, tok).to(os.environ.get("DEVICE", "cuda"))
    t0 = time.time(); losses = train_sft(m, tok, cfg, progress=False); t1 = time.time()
    r = measure_toy(m, tok, cfg, n=200)
    r.update(kw=dict(preset=preset, **kw), train_s=round(t1 - t0, 1), final_loss=round(sum(losses[-20:]) / 20, 4))
    return r

if __name__ == "__main__":
    grid = json.load(open(sys.argv[1]))
    mp.set_start_method("spawn")
    with mp.Pool(int(sys.argv[2])) as pool:
        for r in pool.imap_unordered(work, grid):
            print(json.dumps(r['kw']), r['student_acc'], r['teacher_acc'], r['student_sampled_acc'], r['teacher_top_prob'], r['train_s'], flush=True)
