#!/usr/bin/env bash
# The GPU checks of a session lent a GPU machine (the `device` tool), in one short call.
#
#   bash scripts/gpu_session.sh image-check  # here, before a GPU session: the image's torch and
#                                         # Triton (a venv, $IMAGE_VENV) run the kernel and
#                                         # compile tests and bench/gpu.py --tiny interpreted
#   bash scripts/gpu_session.sh prepare   # here, with network: wheels the image lacks -> .whl/
#                                         # (GemLite 0.6 among them), the shared data the GPU
#                                         # tests read -> .devrun/data
#   device run, carry [".whl", ".devrun", ".devcache"], timeout_s 600:
#       bash scripts/gpu_session.sh run kernels    # issue 45: bench/gpu.py, every section
#       bash scripts/gpu_session.sh run [tests|bench|all]
#   bash scripts/gpu_session.sh keep-cache DIR  # here, after each call: the compile cache it
#                                         # left (DIR: the call's files_at) for the next session
#
# `run kernels` is the one prepared call of issue 45 (about 9 minutes on an H100: installing the
# wheels ~30 s, then bench/gpu.py within its budget, cut before the call's limit): it
# autotunes, checks (codes bit for bit, every path within one bf16 rounding) and times every
# row the issue asks for, prints the short summary table last and leaves the full log in
# $OUT/bench_gpu.txt, every row in $OUT/bench.json and the model section's profiler traces in
# $OUT/trace_*.json.gz.  A failing section prints its traceback and the run goes on (the
# checks run first, in a child process: a launch path that faults there is turned off for the
# run, and no fault there ends the run); a section that would not fit the budget is skipped
# and says so (the `act`, `rows` and `peers` sections come last: a second call takes what the
# first skipped, e.g. BENCH_ARGS="--sections act,rows,tune" (tune, opt-in, stops cleanly for
# time); send it at once: the machine
# goes back after 30 s idle, and a fresh one starts only with 4 minutes of device time left, so
# read `status` for budget_left_s after the first call and give the second CALL_S = its
# timeout_s, e.g. CALL_S=230 and timeout_s 230; call give_back after it).  The limits follow
# the call's: CALL_S (the device call's timeout_s, default 600) less the seconds already spent
# less 25 (leave_caches) is the bench's cut (BENCH_S), 40 s less its budget (BENCH_BUDGET); a
# warm machine's second call reuses the installed wheels.  A section the `timeout` below stops
# still leaves the summary and the JSON of every section before it (bench/gpu.py writes it
# after each, and turns SIGTERM into an orderly exit).
#
# Compiles cost device time (the check took 187 s on 2026-12-04, mostly compiling): `run` keeps
# Triton's and Inductor's caches at one path (a Triton cache entry names its files by absolute
# path) and leaves them in $OUT/compile-cache.tar.gz (the project's kernels as cubins and
# metadata; up to CACHE_MIB), the profiler traces in $OUT/traces.tar (at most 8 files come
# back).  Here, after each call, `bash scripts/gpu_session.sh keep-cache <files_at>` puts it in
# .devcache/ and the next calls carry it (carry [".whl", ".devrun", ".devcache"]): a kernel
# whose source, Triton and options are unchanged is then not compiled again.  bench/gpu.py
# says per section how many kernels it compiled and how many came from the cache; it records
# in the cache the kernel specializations it launched (specs.json) and, at the next run,
# compiles them in parallel processes beside the check (a changed kernel too:
# bench/_gpu_compiles.py).
#
# Measured on an H200 (2026-11-26): the 92 GPU tests need more than 250 s (the kernels' codes
# against the CPU reference 33 to 42 s per format, the compiled roundings 6 to 11 s each);
# bench/gpu.py's model section more than 190 s (it prints each row as it completes).  A device
# start took about 30 s.  `run tests` and `run bench` fit a 600 s call each.
# `run` installs the wheels and the package under /tmp, runs `pytest -m gpu` (each failure's
# traceback written to $OUT/failures.txt as it happens, a per-test time limit) and/or
# `python bench/gpu.py`, teeing both to $OUT.  Limits (seconds): TEST_S, BENCH_S, PER_TEST_S,
# BENCH_BUDGET; BENCH_ARGS is passed to bench/gpu.py; TESTS (node ids, run in that order)
# narrows the tests and PYTEST_ARGS adds options (`--runxfail` shows why an xfail test fails).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD

# The image has torch, triton, lightning, transformers (older), pytest; not these (the versions
# installed here travel; transformers 5.25 refuses the image's huggingface-hub 1.33 at import).
# sdist-only packages are built into wheels here.
PACKAGES="torchao jsonargparse docstring_parser typeshed_client transformers
datasets dill multiprocess lm_eval evaluate sqlitedict pytablewriter DataProperty mbstrdecoder
pathvalidate tabledata tcolorpy typepy chardet rouge_score nltk word2number more-itertools
compressed-tensors pydantic pydantic_core annotated-types typing-inspection loguru gguf pytz
pytest-timeout huggingface_hub httpx2 httpcore2 truststore hf-xet click idna anyio safetensors
accelerate"
DATA="MANIFEST.md tiny_llama_aidreams260K winogrande llama2_tokenizer wikitext2"
# a peer of issue 45 (pure Triton; numpy, tqdm and triton are in the image): an sdist, built
# into a wheel here
GEMLITE="gemlite==0.6.0.post2"

