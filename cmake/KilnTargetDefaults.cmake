# Compile settings shared by every Kiln-owned target.
function(kiln_target_defaults target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wno-unused-parameter)
  if(KILN_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
    # GCC 12/13 at -O3 (the Release build type) report -Wrestrict on std::string code they
    # inline (GCC PR 105329, a false positive); keep it a warning so Release builds.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12
       AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 14)
      target_compile_options(${target} PRIVATE -Wno-error=restrict)
    endif()
  endif()
endfunction()
