#!/usr/bin/env bash
# Several pytest selections in one call on the GPU machine, each under its own time limit and
# logged in full to $OUT/tests-<i>.log (or /tmp without $OUT), printing one line per selection:
# pytest's summary, or how it ended when it has none (a time limit, a crash). A device call
# returns only the tail of its output, so a long run's summary lines must stay short.
#
#   bash bench/device_tests.sh SECONDS "tests/test_quant_gpu.py -k cuda_gemv" "tests/test_kernels.py"
#
# A selection is split on spaces: `-k` takes one word (`-k cuda_gemv_matches`, not `-k "a or
# b"`). The GPU machine lacks some of the tests' packages: carry their wheels (xgrammar with
# apache-tvm-ffi, which it imports: without it every structured request fails there; gguf,
# pydantic, interegular) and install them with `pip install --no-index --no-deps --target`.
set -u
limit=$1
shift
out=${OUT:-/tmp}
i=0
for selection in "$@"; do
    i=$((i + 1))
    log="$out/tests-$i.log"
    # (word splitting of the selection is wanted: it is pytest's arguments)
    # shellcheck disable=SC2086
    timeout "$limit" python -m pytest -q -p no:cacheprovider $selection >"$log" 2>&1
    rc=$?
    summary=$(grep -E " in [0-9.]+s( \([0-9:]+\))?( =+)?$" "$log" | tail -1)
    if [ "$rc" = 124 ]; then  # (the progress lines: one character per test)
        progress=$(grep -E '^[.sFExX]+( +\[ *[0-9]+%\])?$' "$log" | cut -d' ' -f1 | tr -d '\n')
        summary="stopped at the ${limit} s limit: $(echo -n "$progress" | tr -cd . | wc -c) passed, $(echo -n "$progress" | tr -cd FE | wc -c) failed or errors so far"
    fi
    echo "[$i] $selection: rc $rc: ${summary:-no summary (see $log)}"
done
