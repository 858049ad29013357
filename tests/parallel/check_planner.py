#!/usr/bin/env python3
"""The automatic parallelism planner (`kiln plan`, the `auto` strategy) on small graphs where the
best plan is known:

- tiny weights and a big batch: pure data parallelism (no communication, no weight to share);
- huge weights and a small batch: tensor parallelism (each rank reads 1/N of the weights;
  data parallelism would read them all on every rank);
- the memory objective: the smallest footprint of every candidate, the weights split N ways;
- a memory limit the data-parallel plan exceeds: the planner moves to tensor parallelism;
- a slow link (a probe file): communication is dear, data parallelism wins again;
- an impossible limit and bad options: clear errors, exit 1.

    check_planner.py KILN

The weights live in a sparse side file (only a tag per weight is written, so the constants
stay distinct for cse): planning never reads them.
"""
import json
import os
import subprocess
import sys
import tempfile

FAILURES = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def write_mlp(path, d, ff, dtype, batch="B"):
    """x[batch, d] -> linear(ff) -> relu -> linear(d): weights as constants in a sparse side file."""
    size = {"f32": 4, "bf16": 2}[dtype]
    side = os.path.basename(path) + ".bin"
    lines = [f"graph @mlp(%x: {dtype}[{batch}, {d}]) -> ({dtype}[{batch}, {d}]) {{"]
    offset, tags = 0, []
    for name, shape in (("w1", (ff, d)), ("w2", (d, ff))):
        lines.append(f'  %{name} = constant() {{value = dense<{dtype}[{shape[0]}, {shape[1]}]>(file "{side}", offset {offset})}}'
                     f" : {dtype}[{shape[0]}, {shape[1]}]")
        tags.append(offset)
        offset += shape[0] * shape[1] * size
        offset += (-offset) % 64
    lines += [f"  %h = linear(%x, %w1) : {dtype}[{batch}, {ff}]",
              f"  %a = relu(%h) : {dtype}[{batch}, {ff}]",
              f"  %y = linear(%a, %w2) : {dtype}[{batch}, {d}]",
              "  return %y", "}"]
    write_sparse(path, lines, tags, offset)
    return 2 * d * ff * size  # weight bytes


def write_sparse(path, lines, tags, size):
    """The .kir text, and its side file of `size` bytes holding only a tag at each offset."""
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(path + ".bin", "wb") as f:
        for i, t in enumerate(tags):
            f.seek(t)
            f.write(bytes([0, 0x3F, i + 1, 0x3F]))  # small nonzero values, different per weight
        f.truncate(size)


def write_lm(path, vocab, d, dtype):
    """ids[B, T] -> gather(wte) -> linear(wte): a language model that is all embedding, its table
    tied to the output projection; the table in a sparse side file."""
    side = os.path.basename(path) + ".bin"
    size = {"f32": 4, "bf16": 2}[dtype]
    lines = [f"graph @lm(%ids: i64[B, T]) -> ({dtype}[B, T, {vocab}]) {{",
             f'  %wte = constant() {{value = dense<{dtype}[{vocab}, {d}]>(file "{side}", offset 0)}} : {dtype}[{vocab}, {d}]',
             f"  %e = gather(%wte, %ids) {{axis = 0}} : {dtype}[B, T, {d}]",
             f"  %logits = linear(%e, %wte) : {dtype}[B, T, {vocab}]",
             "  return %logits", "}"]
    write_sparse(path, lines, [0], vocab * d * size)
    return vocab * d * size


def write_deep(path, layers, d, dtype):
    """x[B, d] through `layers` linear layers of [d, d] with relu between: deep enough for a
    pipeline of `layers` stages; weights in a sparse side file."""
    size = {"f32": 4, "bf16": 2}[dtype]
    side = os.path.basename(path) + ".bin"
    lines = [f"graph @deep(%x: {dtype}[B, {d}]) -> ({dtype}[B, {d}]) {{"]
    prev, tags, offset = "%x", [], 0
    for i in range(layers):
        lines.append(f'  %w{i} = constant() {{value = dense<{dtype}[{d}, {d}]>(file "{side}", offset {offset})}} : {dtype}[{d}, {d}]')
        lines.append(f"  %h{i} = linear({prev}, %w{i}) : {dtype}[B, {d}]")
        lines.append(f"  %a{i} = relu(%h{i}) : {dtype}[B, {d}]")
        tags.append(offset)
        offset += d * d * size
        prev = f"%a{i}"
    lines += [f"  return {prev}", "}"]
    write_sparse(path, lines, tags, offset)
    return offset


