#!/usr/bin/env bash
# The layer rule of CMakeLists.txt, checked by compiling: from each layer's include tree
# (build/layers/<layer>), a header of the layer itself and of every layer below it compiles, and a
# header of every layer above it is not found; from the seam layers, kernels/cpu/ is not found.
#   check_layers.sh CXX BUILD_DIR SOURCE_DIR "core config ..." "seam layers ..."
set -euo pipefail
cxx=$1 build=$2 src=$3
read -r -a layers <<<"${4//;/ }"
seam_list=${5:-}
read -r -a seam <<<"${seam_list//;/ }"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# One header of a layer (the first by name), as an include path.
header() { (cd "$src/src" && find "lockstep/$1" -maxdepth 1 -name '*.h' | sort | head -1); }
compiles() {  # compiles LAYER HEADER
  echo "#include \"$2\"" >"$tmp/t.cpp"
  "$cxx" -std=c++20 -fsyntax-only -I "$build/layers/$1" $(pkg-config --cflags-only-I libxxhash 2>/dev/null) \
    "$tmp/t.cpp" 2>"$tmp/err"
}
fail=0
for i in "${!layers[@]}"; do
  layer=${layers[$i]}
  for j in "${!layers[@]}"; do
    h=$(header "${layers[$j]}")
    [ -n "$h" ] || continue
    if [ "$j" -le "$i" ]; then
      # Compiling every lower header is the build's job; the layer's own and the one just below suffice.
      [ "$j" -ge $((i - 1)) ] || continue
      compiles "$layer" "$h" || { echo "FAIL: $layer cannot include $h:"; head -3 "$tmp/err"; fail=1; }
    else
      if compiles "$layer" "$h"; then echo "FAIL: $layer includes $h, a layer above it"; fail=1
      elif ! grep -q "No such file" "$tmp/err"; then echo "FAIL: $layer including $h failed otherwise:"; head -3 "$tmp/err"; fail=1
      fi
    fi
  done
done
for layer in "${seam[@]}"; do
  h=$(cd "$src/src" && find lockstep/kernels/cpu -name '*.h' | sort | head -1)
  if compiles "$layer" "$h"; then echo "FAIL: $layer includes $h, behind the op seam"; fail=1; fi
done
[ "$fail" = 0 ] && echo "layers ${layers[*]}: every upward include fails to compile; seam layers: ${seam[*]:-(none)}"
exit "$fail"
