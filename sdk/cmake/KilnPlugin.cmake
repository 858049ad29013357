# kiln_add_plugin(NAME SOURCES src... [LIBRARIES lib...])
#
# Builds a Kiln plugin: a shared library named kiln-plugin-NAME.so that links kiln::core
# (and through it kiln::ir) and exports kiln_plugin_entry (write it with KILN_PLUGIN).
# `kiln plugins --plugin-path DIR` lists it once it is built into DIR.
function(kiln_add_plugin name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBRARIES" ${ARGN})
  if(NOT ARG_SOURCES)
    message(FATAL_ERROR "kiln_add_plugin(${name}): SOURCES is required")
  endif()
  set(target kiln-plugin-${name})
  add_library(${target} MODULE ${ARG_SOURCES})
  set_target_properties(${target} PROPERTIES
    PREFIX ""
    OUTPUT_NAME kiln-plugin-${name}
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  target_compile_features(${target} PRIVATE cxx_std_20)
  target_link_libraries(${target} PRIVATE kiln::core ${ARG_LIBRARIES})
  if(KILN_IN_TREE)
    set_target_properties(${target} PROPERTIES
      LIBRARY_OUTPUT_DIRECTORY ${KILN_PLUGIN_OUTPUT_DIR}
      INSTALL_RPATH "$ORIGIN/../..")
    kiln_target_defaults(${target})
    install(TARGETS ${target} LIBRARY DESTINATION lib/kiln/plugins)
  elseif(DEFINED KILN_LIBRARY_DIR)
    set_target_properties(${target} PROPERTIES BUILD_RPATH "${KILN_LIBRARY_DIR}")
  endif()
endfunction()