def plan(kiln, model, *args):
    proc = subprocess.run([kiln, "plan", model, "--json", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        return None, proc
    return json.loads(proc.stdout), proc


def main():
    kiln = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        small = os.path.join(tmp, "small.kir")
        write_mlp(small, 64, 256, "f32")
        big = os.path.join(tmp, "big.kir")
        weights = write_mlp(big, 8192, 32768, "bf16")

        p, proc = plan(kiln, small, "--devices", "8", "--sym", "B=65536")
        check(p is not None and p["chosen"]["dp"] == 8 and p["chosen"]["tp"] == 1,
              f"tiny weights, batch 65536, 8 devices: data parallel (chose {p and p['chosen']['strategy']})")
        if p:
            check(p["chosen"]["comm_s"] == 0, "data parallel needs no communication")
            check(len(p["candidates"]) >= 4, f"every mesh of 8 was costed ({len(p['candidates'])} candidates)")

        p, proc = plan(kiln, big, "--devices", "8", "--sym", "B=8")
        check(p is not None and p["chosen"]["tp"] == 8,
              f"1 GiB of weights, batch 8, 8 devices: tensor parallel (chose {p and p['chosen']['strategy']})")
        if p:
            dp = [c for c in p["candidates"] if c["tp"] == 1]
            check(len(dp) == 1 and dp[0]["step_s"] > p["chosen"]["step_s"],
                  "data parallelism was costed and is slower")
            check(p["chosen"]["collectives"].get("all_reduce", 0) >= 1, "tensor parallel all-reduces the row-parallel sum")

        p, proc = plan(kiln, big, "--devices", "8", "--sym", "B=1")
        check(p is not None and p["chosen"]["tp"] == 8, "batch 1: tensor parallel")
        if p:
            check(all(c["dp"] == 1 for c in p["candidates"]) and p["rejected"],
                  "a batch of 1 is not split over dp (those candidates are refused)")

        p, proc = plan(kiln, big, "--devices", "8", "--sym", "B=8", "--objective", "memory")
        if p:
            least = min(c["memory_bytes"] for c in p["candidates"])
            check(p["chosen"]["memory_bytes"] == least, "memory objective: the smallest footprint of every candidate")
            check(p["chosen"]["weight_bytes"] == weights // 8,
                  f"memory objective: weights split 8 ways ({p['chosen']['weight_bytes']} of {weights} bytes)")
        else:
            check(False, "memory objective planned: " + proc.stderr)

        # Vocab-parallel embeddings: a 64 MiB table tied to the output projection is split by rows
        # on every rank (8 ranks: 1/8 of it each, not a whole copy for the lookup), and the lookup
        # is costed for the rows it reads, not the whole table.
        lm = os.path.join(tmp, "lm.kir")
        table = write_lm(lm, 32768, 1024, "bf16")
        p, proc = plan(kiln, lm, "--devices", "8", "--sym", "B=4", "--sym", "T=128", "--objective", "memory")
        if p:
            c = p["chosen"]
            # beside the blocks: this rank's first vocabulary row and a few scalars (< 64 bytes)
            check(c["tp"] == 8 and table // 8 <= c["weight_bytes"] < table // 8 + 64,
                  f"vocab parallel: 8 ranks keep {c['weight_bytes']} bytes of the {table}-byte table")
        else:
            check(False, "vocab-parallel plan: " + proc.stderr)
        p, proc = plan(kiln, lm, "--devices", "1", "--sym", "B=4", "--sym", "T=128")
        if p:
            lookup_bytes = 4 * 128 * (8 + 2 * 1024 * 2)  # ids read, rows read, rows written
            head_s = max(2 * 4 * 128 * 1024 * 32768 / 800e12, (4 * 128 * 1024 + table + 4 * 128 * 32768) * 2 / 4.27e12)
            want = lookup_bytes / 4.27e12 + head_s
            check(abs(p["chosen"]["compute_s"] - want) < 1e-6 * want,
                  f"one device: lookup and head {p['chosen']['compute_s']:.6g} s, by hand {want:.6g} s")

        # Pipeline stages: 8 layers of 32 MiB on 8 devices over a slow link, under a memory limit
        # that rules out a whole copy per rank. Tensor parallelism all-reduces the whole batch's
        # activations after every second layer; the pipeline sends one microbatch's activation
        # per stage boundary, so it wins; each rank keeps one layer.
        deep = os.path.join(tmp, "deep.kir")
        deep_weights = write_deep(deep, 8, 4096, "bf16")
        slow = os.path.join(tmp, "slow-link.toml")
        with open(slow, "w") as f:
            f.write("[link]\nmeasured = true\nbandwidth = 1e9\nlatency = 1e-5\n")
        p, proc = plan(kiln, deep, "--devices", "8", "--sym", "B=4096", "--probe", slow, "--memory-limit", "100MiB")
        if p:
            c = p["chosen"]
            check(c["pp"] == 8 and c["strategy"] == 'pipeline{mesh="pp=8"}',
                  f"deep model, slow link, 100 MiB a rank: pipeline stages (chose {c['strategy']})")
            check(c["weight_bytes"] == deep_weights // 8, f"pipeline: one layer of weights per rank ({c['weight_bytes']} bytes)")
            check(c["collectives"] == {"send": 7 * 8}, f"pipeline: 7 boundaries x 8 microbatches of sends ({c['collectives']})")
            # GPipe: 15 slots of the slowest stage, each a layer of 512 rows plus its 4 MiB send.
            layer = max(2 * 512 * 4096 * 4096 / 800e12, 2 * (512 * 4096 * 2 + 4096 * 4096 + 512 * 4096) / 4.27e12)
            relu = 2 * 2 * 512 * 4096 / 4.27e12
            send = 512 * 4096 * 2 / 1e9 + 1e-5
            want = 15 * (layer + relu + send)
            check(abs(c["step_s"] - want) < 1e-6 * want, f"pipeline step {c['step_s']:.6g} s, by hand {want:.6g} s")
        else:
            check(False, "deep plan: " + proc.stderr)
        p, proc = plan(kiln, small, "--devices", "8", "--sym", "B=64")
        check(p is not None and any(r.startswith('pipeline{mesh="pp=8"}') and "places to cut" in r for r in p["rejected"]),
              "a 2-layer model has too few cut points for 8 stages: the pipeline is refused, saying why")

        # A big batch makes tensor parallelism's all-reduces dear: data parallel wins, until a
        # memory limit below the whole weights rules it out.
        p, proc = plan(kiln, big, "--devices", "8", "--sym", "B=16384")
        check(p is not None and p["chosen"]["tp"] == 1, f"batch 16384: data parallel (chose {p and p['chosen']['strategy']})")
        p, proc = plan(kiln, big, "--devices", "8", "--sym", "B=16384", "--memory-limit", "1GiB")
        check(p is not None and p["chosen"]["tp"] > 1 and p["chosen"]["memory_bytes"] <= 2**30 and p["over_limit"] >= 1,
              f"batch 16384 under 1 GiB a rank: weights split (chose {p and p['chosen']['strategy']})")

        probe = os.path.join(tmp, "slow.toml")
        with open(probe, "w") as f:
            f.write("[device]\nname = \"test\"\n[link]\nmeasured = true\nbandwidth = 1e6\nlatency = 1e-3\n")
        p, proc = plan(kiln, big, "--devices", "8", "--sym", "B=8", "--probe", probe)
        check(p is not None and p["chosen"]["tp"] == 1 and p["link_measured"],
              f"a 1 MB/s link (probe): data parallel (chose {p and p['chosen']['strategy']})")

        # The cost model's arithmetic, by hand, with round rates: on one device each op takes
        # max(FLOPs / rate, bytes / bandwidth); tp=2's one all-reduce of y takes
        # 2(p-1)/p * bytes / bw + 2(p-1) * latency; the activation peak is h and relu(h) together.
        exact = os.path.join(tmp, "exact.toml")
        with open(exact, "w") as f:
            f.write("[matmul]\nf32 = 1e12\n[memory]\nbandwidth = 1e11\n[link]\nmeasured = true\n"
                    "bandwidth = 1e9\nlatency = 1e-5\n")
        b, d, ff = 4096, 64, 256
        linear1 = max(2 * b * d * ff / 1e12, 4 * (b * d + ff * d + b * ff) / 1e11)
        relu = max(b * ff / 1e12, 4 * 2 * b * ff / 1e11)
        linear2 = max(2 * b * ff * d / 1e12, 4 * (b * ff + d * ff + b * d) / 1e11)
        p, proc = plan(kiln, small, "--devices", "1", "--sym", f"B={b}", "--probe", exact)
        if p:
            c = p["chosen"]
            check(abs(c["compute_s"] - (linear1 + relu + linear2)) < 1e-9 * c["compute_s"] + 1e-15,
                  f"one device: compute {c['compute_s']:.6g} s, by hand {linear1 + relu + linear2:.6g} s")
            check(c["weight_bytes"] == 4 * 2 * d * ff, f"one device: weights {c['weight_bytes']} bytes")
            check(c["activation_bytes"] == 4 * 2 * b * ff, f"one device: activation peak {c['activation_bytes']} bytes")
        else:
            check(False, "one-device plan: " + proc.stderr)
        p, proc = plan(kiln, small, "--devices", "2", "--sym", f"B={b}", "--probe", exact)
        tp2 = [c for c in (p or {}).get("candidates", []) if c["tp"] == 2 and not c["sequence_parallel"]]
        want = 2 * (1 / 2) * 4 * b * d / 1e9 + 2 * 1e-5
        check(len(tp2) == 1 and tp2[0]["collectives"] == {"all_reduce": 1} and abs(tp2[0]["comm_s"] - want) < 1e-9 * want,
              f"tp=2: one all-reduce of y costed {tp2 and tp2[0]['comm_s']:.6g} s, by hand {want:.6g} s")

        p, proc = plan(kiln, big, "--devices", "8", "--sym", "B=8", "--memory-limit", "1MiB")
        check(p is None and proc.returncode == 1 and "no plan fits memory-limit 1 MiB" in proc.stderr
              and "smallest footprint found" in proc.stderr, "impossible limit: " + proc.stderr.strip())

        for args, want in ((["--objective", "speed"], "objective must be"),
                           (["--device", "a100"], "unknown device 'a100'"),
                           (["--memory-limit", "lots"], "memory size 'lots'"),
                           (["--probe", os.path.join(tmp, "none.toml")], "probe")):
            p, proc = plan(kiln, small, "--devices", "2", *args)
            check(p is None and proc.returncode == 1 and want in proc.stderr,
                  f"{' '.join(args)}: exit {proc.returncode}, {proc.stderr.strip()}")
        p, proc = plan(kiln, small, "--sym", "B=8")
        check(proc.returncode == 2 and "--devices" in proc.stderr, "no --devices: usage error")

        text = subprocess.run([kiln, "plan", big, "--devices", "4", "--sym", "B=8"], capture_output=True, text=True)
        check(text.returncode == 0 and "chosen: mesh tp=4" in text.stdout and "predicted step time" in text.stdout
              and "predicted memory per rank" in text.stdout and "candidates, best first" in text.stdout,
              "the text plan names the mesh, the predictions and the runners-up")

        # 3 devices: B=64 and 256 hidden units do not split 3 ways; the plan says it split nothing.
        p, proc = plan(kiln, small, "--devices", "3", "--sym", "B=64")
        check(p is not None and p["chosen"]["splits_nothing"] and not any(c["dp"] == 3 for c in p["candidates"]),
              "3 devices for a model that does not divide by 3: marked as splitting nothing")
        p, proc = plan(kiln, small, "--devices", "2", "--sym", "B=64")
        check(p is not None and not any(c["splits_nothing"] for c in p["candidates"]), "2 devices: every candidate splits")

        # An artifact records the strategy and its version, like every pass (no GPU needed).
        art = os.path.join(tmp, "small.kiln")
        p = subprocess.run([kiln, "compile", small, "--passes", "canonicalize,cse,auto{devices=2,print-plan=false}",
                            "--target", "sm_90a", "--sym", "B=8", "-o", art], capture_output=True, text=True)
        q = subprocess.run([kiln, "inspect", art], capture_output=True, text=True)
        check(p.returncode == 0 and "auto@0.1.0" in q.stdout and "mesh: dp:2" in q.stdout,
              "kiln compile with auto: the artifact names auto@0.1.0 and the chosen mesh: " +
              (p.stderr.strip()[-300:] + q.stdout[:400]))
    print("PASS" if not FAILURES else f"FAIL ({len(FAILURES)})")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
