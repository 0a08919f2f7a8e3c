#!/usr/bin/env bash
# The demo: a 2-node x 2-process PyTorch DDP job on local nodes (real sshd servers on this
# machine), its outputs pulled back, the cluster torn down at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CLOUDTRAIN_HOME=${CLOUDTRAIN_HOME:-$PWD/.cloudtrain-home}
.venv/bin/cloudtrain launch templates/demo/task.yaml --down "$@"
echo "demo: outputs in templates/demo/cloudtrain-outputs/"
cat templates/demo/cloudtrain-outputs/outputs/result.json; echo
