#!/usr/bin/env python3
"""kmoe's include layering (docs/ARCHITECTURE.md "Layers"): every `#include "..."` of the
framework goes to the same layer or one below it,

    core -> parallel -> io -> modules -> train -> drivers

(src/core, src/parallel, io, modules, train, drivers), the physics modules never include
the model assembly (modules/model sits on top of them), and no two module folders include each
other, directly or through others. Step code (src/parallel, modules, train) waits for the
device only through core/device_sync.hpp (host_sync, read_to_host), where each wait is named
and counted: no Kokkos::fence, execution-space fence or create_mirror_view_and_copy of its own.
A loop whose body counts in std::int64_t (a flat extent that can pass 2^32 elements) takes
flat_range() (core/kokkos_types.hpp), not Range, which counts in 32 bits on CUDA.

    check_layering.py ROOT            check the tree at ROOT; exit 1 listing every violation
    check_layering.py ROOT --planted  check that planted wrong includes are caught (a copy of
                                      ROOT's sources in a temporary directory)
"""
import os
import re
import shutil
import sys
import tempfile

# Layer of each folder, bottom first; an include may only go to the same rank or lower.
LAYERS = [("src/core", "core"), ("src/parallel", "parallel"), ("io", "io"),
          ("modules", "modules"), ("train", "train"), ("drivers", "drivers")]
RANK = {name: i for i, (_, name) in enumerate(LAYERS)}
# Include roots of the kmoe target (CMakeLists.txt): "core/x.hpp" is src/core/x.hpp,
# "io/x.hpp" is io/x.hpp.
ROOTS = ["src", "."]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SOURCES = (".hpp", ".cpp", ".h", ".cc")
STEP_CODE = ("src/parallel", "modules", "train")
HOST_WAIT = re.compile(r"Kokkos::fence\s*\(|\.fence\s*\(|create_mirror_view_and_copy\s*\(")
# deep_copy without an execution space as its first argument fences before and after the copy.
FENCING_COPY = re.compile(r"Kokkos::deep_copy\s*\((?!\s*ExecSpace\(\))")
NAMED = re.compile(r"\bmark_host_sync\s*\(")
# A Range (32-bit index on CUDA) whose lambda takes a 64-bit index.
NARROW_FLAT_LOOP = re.compile(
    r"(?<![\w:])Range\((?:[^()]|\([^()]*\))*\),\s*(?:KOKKOS_LAMBDA|\[[^\]]*\])\s*"
    r"\(\s*(?:const\s+)?std::int64_t")


def layer_of(rel):
    for folder, name in LAYERS:
        if rel == folder or rel.startswith(folder + "/"):
            return name
    return None


def module_of(rel):
    """modules/<name>/... -> <name>"""
    parts = rel.split("/")
    return parts[1] if parts[0] == "modules" and len(parts) > 2 else None


def resolve(root, src_rel, target):
    """The repository path an include names, or None outside the framework's folders."""
    candidates = [os.path.join(os.path.dirname(src_rel), target)]
    candidates += [os.path.normpath(os.path.join(r, target)) for r in ROOTS]
    for c in candidates:
        c = os.path.normpath(c)
        if os.path.isfile(os.path.join(root, c)) and layer_of(c):
            return c
    return None


def source_lines(root, folders):
    """(file relative to root, line number, text) of every source file below the folders."""
    for folder in folders:
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for f in sorted(files):
                if not f.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8") as fh:
                    for n, text in enumerate(fh, 1):
                        yield rel, n, text


def includes(root):
    """[(file, line, include text, resolved path)] over every framework source file."""
    out = []
    for rel, n, text in source_lines(root, [folder for folder, _ in LAYERS]):
        m = INCLUDE.match(text)
        if m:
            out.append((rel, n, m.group(1), resolve(root, rel, m.group(1))))
    return out


def module_cycles(edges):
    """Cycles in the module-folder graph {a: {b, ...}}, each as a list a -> ... -> a."""
    cycles, state, stack = [], {}, []

    def visit(a):
        state[a] = 1
        stack.append(a)
        for b in sorted(edges.get(a, ())):
            if state.get(b) == 1:
                cycles.append(stack[stack.index(b):] + [b])
            elif not state.get(b):
                visit(b)
        stack.pop()
        state[a] = 2

    for a in sorted(edges):
        if not state.get(a):
            visit(a)
    return cycles


