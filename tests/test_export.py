"""Trackers (`report_to`) and `opsd export`, through the user's commands in this process.

* `opsd train --set report_to=tensorboard`: TensorBoard's own reader (EventAccumulator) gets back, for every number of
  every metrics.jsonl row, the same value (float32, as TensorBoard stores it) at the same step; with 'none' no tracker
  folder appears.
* `opsd export RUN`: a folder that plain `from_pretrained` loads and generates with, whose logits equal base + adapter
  put together by peft (the reference built another way), with a model card naming the clip mode and the evaluation.
Breaks seen failing: RunTrackers.log sending every row at step 0 instead of row["step"]; export_run saving the base
with the adapter dropped (`unload()` instead of `merge_and_unload()`: the logits then differ).
"""
import json
import math

import numpy as np
import pytest
import torch

from conftest import opsd_main

SMALL = ["batch_size=2", "micro_batch_size=2", "sampling.max_tokens=8", "lora.r=2", "dtype=float32"]


@pytest.fixture(scope="module")
def tb_run(tiny_ckpt, toy_data_file, tmp_path_factory):
    rd = tmp_path_factory.mktemp("tb") / "run"
    code, _, err = opsd_main("train", "--model", tiny_ckpt, "--data", toy_data_file, "--run-dir", rd, "--steps", "3",
                             "--save-every", "2", "--quiet", "--set", *SMALL, "report_to=tensorboard")
    assert code == 0, err[-3000:]
    return rd


def test_tensorboard_events_equal_metrics(tb_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rows = [json.loads(line) for line in (tb_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    ea = EventAccumulator(str(tb_run / "trackers" / "run"), size_guidance={"scalars": 0}).Reload()
    tags = set(ea.Tags()["scalars"])
    want = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))
            and math.isfinite(float(v))}
    assert len(want) > 20 and tags == want, (sorted(want - tags), sorted(tags - want))
    for k in want:
        got = {e.step: e.value for e in ea.Scalars(k)}
        ref = {r["step"]: float(np.float32(float(r[k]))) for r in rows if isinstance(r.get(k), (int, float))}
        assert got == ref, k


def test_report_to_none_and_bad_name(tiny_ckpt, toy_data_file, tmp_path):
    code, _, err = opsd_main("train", "--model", tiny_ckpt, "--data", toy_data_file, "--run-dir", tmp_path / "r",
                             "--steps", "1", "--quiet", "--set", *SMALL)
    assert code == 0, err[-3000:]
    assert not (tmp_path / "r" / "trackers").exists()
    code, _, err = opsd_main("train", "--model", tiny_ckpt, "--data", toy_data_file, "--run-dir", tmp_path / "s",
                             "--steps", "1", "--quiet", "--set", "report_to=tensorbord")
    assert code == 2 and "report_to" in err and "tensorbord" in err and not (tmp_path / "s").exists()


def test_export_reloads_and_generates(tb_run, tiny_ckpt, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "merged"
    code, stdout, err = opsd_main("export", tb_run, "--step", "2", "--out", out)
    assert code == 0, err[-3000:]
    assert str(out) in stdout
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("12+30=", return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape == (1, ids.shape[1] + 5)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_ckpt),
                                    str(tb_run / "checkpoints" / "step-2")).eval()
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_ckpt)(ids).logits
    assert (b - base).abs().max() > 1e-6          # the adapter changes something, so the check below can fail
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    card = (out / "README.md").read_text()
    assert "Clip mode **entry**" in card and "## Evaluation" in card and "step-2" in card
    assert "/tmp" not in card and str(tiny_ckpt) not in card      # a local base is named by its folder only
    assert json.loads((out / "opsd_export.json").read_text())["step"] == 2
    # an existing folder is refused and left as it was
    before = sorted(p.name for p in out.iterdir())
    code, _, err = opsd_main("export", tb_run, "--out", out)
    assert code == 2 and "exists" in err and sorted(p.name for p in out.iterdir()) == before
    code, _, err = opsd_main("export", tb_run, "--step", "5")
    assert code == 2 and "no checkpoint of step 5" in err
