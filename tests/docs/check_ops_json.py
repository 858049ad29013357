#!/usr/bin/env python3
"""Checks `kiln ops --json`: it parses, every op is complete, and known ops read as declared.

usage: check_ops_json.py KILN [PLUGIN_OP LIBRARY_SUBSTRING]
With the optional pair, PLUGIN_OP must be listed with a library path containing the substring.
"""
import json
import subprocess
import sys


def fail(message):
    print(f"check_ops_json: {message}", file=sys.stderr)
    sys.exit(1)


def main():
    kiln = sys.argv[1]
    run = subprocess.run([kiln, "ops", "--json"], capture_output=True, text=True)
    if run.returncode != 0:
        fail(f"kiln ops --json exited {run.returncode}: {run.stderr}")
    try:
        doc = json.loads(run.stdout)
    except json.JSONDecodeError as e:
        fail(f"kiln ops --json is not JSON: {e}")
    ops = {op["name"]: op for op in doc["ops"]}
    if len(ops) != len(doc["ops"]):
        fail("an op is listed twice")
    if [op["name"] for op in doc["ops"]] != sorted(ops):
        fail("ops are not sorted by name")
    for op in doc["ops"]:
        for key in ("summary", "result_rule", "library"):
            if not op.get(key):
                fail(f"op '{op['name']}' has no {key}")

    # A reduction: operand x, result y, two attributes with their kinds and defaults.
    r = ops.get("reduce_sum") or fail("reduce_sum is not listed")
    if r["library"] != "core" or r["num_results"] != 1 or "reduction" not in r["traits"]:
        fail(f"reduce_sum reads wrong: {r}")
    if r["operands"] != [{"name": "x", "optional": False, "variadic": False}]:
        fail(f"reduce_sum operands: {r['operands']}")
    attrs = {a["name"]: a for a in r["attributes"]}
    if attrs.get("keepdims") != {"name": "keepdims", "kind": "int", "required": False, "default": 1,
                                 "doc": attrs.get("keepdims", {}).get("doc")}:
        fail(f"reduce_sum keepdims: {attrs.get('keepdims')}")
    if attrs.get("axes", {}).get("kind") != "int list" or attrs["axes"]["default"] is not None:
        fail(f"reduce_sum axes: {attrs.get('axes')}")
    # Marks on operands and results, a required attribute, a variadic result.
    lin = ops["linear"]
    if [o["optional"] for o in lin["operands"]] != [False, False, True]:
        fail(f"linear operands: {lin['operands']}")
    cast_to = next(a for a in ops["cast"]["attributes"] if a["name"] == "to")
    if not cast_to["required"] or cast_to["kind"] != "dtype":
        fail(f"cast's 'to': {cast_to}")
    split = ops["split"]
    if split["num_results"] is not None or not split["results"][0]["variadic"]:
        fail(f"split results: {split['results']}, {split['num_results']}")
    if ops["fused"]["regions"] != 1:
        fail("fused should hold one region")

    if len(sys.argv) > 3:
        name, lib = sys.argv[2], sys.argv[3]
        op = ops.get(name) or fail(f"plugin op '{name}' is not listed")
        if lib not in op["library"]:
            fail(f"op '{name}' is attributed to '{op['library']}', expected a path containing '{lib}'")
    print(f"kiln ops --json: {len(ops)} ops, ok")


main()
