# CLI tests of parallel runs, included by CMakeLists.txt: `kiln launch` (starting ranks,
# forwarding their output, stopping them when one fails) and `kiln run` of per-rank programs
# (whole inputs cut into pieces, outputs put back together; the reference backend runs every
# rank in one process, a cuda backend needs a launcher). No GPU needed.

# Each rank sees its own RANK and LOCAL_RANK, the world size and rank 0's address.
kiln_cli_test(launch-env ARGS launch -n 2 -- sh -c "echo rank $RANK of $WORLD_SIZE local $LOCAL_RANK at $MASTER_ADDR:$MASTER_PORT" RC 0
  OUT "(\\[rank 0\\] rank 0 of 2 local 0 at 127\\.0\\.0\\.1:[0-9]+\n.*\\[rank 1\\] rank 1 of 2 local 1 at|\\[rank 1\\] rank 1 of 2 local 1 at 127\\.0\\.0\\.1:[0-9]+\n.*\\[rank 0\\] rank 0 of 2 local 0 at)")
kiln_cli_test(launch-stderr ARGS launch -n 1 --master-port 29999 -- sh -c "echo to-err >&2 && printf partial" RC 0
  OUT "^\\[rank 0\\] partial\n$" ERR "^\\[rank 0\\] to-err\n$")
# `kiln` runs this binary: no PATH needed.
kiln_cli_test(launch-kiln ARGS launch -n 2 -- kiln --version RC 0 OUT "\\[rank 1\\] kiln 0\\.1\\.0")
# A failing rank stops the others (rank 0 would sleep a minute) and its status is launch's.
kiln_cli_test(launch-failure ARGS launch -n 3 --stop-after 1 -- sh -c "[ $RANK = 1 ] && exit 3 || exec sleep 60" RC 3
  ERR "kiln: error: launch: rank 1 exited with status 3; stopped the others \\(rank 0, 2\\)\n$")
kiln_cli_test(launch-signal ARGS launch -n 2 --stop-after 1 -- sh -c "[ $RANK = 0 ] && kill -9 $$ || exec sleep 60" RC 137
  ERR "launch: rank 0 was killed by signal 9 \\([^)]*\\); stopped the others \\(rank 1\\)")
kiln_cli_test(launch-missing-command ARGS launch -n 1 -- /nonexistent/command RC 127
  ERR "\\[rank 0\\] kiln: error: launch: cannot run '/nonexistent/command': No such file or directory\n.*rank 0 exited with status 127")
kiln_cli_test(launch-no-command ARGS launch -n 2 RC 2 ERR "kiln: error: launch: no command given after '--'")
kiln_cli_test(launch-no-n ARGS launch -- true RC 2 ERR "kiln: error: launch: give the number of ranks with -n N")
kiln_cli_test(launch-bad-n ARGS launch -n 0 -- true RC 2 ERR "launch: -n expects an integer from 1 to 1024, got '0'")
kiln_cli_test(launch-help-passes-through ARGS launch -n 1 -- kiln run --help RC 0 OUT "\\[rank 0\\] usage: kiln run")
set_tests_properties(cli.launch-failure cli.launch-signal PROPERTIES TIMEOUT 30)

# Per-rank programs on the reference backend: every rank in this process, whole inputs in,
# whole outputs out, bitwise the unsharded result (double.kir's expected output).
kiln_cli_test(run-per-rank-gather ARGS run ${here}/double_gather.kir --input x=@${here}/data/x.npy
              --output g=@${out}/double_gather.npy RC 0
  COMPARE ${out}/double_gather.npy ${here}/data/y_expected.npy)
kiln_cli_test(run-per-rank-sharded-output ARGS run ${here}/double_columns.kir --input x=@${here}/data/x.npy
              --output y=@${out}/double_columns.npy RC 0
  COMPARE ${out}/double_columns.npy ${here}/data/y_expected.npy)
kiln_cli_test(run-per-rank-mlp ARGS run ${here}/tp_mlp.kir --random-inputs RC 0 OUT "^y: f32\\[3, 4\\]\n\\[\\[")
kiln_cli_test(run-per-rank-wrong-input ARGS run ${here}/tp_mlp.kir --input x=@${here}/data/x.npy --random-inputs RC 1
  ERR "kiln: error: input 'x': got f32\\[2, 3\\], expected f32\\[3, 4\\]")
kiln_cli_test(run-per-rank-partial-input ARGS run ${here}/partial_input.kir --random-inputs RC 1
  ERR "kiln: error: backend 'reference': input 'x': placement <P\\(sum\\)> is partial: its whole value is a reduction of the ranks' pieces")
# A CUDA backend runs one rank per process: without a launcher a mesh of two says how to start it.
kiln_cli_test(run-per-rank-needs-launcher ARGS run ${here}/tp_mlp.kir --backend cuda-sm90 --random-inputs RC 1
  ERR "kiln: error: graph 'mlp' is a per-rank program for 2 ranks \\(mesh <tp = 2>\\): start one process per rank, e\\.g\\. `kiln launch -n 2 -- kiln run \\.\\.\\.`")
kiln_cli_test(run-per-rank-reference-under-launcher ARGS launch -n 2 -- kiln run ${here}/tp_mlp.kir --random-inputs RC 1
  ERR "\\[rank [01]\\] kiln: error: backend 'reference' runs every rank of mesh <tp = 2> in one process: run it without a launcher")
kiln_cli_test(run-per-rank-bad-backend ARGS run ${here}/tp_mlp.kir --backend null --random-inputs RC 1
  ERR "kiln: error: backend 'null' cannot run a per-rank program")

# The artifact of a per-rank program records its mesh and each input's placement.
set(mesh_art ${out}/per-rank)
file(MAKE_DIRECTORY ${mesh_art})
kiln_cli_test(compile-per-rank ARGS compile ${here}/tp_mlp.kir --target sm_90a -o ${mesh_art}/tp_mlp.kiln RC 0)
set_tests_properties(cli.compile-per-rank PROPERTIES FIXTURES_SETUP kiln_per_rank)
kiln_cli_test(inspect-per-rank ARGS inspect ${mesh_art}/tp_mlp.kiln RC 0
  OUT "\nmesh: tp:2 \\(2 ranks[^\n]*\ninputs:\n  x: f32\\[3, 4\\] R\n  w1: f32\\[4, 4\\] S\\(0\\)\n  w2: f32\\[4, 4\\] S\\(1\\)\noutputs:\n  y: f32\\[3, 4\\] R\nplan: steps [0-9]+ \\([^)]*1 collective")
kiln_cli_test(inspect-per-rank-json ARGS inspect ${mesh_art}/tp_mlp.kiln --json RC 0
  OUT "\"mesh\": \"tp:2\", \"inputs\": \\[{\"name\": \"x\", [^}]*\"placement\": \"R\"}")
set_tests_properties(cli.inspect-per-rank cli.inspect-per-rank-json PROPERTIES FIXTURES_REQUIRED kiln_per_rank)