def check(root):
    problems = []
    module_edges = {}
    order = " -> ".join(name for _, name in LAYERS)
    for rel, line, text, target in includes(root):
        if target is None:
            if layer_of(text.split("/")[0]) or text.split("/")[0] in RANK:
                problems.append(f"{rel}:{line}: #include \"{text}\" names no file of the tree")
            continue
        a, b = layer_of(rel), layer_of(target)
        if RANK[b] > RANK[a]:
            problems.append(f"{rel}:{line}: #include \"{text}\": {a} may not depend on {b} "
                            f"(layers: {order})")
        ma, mb = module_of(rel), module_of(target)
        if ma and mb and ma != mb:
            if mb == "model":
                problems.append(f"{rel}:{line}: #include \"{text}\": the module {ma} may not "
                                f"depend on the model assembly (modules/model)")
            module_edges.setdefault(ma, set()).add(mb)
    for cycle in module_cycles(module_edges):
        problems.append("modules include each other: " + " -> ".join(cycle))
    problems += host_waits(root)
    problems += narrow_flat_loops(root)
    return problems


def narrow_flat_loops(root):
    """Range loops whose lambda counts in std::int64_t: they must be flat_range loops."""
    out = []
    for folder, _ in LAYERS:
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in sorted(files):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                for m in NARROW_FLAT_LOOP.finditer(text):
                    line = text.count("\n", 0, m.start()) + 1
                    out.append(f"{os.path.relpath(path, root)}:{line}: Range(...) with a "
                               f"std::int64_t index: use flat_range() (core/kokkos_types.hpp); "
                               f"Range counts in 32 bits on CUDA")
    return out


def host_waits(root):
    """Unnamed host waits in step code: fences and mirror copies outside core/device_sync, and
    deep copies without an execution space (they fence) not named by a mark_host_sync on the
    line before."""
    out = []
    previous = {}
    for rel, n, text in source_lines(root, STEP_CODE):
        code = text.split("//")[0]
        m = HOST_WAIT.search(code)
        if m:
            out.append(f"{rel}:{n}: {m.group(0).strip()}...: step code waits for the device "
                       f"through core/device_sync.hpp (host_sync, read_to_host)")
        m = FENCING_COPY.search(code)
        if m and not NAMED.search(previous.get(rel, "")):
            out.append(f"{rel}:{n}: Kokkos::deep_copy(...) without an execution space fences: "
                       f"name the wait (mark_host_sync on the line before) or pass ExecSpace()")
        if code.strip():
            previous[rel] = code
    return out


def planted(root):
    """Wrong includes planted into a copy of the tree must each be reported."""
    plants = [
        ("src/core/error.hpp", '#include "train/trainer.hpp"', "core may not depend on train"),
        ("src/parallel/communicator.hpp", '#include "io/checkpoint.hpp"',
         "parallel may not depend on io"),
        ("io/checkpoint.cpp", '#include "modules/model/stage.hpp"', "io may not depend on modules"),
        ("modules/norm/rmsnorm.hpp", '#include "modules/model/block.hpp"',
         "may not depend on the model assembly"),
        ("modules/norm/rmsnorm.cpp", '#include "modules/attention/attention.hpp"',
         "modules include each other"),
        ("modules/norm/rmsnorm.cpp", "static void wait() { Kokkos::fence(); }",
         "through core/device_sync.hpp"),
        ("train/optimizer.cpp",
         "static void f(View1F v) { Kokkos::create_mirror_view_and_copy(HostSpace(), v); }",
         "through core/device_sync.hpp"),
        ("src/parallel/staged_comm.cpp",
         "static void g(View1F a, View1F b) { Kokkos::deep_copy(a, b); }",
         "without an execution space fences"),
        ("src/core/tensor_table.cpp",
         'static void z(float* x, std::int64_t n) { Kokkos::parallel_for("z", Range(0, n), '
         "KOKKOS_LAMBDA(std::int64_t i) { x[i] = 0; }); }", "use flat_range()"),
    ]
    ok = True
    with tempfile.TemporaryDirectory(prefix="kmoe-layer-") as tmp:
        for folder, _ in LAYERS:
            shutil.copytree(os.path.join(root, folder), os.path.join(tmp, folder))
        clean = check(tmp)
        if clean:
            print("FAIL the copied tree is not clean:\n  " + "\n  ".join(clean))
            return False
        print("ok   the copied tree is clean")
        for rel, text, expect in plants:
            path = os.path.join(tmp, rel)
            with open(path, encoding="utf-8") as f:
                original = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n" + original)
            found = [p for p in check(tmp) if expect in p and
                     (rel in p or "modules include each other" in p)]
            print(("ok   " if found else "FAIL ") + f"planted {text} in {rel}: " +
                  (found[0] if found else "not reported"))
            ok = ok and bool(found)
            with open(path, "w", encoding="utf-8") as f:
                f.write(original)
    return ok


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    if "--planted" in sys.argv[2:]:
        sys.exit(0 if planted(root) else 1)
    problems = check(root)
    for p in problems:
        print(p)
    n = len(includes(root))
    print(f"{n} includes and the step code's host waits checked, {len(problems)} problems")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
