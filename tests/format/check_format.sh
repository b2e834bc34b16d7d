#!/usr/bin/env bash
# The tree follows .clang-format: every tracked C++ and CUDA source under src/, tests/ and bench/
# is what clang-format 14 (Debian 12's, installed by scripts/setup.sh) makes of it. Lists the
# files that differ and how to fix them.
#   check_format.sh SOURCE_DIR CLANG_FORMAT
set -euo pipefail
src=$1 clang_format=$2
cd "$src"
mapfile -t files < <(git ls-files 'src/*.h' 'src/*.cpp' 'src/*.cu' 'src/*.cuh' 'tests/*.h' 'tests/*.cpp' \
  'tests/*.cu' 'bench/*.h' 'bench/*.cpp' 2>/dev/null || find src tests bench \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \))
[ ${#files[@]} -gt 0 ] || { echo "check_format.sh: no sources found under $src"; exit 1; }
bad=()
for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  "$clang_format" --style=file "$f" | cmp -s - "$f" || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "not formatted (${#bad[@]} files; fix with: $clang_format -i FILE...):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "${#files[@]} files follow .clang-format"
