"""What a sweep trial's own workdir costs at its start (docs/sweep.md, "Outputs: each trial's
own folder"): the copy step of the trial's script (pipeline/sweepscript.py ``own_workdir``,
``rsync -a`` of the synced workdir less the task's outputs) run with bash on this machine,
for three workdir shapes, each with a 50 MiB outputs/ folder that the copy leaves out.

    python bench/bench_trial_copy.py
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from cloudtrain.pipeline.sweepscript import own_workdir
from cloudtrain.spec import parse_task

SHAPES = (("200 files x 8 KiB (code)", 200, 8 << 10),
          ("2000 files x 8 KiB", 2000, 8 << 10),
          ("1 file of 200 MiB", 1, 200 << 20))


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="ct-trial-copy-") as tmp:
        base = Path(tmp)
        task = parse_task("name: t\nworkdir: .\noutputs: [outputs/]\nrun: 'true'\n",
                          base_dir=base)
        body = "\n".join(own_workdir(task)) + "\n"
        for i, (label, files, size) in enumerate(SHAPES):
            src = base / f"workdir{i}"
            (src / "outputs").mkdir(parents=True)
            (src / "outputs" / "big.bin").write_bytes(b"x" * (50 << 20))
            for k in range(files):
                (src / f"f{k}.py").write_bytes(b"a" * size)
            times = []
            for n in range(3):
                trial = base / f"trial{i}-{n}"
                trial.mkdir()
                t0 = time.perf_counter()
                subprocess.run(["bash", "-c", body], check=True, env={
                    **os.environ, "CLOUDTRAIN_TRIAL_DIR": str(trial),
                    "CLOUDTRAIN_SYNCED_WORKDIR": str(src)})
                times.append(time.perf_counter() - t0)
                assert not (trial / "work" / "outputs").exists()
            print(f"{label}: {min(times) * 1000:.0f} ms (best of 3)")


if __name__ == "__main__":
    main()
