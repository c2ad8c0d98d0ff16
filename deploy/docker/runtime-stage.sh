#!/bin/sh
# The image's runtime stage, run as root on a Debian 12 base: the shared
# libraries the daemons link (runtime-packages, beside this script) and the
# unprivileged user they run as (uid and gid 10001, no login, no password).
set -eu
here=$(dirname "$0")
apt-get update -qq
DEBIAN_FRONTEND=noninteractive xargs -a "$here/runtime-packages" apt-get install -y -qq --no-install-recommends >/dev/null
rm -rf /var/lib/apt/lists/*
getent group tessel >/dev/null || groupadd --gid 10001 tessel
getent passwd tessel >/dev/null ||
  useradd --uid 10001 --gid tessel --home-dir /var/lib/tessel --create-home --shell /usr/sbin/nologin --no-log-init tessel
