#!/bin/bash
# One GPU session in one command: install ecd, run tests/gpu, then benchmarks/gpu.py; logs and
# the JSON under $OUT. The machine it ran on (python 3.12, torch preinstalled) lacked pyzmq,
# msgspec and redis: bring them as wheels in .whl/ (pip download --only-binary=:all:
# --python-version 3.12 ... pyzmq msgspec redis), e.g.
#   TESTS_S=300 BENCH_S=170 BENCH_ARGS="--quick --items 1000" OUT=/tmp/out bash benchmarks/gpu_session.sh
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; uname -r; python3 -c "import torch;print('torch', torch.__version__, torch.version.cuda)"; } 2>&1 | tee $OUT/env.log
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
timeout ${TESTS_S:-300} python3 -m pytest tests/gpu -m gpu -v -p no:cacheprovider -o timeout=90 ${K:+-k "$K"} 2>&1 | tee $OUT/pytest.log | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|Error|^E "
[ -n "$NOBENCH" ] || timeout ${BENCH_S:-150} python3 benchmarks/gpu.py ${BENCH_ARGS:---quick} --json $OUT/bench.json 2>&1 | tee $OUT/bench.log
echo done