# The image's torch (research/2026-11-26-first-gpu-run.md); its wheel pins the image's Triton
IMAGE_TORCH=2.11.0
# where the device keeps its compile caches (leave_caches)
CACHE=/tmp/kbbq-compile-cache

image_check() {
    # The CPU suite runs the newest torch and Triton; the GPU machine runs the image's, where
    # torch.compile traced W4A4 layers differently (2026-11-28): check them here first.
    local venv=${IMAGE_VENV:-/tmp/kbbq-image-venv}
    if [ ! -x "$venv/bin/python" ]; then
        # torch's CUDA wheel runs on a CPU; Triton 3.6's interpreter needs numpy < 2.4 (it
        # takes int() of one-element arrays)
        python3 -m venv "$venv" && "$venv/bin/pip" install -q "torch==$IMAGE_TORCH" "numpy<2.4" &&
            "$venv/bin/pip" install -q -e ".[test]" || exit 1
    fi
    "$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton',
    triton.__version__)"
    # KBBQ_PL_SLOW=1: the device script's own tiny runs (bench/gpu.py), slow tests in CI
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 KBBQ_PL_SLOW=1 \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs tests/kernels \
        tests/quant/test_w4a4_compile.py tests/bench/test_gpu_session.py "$@"
}

prepare() {
    rm -rf .whl .devrun  # one wheel per package: an older one left here fails the install
    mkdir -p .whl .devrun/data
    grep -qx "/.devrun/" .git/info/exclude 2>/dev/null || echo "/.devrun/" >> .git/info/exclude
    for name in $PACKAGES; do
        version=$(python -c "import importlib.metadata as m; print(m.version('$name'))") || exit 1
        python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .whl "$name==$version" 2>/dev/null ||
            python -m pip wheel -q --no-deps -w .whl "$name==$version" || exit 1
    done
    python -m pip wheel -q --no-deps -w .whl "$GEMLITE" || echo "GemLite wheel not built: its rows will say so"
    # the device's copy of the tree has no .git; it carries uncommitted changes too
    git describe --always --dirty --abbrev=7 > .devrun/commit
    for item in $DATA; do cp -r "../shared/data/$item" .devrun/data/; done
    du -sh .whl .devrun
}

