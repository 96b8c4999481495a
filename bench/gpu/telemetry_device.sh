#!/usr/bin/env bash
# Run on the lent GPU machine from the repo root: records the telemetry of a real run into $OUT.
#   foreign GPU holder -> GPU guard refuses "gpuwork" -> holder exits -> gpuwork runs -> done.
# Copies telemetry.jsonl, the events and the board's reasons (one line a second) to $OUT.
set -u
OUT=${OUT:-/tmp/telemetry-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 AERIE_REPO=$PWD
RUN=/tmp/aerie-telemetry-run
rm -rf "$RUN"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv >"$OUT/nvidia-smi.csv" 2>&1
python3 - <<'PY'
import importlib.metadata as m, sys
print("python", sys.version.split()[0], "nvidia-ml-py", m.version("nvidia-ml-py"))
PY
# The real cost of one NVML sample (+ owner mapping) on this GPU, before the run.
python3 - >"$OUT/nvml-cost.txt" 2>&1 <<'PY'
import time
from pipeline.gpus import NvmlSource, annotate_owners
s = NvmlSource()
t0 = time.process_time()
info = s.open()
print("open:", info, f"cpu {1e3 * (time.process_time() - t0):.1f} ms")
for _ in range(5):
    s.sample()
n = 100
t0, w0 = time.process_time(), time.perf_counter()
for _ in range(n):
    g = s.sample()
    annotate_owners(g, None)
cpu, wall = (time.process_time() - t0) / n, (time.perf_counter() - w0) / n
print(f"NVML sample + owners x{n}: cpu {1e3 * cpu:.3f} ms/sample, wall {1e3 * wall:.3f} ms/sample, {len(g)} GPU(s)")
s.close()
PY
cat "$OUT/nvml-cost.txt"
python3 -m bench.gpu.load --hold-gib 2 --seconds 20 --idle &
FOREIGN=$!
for _ in $(seq 40); do
  nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -q . && break
  sleep 0.5
done
echo "foreign pid $FOREIGN; nvidia-smi apps: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1 | tr '\n' ' ')"
python3 -m pipeline.supervisor "$RUN" --create bench/gpu/telemetry_device.toml --poll 0.5 &
SUP=$!
while kill -0 "$SUP" 2>/dev/null; do
  python3 - "$RUN" >>"$OUT/board.log" 2>/dev/null <<'PY'
import json, sys, time
s = json.load(open(sys.argv[1] + "/state.json"))
print(time.strftime("%H:%M:%S"), " | ".join(f"{x['id']}={x['state']} {x['reason']}" for x in s["stages"]))
PY
  sleep 1
done
wait "$SUP"
kill "$FOREIGN" 2>/dev/null
wait "$FOREIGN" 2>/dev/null
cp "$RUN/stages/telemetry/out/telemetry.jsonl" "$OUT/"
cat "$RUN/stages/telemetry/events.jsonl" "$RUN/stages/gpuwork/events.jsonl" >"$OUT/events.jsonl"
cp "$RUN/supervisor.log" "$RUN/state.json" "$OUT/"
tail -n 3 "$RUN/stages/gpuwork/stage.log" "$RUN/stages/telemetry/stage.log"
uniq -f1 "$OUT/board.log" | head -n 20
python3 - "$OUT/telemetry.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
hosts = [r for r in recs if r["kind"] == "host"]
gpus = [r for r in recs if r["kind"] == "gpu"]
owners = sorted({p.get("owner") for g in gpus for p in (g.get("procs") or [])})
cpu = [b["agent_cpu_s"] - a["agent_cpu_s"] for a, b in zip(hosts[1:], hosts[2:])]
print(f"{len(hosts)} samples, {len(gpus)} gpu records, owners seen: {owners}")
if cpu:
    print(f"agent CPU per sample (steady state, 1 GPU, real NVML): mean {1e3 * sum(cpu) / len(cpu):.2f} ms, "
          f"max {1e3 * max(cpu):.2f} ms")
print(json.dumps(gpus[len(gpus) // 2])[:1500] if gpus else "no gpu records")
PY
