"""The `kiln` command of an installed wheel: runs the kiln binary the wheel holds."""
import os
import sys


def main() -> None:
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "kiln")
    if not os.path.exists(exe):
        sys.exit(f"kiln: error: no kiln binary at {exe} (a build tree has it in build/bin)")
    os.execv(exe, [exe] + sys.argv[1:])
