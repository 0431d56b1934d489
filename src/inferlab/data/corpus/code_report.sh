#!/usr/bin/env bash
# Summarise a web server access log: requests per status code and the ten busiest paths.
set -euo pipefail

log="${1:-access.log}"
if [[ ! -f "$log" ]]; then
    echo "usage: $0 ACCESS_LOG" >&2
    exit 1
fi

echo "requests: $(wc -l < "$log")"

echo "by status:"
awk '{ print $9 }' "$log" | sort | uniq -c | sort -rn

echo "busiest paths:"
awk '{ print $7 }' "$log" | sort | uniq -c | sort -rn | head -n 10

errors=$(awk '$9 >= 500' "$log" | wc -l)
if (( errors > 0 )); then
    echo "server errors: $errors"
fi
