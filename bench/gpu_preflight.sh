#!/usr/bin/env bash
# The preflight's GPU checks on one real machine (issue 27, "On a GPU"): run from the
# repository root with only python3 + torch (none of cloudtrain's pip dependencies), no
# internet, nothing installed. Every figure goes to stdout and to files under $OUT
# (default: a new temporary folder), summary.txt last.
#
#   (a) node checks: cloudtrain/node/preflight.py node  (real nvidia-smi, bf16 matmul TFLOPS)
#   (b) NCCL all-reduce, one process per GPU under torchrun, 64 KiB .. 1 GiB: algbw, busbw,
#       the transport NCCL chose (NCCL_DEBUG=INFO files kept in $OUT)
#   (b2) the CLI's verdict on (b)'s figures: each GPU against its datasheet peak and the median
#   (c) templates/train/train.py under torchrun, --precision bf16, NCCL: samples/s, peak memory
#   (d) bootstrap/node.sh with CLOUDTRAIN_CHECK_ONLY=1: its GPU, driver, Python and torch steps
#       against the real nvidia-smi, installing nothing
#
# Without a GPU every part still runs (gloo, CPU fp32, 2 processes, small sizes), so the
# script can be tried anywhere. Each part has its own time limit (60 + 90 + 100 + 60 s); a
# usual run on one GPU takes about a minute.
#   PYTHON=/path/to/python3 bash bench/gpu_preflight.sh      (default: python3)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t ct-gpu-preflight-XXXXXX)}
mkdir -p "$OUT"
START=$(date +%s)
say() { printf '%s\n' "$*" | tee -a "$OUT/summary.txt"; }
part() {  # part NAME LIMIT_S CMD...: run with a time limit, output to $OUT/NAME.log and stdout
    local name=$1 limit=$2 rc t0
    shift 2
    echo "=== $name: $*" | tee -a "$OUT/commands.txt"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/commands.txt"
    return "$rc"
}

: > "$OUT/summary.txt"
say "gpu_preflight: $(date -u +%FT%TZ) on $(hostname), results in $OUT"
NGPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    nvidia-smi --query-gpu=index,name,memory.total,driver_version,ecc.errors.uncorrected.volatile.total \
        --format=csv > "$OUT/nvidia-smi-query.csv" 2>&1
    say "nvidia-smi: $NGPU GPU(s): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sort | uniq -c | tr -s ' ' | paste -sd ';')"
else
    say "nvidia-smi: not found: the CPU path (gloo, fp32)"
fi
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cuda_available", torch.cuda.is_available(), "devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)' \
    2>&1 | tee "$OUT/torch.txt" | while read -r l; do say "$l"; done

# (a) ------------------------------------------------------------------------------------------
part a_node 60 "$PY" cloudtrain/node/preflight.py node --out "$OUT/node.json"
say "(a) node checks: exit $?"
"$PY" - "$OUT/node.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"    no result: {e}")
v = d["versions"]
print(f"    versions: driver {v['driver'] or '-'} cuda {v['cuda'] or '-'} nccl {v['nccl'] or '-'} "
      f"torch {v['torch']} python {v['python']}; torch sees {v['torch_gpus']} GPU(s)")
if d["nvidia_smi"]["error"]:
    print(f"    nvidia-smi error: {d['nvidia_smi']['error']}")
for g in d["nvidia_smi"]["gpus"]:
    print(f"    GPU {g['index']}: {g['name']}, {g['memory_mib']} MiB, ECC uncorrected {g['ecc_uncorrected']}")
for m in d["matmul"]:
    fig = f"{m['tflops']} TFLOPS" if "tflops" in m else f"{m['gflops']} GFLOPS ({m['threads']} threads)"
    print(f"    matmul {m['device']} {m['dtype']} {m['n']}x{m['n']}: {fig}")
EOF

# (b) ------------------------------------------------------------------------------------------
if [ "$NGPU" -gt 0 ]; then NPROC=$NGPU MAXSIZE=1GiB; else NPROC=2 MAXSIZE=16MiB; fi
part b_allreduce 90 env NCCL_DEBUG_FILE="$OUT/nccl.%h.%p.log" \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
    cloudtrain/node/preflight.py run --max-size "$MAXSIZE" --out "$OUT/allreduce.json"
