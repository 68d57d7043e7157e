#!/usr/bin/env bash
# Third device call: optimizer, memory and precision benchmarks (each capped), results copied to $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=$PYTHONPATH:/tmp/site
R=/tmp/results; mkdir -p $R
timeout 110 python3 benchmarks/optimizer/run.py --out $R/optimizer > $R/optimizer.log 2>&1; echo "optimizer rc=$?"
timeout 170 python3 benchmarks/memory/run.py --out $R/memory > $R/memory.log 2>&1; echo "memory rc=$?"
timeout 150 python3 benchmarks/precision/run.py --out $R/precision > $R/precision.log 2>&1; echo "precision rc=$?"
for b in optimizer memory precision; do
  mkdir -p $OUT/$b; cp $R/$b/results.json $OUT/$b/ 2>/dev/null; cp "$(ls $R/$b/*.png 2>/dev/null | head -1)" $OUT/$b/ 2>/dev/null
  { echo "== $b"; tail -c 2500 $R/$b.log; } >> $OUT/logs.txt
done
ls -R $OUT
