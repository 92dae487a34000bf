#!/usr/bin/env bash
# Re-verify every tuned config listed in autotune-configs.txt and refresh the ones that no longer hold.
# One line per config in that file:  CONFIG MODEL GPUS BATCH_SIZE [extra autotune search flags]
#
#   autotune check exit 0  -> still fits and as fast as recorded: nothing to do
#   exit 1 (regressed) / 3 (no longer fits) -> autotune search again over the same file; it keeps the old config
#                          unless the new one is better by more than --min-improvement (no churn)
#   exit 2 (the model changed) -> autotune search again from scratch
#
# Reports land in autotune-reports/<config name>/; CI uploads them. Exit status: 0 unless a search failed.
set -uo pipefail
list=${1:-autotune-configs.txt}
device=${AUTOTUNE_DEVICE:-auto}
trials=${AUTOTUNE_TRIALS:-30}
status=0
while read -r config model gpus batch extra; do
  [[ -z "${config:-}" || "$config" == \#* ]] && continue
  name=$(basename "$config" .yaml)
  report="autotune-reports/$name"
  mkdir -p "$report"
  if [[ -f "$config" ]]; then
    autotune check "$config" --model "$model" --device "$device" --json > "$report/check.json"
    code=$?
  else
    code=2
  fi
  echo "check $config: exit $code"
  case $code in
    0) continue ;;
    1|3) study_flags=(--study-name "$name-refresh-$(date +%Y%m%d%H%M%S)") ;;
    2) rm -f "$config"; study_flags=(--study-name "$name-$(date +%Y%m%d%H%M%S)") ;;
    *) status=1; continue ;;
  esac
  # shellcheck disable=SC2086
  if ! autotune search "$model" --gpus "$gpus" --batch-size "$batch" --device "$device" --trials "$trials" \
      --output "$config" --report-dir "$report" "${study_flags[@]}" --json $extra > "$report/search.json"; then
    echo "search for $config failed: see $report/search.json"
    status=1
  fi
done < "$list"
exit $status
