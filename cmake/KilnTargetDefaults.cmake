# Compile settings shared by every Kiln-owned target.
function(kiln_target_defaults target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wno-unused-parameter)
  if(KILN_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()
