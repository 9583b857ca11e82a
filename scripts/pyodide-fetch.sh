#!/usr/bin/env bash
# The Pyodide runtime the website's calculators run on (labkit site build copies it into the
# site; nothing is fetched from outside the site at reading time). Downloads the npm registry's
# tarball of the pinned version once, checks its sha256, and keeps the core runtime's files in
# a gitignored cache. Prints the cache folder (last line of stdout); exit 1 if it cannot.
#   PYODIDE_CACHE=DIR   where to keep it (default .cache/pyodide in the repository)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=314.0.7   # Python 3.14; `npm view pyodide version`
SHA256=66b7949e5a0cba2250b586d7e368bf12fb482800748d182c4618254b685ffaa0   # of pyodide-$VERSION.tgz
FILES="pyodide.mjs pyodide.asm.mjs pyodide.asm.wasm python_stdlib.zip pyodide-lock.json"
DEST="${PYODIDE_CACHE:-$PWD/.cache/pyodide}/$VERSION"
have() { for f in $FILES; do [ -s "$DEST/$f" ] || return 1; done; }
if have; then echo "$DEST"; exit 0; fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tgz="$tmp/pyodide-$VERSION.tgz"
url="https://registry.npmjs.org/pyodide/-/pyodide-$VERSION.tgz"
if command -v npm >/dev/null 2>&1 && (cd "$tmp" && npm pack --silent "pyodide@$VERSION" >/dev/null 2>&1); then
  :
elif command -v curl >/dev/null 2>&1; then
  curl -fsSL --retry 2 -o "$tgz" "$url" || { echo "pyodide-fetch: cannot download $url" >&2; exit 1; }
else
  python3 -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$url" "$tgz" \
    || { echo "pyodide-fetch: cannot download $url" >&2; exit 1; }
fi
got=$(sha256sum "$tgz" | cut -d' ' -f1)
if [ "$got" != "$SHA256" ]; then
  echo "pyodide-fetch: sha256 of pyodide-$VERSION.tgz is $got, expected $SHA256" >&2; exit 1
fi
mkdir -p "$DEST"
tar -xzf "$tgz" -C "$tmp" $(for f in $FILES; do echo "package/$f"; done)
for f in $FILES; do mv "$tmp/package/$f" "$DEST/$f"; done
echo "$DEST"