run() {
    local what=${1:-all}
    if [ -f /tmp/site/.kbbq_installed ] && [ -d /tmp/pkg/kbbq_pl ]; then
        echo "wheels and package already installed (a warm machine's second call)"
    else
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
            .whl/*.whl >/tmp/whl.log 2>&1 || { tail -20 /tmp/whl.log; echo "wheel install failed"; exit 3; }
        # Installed, not run from the checkout: kbbq_pl.callbacks and kbbq_pl.recipes are mapped
        # from callbacks/ and recipes/ (pyproject.toml), which a plain PYTHONPATH does not do.
        PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation \
            --no-compile --target /tmp/pkg . >/tmp/pkg.log 2>&1 || { tail -20 /tmp/pkg.log; exit 4; }
        touch /tmp/site/.kbbq_installed
    fi
    export PYTHONPATH=/tmp/pkg:/tmp/site PATH=/tmp/pkg/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
    export HF_HUB_OFFLINE=1 KBBQ_PL_FAILURE_LOG=$OUT/failures.txt
    restore_caches
    mkdir -p ../shared && rm -rf ../shared/data && cp -r .devrun/data ../shared/data
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers, torchao; print('torch', torch.__version__,
    'triton', triton.__version__, 'transformers', transformers.__version__, torchao.__version__)"
    if [ "$what" = tests ] || [ "$what" = all ]; then
        # from /tmp: the checkout's kbbq_pl/ (without the mapped subpackages) stays off sys.path
        local selected=()
        for test in ${TESTS:-tests}; do selected+=("$ROOT/$test"); done
        (cd /tmp && timeout -k 5 "${TEST_S:-300}" python3 -m pytest -m gpu -q -rfEs \
            -p no:cacheprovider --timeout "${PER_TEST_S:-90}" --durations=15 \
            --rootdir "$ROOT" -c "$ROOT/pyproject.toml" ${PYTEST_ARGS:-} "${selected[@]}") 2>&1 |
            grep --line-buffered -v "IndexKernel.cu" | tee "$OUT/pytest_gpu.txt" | tail -60
    fi
    if [ "$what" = bench ] || [ "$what" = all ]; then
        timeout -k 5 "${BENCH_S:-250}" python3 bench/gpu.py ${BENCH_ARGS:-} 2>&1 |
            grep --line-buffered -v "IndexKernel.cu" | tee "$OUT/bench_gpu.txt"
    fi
    if [ "$what" = kernels ]; then
        # the cut and the budget follow what is left of the call (the header)
        local cut=${BENCH_S:-$(( ${CALL_S:-600} - SECONDS - 25 ))}
        local budget=${BENCH_BUDGET:-$(( cut - 40 ))}
        echo "bench: cut at $cut s, budget $budget s ($SECONDS s spent before it)"
        # the full log goes to $OUT; the summary table is the last thing bench/gpu.py prints
        KBBQ_PL_COMMIT=$(cat .devrun/commit 2>/dev/null ||
                         git describe --always --dirty --abbrev=7) \
        timeout -k 5 "$cut" python3 bench/gpu.py --budget-s "$budget" --json "$OUT/bench.json" \
            --specs "$CACHE/specs.json" ${BENCH_ARGS:-} 2>&1 |
            grep --line-buffered -v "IndexKernel.cu" | tee "$OUT/bench_gpu.txt"
    fi
    leave_caches
}

restore_caches() {
    # an earlier session's compile caches (keep_cache), unless this machine has its own
    local archive=${1:-.devcache/compile-cache.tar.gz}
    export TRITON_CACHE_DIR=$CACHE/triton TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor
    if [ ! -d "$CACHE" ] && [ -f "$archive" ]; then
        tar -C "$(dirname "$CACHE")" -xzf "$archive" &&
            echo "compile cache of $(cat "$(dirname "$archive")/from" 2>/dev/null || echo '?'):" \
                "$(find "$CACHE/triton" -name '__grp__*' | wc -l) Triton kernels"
    fi
}

leave_caches() {
    # the traces in one file; the compile caches, only Triton's where both exceed CACHE_MIB
    if compgen -G "$OUT/trace_*.json.gz" >/dev/null; then
        (cd "$OUT" && tar -cf traces.tar trace_*.json.gz && rm -f trace_*.json.gz)
    fi
    [ -d "$CACHE/triton" ] || return 0
    # the project's kernels keep their cubin and metadata (what a hit reads; their group files
    # list no more: Triton 3.9 takes a group with a missing file for a miss); Inductor's
    # (triton_*) stay whole
    python3 - "$CACHE/triton" <<'EOF'
import json, pathlib, sys
for group in pathlib.Path(sys.argv[1]).glob("*/__grp__*.json"):
    if group.name.startswith("__grp__triton_"):
        continue
    children = json.loads(group.read_text())["child_paths"]
    for name, path in children.items():
        if name.rsplit(".", 1)[-1] not in ("cubin", "json"):
            pathlib.Path(path).unlink(missing_ok=True)
    kept = {name: path for name, path in children.items() if pathlib.Path(path).exists()}
    group.write_text(json.dumps({"child_paths": kept}))
EOF
    local limit=$(( ${CACHE_MIB:-12} * 1048576 )) part packed=/tmp/compile-cache.tar.gz
    local name; name=$(basename "$CACHE")
    [ -f "$CACHE/specs.json" ] || echo "[]" > "$CACHE/specs.json"
    for part in "$name" "$name/triton $name/specs.json"; do
        # packed outside $OUT, then moved: a call cut short leaves no half-written archive
        # shellcheck disable=SC2086  # $part: one or two paths
        timeout 20 tar -C "$(dirname "$CACHE")" -czf "$packed" $part 2>/dev/null &&
            [ "$(stat -c %s "$packed")" -le "$limit" ] && mv "$packed" "$OUT/" &&
            { echo "compile cache left in \$OUT: $part," \
                   "$(du -h "$OUT/compile-cache.tar.gz" | cut -f1)"; return 0; }
    done
    rm -f "$packed"
    echo "compile cache not left: over ${CACHE_MIB:-12} MiB even without Inductor's"
}

keep_cache() {
    # here, after a GPU call: its compile cache for the next calls (a fresh machine, a session)
    local from=${1:?usage: keep-cache <files_at of the last call>}
    [ -f "$from/compile-cache.tar.gz" ] || { echo "no compile-cache.tar.gz in $from"; exit 1; }
    grep -qx "/.devcache/" .git/info/exclude 2>/dev/null || echo "/.devcache/" >> .git/info/exclude
    mkdir -p .devcache && cp "$from/compile-cache.tar.gz" .devcache/ &&
        cp .devrun/commit .devcache/from 2>/dev/null
    du -h .devcache/compile-cache.tar.gz
}

# sourced (the tests), only the functions
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0
case "${1:-}" in
    prepare) prepare ;;
    image-check) shift; image_check "$@" ;;
    run) shift; run "$@" ;;
    keep-cache) shift; keep_cache "$@" ;;
    *) echo "usage: bash scripts/gpu_session.sh image-check | prepare | run [kernels|tests|bench|all] | keep-cache DIR" >&2
       exit 2 ;;
esac
