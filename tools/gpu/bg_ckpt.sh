#!/usr/bin/env bash
# start building the 1.7B-shaped checkpoint + run folder in the background (survives the call)
source tools/gpu/env.sh
mkdir -p /tmp/w /tmp/repo && cp -r opsd tools/gpu /tmp/repo/
cd /tmp/repo && PYTHONPATH=/tmp/site:/tmp/repo setsid nohup python3 gpu/make_ckpt.py /tmp/w > /tmp/w/ckpt.log 2>&1 < /dev/null &
echo started
