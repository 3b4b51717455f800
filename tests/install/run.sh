#!/usr/bin/env bash
# ctest "install_consume": installs the current build into a scratch prefix,
# checks what was installed, then builds and runs consumer.c against it twice,
# through find_package(kvxfer) (CMakeLists.txt here) and through pkg-config.
#
#   run.sh BUILD_DIR WORK_DIR LIBDIR VERSION C_COMPILER GENERATOR
#
# LIBDIR is CMAKE_INSTALL_LIBDIR of the build (relative), VERSION its
# PROJECT_VERSION (major.minor.patch).  WORK_DIR is wiped first.
set -euo pipefail

build_dir=$1 work=$2 libdir=$3 version=$4 cc=$5 generator=$6
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
major=${version%%.*}
minor=${version#*.}; minor=${minor%%.*}
patch=${version##*.}
prefix="$work/prefix"
lib="$prefix/$libdir"

fail() { echo "install_consume: FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }

rm -rf "$work"
mkdir -p "$work"

step "cmake --install $build_dir --prefix $prefix"
cmake --install "$build_dir" --prefix "$prefix" >"$work/install.log" || { cat "$work/install.log"; fail "cmake --install failed"; }

step "headers"
for h in kvxfer.h spec.h spectrum.h version.h; do
  [[ -f "$prefix/include/kvxfer/$h" ]] || fail "include/kvxfer/$h not installed"
done
grep -q "^#define KVXFER_MAJOR $major\$" "$prefix/include/kvxfer/version.h" || fail "version.h: KVXFER_MAJOR is not $major"
grep -q "^#define KVXFER_MINOR $minor\$" "$prefix/include/kvxfer/version.h" || fail "version.h: KVXFER_MINOR is not $minor"
grep -q "^#define KVXFER_PATCH $patch\$" "$prefix/include/kvxfer/version.h" || fail "version.h: KVXFER_PATCH is not $patch"
if ls "$prefix/include/kvxfer" | grep -v '\.h$'; then fail "non-header files installed under include/kvxfer"; fi

step "library: libkvxfer.so -> .so.$major -> .so.$version, soname, exported symbols"
[[ -f "$lib/libkvxfer.so.$version" && ! -L "$lib/libkvxfer.so.$version" ]] || fail "$libdir/libkvxfer.so.$version is not a regular file"
[[ "$(readlink "$lib/libkvxfer.so.$major")" == "libkvxfer.so.$version" ]] || fail "libkvxfer.so.$major does not link to libkvxfer.so.$version"
[[ "$(readlink "$lib/libkvxfer.so")" == "libkvxfer.so.$major" ]] || fail "libkvxfer.so does not link to libkvxfer.so.$major"
readelf -d "$lib/libkvxfer.so.$version" | grep -q "Library soname: \[libkvxfer.so.$major\]" || fail "SONAME is not libkvxfer.so.$major"
if readelf -d "$lib/libkvxfer.so.$version" | grep -E 'R(UN)?PATH'; then fail "installed library carries an RPATH/RUNPATH"; fi
# Defined dynamic symbols: only the public C API (plus the version node).
nm -D --defined-only "$lib/libkvxfer.so.$version" | awk '$2 != "A" {print $3}' | sed 's/@.*//' >"$work/symbols.txt"
grep -qx kvxfer_page_encode "$work/symbols.txt" || fail "kvxfer_page_encode is not exported"
grep -qx kvxfer_get_version "$work/symbols.txt" || fail "kvxfer_get_version is not exported"
if grep -v '^kvxfer_' "$work/symbols.txt"; then fail "symbols other than kvxfer_* are exported (above)"; fi
# Every function declared in the public headers is exported.
sed -nE 's/^[A-Za-z_][A-Za-z0-9_ *]*[ *](kvxfer_[a-z0-9_]+)\(.*/\1/p' \
  "$prefix/include/kvxfer/kvxfer.h" "$prefix/include/kvxfer/spec.h" \
  "$prefix/include/kvxfer/spectrum.h" | sort -u >"$work/declared.txt"
[[ -s "$work/declared.txt" ]] || fail "found no function declarations in kvxfer.h"
missing=$(comm -23 "$work/declared.txt" <(sort -u "$work/symbols.txt"))
[[ -z "$missing" ]] || fail "declared in the public headers but not exported: $missing"

step "CMake package and pkg-config file"
for f in kvxferConfig.cmake kvxferConfigVersion.cmake kvxferTargets.cmake; do
  [[ -f "$lib/cmake/kvxfer/$f" ]] || fail "$libdir/cmake/kvxfer/$f not installed"
done
src_dir="$(cd "$here/../.." && pwd)"
build_abs="$(cd "$build_dir" && pwd)"
for f in "$lib"/cmake/kvxfer/* "$lib"/pkgconfig/*; do
  text="$(<"$f")"
  text="${text//"$prefix"/}"  # the prefix itself may lie inside the build tree
  [[ "$text" != *"$build_abs"* && "$text" != *"$src_dir/"* ]] || fail "$f names the build or source tree"
done
export PKG_CONFIG_LIBDIR="$lib/pkgconfig"  # only the scratch prefix, never the system's
unset PKG_CONFIG_PATH
[[ "$(pkg-config --modversion kvxfer)" == "$version" ]] || fail "pkg-config --modversion is not $version"
[[ "$(pkg-config --variable=prefix kvxfer)" == "$prefix" ]] || fail "kvxfer.pc prefix is $(pkg-config --variable=prefix kvxfer), not $prefix"
pc_flags="$(pkg-config --cflags --libs kvxfer)"
echo "pkg-config --cflags --libs kvxfer: $pc_flags"
[[ " $pc_flags " == *" -I$prefix/include "* || "$prefix/include" == /usr/include ]] || fail "cflags lack -I$prefix/include"
[[ " $pc_flags " == *" -L$lib "* ]] || fail "libs lack -L$lib"

step "consumer via find_package(kvxfer CONFIG) + kvxfer::kvxfer"
cmake -S "$here" -B "$work/consumer-cmake" -G "$generator" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF >"$work/consumer-cmake.log" 2>&1 \
  || { cat "$work/consumer-cmake.log"; fail "configuring the find_package consumer failed"; }
found=$(sed -n 's/^kvxfer_DIR:PATH=//p' "$work/consumer-cmake/CMakeCache.txt")
[[ "$found" -ef "$lib/cmake/kvxfer" ]] || fail "find_package found kvxfer in '$found', not in the scratch prefix"
cmake --build "$work/consumer-cmake" || fail "building the find_package consumer failed"
ldd "$work/consumer-cmake/consumer" | grep -F "libkvxfer.so.$major => $lib/" || fail "the find_package consumer does not load $lib/libkvxfer.so.$major"
"$work/consumer-cmake/consumer" || fail "the find_package consumer failed"

step "consumer via pkg-config"
# shellcheck disable=SC2086  # word splitting of the flags is intended
"$cc" -std=c99 -Wall -Wextra -pedantic -Werror "$here/consumer.c" $pc_flags -lm -o "$work/consumer-pc" \
  || fail "building the pkg-config consumer failed"
LD_LIBRARY_PATH="$lib" ldd "$work/consumer-pc" | grep -F "libkvxfer.so.$major => $lib/" || fail "the pkg-config consumer does not load $lib/libkvxfer.so.$major"
LD_LIBRARY_PATH="$lib" "$work/consumer-pc" || fail "the pkg-config consumer failed"

echo "install_consume: OK"
