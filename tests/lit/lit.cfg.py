# lit configuration for Kiln's text-IR tests (loaded through the generated lit.site.cfg.py).
import os

import lit.formats

config.name = "Kiln"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".kir", ".test"]  # .test: RUN lines over files kept elsewhere
config.excludes = ["Inputs"]
config.test_source_root = os.path.dirname(os.path.abspath(__file__))
config.test_exec_root = os.path.join(config.kiln_binary_dir, "tests", "lit")

# Tool names are replaced only as whole words, so "not" inside a path or a flag stays.
def tool(name, path):
    config.substitutions.append((r"(?<![\w/.-])" + name + r"(?![\w/.-])", path))

config.substitutions.append(("%kiln", os.path.join(config.kiln_binary_dir, "bin", "kiln")))
config.substitutions.append(("%examples", os.path.join(config.kiln_source_dir, "examples")))
tool("FileCheck", config.kiln_filecheck)
tool("not", config.kiln_not)

# Plugins come from the build tree only (next to bin/kiln), never from the caller's setup.
config.environment.pop("KILN_PLUGIN_PATH", None)
