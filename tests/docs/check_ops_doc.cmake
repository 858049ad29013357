# Fails when the committed docs/ops.md differs from what `kiln ops --markdown --core` prints now.
#   cmake -DKILN=<kiln> -DDOC=<docs/ops.md> -DOUT=<scratch file> -P check_ops_doc.cmake
execute_process(COMMAND "${KILN}" ops --markdown --core RESULT_VARIABLE rc OUTPUT_VARIABLE generated ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kiln ops --markdown --core failed (exit status ${rc}):\n${err}")
endif()
file(READ "${DOC}" committed)
if(committed STREQUAL generated)
  return()
endif()
# Show what changed: a unified diff on stdout (ctest --output-on-failure shows it), when diff is there.
file(WRITE "${OUT}" "${generated}")
find_program(DIFF diff)
if(DIFF)
  execute_process(COMMAND "${DIFF}" -u "${DOC}" "${OUT}")
endif()
message(FATAL_ERROR "docs/ops.md is out of date with the op table; regenerate it with "
                    "scripts/gen-ops-doc.sh (or make docs) and commit the result")
