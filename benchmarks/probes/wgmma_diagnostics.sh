#!/usr/bin/env bash
# Where the Gluon wgmma kernel's time goes at M = 16 (issue 4): the kernel timed with one part of its work changed
# (atomics made stores, x's copies masked off, the decode made one mov), each against the kernel itself in the same
# run, then Nsight Compute on 8B down and 8B gate_up. Variants are made with sed into /tmp and not checked.
#   usage: OUT=dir [MS=16] [CONFIGS="default"] [NCU_M=16] [NCU_CONFIG=...] \
#            bash benchmarks/probes/wgmma_diagnostics.sh [--models 8b,70b]
#   (MS, CONFIGS: wgmma_sweep's --ms and --configs; NCU_CONFIG: mma_ncu's --config, default the launcher's)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/wgmma-diagnostics}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
src=quanta/kernels/affine_wgmma.py
sed 's/gl.atomic_add(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask, sem="relaxed")/gl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)/' $src > /tmp/wg_stores.py
sed 's/mask=(m < M)\[:, None\] & (k < K)\[None, :\] & pred)/mask=(m < 0)[:, None] \& (k < K)[None, :] \& pred)/' $src > /tmp/wg_no_x.py
sed 's/w = gl.inline_asm_elementwise(_H2_F16 if F16 else (_H2_BF16_HIGH if HIGH else _H2_BF16),/w = gl.inline_asm_elementwise("mov.b32 $0, $1; \/\/ $2 $3 $4 $5 $6 $7 $8 $9 $10",/' $src > /tmp/wg_mov.py
for v in stores no_x mov; do
  cmp -s $src /tmp/wg_$v.py && { echo "variant $v: sed changed nothing"; exit 1; }
  timeout 150 python3 benchmarks/probes/wgmma_sweep.py --out "$OUT/wgmma-diag-$v.json" --ms "${MS:-16}" \
    --configs "${CONFIGS:-default}" --before /tmp/wg_$v.py --unchecked wg_$v "$@" > "$OUT/wgmma-diag-$v.log" 2>&1 \
    || echo "variant $v failed: $(tail -3 "$OUT/wgmma-diag-$v.log")"
done
python3 - "$OUT" <<'PY'
import json, sys
for v in ("stores", "no_x", "mov"):
    try:
        rs = json.load(open(f"{sys.argv[1]}/wgmma-diag-{v}.json"))["results"]
    except OSError:
        continue
    for r in rs:
        keys = [k.removeprefix("wg_") for k in r if k.startswith("wg_") and not k.startswith(f"wg_{v}_")]
        print(v, r["model"], r["layer"], r["m"], " ".join(f"{k}: {r['wg_' + k]}->{r.get(f'wg_{v}_' + k)}"
                                                         for k in keys))
PY
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for shape in "4096 14336" "28672 4096"; do
  set -- $shape
  timeout 120 "$NCU" --clock-control none -k regex:_w4_wgmma_kernel --launch-skip 3 -c 1 --set full \
    python3 benchmarks/probes/mma_ncu.py --kernel wgmma --n $1 --k $2 --m "${NCU_M:-16}" \
    ${NCU_CONFIG:+--config "$NCU_CONFIG"} > "$OUT/wgmma-ncu-$1x$2.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit" \
    "$OUT/wgmma-ncu-$1x$2.txt" | head -12
done
