#!/usr/bin/env bash
# Start a Docker Engine for the tests and the demo when none answers on /var/run/docker.sock,
# with no bridge network and no firewall change: a default dockerd creates docker0 on
# 172.17.0.0/16, rewrites the host's iptables (FORWARD policy DROP) and turns on ip_forward,
# and leaves all of it behind (../shared/REALPARTS.md). Containers then use --network host,
# which is what cloudtrain runs them with anyway. A daemon already running is left as it is.
# Prints where its log is; exits non-zero when it does not answer within 30 s.
set -euo pipefail
DOCKER=/usr/bin/docker
[ -x "$DOCKER" ] || DOCKER=$(command -v docker)
if "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1; then
    exit 0
fi
command -v dockerd >/dev/null 2>&1 || { echo "dockerd: not installed (apt-get install docker.io)" >&2; exit 1; }
if [ "$(id -u)" != 0 ]; then
    echo "dockerd: no Docker Engine answers, and only root can start one: sudo bash $0" >&2
    exit 1
fi
LOG=${CLOUDTRAIN_DOCKERD_LOG:-/var/log/cloudtrain-dockerd.log}
nohup setsid dockerd --bridge=none --iptables=false --ip-forward=false --ip-masq=false \
    >"$LOG" 2>&1 </dev/null &
pid=$!
for _ in $(seq 300); do
    if "$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1; then
        echo "dockerd: started (log: $LOG)"
        exit 0
    fi
    kill -0 "$pid" 2>/dev/null || { echo "dockerd: exited at once; its log: $LOG" >&2; tail -n 20 "$LOG" >&2; exit 1; }
    sleep 0.1
done
echo "dockerd: did not answer within 30 s; its log: $LOG" >&2
tail -n 20 "$LOG" >&2
exit 1
