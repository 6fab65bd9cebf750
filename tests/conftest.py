"Shared fixtures: a tiny real Qwen3 checkpoint (random init, the toy tokenizer) and toy problems."
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Without a GPU the Triton kernel (tests/test_fused_triton.py) runs in Triton's interpreter, which must be chosen before
# triton is first imported; peft imports triton when it is installed, so set it here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The arithmetic a user's `opsd` command uses (AVX2 kernels: nbs/05a_repro), before any test computes: stored values
# then hold on Intel x86 CPUs (an AMD CPU differs through MKL: tests/test_repro.py), and subprocesses inherit it.
from opsd.repro import pin_numerics  # noqa: E402
pin_numerics()


def _tiny_qwen3(tmp_path_factory, name: str, seed: int, **extra) -> Path:
    "A small random-init Qwen3ForCausalLM with the toy tokenizer, saved with save_pretrained."
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from opsd.toy import toy_tokenizer
    tok = toy_tokenizer()
    torch.manual_seed(seed)
    shape = dict(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=12, max_position_embeddings=1024, tie_word_embeddings=True,
                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = Qwen3ForCausalLM(Qwen3Config(**{**shape, **extra}))
    path = tmp_path_factory.mktemp("ckpt") / name
    model.save_pretrained(path); tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    "A small random-init Qwen3ForCausalLM saved with save_pretrained, with the toy tokenizer."
    return _tiny_qwen3(tmp_path_factory, "tiny-qwen3", seed=0)


@pytest.fixture(scope="session")
def sharp_ckpt(tmp_path_factory) -> Path:
    "`tiny_ckpt` with larger weights (initializer_range 0.2): peaked outputs, teacher != student, the clip acts."
    return _tiny_qwen3(tmp_path_factory, "sharp-qwen3", seed=1, initializer_range=0.2)


@pytest.fixture(scope="session")
def toy_problems():
    from opsd.toy import make_problems
    return make_problems(64, seed=0, split="train")


def venv_bin(name: str) -> str:
    import sys
    return str(Path(sys.executable).parent / name)


def opsd_main(*args) -> tuple[int, str, str]:
    """`opsd ARGS` run in this process through `opsd.cli.main` (the console script's function: the real parser, checks
    and commands): (exit code, stdout, stderr); the code is 0 when main returns. A test that needs the process boundary
    itself (the installed entry point, a signal, a fresh interpreter) runs `venv_bin("opsd")` instead."""
    import contextlib, io
    from opsd.cli import main
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try: assert main([str(a) for a in args]) is None  # sys.exit(main()) would print a returned value and exit 1
        except SystemExit as e: code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def toy_data_file(toy_problems, tmp_path_factory) -> Path:
    "The toy problems as a jsonl file (what a user passes with --data)."
    import json
    path = tmp_path_factory.mktemp("data") / "toy.jsonl"
    keys = ("problem", "solution", "answer")
    path.write_text("".join(json.dumps({k: p[k] for k in keys}) + "\n" for p in toy_problems))
    return path


def pytest_collection_finish(session):
    """Every test starts with one torch thread, whichever test files were collected (a module's own
    `torch.set_num_threads` at import would otherwise set it for all tests, the last imported winning): the tiny models
    here are fastest on one thread, a fixed count keeps float reductions the same run to run, and two threads on a
    shared 2-core machine wait on each other. Subprocesses keep their own defaults."""
    torch.set_num_threads(1)


def pytest_configure(config):
    for name, what in (("slow", "long CPU tests"), ("gpu", "needs a CUDA GPU (skipped without one)"),
                       ("vllm", "needs vLLM on a CUDA GPU (skipped without it)")):
        config.addinivalue_line("markers", f"{name}: {what}")
