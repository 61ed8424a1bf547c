#!/usr/bin/env bash
# Install Debian's Prometheus server (the `prometheus` binary) for the tests of
# `autotune shape from-prometheus` and `watch --prometheus` (tests/integration/test_prometheus.py starts
# its own on 127.0.0.1; the package's system service is not used, and not started here).
# Idempotent: skipped when a `prometheus` binary is on PATH; where apt-get is not ours to
# run, it says so and the tests skip.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 || [ "${AUTOTUNE_NO_PROMETHEUS:-}" = 1 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "[setup] note: no prometheus and no root apt-get here: the Prometheus tests will skip" \
    "(install Debian's prometheus package to run them)"
  exit 0
fi
echo "[setup] installing Debian's prometheus for the from-prometheus tests (apt-get)"
export DEBIAN_FRONTEND=noninteractive
apt_install() {
  # --no-install-recommends: the server binary only, without the node exporter and friends;
  # the lock timeout: another apt-get may be running on the machine
  apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 prometheus >/dev/null
}
if ! apt_install 2>/dev/null; then
  apt-get update -qq -o DPkg::Lock::Timeout=600 >/dev/null  # an old or missing list: refresh it
  apt_install
fi
# the package's postinst may start its system service where an init system runs: the tests
# start their own server, so leave that one to the machine's owner
echo "[setup] prometheus: $(prometheus --version 2>&1 | head -1)"
