#!/usr/bin/env bash
# Debian's chromium and its WebDriver, for the dashboard's browser test (tests/integration/test_dashboard_browser.py).
# `make test` runs this first; it installs them (as root) only when they are missing.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_browser.sh: chromium or chromedriver is missing and this is not root;" \
         "sudo apt-get install chromium chromium-driver (until then the browser test is skipped)" >&2
    exit 0
fi
echo "install_browser.sh: installing Debian's chromium and chromium-driver" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
chromium --version >&2
