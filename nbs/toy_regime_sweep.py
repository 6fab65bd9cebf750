"""Toy-regime exploration: bases x OPSD runs, held-out accuracy in-process. One JSON line per finished run.
usage: python explore.py GRID.json OUT.jsonl WORKERS DEADLINE_S BASEDIR
"""
import json, os, sys, time, math, random
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _setup():
    import torch
    torch.set_num_threads(1)


def build(spec, basedir):
    _setup()
    from opsd.toy import toy_config, build_toy_base, toy_build_info
    cfg = toy_config("soft", **spec)
    t = time.time()
    p = build_toy_base(cfg, preset="soft", cache_dir=basedir, progress=False)
    info = toy_build_info(p)
    return dict(kind="base", spec=spec, path=str(p), measure=info.get("measure"), seconds=time.time() - t)


def _eval(model, tok, probs, pc, seeds, greedy=True):
    from opsd.rollout import HFRollout, SamplingConfig
    from opsd.data import student_prompt_ids
    from opsd.eval import grade
    ids = [student_prompt_ids(tok, p["problem"], pc) for p in probs]
    ro = HFRollout(model, tok, batch_size=256, progress=False)
    out = {}
    accs = []
    for s in seeds:
        r = ro.generate(ids, SamplingConfig(temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=64, seed=s))
        accs.append(sum(grade(tok.decode(c, skip_special_tokens=True), p["answer"], mode="exact")
                        for c, p in zip(r.completion_ids, probs)) / len(probs))
    out["acc"] = sum(accs) / len(accs)
    out["acc_seeds"] = accs
    if greedy:
        r = ro.generate(ids, SamplingConfig(temperature=0.0, max_new_tokens=64))
        out["greedy"] = sum(grade(tok.decode(c, skip_special_tokens=True), p["answer"], mode="exact")
                            for c, p in zip(r.completion_ids, probs)) / len(probs)
    return out


def run(task):
    _setup()
    import torch
    from opsd.toy import toy_config, make_problems, TOY_PROMPT, toy_base_path
    from opsd.train import OPSDConfig, OPSDTrainer
    from opsd.eval import grade
    spec, rs = task["base"], task["run"]
    cfgb = toy_config("soft", **spec)
    path = toy_base_path(cfgb, "soft", task["basedir"])
    kw = cfgb.problem_kw()
    train_set = make_problems(2000, seed=rs.get("seed", 0), split="train", **kw)
    test_set = make_problems(task.get("n_eval", 200), seed=10_000, split="test", **kw)
    ov = {k: v for k, v in rs.items() if k not in ("eval_every",)}
    cfg = OPSDConfig.toy(model="toy", run_dir=f"/tmp/xr/{task['id']}", name=task["id"], padding="aligned",
                         log_positions=0, **ov)
    grader = lambda t, a: grade(t, a, mode="exact")
    t0 = time.time()
    tr = OPSDTrainer(cfg, train_set, model_path=str(path), grader=grader, prompt_config=TOY_PROMPT, progress=False)
    every = rs.get("eval_every", 25)
    evs = {0: _eval(tr.model, tr.tok, test_set, TOY_PROMPT, (101, 102))}
    rows = []
    for step in range(1, cfg.steps + 1):
        row = tr.step(step)
        rows.append({k: row.get(k) for k in ("step", "loss", "true_kl", "neg_loss_frac", "argmax_clipped_frac",
                                              "clipped_teacher_mass", "grad_cos", "sampled_acc", "grad_norm", "completion_len",
                                              "seconds", "rollout_seconds")})
        if step % every == 0 or step == cfg.steps:
            evs[step] = _eval(tr.model, tr.tok, test_set, TOY_PROMPT, (101, 102))
    return dict(kind="run", id=task["id"], base=spec, run=rs, evals=evs, rows=rows, seconds=time.time() - t0)


def main():
    grid, out, workers, deadline, basedir = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    t_start = time.time()
    g = json.load(open(grid))
    from concurrent.futures import ProcessPoolExecutor, as_completed, wait, FIRST_COMPLETED
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    f = open(out, "a")
    def emit(r):
        f.write(json.dumps(r) + "\n"); f.flush()
        print(json.dumps({k: v for k, v in r.items() if k not in ("rows", "evals")})[:300], flush=True)
        if r.get("kind") == "run":
            e = r["evals"]; ks = sorted(e, key=int)
            print("   acc", [round(e[k]["acc"], 3) for k in ks], "greedy", [round(e[k]["greedy"], 3) for k in ks],
                  "kl", round(r["rows"][0]["true_kl"], 4), "->", round(sum(x["true_kl"] for x in r["rows"][-5:]) / 5, 4),
                  "loss_last", round(r["rows"][-1]["loss"], 4), f"{r['seconds']:.0f}s", flush=True)
    with ProcessPoolExecutor(workers, mp_context=ctx) as ex:
        futs = {ex.submit(build, b, basedir): ("base", i) for i, b in enumerate(g["bases"])}
        done_bases = set()
        pending_runs = list(g["runs"])  # each: {id, base: spec, run: {...}}
        running = {}
        while futs or pending_runs:
            # submit runs whose base is built, keeping at most `workers` tasks in flight
            for t in list(pending_runs):
                if len(futs) >= workers: break
                key = json.dumps(t["base"], sort_keys=True)
                if key in done_bases:
                    t["basedir"] = basedir
                    futs[ex.submit(run, t)] = ("run", t["id"]); pending_runs.remove(t)
            if not futs: break
            left = deadline - (time.time() - t_start)
            if left <= 0: print("DEADLINE", flush=True); break
            d, _ = wait(list(futs), timeout=min(left, 5), return_when=FIRST_COMPLETED)
            for fu in d:
                kind = futs.pop(fu)
                try: r = fu.result()
                except Exception as e:
                    import traceback; print("FAIL", kind, repr(e), traceback.format_exc()[-1500:], flush=True); continue
                if r["kind"] == "base": done_bases.add(json.dumps(r["spec"], sort_keys=True))
                emit(r)
        f.close()
        print(f"total {time.time() - t_start:.0f}s", flush=True)
        for p in list(getattr(ex, "_processes", {}).values()):
            try: p.kill()
            except Exception: pass
        sys.stdout.flush(); os._exit(0)


if __name__ == "__main__":
    main()
