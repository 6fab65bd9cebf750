"Tests of opsd.data: the Qwen3 tokenizer (real ids), the chat template, the prompts, and every bad-input error."

import json
import warnings

import polars as pl
import pytest

from opsd.data import (
    QWEN3_CHAT_TEMPLATE,
    QWEN3_VOCAB_SIZE,
    PromptConfig,
    Problems,
    build_prompts,
    last_boxed,
    load_problems,
    prompt_ids,
    qwen3_tokenizer,
    student_prompt,
    student_prompt_ids,
    teacher_prompt,
    teacher_prompt_ids,
    user_cache_dir,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    # build into a private folder: exercises the build path and the cache-reload path
    d = tmp_path_factory.mktemp("qwen3tok") / "tok"
    t = qwen3_tokenizer(cache_dir=d)
    assert (d / "tokenizer.json").exists() and (d / "opsd_build.json").exists()
    return qwen3_tokenizer(cache_dir=d)  # second call loads the saved copy


# ---------------------------------------------------------------- tokenizer
def test_qwen3_known_ids(tok):
    assert tok.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]
    ids = tok.convert_tokens_to_ids(
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<tool_call>",
            "<|fim_prefix|>",
            "<think>",
            "</think>",
        ]
    )
    assert ids == [151643, 151644, 151645, 151646, 151657, 151659, 151667, 151668]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.pad_token_id != tok.eos_token_id
    assert len(tok) == 151669 and QWEN3_VOCAB_SIZE == 151936 > len(tok)
    assert tok.bos_token is None
    # "user" and "assistant" and "\n" as in Qwen's vocabulary
    assert tok.encode("user\n", add_special_tokens=False) == [872, 198]
    assert tok.encode("assistant", add_special_tokens=False) == [77091]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain ascii",
        "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\n\n",
        "Ünïcödé 中文 日本語 🙂",
        r"\boxed{\frac{1}{2}} $x^2$",
        "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
        "1234567890 3.14159",
    ],
)
def test_qwen3_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_qwen3_digits_single(tok):
    # Qwen splits numbers into single digits (\p{N} in the pattern)
    assert tok.convert_ids_to_tokens(tok.encode("2024", add_special_tokens=False)) == ["2", "0", "2", "4"]


def test_qwen3_think_not_special(tok):
    out = tok.decode(tok.encode("<think>a</think>b<|im_end|><|endoftext|>"), skip_special_tokens=True)
    assert out == "<think>a</think>b"


def test_user_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_cache_dir("qwen3-tokenizer") == tmp_path / "opsd" / "qwen3-tokenizer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(user_cache_dir()).endswith(".cache/opsd")


def test_broken_cache_is_rebuilt(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text("{not json")
    t = qwen3_tokenizer(cache_dir=d)
    assert t.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]


