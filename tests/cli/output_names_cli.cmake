# CLI tests of graph output names, included by CMakeLists.txt. data/rms-tail/model.onnx ends in a
# T5-style RMS norm followed by an Identity; its output is "y". canonicalize drops the Identity and
# the fusion passes put the norm into one fused node, so another value computes "y": the name must
# survive in `kiln opt`, `kiln run --output`, `kiln compile` and the artifact (`kiln inspect`, which
# reads what the runtime and the C API read).
set(rms ${here}/data/rms-tail)
set(cuda_pipeline ${CMAKE_SOURCE_DIR}/examples/pipelines/cuda-sm90.toml)

kiln_cli_test(output-name-opt ARGS opt ${rms}/model.onnx --pipeline ${cuda_pipeline} RC 0
  OUT "^graph @rms_tail\\(%x: f32\\[2, 3, 16\\]\\) -> \\(%y: f32\\[2, 3, 16\\]\\) {\n.*= fused\\(%x, %w\\)")
kiln_cli_test(output-name-unknown ARGS run ${rms}/model.onnx --pipeline ${cuda_pipeline} --backend reference
              --input x=@${rms}/input_x.npy --output scaled=@${out}/scaled.npy RC 1
  ERR "kiln: error: graph 'rms_tail' has no output 'scaled'; its outputs: y\n")

# `kiln run --output y=@FILE` after every pass of the CUDA pipeline, against the expected values.
add_test(NAME cli.output-name-run
  COMMAND ${KILN_MODEL_PYTHON} ${CMAKE_SOURCE_DIR}/tests/models/check_model.py $<TARGET_FILE:kiln> ${rms}
          --pipeline ${cuda_pipeline} --backend reference)

set(names_art ${out}/output-names)
file(MAKE_DIRECTORY ${names_art})
kiln_cli_test(output-name-compile ARGS compile ${rms}/model.onnx --pipeline ${cuda_pipeline}
              --target sm_80,sm_90a,sm_100a -o ${names_art}/rms-tail.kiln RC 0)
set_tests_properties(cli.output-name-compile PROPERTIES FIXTURES_SETUP kiln_output_names)
kiln_cli_test(output-name-inspect ARGS inspect ${names_art}/rms-tail.kiln RC 0
  OUT "\ninputs:\n  x: f32\\[2, 3, 16\\]\noutputs:\n  y: f32\\[2, 3, 16\\]\n")
kiln_cli_test(output-name-inspect-json ARGS inspect ${names_art}/rms-tail.kiln --json RC 0
  OUT "\"outputs\": \\[{\"name\": \"y\", ")
set_tests_properties(cli.output-name-inspect cli.output-name-inspect-json PROPERTIES FIXTURES_REQUIRED kiln_output_names)
