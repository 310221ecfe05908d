#!/bin/sh
# Installs Debian's Chromium and its matching chromedriver for the report's browser test.
# Called by tests/report/test_report_browser.py when /usr/bin/chromium or /usr/bin/chromedriver
# is missing; exits non-zero (the test then skips, printing why) where apt cannot install them:
# not root, no apt-get, or no network to the Debian mirrors. Nothing is downloaded from elsewhere.
set -e
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-get not found (not a Debian/Ubuntu machine)" >&2
    exit 1
fi
if [ "$(id -u)" != "0" ]; then
    SUDO="sudo -n"
else
    SUDO=""
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
test -x /usr/bin/chromium && test -x /usr/bin/chromedriver
