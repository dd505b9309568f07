#!/usr/bin/env bash
# `make test` with two CPU-bound processes competing for the (2-core) machine: the suite must
# stay green under load (XLA:CPU's collective rendezvous must not time out).
#     bash tests/loaded.sh          (or: make test-loaded)
set -u
cd "$(dirname "$0")/.."
python3 -c "while True: pass" &
a=$!
python3 -c "while True: pass" &
b=$!
trap 'kill $a $b 2>/dev/null' EXIT
echo "busy loops: pids $a $b"
make test
