"""OPSDConfig's nested fields (`lora`, `sampling`, `vllm`, `ema`) against the flat names older runs wrote.

The store's config.json files are flat (`lora_r`, `max_completion_length`, `vllm_sleep`, ...). Each must load to the
config its nested form gives, field by field, with the mapping written out here by hand (not `RENAMED`), so that a
name dropped from or misrouted in `upgrade_config` fails. Break tried: `sample_top_k` removed from `RENAMED` (the
stored configs then fail with "unknown config field(s) ['sample_top_k']"), and `top_p` sent to `sampling.top_k`
(values differ)."""
import json
from pathlib import Path

import pytest

from conftest import opsd_main
from opsd.config import OPSDConfig, upgrade_config
from opsd.report import config_groups
from opsd.checkpoint import config_differences

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "results" / "smollm2-clips" / "smollm2-entry-sync-s2" / "config.json"   # lora 16/32, vllm 0.2, no sleep
OLD = {"lora_r": ("lora", "r"), "lora_alpha": ("lora", "alpha"), "lora_dropout": ("lora", "dropout"),
       "lora_targets": ("lora", "targets"), "max_completion_length": ("sampling", "max_tokens"),
       "sample_temperature": ("sampling", "temperature"), "top_p": ("sampling", "top_p"),
       "sample_top_k": ("sampling", "top_k"), "vllm_memory": ("vllm", "memory"), "vllm_sleep": ("vllm", "sleep"),
       "rollout_quantization": ("vllm", "quantization"), "rollout_kv_cache": ("vllm", "kv_cache"),
       "ema_decay": ("ema", "decay"), "ema_start": ("ema", "start")}


def nested_by_hand(flat: dict) -> dict:
    "A flat config.json in today's nested form, by the table above."
    out = {k: v for k, v in flat.items() if k not in OLD}
    for k, (g, f) in OLD.items():
        if k in flat: out.setdefault(g, {})[f] = flat[k]
    return out


def test_stored_flat_config_loads_as_its_nested_form():
    flat = json.loads(STORED.read_text())
    assert set(OLD) <= set(flat)                       # a config of before the nested fields
    cfg = OPSDConfig.from_dict(flat, source=str(STORED))
    assert cfg == OPSDConfig.from_dict(nested_by_hand(flat))
    for k, (g, f) in OLD.items():                      # every old value in its new place
        got = getattr(getattr(cfg, g), f)
        assert (list(got) if f == "targets" else got) == flat[k], k
    assert (cfg.lora.r, cfg.vllm.memory, cfg.vllm.sleep, cfg.sampling.max_tokens) == (16, 0.2, False, 128)
    assert OPSDConfig.from_dict(cfg.to_dict()) == cfg  # today's config.json (nested) round-trips
    # resuming a run whose config.json is flat with today's config: nothing differs; one real change is named dotted
    assert config_differences(flat, cfg.to_dict()) == {}
    assert config_differences(flat, cfg.replace(lora=dict(r=8)).to_dict()) == {"lora.r": (16, 8)}
    # the report's config groups read old and new files alike
    new = nested_by_hand(flat)   # the same run's config.json as today writes it (nested)
    other = dict(new, vllm=dict(new["vllm"], memory=0.5))
    label, differ = config_groups({"old": flat, "new": new, "other": other})
    assert differ == ["vllm.memory"] and label["old"] == label["new"] == "entry, vllm.memory=0.2"


def test_every_stored_config_loads():
    "Every config.json of the results store loads, and its nested form (to_dict) gives the same config."
    paths = sorted((ROOT / "results").rglob("config.json"))
    assert len(paths) > 50
    for p in paths:
        if "checkpoints" in p.parts: continue
        cfg = OPSDConfig.from_dict(json.loads(p.read_text()), source=str(p))
        assert OPSDConfig.from_dict(cfg.to_dict()) == cfg, p


def test_nested_overrides_merge(tmp_path):
    "A mapping merges into its group (replace, toy, YAML block); a whole group replaces it; flat names in code refused."
    t = OPSDConfig.toy()
    assert t.replace(lora=dict(r=4)).lora.alpha == t.lora.alpha == 16
    (tmp_path / "c.yaml").write_text("vllm:\n  sleep: false\nsampling.top_k: 5\nema_decay: 0.5\n")   # block, dotted, old
    c = OPSDConfig.from_yaml(tmp_path / "c.yaml", base=t.replace(vllm=dict(memory=0.2)))
    assert (c.vllm.memory, c.vllm.sleep, c.sampling.top_k, c.sampling.max_tokens, c.ema.decay) == (0.2, False, 5, 64, 0.5)
    with pytest.raises(TypeError, match=r"\['max_completion_length'\] moved to \['sampling.max_tokens'\]"):
        t.replace(max_completion_length=8)
    with pytest.raises(ValueError, match=r"config field sampling.max_tokens=0: must be in \[1, inf\]"):
        OPSDConfig.toy(sampling=dict(max_tokens=0))
    assert upgrade_config({"lora.r": 2, "lora": {"alpha": 4}}) == {"lora": {"r": 2, "alpha": 4}}


def test_cli_nested_set_and_help(tmp_path):
    "`--set lora.r=16 sampling.max_tokens=32` (and an old flat name, read quietly) resolve; --help lists nested fields."
    from opsd.cli import config_from_args, parser
    a = parser().parse_args(["train", "--preset", "toy", "--set", "lora.r=16", "--set", "sampling.max_tokens=32",
                             "vllm_sleep=false"])   # --set repeated: every item kept
    cfg = config_from_args(a)
    assert (cfg.lora.r, cfg.lora.alpha, cfg.sampling.max_tokens, cfg.vllm.sleep) == (16, 16, 32, False)
    code, out, err = opsd_main("train", "--help")
    assert code == 0 and "lora.r" in out and "sampling.max_tokens" in out and "vllm.kv_cache" in out, out[-800:]
    code, out, err = opsd_main("train", "--preset", "toy", "--set", "lora.rank=4", "--run-dir", tmp_path / "r")
    assert code == 2 and "config field lora: unknown key(s) ['rank']" in err, err
