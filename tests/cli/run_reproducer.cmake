# A pass from a plugin fails, writes a reproducer naming the plugin's path, and
# `kiln opt --reproducer` replays it to the same failure. One run per way of naming the plugin.
#   cmake -DKILN=<kiln> -DMODEL=<fail_marker.kir> -DPLUGIN_DIR=<fixtures/fail-marker>
#         -DWORK=<scratch folder> -DMODE=flag|env|pipeline|missing|fixed -P run_reproducer.cmake
#
#   flag      --plugin-path, given relative to the working folder
#   env       KILN_PLUGIN_PATH, with a folder that does not exist beside it (left out)
#   pipeline  [plugins] paths of a pipeline TOML, relative to the TOML
#   missing   the recorded plugin path is gone when the reproducer is replayed
#   fixed     the IR no longer fails: the replay passes and says what had been recorded
cmake_minimum_required(VERSION 3.25)  # for the policies: if() takes "pipeline" as a string
unset(ENV{KILN_PLUGIN_PATH})  # only what each mode sets
set(work ${WORK}/${MODE})
file(REMOVE_RECURSE ${work})
file(MAKE_DIRECTORY ${work}/first ${work}/replay)
cmake_path(GET PLUGIN_DIR PARENT_PATH fixtures)

# Runs kiln; fails unless it exits with `rc`. Leaves stdout and stderr in `out` and `err`.
function(kiln rc)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE got OUTPUT_VARIABLE o ERROR_VARIABLE e
                  WORKING_DIRECTORY ${fixtures})
  if(NOT "${got}" STREQUAL "${rc}")
    message(FATAL_ERROR "expected exit status ${rc}, got ${got}\ncommand: ${ARGN}\n--- stdout\n${o}--- stderr\n${e}---")
  endif()
  set(out "${o}" PARENT_SCOPE)
  set(err "${e}" PARENT_SCOPE)
endfunction()

# Fails unless `text` matches `regex`; leaves its first group in `match`.
function(expect what text regex)
  if(NOT text MATCHES "${regex}")
    message(FATAL_ERROR "${what} does not match: ${regex}\n--- text\n${text}---")
  endif()
  set(match "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()

set(passes canonicalize,fixture-fail-on-marker)
set(pipeline "kir | ${passes} |")
set(run ${KILN} opt ${MODEL} --reproducer-dir ${work}/first)
if(MODE STREQUAL "env")
  list(PREPEND run ${CMAKE_COMMAND} -E env "KILN_PLUGIN_PATH=${fixtures}/fail-marker/../fail-marker:${work}/no-such-folder")
  list(APPEND run --passes ${passes})
elseif(MODE STREQUAL "pipeline")
  file(RELATIVE_PATH rel ${work} ${PLUGIN_DIR})
  file(WRITE ${work}/p.toml "frontend = \"kir\"\npasses = [\"canonicalize\", \"fixture-fail-on-marker\"]\n[plugins]\npaths = [\"${rel}\"]\n")
  list(APPEND run --pipeline ${work}/p.toml)
  set(pipeline "${pipeline} | plugins{paths=[${PLUGIN_DIR}]}")
else()
  list(APPEND run --plugin-path fail-marker --passes ${passes})  # relative to ${fixtures}
endif()

# 1. The plugin's pass fails and a reproducer is written.
set(failure "pass 'fixture-fail-on-marker' failed: found the marker value '%boom'")
kiln(1 ${run})
expect("stderr" "${err}" "kiln: error: ${failure}; reproducer written to ([^\n]*/kiln-reproducer-[0-9]+-0\\.kir)\n$")
set(repro ${match})

# 2. Its header names the pipeline, the plugin path (absolute, only the folder that exists) and
#    the failure.
file(STRINGS ${repro} lines)
list(SUBLIST lines 0 3 header)
set(expected_header
    "// kiln-reproducer: pipeline = \"${pipeline}\""
    "// kiln-reproducer: plugin-paths = [${PLUGIN_DIR}]"
    "// failed: fixture-fail-on-marker: found the marker value '%boom'")
if(NOT header STREQUAL expected_header)
  message(FATAL_ERROR "reproducer header:\n${header}\nexpected:\n${expected_header}")
endif()

# 3. It is plain .kir: `kiln opt FILE` reads it (and, with no passes, prints the IR).
kiln(0 ${KILN} opt ${repro})
expect("stdout of kiln opt on the reproducer" "${out}" "^graph @marked\\(%x: f32\\[2\\]\\)")

if(MODE STREQUAL "missing")
  # 4. A recorded plugin path that is gone is named.
  file(READ ${repro} text)
  string(REPLACE "${PLUGIN_DIR}" "${work}/gone" text "${text}")
  file(WRITE ${work}/moved.kir "${text}")
  kiln(1 ${KILN} opt --reproducer ${work}/moved.kir)
  expect("stderr" "${err}" "^kiln: error: [^\n]*/moved\\.kir: plugin path '${work}/gone' recorded in the reproducer does not exist; restore it, or edit the reproducer's plugin-paths line\n$")
  return()
endif()
if(MODE STREQUAL "fixed")
  # 4. Once the IR no longer trips the pass, the replay passes and says what had failed.
  file(READ ${repro} text)
  string(REPLACE "%boom" "%fine" text "${text}")
  string(REPLACE "'%fine'" "'%boom'" text "${text}")  # the recorded failure stays as it was
  file(WRITE ${work}/fixed.kir "${text}")
  kiln(0 ${KILN} opt --reproducer ${work}/fixed.kir)
  expect("stdout" "${out}" "%fine = neg\\(%x\\)")
  expect("stderr" "${err}" "kiln: note: the reproducer recorded a failure \\(fixture-fail-on-marker: found the marker value '%boom'\\); this run passed\n$")
  return()
endif()

# 4. Replaying it, with no plugin path given, loads the plugin and fails the same way; the
#    replay's own reproducer has the same header.
kiln(1 ${KILN} opt --reproducer ${repro} --reproducer-dir ${work}/replay)
expect("stderr" "${err}" "^pipeline: [^\n]*\nkiln: error: ${failure}; reproducer written to ([^\n]*/replay/kiln-reproducer-[0-9]+-0\\.kir)\n$")
file(STRINGS ${match} again)
list(SUBLIST again 0 3 again)
if(NOT again STREQUAL expected_header)
  message(FATAL_ERROR "the replay's reproducer header:\n${again}\nexpected:\n${expected_header}")
endif()
