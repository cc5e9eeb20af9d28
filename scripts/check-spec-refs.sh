#!/usr/bin/env bash
# Checks that every "§N", "§N.M" or "§0.1b.K" cited in the sources (crates/, kernels/, examples/,
# tests/) names a section of the vendored spec (docs/spec/0*.md): a "## N." / "### N.M" heading,
# or item K of the numbered list of §0.1b. Prints the citations that do not resolve (file:line)
# and exits non-zero if there is any.
set -euo pipefail
cd "$(dirname "$0")/.."

valid=$(
  awk '
    /^## [0-9]+\./      { s = $2; sub(/\.$/, "", s); print s; in01b = 0; next }
    /^### [0-9]+\.[0-9]+b? / { print $2; in01b = ($2 == "0.1b"); next }
    /^#/                { in01b = 0; next }
    in01b && /^[0-9]+\. / { k = $1; sub(/\.$/, "", k); print "0.1b." k }
  ' docs/spec/0*.md | sort -u
)

status=0
while IFS=: read -r file line text; do
  for ref in $(grep -oE '§[0-9]+(\.[0-9]+b?)?(\.[0-9]+)?' <<<"$text" | sed 's/^§//'); do
    if ! grep -qxF "$ref" <<<"$valid"; then
      echo "$file:$line: §$ref does not resolve in docs/spec/"
      status=1
    fi
  done
done < <(grep -rnE '§[0-9]' crates kernels examples tests \
           --include='*.rs' --include='*.cu' --include='*.cuh' --include='*.h' --include='*.md' || true)
[ "$status" = 0 ] && echo "every spec § citation resolves in docs/spec/"
exit "$status"
