# CLI tests of parallel strategies in pipelines, included by CMakeLists.txt: the [parallel]
# section places its strategy among the passes (after the leading clean-up passes unless `after`
# says otherwise), the canonical one-line form names it like a pass, and each bad section is
# refused with its file:line:col.
kiln_cli_test(parallel-toml ARGS opt ${here}/double.kir --pipeline ${here}/parallel_ok.toml RC 0
  ERR "pipeline: kir \\| canonicalize,dce,tensor-parallel{mesh=\"tp=2\",min-size=4} \\|"
  OUT "^graph @double\\(%x: f32\\[2, 3\\]<R>\\) -> \\(f32\\[2, 3\\]<R>\\) mesh<tp = 2> per_rank {")
kiln_cli_test(parallel-one-line ARGS opt ${here}/double.kir --passes "cse,data-parallel{mesh=\"dp=2\"},dce" RC 0
  ERR "pipeline: kir \\| cse,data-parallel{mesh=\"dp=2\"},dce \\|"
  OUT "%x: f32\\[1, 3\\]<S\\(0\\)>")
kiln_cli_test(parallel-bad-mesh ARGS opt ${here}/double.kir --pipeline ${here}/parallel_bad_mesh.toml RC 1
  ERR "kiln: error: [^\n]*/parallel_bad_mesh\\.toml:5:12: mesh 'dp=two': size of axis 'dp' must be an integer, got 'two'")
kiln_cli_test(parallel-unknown ARGS opt ${here}/double.kir --pipeline ${here}/parallel_unknown.toml RC 1
  ERR "kiln: error: [^\n]*/parallel_unknown\\.toml:4:12: unknown parallel strategy 'tensr-parallel' \\(did you mean 'tensor-parallel'\\?\\); registered parallel strategies: auto, data-parallel, pipeline, tensor-parallel; a plugin may provide it")
kiln_cli_test(parallel-after-missing ARGS opt ${here}/double.kir --pipeline ${here}/parallel_after.toml RC 1
  ERR "kiln: error: [^\n]*/parallel_after\\.toml:6:9: \\[parallel\\] after = 'cse', which is not in 'passes'")
kiln_cli_test(parallel-mesh-twice ARGS opt ${here}/double.kir --pipeline ${here}/parallel_mesh_twice.toml RC 1
  ERR "kiln: error: [^\n]*/parallel_mesh_twice\\.toml:5:8: \\[parallel\\] gives the mesh twice: as 'mesh' and in 'options'")
kiln_cli_test(parallel-two-strategies ARGS opt ${here}/double.kir --passes "cse,tensor-parallel{mesh=\"tp=2\"},data-parallel" RC 1
  ERR "kiln: error: --passes: <pipeline>:1:34: a pipeline runs one parallel strategy; 'tensor-parallel' comes first")
kiln_cli_test(parallel-indivisible ARGS opt ${here}/double.kir --passes "data-parallel{mesh=\"dp=4\"}" RC 1
  ERR "data-parallel: the batch of input %x f32\\[2, 3\\] \\(dim 0, 2\\) does not split evenly over 4 ranks \\(mesh <dp = 4>\\): use a batch size that is a multiple of 4")
