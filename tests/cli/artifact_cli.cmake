# CLI tests of `kiln compile`, `kiln inspect` and `kiln cache`, included by CMakeLists.txt.
# Artifacts come from the fake-gpu fixture backends (tests/fixtures/fake_gpu_plugin.cpp), so
# everything here runs without CUDA or a GPU.
set(fake --plugin-path ${fixtures}/fake-gpu --backend fake-gpu,fake-gpu-next)
set(art ${out}/artifacts)
file(MAKE_DIRECTORY ${art})

# compile → inspect: one artifact for three targets from two backends.
kiln_cli_test(compile ARGS compile ${here}/symbolic.kir --target sm_80,sm_90a,sm_100a --sym B=4 ${fake}
              -o ${art}/sym.kiln RC 0
  OUT "^compiled [^\n]*/symbolic\\.kir for sm_80, sm_90a, sm_100a in [0-9.]+ s: [^\n]*/sym\\.kiln \\([0-9]+ bytes\\)\n  sm_80: sm_80\\.cubin 17 bytes, compute_80\\.ptx 22 bytes\n  sm_90a: sm_90a\\.cubin 18 bytes, compute_90a\\.ptx 23 bytes\n  sm_100a: sm_100a\\.cubin 19 bytes, compute_100a\\.ptx 24 bytes\n  peak activation memory: 108 B in import order, 108 B as compiled \\(\\+0\\.0%\\)\n  plan arena: 1\\.00 KiB \\(arena bytes=1024\\)\n$")
set_tests_properties(cli.compile PROPERTIES FIXTURES_SETUP kiln_artifact)
kiln_cli_test(inspect-json ARGS inspect ${art}/sym.kiln --json RC 0
  OUT "^{\"format_version\": 1, \"meta\": {\"created_by\": \"kiln compile\", [^\n]*\"model\": \"symbolic\\.kir\", [^\n]*\"plugins\": \"kir@[0-9.]+,[^\"]*fake-gpu@0\\.0\\.1,fake-gpu-next@0\\.0\\.1\", [^\n]*\"targets\": \"sm_80,sm_90a,sm_100a\"}, \"targets\": \\[\"sm_80\", \"sm_90a\", \"sm_100a\"\\], \"images\": \\[{\"name\": \"sm_80\\.cubin\", \"target\": \"sm_80\", \"form\": \"cubin\", \"bytes\": 17}, [^\n]*\"inputs\": \\[{\"name\": \"x\", \"buffer\": 0, \"dtype\": \"f32\", \"shape\": \\[4, 3\\], \"bytes\": 48}, [^\n]*\"weights_bytes\": 16, [^\n]*}\n$")
kiln_cli_test(inspect-text ARGS inspect ${art}/sym.kiln RC 0
  OUT "^file: [^\n]*/sym\\.kiln \\([0-9]+ bytes\\)\nformat version 1, kiln [0-9.]+, created by kiln compile from symbolic\\.kir\ntargets: sm_80, sm_90a, sm_100a\npipeline: kir \\| canonicalize,cse,[^|]*dce[^|]* \\| fake-gpu@sm_80,sm_90a,sm_100a\n.*inputs:\n  x: f32\\[4, 3\\]\n  b: f32\\[3\\]\noutputs:\n  y: f32\\[4, 3\\]\n")
set_tests_properties(cli.inspect-json cli.inspect-text PROPERTIES FIXTURES_REQUIRED kiln_artifact)

# Damaged copies are refused with a clear message and exit status 1.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  set(damage_truncate "truncated: [0-9]+ bytes, header says [0-9]+")
  set(damage_flip "corrupt section 'plan' \\(checksum mismatch\\)")
  set(damage_magic "not a Kiln artifact \\(bad magic\\)")
  set(damage_version "format version 2; this runtime reads 1")
  foreach(mode truncate flip magic version)
    add_test(NAME cli.damage-${mode}
             COMMAND ${Python3_EXECUTABLE} ${here}/corrupt_artifact.py ${art}/sym.kiln ${art}/${mode}.kiln ${mode})
    set_tests_properties(cli.damage-${mode} PROPERTIES FIXTURES_REQUIRED kiln_artifact FIXTURES_SETUP kiln_damaged_${mode})
    kiln_cli_test(inspect-${mode} ARGS inspect ${art}/${mode}.kiln --json RC 1
      ERR "^kiln: error: [^\n]*/${mode}\\.kiln: ${damage_${mode}}\n$")
    set_tests_properties(cli.inspect-${mode} PROPERTIES FIXTURES_REQUIRED kiln_damaged_${mode})
  endforeach()
