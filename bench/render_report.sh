#!/usr/bin/env bash
# Renders `lockstep report` of two moe-debug runs to a PNG in headless Chromium: the picture in
# docs/observability.md. The second run branches from the first's step-20 checkpoint with twice the
# learning rate ("change one thing"), so the report marks their first divergent step, 21.
#
#   bench/render_report.sh [OUT.png]      default docs/images/report-moe-debug.png
#
# Needs build/lockstep (scripts/setup.sh); installs Debian's chromium with apt when it is missing.
# The runs and the HTML go to a temporary directory, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${1:-docs/images/report-moe-debug.png}
lockstep=build/lockstep
[ -x "$lockstep" ] || { echo "render_report.sh: $lockstep not found (build it: scripts/setup.sh)" >&2; exit 2; }

if ! command -v chromium >/dev/null; then
  echo "render_report.sh: installing chromium"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
job=(-c configs/moe-debug.toml train.save_interval=20)
"$lockstep" train "${job[@]}" train.out_dir="$tmp/moe-debug" >"$tmp/train.log"
cp -r "$tmp/moe-debug" "$tmp/moe-debug-lr"
"$lockstep" train "${job[@]}" train.out_dir="$tmp/moe-debug-lr" train.lr=4e-3 \
  train.resume="$tmp/moe-debug-lr/checkpoints/step-00000020" >>"$tmp/train.log"
# Relative names: they are the runs' labels in the report.
(cd "$tmp" && "$root/$lockstep" report moe-debug moe-debug-lr -o report.html)

# The page is 1000 pixels wide and about 2300 high; --no-sandbox: Chromium's sandbox refuses root.
mkdir -p "$(dirname "$out")"
if ! chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1040,2330 \
  --screenshot="$tmp/report.png" "file://$tmp/report.html" >"$tmp/chromium.log" 2>&1; then
  cat "$tmp/chromium.log" >&2
  exit 1
fi
cp "$tmp/report.png" "$out"
echo "render_report.sh: wrote $out ($(stat -c %s "$out") bytes)"
