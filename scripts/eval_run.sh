# Sourced by eval_results.sh and recall_results.sh: the repository root as working directory, docs/results as
# $out, a scratch folder $tmp, and run NAME EVAL-ARGS... which runs `h2o-chat eval EVAL-ARGS --json` into
# $out/NAME.json, its wall time into $tmp/NAME.seconds and its markdown table into $tmp/NAME.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=docs/results
h2o=(${H2O_CHAT:-h2o-chat})
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() {  # name, then the eval command's arguments; records the wall time
    local name=$1 start=$SECONDS
    shift
    echo "== $name: ${h2o[*]} eval $*" >&2
    "${h2o[@]}" eval "$@" --json > "$tmp/$name.json"
    mv "$tmp/$name.json" "$out/$name.json"
    echo "$((SECONDS - start))" > "$tmp/$name.seconds"
    python -m h2o_chat.measure.plots "$name" "$out/$name.json" > "$tmp/$name.md"  # the table (ppl_prompt -> ppl)
}
