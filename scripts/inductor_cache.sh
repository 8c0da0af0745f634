#!/usr/bin/env bash
# Carry Inductor's compile cache (kernels.compile: inductor) from one device session to the next: each session
# gets a fresh machine, and files come back through $OUT at 16 MiB at most each (docs/gpu.md).
#   scripts/inductor_cache.sh pack DIR     the cache (TORCHINDUCTOR_CACHE_DIR) as DIR/inductor.tgz.00, .01, ... (15 MiB parts)
#   scripts/inductor_cache.sh unpack DIR   the cache restored from those parts (scripts/gpu_env.sh does this for .inductor/)
set -euo pipefail
cache=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
case ${1:-} in
  pack) tar czf - -C "$(dirname "$cache")" "$(basename "$cache")" | split -b 15M -d - "$2/inductor.tgz." ;;
  unpack) mkdir -p "$(dirname "$cache")" && cat "$2"/inductor.tgz.* | tar xzf - -C "$(dirname "$cache")" ;;
  *) echo "usage: $0 pack|unpack DIR" >&2; exit 2 ;;
esac
