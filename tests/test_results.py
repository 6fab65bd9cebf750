"""Every number the README quotes is recomputed from the results store (`opsd.results`); `findings` and the other
explanation notebooks are re-run against their saved outputs in `tests/test_explanations.py`.

Each test names the break it catches: a number edited by hand in the README, a measurement typed into its prose, a
study whose manifest row does not describe its runs."""
import contextlib, io, json, re

import polars as pl
import pytest

from opsd import results as R

ROOT = R.repo_root()
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def claims():
    return R.claims()


def test_every_claim_is_quoted_verbatim(claims):
    "Catches a README number edited by hand, or a store that changed without `bash dev.sh readme` after it."
    missing = [k for k, v in claims.items() if v not in README]
    assert not missing, f"README.md lacks the store's text for {missing}: run `bash dev.sh readme` (or fix the edit)"


def _measurements(text: str) -> list[str]:
    "Numbers that quote a measurement: signed values, percentages, points, ratios, decimal seconds."
    text = re.sub(r"```.*?```", "", text, flags=re.S)     # commands and the library example (checked below)
    text = re.sub(r"\n    .*", "", text)                  # code output blocks
    pat = r"(?<![\w.])[+−]\d+(?:\.\d+)?|\b\d+(?:\.\d+)?\s?(?:%|pts\b|×)|\b\d+\.\d+\s?s\b"
    return [m for m in re.findall(pat, text) if m != "95%"]   # 95%: the intervals' coverage, a convention


def test_readme_types_no_measurement(claims):
    "Catches a measured number typed into the README's prose instead of computed from the store."
    text = README
    for v in sorted(claims.values(), key=len, reverse=True): text = text.replace(v, "")
    assert not _measurements(text), f"README.md types measurements not computed from the store: {_measurements(text)}"


def test_measurement_scan_catches_an_edit(claims):
    "The two checks above fail on a README with one number changed (the break this file exists for)."
    row = claims["toy_table"].splitlines()[2]
    num = re.search(r"[+−]\d+\.\d", row).group(0)
    broken = README.replace(row, row.replace(num, num[0] + str((int(num[1]) + 1) % 10) + num[2:], 1))
    assert claims["toy_table"] not in broken
    text = broken
    for v in claims.values(): text = text.replace(v, "")
    assert _measurements(text)


def test_library_example_prints_what_the_readme_shows():
    "Catches a README whose library example output no longer matches what the code prints."
    sec = README.split("## As a library", 1)[1]
    code = re.search(r"```(?:python)?\n(.*?)```", sec, re.S).group(1)
    shown = [l[4:] for l in sec.split("```", 2)[2].splitlines() if l.startswith("    ")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out): exec(code, {})
    assert out.getvalue().split("\n")[:len(shown)] == shown


def test_manifest_describes_every_study():
    "Catches a study folder without a manifest row, or a row whose run count or seeds do not match the folder."
    m = R.manifest()
    folders = sorted(p.name for p in R.store_dir().iterdir() if p.is_dir() and not p.name.startswith("."))
    assert sorted(m["study"].to_list()) == folders
    for row in m.filter(pl.col("runs") > 0).iter_rows(named=True):
        runs = R.run_folders(R.store_dir() / row["study"])
        assert len(runs) == row["runs"], row["study"]
        seeds = sorted({json.loads((r / "config.json").read_text())["seed"] for r in runs})
        assert seeds == row["seeds"], row["study"]
        assert row["command"] and row["commit"] and row["date"] and row["machine"], row["study"]
