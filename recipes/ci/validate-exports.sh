#!/usr/bin/env bash
# Export every tuned config listed in autotune-configs.txt for each trainer and run the trainer's own checks on it
# (`autotune export CONFIG --format F --validate`). Same list as refresh.sh: the first word of a line is the config.
#
#   AUTOTUNE_EXPORT_FORMATS   trainers to check (default "torchtitan deepspeed"; add megatron where Megatron-LM is
#                             importable)
#   AUTOTUNE_REQUIRE_VALIDATION=1 (default): an export whose trainer could not be imported counts as a failure, so a
#                             moved module fails the job instead of passing unchecked
#
# Exports and logs land in autotune-exports/. Exit status: 0 when every export was validated, 1 otherwise.
set -uo pipefail
list=${1:-autotune-configs.txt}
formats=${AUTOTUNE_EXPORT_FORMATS:-torchtitan deepspeed}
require=${AUTOTUNE_REQUIRE_VALIDATION:-1}
mkdir -p autotune-exports
status=0
while read -r config _; do
  [[ -z "${config:-}" || "$config" == \#* ]] && continue
  name=$(basename "$config" .yaml)
  for fmt in $formats; do
    out="autotune-exports/$name.$fmt"
    autotune export "$config" --format "$fmt" --validate > "$out" 2> "$out.log"
    code=$?
    verdict=$(grep -E "^(validated|rejected|not validated)" "$out.log" | tail -n 1)
    echo "$config -> $fmt (exit $code): ${verdict:-$(tail -n 1 "$out.log")}"
    if [[ $code -ne 0 ]] || { [[ "$require" == 1 ]] && [[ "$verdict" != validated* ]]; }; then
      status=1
    fi
  done
done < "$list"
exit $status