else()
  kiln_skipped_test(cli.damage "the damaged-artifact tests need python3 (corrupt_artifact.py)")
endif()
kiln_cli_test(inspect-not-artifact ARGS inspect ${here}/double.kir RC 1
  ERR "^kiln: error: [^\n]*/double\\.kir: not a Kiln artifact \\(bad magic\\)\n$")
kiln_cli_test(inspect-missing ARGS inspect ${art}/nope.kiln RC 1
  ERR "^kiln: error: cannot read '[^']*/nope\\.kiln': No such file or directory\n$")
kiln_cli_test(inspect-no-file ARGS inspect --json RC 2 ERR "kiln: error: inspect: no artifact given")

# compile errors name what is wrong.
kiln_cli_test(compile-unbound-sym ARGS compile ${here}/symbolic.kir --target sm_80 ${fake} -o ${art}/x.kiln RC 1
  ERR "^kiln: error: input 'x' has symbolic dimension 'B' \\(f32\\[B, 3\\]\\); artifacts need static shapes: give --sym B=N\n$")
kiln_cli_test(compile-unknown-sym ARGS compile ${here}/symbolic.kir --target sm_80 --sym B=2 --sym Q=1 ${fake} -o ${art}/x.kiln RC 1
  ERR "kiln: error: --sym Q: the model has no symbolic dimension 'Q'; its symbols: B\n$")
kiln_cli_test(compile-unknown-target ARGS compile ${here}/double.kir --target sm_80,sm_75 ${fake} -o ${art}/x.kiln RC 1
  ERR "^kiln: error: no backend builds target 'sm_75'; known targets: sm_80 \\(fake-gpu\\), sm_90a \\(fake-gpu\\), sm_100a \\(fake-gpu-next\\)\n$")
kiln_cli_test(compile-unknown-backend ARGS compile ${here}/double.kir --target sm_80 --backend fake-cpu RC 1
  ERR "^kiln: error: unknown backend 'fake-cpu'")
kiln_cli_test(compile-no-artifacts ARGS compile ${here}/double.kir --target cpu --backend reference -o ${art}/x.kiln RC 1
  ERR "^kiln: error: backend 'reference': this backend does not produce \\.kiln artifacts\n$")
kiln_cli_test(compile-no-target ARGS compile ${here}/double.kir ${fake} RC 1
  ERR "^kiln: error: compile: no targets; give --target")
kiln_cli_test(compile-duplicate-target ARGS compile ${here}/double.kir --target sm_80,sm_80 RC 2
  ERR "kiln: error: compile: target 'sm_80' given twice")
kiln_cli_test(compile-bad-sym ARGS compile ${here}/symbolic.kir --target sm_80 --sym B=x RC 2
  ERR "kiln: error: --sym expects NAME=VALUE with VALUE >= 0, got 'B=x'")
kiln_cli_test(compile-help ARGS compile --help RC 0 OUT "usage: kiln compile IN --target LIST.*--sym NAME=VALUE.*--pipeline FILE")

# The kernel cache: entries are <dir>/<2 hex>/<64 hex>.bin; anything else is left alone.
set(cache ${out}/kernel-cache)
set(entry_a ${cache}/ab/ab00000000000000000000000000000000000000000000000000000000000000.bin)
set(entry_b ${cache}/cd/cd00000000000000000000000000000000000000000000000000000000000000.bin)
file(SIZE ${here}/double.kir entry_size)
math(EXPR cache_bytes "2 * ${entry_size}")
add_test(NAME cli.cache-setup COMMAND sh -c
  "mkdir -p ${cache}/ab ${cache}/cd && cp ${here}/double.kir ${entry_a} && cp ${here}/double.kir ${entry_b} && cp ${here}/double.kir ${cache}/keep.txt")
