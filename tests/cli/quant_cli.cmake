# FP8 on the command line: kiln calibrate and kiln quant-report on the small GPT-2 model, and
# kiln compile refusing FP8 for sm_80 by name unless the graph may fall back.
set(gpt2 ${CMAKE_SOURCE_DIR}/tests/models/gpt2-small-dynamo)
set(fp8_passes "canonicalize,cse,quantize-fp8{scales=${out}/gpt2-scales.json}")
kiln_cli_test(calibrate ARGS calibrate ${gpt2}/model.onnx --passes ${fp8_passes} --inputs ${gpt2} -o ${out}/gpt2-scales.json
  RC 0 ERR "kiln: note: calibrate: 13 activations over 1 input sets")
kiln_cli_test(quant-report ARGS quant-report ${gpt2}/model.onnx --passes ${fp8_passes} --inputs ${gpt2} --floor 22.5 RC 0
  OUT "per layer \\(13\\):\n +[0-9.]+ dB  scaled_matmul %addmm\n.*end to end:\n +[0-9.]+ dB  output output  top-1 agreement [0-9.]+% \\([0-9]+/16\\)\n$")
kiln_cli_test(quant-report-floor ARGS quant-report ${gpt2}/model.onnx --passes ${fp8_passes} --inputs ${gpt2} --floor 40 RC 1
  ERR "kiln: error: quant-report: an end-to-end SQNR is below the floor of 40\\.00 dB")
set_tests_properties(cli.calibrate PROPERTIES FIXTURES_SETUP kiln_fp8_scales)
set_tests_properties(cli.quant-report cli.quant-report-floor PROPERTIES FIXTURES_REQUIRED kiln_fp8_scales)
kiln_cli_test(quant-report-no-pipeline ARGS quant-report ${gpt2}/model.onnx RC 2
  ERR "kiln: error: quant-report: give --pipeline FILE\\.toml or --passes LIST")
kiln_cli_test(quant-report-no-quant-pass ARGS quant-report ${gpt2}/model.onnx --passes cse RC 1
  ERR "kiln: error: the pipeline has no quantize-\\* or convert-\\* pass; nothing to compare")
kiln_cli_test(calibrate-no-inputs ARGS calibrate ${gpt2}/model.onnx -o ${out}/x.json RC 2
  ERR "kiln: error: calibrate: give exactly one of --inputs DIR and --random-inputs N")
kiln_cli_test(calibrate-bad-dir ARGS calibrate ${gpt2}/model.onnx --inputs ${out}/nope -o ${out}/x.json RC 1
  ERR "kiln: error: --inputs: '[^']*/nope' is not a folder")
kiln_cli_test(compile-fp8-sm80 ARGS compile ${here}/fp8.kir --target sm_80 -o ${out}/fp8-sm80.kiln RC 1
  ERR "cuda-sm80: target sm_80 has no FP8 tensor cores; scaled_matmul %y needs them \\(quantize with fallback=bf16")
kiln_cli_test(compile-fp8-fallback ARGS compile ${here}/fp8-fallback.kir --target sm_80,sm_90a -o ${out}/fp8-all.kiln RC 0
  OUT "compiled [^\n]*fp8-fallback\\.kir for sm_80, sm_90a")
kiln_cli_test(compile-fp8-order ARGS compile ${here}/fp8-fallback.kir --target sm_90a,sm_80 -o ${out}/fp8-order.kiln RC 1
  ERR "target sm_80 has no FP8 tensor cores, but the plan built for the targets before it uses FP8 GEMMs; list this target first")
kiln_cli_test(compile-fp8-sm90 ARGS compile ${here}/fp8.kir --target sm_90a,sm_100a -o ${out}/fp8-sm90.kiln RC 0
  OUT "compiled [^\n]*fp8\\.kir for sm_90a, sm_100a")
# The Llama-style model: end-to-end 22.6 dB on its saved input (GPT-2: 23.9 dB); the floor
# guards those numbers (random-weight models compound E4M3's ~29 dB per layer).
set(llama ${CMAKE_SOURCE_DIR}/tests/models/llama-small-dynamo)
set(llama_passes "canonicalize,cse,quantize-fp8{scales=${out}/llama-scales.json}")
kiln_cli_test(calibrate-llama ARGS calibrate ${llama}/model.onnx --passes ${llama_passes} --inputs ${llama} -o ${out}/llama-scales.json
  RC 0 ERR "kiln: note: calibrate: 13 activations over 1 input sets")
kiln_cli_test(quant-report-llama ARGS quant-report ${llama}/model.onnx --passes ${llama_passes} --inputs ${llama} --floor 21.5 RC 0
  OUT "per layer \\(19\\):.*scaled_matmul %linear_13\n.*end to end:\n +2[0-9]\\.[0-9]+ dB  output output  top-1 agreement")
set_tests_properties(cli.calibrate-llama PROPERTIES FIXTURES_SETUP kiln_fp8_llama_scales)
set_tests_properties(cli.quant-report-llama PROPERTIES FIXTURES_REQUIRED kiln_fp8_llama_scales)
# INT4 with bf16 activations: h200-int4.toml's quantizer options with min-size 0 (this small model's
# weights are all under the pipeline's 65536 elements) on the random-weight small Llama-style model.
# 14.5 dB end to end on its saved input: random weights compound group 128's ~17-20 dB per layer
# (trained models: bench/results/2026-12-03-quant-accuracy-trained.md); the floor guards that
# number. The lm_head stays in bf16 (keep-output-layers); convert-bf16 names its value output.bf16,
# which is matched with the fp32 output.
set(llama_legacy ${CMAKE_SOURCE_DIR}/tests/models/llama-small-legacy)
kiln_cli_test(quant-report-int4 ARGS quant-report ${llama_legacy}/model.onnx
  --passes "canonicalize,cse,convert-bf16,quantize-int4{keep-output-layers=true,min-size=0,scale-dtype=bf16,symmetric=false}"
  --sym batch=1 --sym seq=16 --inputs ${llama_legacy} --floor 13.5 RC 0
  OUT "contractions by op: matmul 7, matmul_int4 12\nper layer \\(19\\):.*matmul_int4 %/model/model/layers\\.1/mlp/up_proj/MatMul_output_0\n.* matmul %output\\.bf16\nend to end:\n +14\\.[0-9]+ dB  output output  top-1 agreement")