# ---------------------------------------------------------------- template
def test_template_thinking(tok):
    msgs = [{"role": "user", "content": "Q"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    on2 = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on == on2 == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    ids = tok.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    assert ids == [151644, 872, 198, 48, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]


def test_template_multi_turn(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    out = tok.apply_chat_template(msgs, tokenize=False)
    assert out == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE


# ---------------------------------------------------------------- prompts
def test_released_prompts(tok):
    s = student_prompt(tok, "What is 2+2?")
    assert s == (
        "<|im_start|>user\nProblem: What is 2+2?\n\nPlease reason step by step, and put your final answer "
        "within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    t = teacher_prompt(tok, "What is 2+2?", "2+2=4. \\boxed{4}")
    assert t.startswith(
        "<|im_start|>user\nProblem: What is 2+2?\n\nHere is a reference solution to this problem:\n"
        "=== Reference Solution Begin ===\n2+2=4. \\boxed{4}\n=== Reference Solution End ===\n\n\n"
        "After reading the reference solution above"
    )
    assert t.endswith(
        "reconsider if something doesn't work out:\n\nPlease reason step by step, and put your final "
        "answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<think>" not in t


def test_prompt_knobs(tok):
    cfg = PromptConfig(
        student_thinking=True, teacher_thinking=False, instruction="Box it.", begin="<<", end=">>", guard="Own words."
    )
    assert student_prompt(tok, "P", cfg).endswith("Box it.<|im_end|>\n<|im_start|>assistant\n")
    t = teacher_prompt(tok, "P", "S", cfg)
    assert "<<\nS\n>>\nOwn words.\nBox it." in t and t.endswith("<think>\n\n</think>\n\n")
    # mismatch knob: the student without its chat template, the teacher with it
    mm = PromptConfig(student_uses_chat_template=False)
    assert (
        student_prompt(tok, "P", mm)
        == "Problem: P\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert teacher_prompt(tok, "P", "S", mm).startswith("<|im_start|>user\n")
    assert teacher_prompt(tok, "P", "S", PromptConfig(teacher_uses_chat_template=False)).startswith("Problem: P")
    early = PromptConfig.early_release()
    assert student_prompt(tok, "P", early).endswith("<|im_start|>assistant\n")
    assert teacher_prompt(tok, "P", "S", early).startswith(
        "<|im_start|>user\nP\n\nHere is a reference solution to this problem:\nS\n"
    )


def test_prompt_errors(tok):
    with pytest.raises(ValueError, match="unknown field"):
        teacher_prompt(tok, "P", "S", PromptConfig(teacher_template="{problem} {reference}"))
    with pytest.raises(TypeError, match="solution must be a str"):
        teacher_prompt(tok, "P", None)

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        student_prompt(NoTemplate(), "P")


def test_prompt_ids_no_double_specials(tok):
    ids = student_prompt_ids(tok, "P")
    assert ids.count(151644) == 2 and ids[0] == 151644
    assert prompt_ids(tok, ["a", "b c"]) == [tok.encode("a"), tok.encode("b c")]
    tids = teacher_prompt_ids(tok, "P", "S")
    assert tok.decode(tids) == teacher_prompt(tok, "P", "S")
    bp = build_prompts(tok, [dict(problem="P", solution="S")])
    assert bp == dict(student=[student_prompt(tok, "P")], teacher=[teacher_prompt(tok, "P", "S")])


# ---------------------------------------------------------------- records
GOOD = [
    dict(problem="1+1?", solution="1+1=2 \\boxed{2}", answer="2"),
    dict(problem="2*3?", solution="\\boxed{6}", answer=6),
]


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_sources(tmp_path):
    want = [
        dict(problem="1+1?", solution="1+1=2 \\boxed{2}", answer="2", id="0"),
        dict(problem="2*3?", solution="\\boxed{6}", answer="6", id="1"),
    ]
    assert load_problems(_jsonl(tmp_path / "a.jsonl", GOOD)) == want
    assert load_problems(str(tmp_path / "a.jsonl")) == want
    (tmp_path / "a.json").write_text(json.dumps(GOOD))
    assert load_problems(tmp_path / "a.json") == want
    pl.DataFrame([dict(problem="1+1?", solution="1+1=2 \\boxed{2}", answer="2")]).write_parquet(tmp_path / "a.parquet")
    assert load_problems(tmp_path / "a.parquet") == want[:1]
    pl.DataFrame([dict(problem="1+1?", solution="1+1=2 \\boxed{2}", answer="2")]).write_csv(tmp_path / "a.csv")
    assert load_problems(tmp_path / "a.csv") == want[:1]
    assert load_problems(GOOD) == want
    assert load_problems(pl.DataFrame([dict(problem="1+1?", solution="1+1=2 \\boxed{2}", answer="2")])) == want[:1]
    ps = load_problems(GOOD)
    assert isinstance(ps, Problems) and isinstance(ps, list) and ps.skipped == {} and ps.n_skipped == 0


def test_load_field_names_and_ids():
    rows = [dict(question="Q", sol="S \\boxed{7}", uid=11), dict(question="R", sol="T \\boxed{\\frac{1}{2}}", uid=12)]
    ps = load_problems(rows, problem="question", solution="sol", answer=None, id="uid")
    assert ps == [
        dict(problem="Q", solution="S \\boxed{7}", answer="7", id="11"),
        dict(problem="R", solution="T \\boxed{\\frac{1}{2}}", answer="\\frac{1}{2}", id="12"),
    ]


@pytest.mark.parametrize(
    "row,msg",
    [
        (dict(solution="s", answer="1"), "row 0: field 'problem' is missing (row has: solution, answer)"),
        (dict(problem="p", answer="1"), "row 0: field 'solution' is missing"),
        (dict(problem="p", solution="s"), "row 0: field 'answer' is missing"),
        (dict(problem="   ", solution="s", answer="1"), "row 0: field 'problem' is empty"),
        (dict(problem="p", solution="", answer="1"), "row 0: field 'solution' is empty"),
        (dict(problem="p", solution="s", answer=""), "row 0: field 'answer' is empty"),
        (dict(problem=3, solution="s", answer="1"), "row 0: field 'problem' must be a string, got int"),
        (dict(problem="p", solution=None, answer="1"), "row 0: field 'solution' must be a string, got NoneType"),
        (dict(problem="p", solution="s", answer=[1]), "row 0: field 'answer' must be a string, got list"),
        (dict(problem="p", solution="s", answer=False), "row 0: field 'answer' must be a string, got bool"),
        ("just a string", "row 0: expected an object with fields, got str"),
    ],
)
def test_bad_rows_list(row, msg):
    with pytest.raises(ValueError) as e:
        load_problems([row])
    assert msg in str(e.value) and "<list>" in str(e.value)


def test_bad_rows_jsonl_name_file_and_line(tmp_path):
    p = _jsonl(tmp_path / "data.jsonl", [GOOD[0], "", GOOD[1], '{"problem": "x", ', dict(problem="p", solution="s")])
    with pytest.raises(ValueError, match=r"data\.jsonl: line 4: not valid JSON"):
        load_problems(p)
    p2 = _jsonl(tmp_path / "d2.jsonl", [GOOD[0], dict(problem="p", solution="s")])
    with pytest.raises(ValueError, match=r"d2\.jsonl: line 2: field 'answer' is missing"):
        load_problems(p2)
    p3 = _jsonl(tmp_path / "d3.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"d3\.jsonl: line 1: expected an object with fields, got list"):
        load_problems(p3)


def test_bad_parquet_row_names_file_and_row(tmp_path):
    pl.DataFrame(dict(problem=["a", "b", None], solution=["s", "s", "s"], answer=["1", "2", "3"])).write_parquet(
        tmp_path / "x.parquet"
    )
    with pytest.raises(ValueError, match=r"x\.parquet: row 2: field 'problem' must be a string, got NoneType"):
        load_problems(tmp_path / "x.parquet")


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_problems(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="is a folder"):
        load_problems(tmp_path)
    (tmp_path / "x.json").write_text('{"problem": "a"}')
    with pytest.raises(ValueError, match="must hold a list of objects"):
        load_problems(tmp_path / "x.json")
    (tmp_path / "y.json").write_text('[{"problem": ')
    with pytest.raises(ValueError, match=r"y\.json: not valid JSON"):
        load_problems(tmp_path / "y.json")
    (tmp_path / "z.txt").write_text("hi")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_problems(tmp_path / "z.txt")
    with pytest.raises(TypeError, match="source must be"):
        load_problems(42)
    with pytest.raises(ValueError, match="it is empty"):
        load_problems(_jsonl(tmp_path / "empty.jsonl", []))
    with pytest.raises(ValueError, match="duplicate id 'a'"):
        load_problems([dict(GOOD[0], id="a"), dict(GOOD[1], id="a")])
    with pytest.raises(ValueError, match="no \\\\boxed"):
        load_problems([dict(problem="p", solution="no box")], answer=None)


def test_skip_invalid_counts_everything(tmp_path):
    rows = [
        GOOD[0],
        '{"bad json',
        dict(problem="", solution="s", answer="1"),
        dict(solution="s", answer="1"),
        dict(problem=1, solution="s", answer="1"),
        GOOD[1],
        dict(problem="p", solution="s", answer="1", id="0"),
    ]
    p = _jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.warns(UserWarning, match="skipped 5 invalid rows"):
        ps = load_problems(p, skip_invalid=True)
    assert [r["problem"] for r in ps] == ["1+1?", "2*3?"]
    assert ps.skipped == {
        "invalid JSON": 1,
        "empty problem": 1,
        "missing problem": 1,
        "wrong type problem": 1,
        "duplicate id": 1,
    }
    assert ps.n_skipped == 5 and len(ps.errors) == 5 and all("mixed.jsonl: line" in e for e in ps.errors)
    with pytest.raises(ValueError, match="5 rows skipped"):
        load_problems(_jsonl(tmp_path / "allbad.jsonl", rows[1:5] + [rows[1]]), skip_invalid=True)


def test_no_warning_when_clean():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_problems(GOOD, skip_invalid=True)


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{2}") == "2"
    assert last_boxed("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{") is None and last_boxed("") is None
    # the one extractor: the brace-less form, \fbox, no fallback past a cut-off last box
    assert last_boxed("\\boxed 7") == "7" and last_boxed("\\fbox{x}") == "x"
    assert last_boxed("\\boxed{1} then \\boxed{2") is None and last_boxed(None) is None


# ---------------------------------------------------------------- folders opsd writes into
def test_check_out_folder(tmp_path):
    """A folder path that is a file, lies under a file or cannot be written is refused, and nothing is created.
    Break: checking only `path.exists() and not path.is_dir()` (no walk up the parents) -> the under-a-file cases pass
    silently (and a later mkdir fails with the OS's FileExistsError / NotADirectoryError)."""
    import os
    from opsd.data import check_out_folder
    (tmp_path / "notes.txt").write_text("x")
    assert check_out_folder(tmp_path / "new" / "run") == tmp_path / "new" / "run"
    assert check_out_folder(tmp_path) == tmp_path
    with pytest.raises(NotADirectoryError, match=r"--out .*notes.txt: is a file, not a folder"):
        check_out_folder(tmp_path / "notes.txt", "--out")
    for under in (tmp_path / "notes.txt" / "run", tmp_path / "notes.txt" / "a" / "b"):
        with pytest.raises(NotADirectoryError, match=r"run folder .*: .*notes.txt is a file, so no folder"):
            check_out_folder(under, "run folder")
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"; ro.mkdir(); ro.chmod(0o500)
        try:
            with pytest.raises(PermissionError, match="not writable"):
                check_out_folder(ro / "run", "run folder")
            with pytest.raises(PermissionError, match="the folder is not writable"):
                check_out_folder(ro, "run folder")
        finally: ro.chmod(0o700)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] + (["ro"] if os.geteuid() != 0 else [])
