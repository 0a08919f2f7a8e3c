#!/usr/bin/env bash
# The demo: the training template (templates/train) as a 2-node x 2-process PyTorch DDP job on
# local nodes (real sshd servers on this machine), its checkpoints, TensorBoard events and
# result pulled back, the cluster torn down at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CLOUDTRAIN_HOME=${CLOUDTRAIN_HOME:-$PWD/.cloudtrain-home}
.venv/bin/cloudtrain launch templates/train/task.yaml --down "$@"
out=templates/train/cloudtrain-outputs/outputs
.venv/bin/python - "$out" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
r = json.loads((out / "result.json").read_text())
ckpts = sorted(p.name for p in (out / "checkpoints").glob("*.pt"))
tb = list((out / "tb").glob("events.out.tfevents.*"))
print(f"demo: {r['world_size']} processes ({r['backend']}, {r['precision']}), steps "
      f"{r['start_step']}->{r['final_step']} ({r['stop_reason']}), validation loss "
      f"{r['first_val_loss']:.3f} -> {r['last_val_loss']:.3f}, {r['samples_per_sec']:.0f} samples/s")
print(f"demo: checkpoints {', '.join(ckpts)}; TensorBoard files {len(tb)}; all in {out}/")
PY