say "(b) all-reduce, $NPROC process(es): exit $?"
"$PY" - "$OUT/allreduce.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"    no result: {e}")
t = d["transport"]
print(f"    backend {d['backend']}, {d['world_size']} rank(s), transport via {t['via'] or '-'} "
      f"network {t['network'] or '-'}; sweep {d['sweep_s']} s")
if d["world_size"] == 1:
    print("    (one rank: NCCL moves no data between GPUs; busbw is 0 by definition)")
print("    %12s %12s %12s %12s" % ("bytes", "time_us", "algbw GB/s", "busbw GB/s"))
for r in d["allreduce"]:
    print("    %12d %12.1f %12.3f %12.3f" % (r["bytes"], r["time_us"], r["algbw_gbps"], r["busbw_gbps"]))
for r in d["ranks"]:
    m = r["matmul"]
    fig = f"{m['tflops']} TFLOPS" if "tflops" in m else f"{m['gflops']} GFLOPS"
    print(f"    rank {r['rank']} matmul {m['device']} {m['dtype']}: {fig}")
EOF

# (b2) the CLI's own judgement of (b)'s figures (cloudtrain/preflight: standard library only):
# each GPU's matmul against the datasheet's dense bf16 peak (reference.py) and the median GPU.
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PY" - "$OUT/allreduce.json" "$OUT/verdict.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from cloudtrain.preflight.report import parse
from cloudtrain.preflight.verdict import Context, judge
from cloudtrain.preflight import reference
try:
    m = parse(json.load(open(sys.argv[1])))
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"    (b2) no verdict: {e}")
v = judge(m, Context("this machine", "local", None))
json.dump(v.to_dict(), open(sys.argv[2], "w"), indent=2)
for n in m.nodes:
    for g in n.gpus[:1]:
        ref = reference.gpu(g.name)
        print(f"    (b2) reference for {g.name}: " + (f"{ref.model} {ref.bf16_tflops:g} TFLOPS dense bf16 ({ref.source})" if ref else "none in the table"))
print(f"    (b2) verdict: {v.paragraph}")
EOF

# (c) ------------------------------------------------------------------------------------------
if [ "$NGPU" -gt 0 ]; then
    TRAIN=(--dataset tiny-text --hidden 512 --layers 6 --heads 8 --context 256 --batch-size 64
           --max-steps 150 --eval-every 50 --ckpt-every 0 --log-every 25)
else
    TRAIN=(--dataset tiny-text --hidden 64 --layers 2 --heads 4 --context 64 --batch-size 8
           --max-steps 20 --eval-every 10 --ckpt-every 0 --log-every 5 --num-workers 0)
fi
# (its checkpoints, hundreds of MB, stay in a temporary folder; result.json and metrics come back)
TRAIN_D=$(mktemp -d -t ct-train-XXXXXX)
part c_train 100 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
    templates/train/train.py --precision bf16 --out "$TRAIN_D" "${TRAIN[@]}"
say "(c) train.py bf16, $NPROC process(es), ${TRAIN[*]}: exit $?"
mkdir -p "$OUT/train" && cp "$TRAIN_D"/result.json "$TRAIN_D"/metrics.jsonl "$OUT/train/" 2>/dev/null
rm -rf "$TRAIN_D"
"$PY" - "$OUT/train/result.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"    no result: {e}")
sps, mem = d.get("samples_per_sec"), d.get("peak_mem_mb")
print(f"    backend {d['backend']} device {d['device']} precision {d['precision']} world {d['world_size']}: "
      f"{sps:.1f} samples/s (global batch {d['global_batch']}), "
      f"peak memory {('%.0f MiB' % mem) if mem is not None else '- (CPU)'}, "
      f"val_loss {d['first_val_loss']:.3f} -> {d['last_val_loss']:.3f}, {d['wall_time_s']:.1f} s")
EOF

# (d) ------------------------------------------------------------------------------------------
ROOT_D=$(mktemp -d -t ct-nodesh-XXXXXX)
part d_node_sh 60 env CLOUDTRAIN_CHECK_ONLY=1 CLOUDTRAIN_ROOT="$ROOT_D" \
    CLOUDTRAIN_PYTHON="$(command -v "$PY")" bash bootstrap/node.sh
say "(d) bootstrap/node.sh check-only: exit $?"
grep -E '^::(found|skip|fail|result (gpus|gpu_name|gpu_gen|driver|python_version|torch|torch_cuda))' \
    "$OUT/d_node_sh.log" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
rm -rf "$ROOT_D"

say "gpu_preflight: done in $(( $(date +%s) - START )) s; files in $OUT"
