"""What the model checks read from an exported model folder (bench/models/export.py writes it):
the model, the `kiln run` arguments for its symbolic dims and saved inputs, and its outputs."""
import glob
import os


def sym_args(model_dir):
    """--sym NAME=SIZE for each line of dims.txt (symbolic dims the exporter left that Kiln's
    shape arithmetic needs at import)."""
    args = []
    dims_file = os.path.join(model_dir, "dims.txt")
    if os.path.exists(dims_file):
        for line in open(dims_file):
            if line.strip():
                args += ["--sym", line.strip()]
    return args


def input_args(model_dir):
    """--input NAME=@PATH for each saved input_NAME.npy (absolute paths)."""
    args = []
    for path in sorted(glob.glob(os.path.join(os.path.abspath(model_dir), "input_*.npy"))):
        name = os.path.basename(path)[len("input_"):-len(".npy")]
        args += ["--input", f"{name}=@{path}"]
    return args


def output_files(model_dir):
    """(NAME, path) of each saved output_NAME.npy, sorted by name."""
    return [(os.path.basename(p)[len("output_"):-len(".npy")], p)
            for p in sorted(glob.glob(os.path.join(model_dir, "output_*.npy")))]
