"""opsd.recipes (nbs/06c_recipes) and configs/recipes/: each named recipe loads, runs its step on a tiny real Qwen3 on
CPU (real LoRA through peft), and computes what its `equals` key says it does.

`fast` against `released` with aligned padding runs its real parts on CPU: packed rows with varlen attention (the
per-row sdpa reference, not flash), length grouping, micro-batches of 8, the chunked loss (torch's chunk math: Triton's
kernel is CUDA's), fused LoRA, no checkpointing, and `torch.compile`d decoder layers (Inductor's C++ backend, checked
once as written, and once with eager layers for a sharp tolerance). `bf16_adapters` is ignored on CPU (the documented
rule: CUDA only), so the comparison is in float64; on CUDA the bf16 adapter compute would add bf16 rounding."""
import json
import os
import subprocess
import sys

import pytest
import torch
from peft.utils import get_peft_model_state_dict

from opsd.bench import cut_completions
from opsd.recipes import RECIPES, STEP_FIELDS, equal_config, load_recipe, read_recipe, recipe_config
from opsd.train import OPSDConfig, OPSDTrainer
from opsd.config import upgrade_config

pytestmark = [pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")]

CUT = [12, 2, 9, 1, 11, 3, 2, 10, 7, 12, 4, 5, 12, 1, 8, 6]   # completion lengths, as a real model stops at EOS


def base(ckpt, run_dir) -> OPSDConfig:
    "The toy preset on a tiny checkpoint: 16 completions a step, float64, so that 'to rounding' is tight."
    return OPSDConfig.toy(model=str(ckpt), run_dir=str(run_dir), steps=2, batch_size=16, micro_batch_size=4,
                          sampling=dict(max_tokens=12), log_positions=0, dtype="float64", lr=0.05, save_every=100)


def two_steps(cfg, problems) -> tuple[list, dict]:
    "Two steps (completions cut to `CUT`) and the adapter after them."
    torch._dynamo.reset()
    tr = OPSDTrainer(cfg, problems, progress=False)
    with cut_completions(tr.rollout, lambda call, lens: CUT):
        rows = [tr.step(s) for s in (1, 2)]
    return rows, get_peft_model_state_dict(tr.unwrapped), tr


def test_released_recipe_is_the_defaults():
    """`released.yaml` writes out every step field at `OPSDConfig()`'s default: a default that changes without the
    recipe (or a field added to the step without it) fails here. Break tried: loss_chunk 512 in the file."""
    rel = upgrade_config(load_recipe("released"), flat=True)   # its nested blocks by dotted names (vllm.sleep)
    defaults = upgrade_config(OPSDConfig().to_dict(), flat=True)
    assert sorted(rel) == sorted(STEP_FIELDS)
    assert rel == {k: defaults[k] for k in STEP_FIELDS}
    assert read_recipe("released")[1] is None


def test_each_recipe_loads_and_names_its_departure():
    "Every named recipe loads over the toy preset; `fast` declares its equal, `fast-offpolicy` (a departure) none."
    for name in RECIPES:
        cfg = recipe_config(name, OPSDConfig.toy())
        assert cfg.lr == OPSDConfig.toy().lr and cfg.lora.r == 8      # the run's hyperparameters are the base's
    assert read_recipe("fast")[1] == dict(recipe="released", overrides=dict(padding="aligned"))
    assert read_recipe("fast-offpolicy")[1] is None
    off = recipe_config("fast-offpolicy")
    assert (off.steps_per_rollout, off.async_rollout, off.vllm.sleep) == (4, True, False)


EQUALS = [n for n in RECIPES if read_recipe(n)[1] is not None]


@pytest.mark.parametrize("name,eager", [(n, e) for n in EQUALS for e in (True, False)],
                         ids=[f"{n}-{'eager-layers' if e else 'as-written'}" for n in EQUALS for e in (True, False)])
def test_recipe_step_equals_what_it_declares(name, eager, sharp_ckpt, toy_problems, tmp_path):
    """Two steps of the recipe against two steps of the config its `equals` names (fast: released with aligned
    padding), both from the toy preset, completions of varied lengths: loss, true KL, clip fraction, gradient norm,
    token count and the adapter after two updates. With eager decoder layers (`decoder_kernels='none'`, seconds) the
    rest of the recipe (packing, length grouping, micro-batches of 8, the chunked loss, fused LoRA, no checkpointing)
    equals it to float64 rounding (1e-16 measured; asserted at 1e-12). As written, with `torch.compile`d layers
    (Inductor's C++ backend; most of the time is compiling), metrics to 1e-6 and the adapter to 1e-4 absolute:
    Inductor's float64 code differs from eager by about 1e-7 relative (loss 0.63898730 against 0.63898735 at step 1),
    and Adam's per-entry normalisation turns that into up to 2e-6 on an adapter entry whose gradient is near zero
    (the metrics' 1e-6 is the sharp check of the compiled case). Break tried once, on the eager case: `pack`
    reading the completion logits one position late (`W - L:W`): loss 0.5791 against 0.6390, and it failed."""
    b = base(sharp_ckpt, tmp_path / "r")
    mine = recipe_config(name, b, **(dict(decoder_kernels="none") if eager else {}))
    want = equal_config(name, b.replace(run_dir=str(tmp_path / "eq")))
    assert mine != want and want.padding == "aligned"
    got_rows, got_w, tr = two_steps(mine, toy_problems)
    ref_rows, ref_w, _ = two_steps(want, toy_problems)
    if name == "fast":   # the recipe's parts really ran
        assert tr.unwrapped.opsd_kernels == ("none" if eager else "compile") and tr.unwrapped.opsd_fused_lora > 0
        assert tr.unwrapped.get_base_model().config._attn_implementation == "opsd_packed_sdpa"
    rel = 1e-12 if eager else 1e-6
    for a, g in zip(ref_rows, got_rows):
        assert g["tokens"] == a["tokens"] == sum(CUT)
        for k in ("loss", "kl/true", "entry/argmax_clipped_frac", "grad_norm"):
            assert g[k] == pytest.approx(a[k], rel=rel, abs=1e-12), k
    assert ref_rows[0]["grad_norm"] > 0
    for k, v in ref_w.items():   # compiled: Adam's per-entry normalisation amplifies the gradients' 1e-7 differences
        torch.testing.assert_close(got_w[k], v, rtol=rel if eager else 1e-3, atol=1e-12 if eager else 1e-4)


def test_cli_train_recipe_fast_offpolicy_runs_on_cpu(tiny_ckpt, toy_data_file, tmp_path):
    """`opsd train --recipe fast-offpolicy` on the toy model on CPU: the recipe's fields reach config.json (under
    --set, which wins), and steps train on completions up to 3 updates old: steps 1-4 from one rollout of step 1's
    weights, step 5 from the rollout that ran beside step 4 (from the weights before step 4's update)."""
    run = tmp_path / "off"
    cmd = [sys.executable, "-m", "opsd.cli", "train", "--recipe", "fast-offpolicy", "--model", str(tiny_ckpt),
           "--data", str(toy_data_file), "--run-dir", str(run), "--steps", "5", "--batch-size", "4", "--quiet",
           "--set", "sampling.max_tokens=8", "log_positions=0", "decoder_kernels=none", "micro_batch_size=2"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["padding"], cfg["steps_per_rollout"], cfg["async_rollout"], cfg["loss_kernel"]) == ("packed", 4, True, "auto")
    assert (cfg["decoder_kernels"], cfg["micro_batch_size"]) == ("none", 2)    # --set after the recipe
    ages = [json.loads(line)["rollout_age"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert ages == [0, 1, 2, 3, 1], ages


def test_cli_recipe_refusals(tmp_path):
    "A recipe name that does not exist, or a file with a run's field: one line naming it, exit status 2."
    for arg, msg in (("fastest", "recipe 'fastest': not one of"), (str(tmp_path / "r.yaml"), "field 'lr'")):
        (tmp_path / "r.yaml").write_text("lr: 0.1\n")
        r = subprocess.run([sys.executable, "-m", "opsd.cli", "train", "--recipe", arg, "--model", "toy", "--steps", "1",
                            "--run-dir", str(tmp_path / "x")], capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and msg in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
