#!/usr/bin/env bash
# Opcode histogram of every built TQ3 decode kernel (TileLang's cache), for the kernel notes:
#   usage (device): bash scripts/device/sass_stats.sh > $OUT/sass_stats.txt
command -v cuobjdump >/dev/null || { echo "no cuobjdump"; exit 0; }
find ~/.tilelang /tmp -name "*.cubin" 2>/dev/null | while read -r f; do
  sass=$(cuobjdump -sass "$f" 2>/dev/null) || continue
  grep -q "tq3_decode" <<< "$sass" || continue
  echo "== $f  ($(grep -oE 'REG:[0-9]+|spill[^,]*' <<< "$(cuobjdump -res-usage "$f" 2>/dev/null)" | tr '\n' ' '))"
  grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z][A-Z0-9_]+' <<< "$sass" | awk '{print $NF}' | sort | uniq -c | sort -rn | head -25
done
