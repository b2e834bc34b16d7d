# Writes OUT (a header) with the source tree's identity: LOCKSTEP_GIT_COMMIT, the HEAD commit, with
# "+dirty.<sha1 of the uncommitted diff>" when the tracked files differ from it ("unknown" outside a
# git checkout). Run at every build (train/build_info.cpp includes it); the file is replaced only
# when its text changes, so an unchanged tree rebuilds nothing.
#   cmake -DSOURCE_DIR=... -DOUT=... -P build_identity.cmake
execute_process(COMMAND git -C ${SOURCE_DIR} rev-parse HEAD OUTPUT_VARIABLE commit RESULT_VARIABLE rc
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT rc EQUAL 0)
  set(commit "unknown")
else()
  execute_process(COMMAND git -C ${SOURCE_DIR} diff HEAD OUTPUT_VARIABLE diff ERROR_QUIET)
  if(NOT diff STREQUAL "")
    string(SHA1 diff_sha "${diff}")
    string(SUBSTRING "${diff_sha}" 0 12 diff_sha)
    set(commit "${commit}+dirty.${diff_sha}")
  endif()
endif()
file(WRITE ${OUT}.tmp "#define LOCKSTEP_GIT_COMMIT \"${commit}\"\n")
configure_file(${OUT}.tmp ${OUT} COPYONLY)