set_tests_properties(cli.cache-setup PROPERTIES FIXTURES_SETUP kiln_cache)
kiln_cli_test(cache-info ARGS cache info --dir ${cache} RC 0 OUT "^dir: [^\n]*/kernel-cache\nentries: 2\nbytes: ${cache_bytes}\n$")
kiln_cli_test(cache-clear ARGS cache clear --dir ${cache} RC 0 OUT "^removed 2 entries \\(${cache_bytes} bytes\\) from [^\n]*/kernel-cache\n$")
kiln_cli_test(cache-info-cleared ARGS cache info --dir ${cache} RC 0 OUT "entries: 0\nbytes: 0\n$")
set_tests_properties(cli.cache-info cli.cache-clear cli.cache-info-cleared PROPERTIES FIXTURES_REQUIRED kiln_cache)
set_tests_properties(cli.cache-clear PROPERTIES DEPENDS cli.cache-info)
set_tests_properties(cli.cache-info-cleared PROPERTIES DEPENDS cli.cache-clear)
kiln_cli_test(cache-env ARGS cache info RC 0 OUT "^dir: [^\n]*/env-cache\nentries: 0\n")
set_tests_properties(cli.cache-env PROPERTIES ENVIRONMENT "KILN_CACHE_DIR=${out}/env-cache")
kiln_cli_test(cache-no-action ARGS cache RC 2 ERR "kiln: error: cache: expected 'info' or 'clear'")
kiln_cli_test(cache-bad-action ARGS cache purge RC 2 ERR "kiln: error: cache: unknown action 'purge' \\(expected info or clear\\)")

# Backend options that change what is compiled: validated, listed, in the canonical pipeline
# (logs and reproducers) and in the artifact's record. Given for cuda-sm90, they reach cuda-sm80
# too, which builds sm_80 and so leads the plan.
if(TARGET kiln-plugin-cuda-sm90)
  kiln_cli_test(plugins-cuda-options ARGS plugins RC 0
    OUT "cuda-sm90 +backend .*option int4-exact-zeros: bool = false  -- asymmetric INT4 weights dequantize as \\(q - zero\\)")
  kiln_cli_test(backend-option-bad-value ARGS opt ${here}/int4.kir --pipeline ${here}/int4_bad_option.toml RC 1
    ERR "^kiln: error: [^\n]*/int4_bad_option\\.toml:8:32: option 'int4-exact-zeros' for backend 'cuda-sm90' expects bool, got string \"yes\"\n$")
  kiln_cli_test(backend-option-canonical ARGS opt ${here}/int4.kir --pipeline ${here}/int4_exact.toml RC 0
    ERR "^pipeline: kir \\| \\| cuda-sm90{int4-exact-zeros=true}@sm_90a\n$")
  kiln_cli_test(compile-backend-option ARGS compile ${here}/int4.kir --pipeline ${here}/int4_exact.toml
                --target sm_80,sm_90a -o ${art}/int4-exact.kiln RC 0 OUT "sm_80: sm_80\\.cubin [0-9]+ bytes\n  sm_90a: sm_90a\\.cubin")
  set_tests_properties(cli.compile-backend-option PROPERTIES FIXTURES_SETUP kiln_int4_artifact)
  kiln_cli_test(inspect-backend-option ARGS inspect ${art}/int4-exact.kiln RC 0
    OUT "\npipeline: kir \\| \\| cuda-sm80{int4-exact-zeros=true}@sm_80,sm_90a\nplugins: kir@[0-9.]+,cuda-sm80@[0-9.]+,cuda-sm90@[0-9.]+\n")
  kiln_cli_test(inspect-json-backend-option ARGS inspect ${art}/int4-exact.kiln --json RC 0
    OUT "\"pipeline\": \"kir \\| \\| cuda-sm80{int4-exact-zeros=true}@sm_80,sm_90a\"")
  set_tests_properties(cli.inspect-backend-option cli.inspect-json-backend-option PROPERTIES FIXTURES_REQUIRED kiln_int4_artifact)
endif()
if(TARGET kiln-plugin-backend-cpu)
  kiln_cli_test(plugins-cpu-options ARGS plugins RC 0
    OUT "cpu +backend .*option threads: int = 0  -- [^\n]*\n +option winograd: bool = true  -- [^\n]*\n +option profile: bool = false  -- ")
endif()
