#!/usr/bin/env bash
# Join the carried pieces, check them, install to /tmp/site (no deps). Usage: install.sh vllm|opsd
set -e
w=/tmp/$1; cd $w
cat part.* > w.tar && sha256sum -c w.sha256 && mkdir -p w && tar -xf w.tar -C w
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site w/*.whl 2>&1 | grep -v "^WARNING\|already exists" | tail -3
echo "installed $1: $(ls w | wc -l) wheels in $(( $(date +%s) - t0 )) s"
