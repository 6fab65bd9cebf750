import sys, os, json, time, itertools
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); sys.path.insert(0, os.getcwd())
import torch.multiprocessing as mp

def work(args):
    i, kw = args
    import torch; torch.set_num_threads(1)
    from toy import ToyConfig, toy_tokenizer, train, measure
    import io, contextlib
    cfg = ToyConfig(**kw); tok = toy_tokenizer()
    t0 = time.time()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        m = train(cfg, tok, log=10**9, device=os.environ.get("DEVICE","cuda"))
    t1 = time.time()
    r = measure(m, tok, cfg)
    r.update(kw=kw, train_s=round(t1-t0,1), final_loss=sum(m.losses[-20:])/max(1,len(m.losses[-20:])))
    return r

if __name__ == "__main__":
    grid = json.loads(open(sys.argv[1]).read())
    out = os.environ.get("OUT", "/tmp")
    mp.set_start_method("spawn")
    with mp.Pool(int(sys.argv[2]) if len(sys.argv) > 2 else 8) as pool:
        with open(os.path.join(out, "results.jsonl"), "a") as f:
            for r in pool.imap_unordered(work, list(enumerate(grid))):
                print(json.dumps(r), flush=True); f.write(json.dumps(r) + "\n"); f.flush()
