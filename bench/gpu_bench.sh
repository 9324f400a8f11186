#!/usr/bin/env bash
# Run bench/gpu_bench.py on a GPU machine that has PyTorch (CUDA), torchvision and numpy
# but no redis-server, no conveyor dependencies and no network.
#
# Prepare on a machine with network, in the repository root (both folders are ignored
# through .git/info/exclude, and travel with the tree):
#   mkdir -p .gpu/debs .gpu/debs-fallback .gpu/whl .gpu/src
#   git archive HEAD | tar -x -C .gpu/src && git rev-parse HEAD >.gpu/src/COMMIT \
#       && cp bench/gpu_*.py bench/gpu_bench.sh .gpu/src/bench/    # optional snapshot
#   (cd .gpu/debs && apt-get download redis-server redis-tools libjemalloc2 liblzf1 \
#        wrk libluajit-5.1-2 libluajit-5.1-common)                # wrk: the load generator
#   (cd .gpu/debs-fallback && apt-get download libatomic1 libssl3 libsystemd0 libcap2 \
#        libgcrypt20 libgpg-error0 liblz4-1 liblzma5 libzstd1)   # used only if ldd misses them
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .gpu/whl fastapi starlette uvicorn httptools pydantic pydantic-core \
#       pydantic-settings python-dotenv annotated-types annotated-doc typing-inspection \
#       redis hiredis celery kombu billiard vine amqp click-didyoumean click-repl \
#       click-plugins prompt-toolkit wcwidth tzdata tzlocal python-dateutil orjson hpack \
#       grpcio grpcio-health-checking protobuf fastapi-offline opentelemetry-api \
#       importlib-metadata zipp py-spy      # at the versions of the local .venv (pip freeze)
#
# Usage: bash bench/gpu_bench.sh [gpu_bench.py arguments]   (OUT: where results go)
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
GPU=${GPU_DIR:-$ROOT/.gpu}
# A snapshot of one commit (git archive HEAD | tar -x -C .gpu/src, plus these two files)
# runs in place of the working tree when present: the tree may be mid-edit.
if [ -z "${GPU_NO_SNAPSHOT:-}" ] && [ -f "$GPU/src/bench/gpu_bench.py" ]; then
    ROOT=$(cd "$GPU/src" && pwd); cd "$ROOT"
    echo "== running the snapshot in $ROOT (commit $(cat COMMIT 2>/dev/null || echo '?'))"
fi
OUT=${OUT:-$ROOT/bench/out/gpu}
PY=${PYTHON:-python3}
SITE=/tmp/conveyor-site
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)

echo "== wheels"
if ls "$GPU"/whl/*.whl >/dev/null 2>&1; then
    rm -rf "$SITE"
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$GPU"/whl/*.whl || echo "!! WHEEL INSTALL FAILED"
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"  # py-spy
else
    echo "no wheels in $GPU/whl: using what $PY has"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== redis-server"
RR=/tmp/conveyor-redis
unpack() {  # unpack a .deb into a folder: dpkg -x, or Python where dpkg is missing
    if command -v dpkg >/dev/null; then dpkg -x "$1" "$2"; return; fi
    "$PY" - "$1" "$2" <<'EOF'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
pos = 8  # "!<arch>\n", then 60-byte member headers
while pos < len(data):
    name, size = data[pos:pos + 16].decode().strip(), int(data[pos + 48:pos + 58])
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(body)).extractall(sys.argv[2])
    pos += 60 + size + (size & 1)
EOF
}
if ls "$GPU"/debs/*.deb >/dev/null 2>&1; then
    rm -rf "$RR" && mkdir -p "$RR"
    for f in "$GPU"/debs/*.deb; do unpack "$f" "$RR" || echo "!! unpacking $f failed"; done
    LD="$RR/usr/lib/x86_64-linux-gnu"
    if LD_LIBRARY_PATH="$LD" ldd "$RR/usr/bin/redis-server" | grep -q "not found"; then
        echo "missing libraries:"; LD_LIBRARY_PATH="$LD" ldd "$RR/usr/bin/redis-server" | grep "not found"
        mkdir -p "$RR/fb"
        for f in "$GPU"/debs-fallback/*.deb; do unpack "$f" "$RR/fb"; done
        for lib in $(LD_LIBRARY_PATH="$LD" ldd "$RR/usr/bin/redis-server" | awk '/not found/ {print $1}'); do
            found=$(find "$RR/fb" -name "$lib" | head -1)
            [ -n "$found" ] && mkdir -p "$RR/fblib" && cp -aL "$found" "$RR/fblib/" && echo "  $lib from fallback"
        done
        LD="$LD:$RR/fblib"
    fi
    export CONVEYOR_GPU_REDIS_SERVER="$RR/usr/bin/redis-server" CONVEYOR_GPU_REDIS_LD="$LD"
    LD_LIBRARY_PATH="$LD" "$CONVEYOR_GPU_REDIS_SERVER" --version || echo "!! REDIS-SERVER DOES NOT RUN"
    if [ -x "$RR/usr/bin/wrk" ]; then  # wrk (and its libluajit) from the same folder of .debs
        mkdir -p "$RR/bin"
        printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' "$LD" "$RR/usr/bin/wrk" >"$RR/bin/wrk"
        chmod +x "$RR/bin/wrk" && export PATH="$RR/bin:$PATH"
        wrk --version 2>&1 | head -1 || echo "!! WRK DOES NOT RUN"
    fi
else
    echo "no debs in $GPU/debs: using $(command -v redis-server || echo 'no redis-server')"
fi

echo "== python"
"$PY" - <<'EOF' || echo "!! IMPORT CHECK FAILED"
import importlib, sys
print(sys.executable, sys.version.split()[0])
for name in ("torch", "torchvision", "numpy", "fastapi", "uvicorn", "redis", "celery",
             "pydantic_settings", "orjson", "msgpack", "grpc", "google.protobuf", "aiohttp", "httpx",
             "workers.app"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '')} {getattr(module, '__file__', '')}")
    except Exception as exc:
        print(f"  !! {name}: {type(exc).__name__}: {exc}")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu --format=csv || true
echo "== setup took $(( $(date +%s) - t0 ))s"

# The check time-boxes itself (--budget-s, default 330 s); this is the hard stop.
timeout -k 10 ${GPU_CHECK_TIMEOUT:-360} "$PY" -u -m bench.gpu_bench --out "$OUT" "$@"
rc=$?
echo "== gpu_bench exit $rc after $(( $(date +%s) - t0 ))s"
exit $rc
