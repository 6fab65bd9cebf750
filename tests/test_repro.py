"""The numbers a seed gives do not depend on the machine's thread settings, nor on an interruption.

Each case runs in a fresh process, as a user's command would: it builds a reduced toy base (30 SFT steps) and trains
4 OPSD steps on it (checkpoints every 2), under a different thread setting: OMP_NUM_THREADS=1 with torch at 1
thread; no environment setting with torch at 2 threads; OMP/MKL at 2 with the run stopped after step 2 and resumed
by a second trainer. All three must give the same base fingerprint and the same metrics, bit for bit, and the same
values as stored in tests/data/repro_toy.json for this CPU's vendor. The pins of nbs/05a_repro make Intel CPUs with
AVX2 or AVX-512 agree; an AMD EPYC (Zen 4, 2026-12-04) gives other bits under the same pins: MKL takes another code
path there (MKL_CBWR=AVX2 and =AVX512 gave the same bits on it, =COMPATIBLE others again), so each vendor has its
stored values. A vendor with none is checked between settings only, with a warning. Regenerate this vendor's entry
with OPSD_REGEN=1 after a change that is meant to move the numbers, and say why in the commit.

Breaks that made it fail: `sft_threads` left to the caller's thread count (the base differs between settings);
`OPSDConfig.cpu_threads` not applied (the runs differ at step 1); `pin_numerics` removed from build_toy_base (the
stored fingerprint differs: this machine dispatches AVX-512 without it)."""
import json, os, subprocess, sys, textwrap
from pathlib import Path

import pytest

STORED = Path(__file__).parent / "data" / "repro_toy.json"   # {cpu vendor: {base, metrics}}


def cpu_vendor() -> str:
    "The CPU's vendor id (GenuineIntel, AuthenticAMD, ...) from /proc/cpuinfo, or the platform's machine name."
    import platform
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("vendor_id"))
    except (OSError, StopIteration):
        return platform.machine()

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    torch.set_num_threads(int(sys.argv[3]))           # the caller's setting: opsd's own must win
    from opsd.toy import build_toy_base, toy_config, toy_fingerprint, make_problems, TOY_PROMPT
    from opsd.train import OPSDConfig, OPSDTrainer
    from opsd.eval import grade
    out, mode = Path(sys.argv[1]), sys.argv[2]
    base = build_toy_base(toy_config("soft", sft_steps=30, n_eval=0), cache_dir=out / "cache", progress=False)
    cfg = OPSDConfig.toy(model=str(base), run_dir=str(out / "run"), steps=4, save_every=2, batch_size=4,
                         micro_batch_size=2, sampling=dict(max_tokens=16), seed=5, clip="entry", log_positions=0)
    probs = make_problems(64, seed=5, split="train")
    trainer = lambda: OPSDTrainer(cfg, probs, grader=lambda t, a: grade(t, a, mode="exact"), prompt_config=TOY_PROMPT,
                                  progress=False)
    if mode == "interrupted": trainer().fit(stop_after=2)
    trainer().fit()
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    keep = lambda r: {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                      and not k.startswith("time/") and k != "seconds"}
    print(json.dumps(dict(base=toy_fingerprint(base), metrics=[keep(r) for r in rows])))
""")

CASES = {  # name: (environment, caller's torch threads, mode)
    "omp1": ({"OMP_NUM_THREADS": "1"}, 1, "straight"),
    "default-2-threads": ({}, 2, "straight"),
    "omp2-mkl2-interrupted": ({"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}, 2, "interrupted"),
}


def test_same_numbers_on_any_thread_setting_and_after_resume(tmp_path):
    from opsd.repro import NUMERIC_PINS
    drop = {"OMP_NUM_THREADS", "MKL_NUM_THREADS", *NUMERIC_PINS}   # a user's shell: opsd must pin the arithmetic itself
    base_env = {k: v for k, v in os.environ.items() if k not in drop}
    procs = {}
    for name, (env, threads, mode) in CASES.items():
        procs[name] = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / name), mode, str(threads)],
                                       env={**base_env, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    got = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, f"{name}: exit {p.returncode}\n{err[-3000:]}"
        got[name] = json.loads(out.strip().splitlines()[-1])
    first = got["omp1"]
    assert len(first["metrics"]) == 4 and [r["step"] for r in first["metrics"]] == [1, 2, 3, 4]
    for name, g in got.items():
        assert g["base"] == first["base"], f"{name}: the toy base differs from omp1's ({g['base']} vs {first['base']})"
        for s, (a, b) in enumerate(zip(first["metrics"], g["metrics"]), 1):
            diff = {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
            assert not diff, f"{name}: step {s} differs from omp1: {dict(list(diff.items())[:4])}"
    stored, vendor = json.loads(STORED.read_text()), cpu_vendor()
    if os.environ.get("OPSD_REGEN"):
        STORED.write_text(json.dumps({**stored, vendor: first}, indent=1) + "\n")
        pytest.skip(f"OPSD_REGEN: wrote the {vendor} entry of {STORED.name}")
    if vendor not in stored:
        import warnings
        warnings.warn(f"no stored values for CPU vendor {vendor} in {STORED.name} (stored: {sorted(stored)}): checked "
                      "between thread settings and resume only; OPSD_REGEN=1 stores them")
        return
    want = stored[vendor]
    assert first["base"] == want["base"], (f"the toy base's fingerprint {first['base']} is not the stored "
                                           f"{want['base']} of {vendor}: the arithmetic differs from the stored "
                                           "machine's")
    assert first["metrics"] == want["metrics"], f"the run's metrics differ from the values stored for {vendor}"
