"""The package's shape: no import circle between roundpipe's modules, no private name of one
module used by another, no private attribute of another object written (read from the source,
without importing it)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "roundpipe"


def _modules():
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = ast.parse(path.read_text(), filename=str(path))
    return mods


MODULES = _modules()


def _owner(name):
    """The roundpipe module that defines ``name`` (a dotted import target)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module, tree):
    """(target module, imported name or None, node) of every roundpipe import in ``tree``,
    wherever it is (lazy imports and TYPE_CHECKING blocks too)."""
    base = (
        module
        if module in MODULES
        and (PACKAGE / "/".join(module.split(".")[1:]) / "__init__.py").exists()
        else module.rpartition(".")[0]
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                source = ".".join(
                    base.split(".")[: len(base.split(".")) - node.level + 1]
                    + ([source] if source else [])
                )
            if not source.startswith("roundpipe"):
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:
                    yield full, None, node
                else:
                    yield _owner(source), alias.name, node
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("roundpipe"):
                    yield _owner(alias.name), None, node


def test_no_import_circle():
    edges = {
        m: {t for t, _, _ in _imports(m, tree) if t != m and not m.startswith(t + ".")}
        for m, tree in MODULES.items()
    }
    state, path, circles = {}, [], []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                circles.append(path[path.index(t) :] + [t])
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_no_private_name_crosses_a_module_boundary():
    found = []
    for m, tree in MODULES.items():
        module_aliases = {}
        for target, name, node in _imports(m, tree):
            if name is not None and name.startswith("_") and target != m:
                found.append(f"{m}: from {target} import {name}")
            if name is None and isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    module_aliases[alias.asname or alias.name] = target
            elif name is None:
                for alias in node.names:
                    module_aliases[alias.asname or alias.name.split(".")[0]] = target
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and module_aliases[node.value.id] != m
            ):
                found.append(f"{m}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, "\n".join(found)


def test_no_private_attribute_of_another_object_is_written():
    found = []
    for m, tree in MODULES.items():
        if m.startswith("roundpipe.testing"):
            continue  # the emulated device wraps torch's own objects
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if (
                        isinstance(sub, ast.Attribute)
                        and sub.attr.startswith("_")
                        and not sub.attr.startswith("__")
                        and not (
                            isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")
                        )
                    ):
                        found.append(f"{m}:{sub.lineno}: {ast.unparse(sub)} = ...")
    assert not found, "\n".join(found)


def test_the_checks_see_the_package():
    # The scans above would pass vacuously on an empty tree.
    assert {
        "roundpipe.plan.build",
        "roundpipe.runtime.executor",
        "roundpipe.devices.accelerator",
    } <= set(MODULES)
    assert any(
        t == "roundpipe.plan"
        for t, _, _ in _imports("roundpipe.runtime.call", MODULES["roundpipe.runtime.call"])
    )


def test_no_device_reaches_torch_accelerator():
    # torch.accelerator serves the process's one accelerator (an installed emulated device is
    # chosen before CUDA) and refuses a device of another type: roundpipe asks each device's own
    # module instead (roundpipe/devices/kind.py), so CUDA devices work beside the emulated one.
    calls = []
    for module, tree in MODULES.items():
        if module.startswith("roundpipe.testing"):
            continue  # the emulated device is the accelerator it registers
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "accelerator"
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "torch"
            ):
                calls.append(f"{module}:{node.lineno} torch.accelerator.{node.attr}")
    assert calls == []


# Modules that may register into another module at import, and why.
_REGISTERS_AT_IMPORT = {
    # The test harness: importing roundpipe.testing is how a test asks for the emulated device.
    "roundpipe.testing": "register_device_kind",
}


def test_no_module_registers_itself_elsewhere_at_import():
    """A behaviour of one module must not depend on whether another was imported: no module
    calls a ``register*`` function of another roundpipe module at import (a launch check, an
    optimizer hook, a device kind), except the listed ones."""
    found = []
    for m, tree in MODULES.items():
        imported = {
            alias.asname or alias.name.split(".")[0]
            for t, _, node in _imports(m, tree)
            for alias in node.names
            if t != m
        }
        for stmt in tree.body:
            for node in ast.walk(stmt) if not isinstance(stmt, _DEFS) else ():
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                root = func
                while isinstance(root, ast.Attribute):
                    root = root.value
                owner = getattr(root, "id", "")
                if not name.startswith("register") or owner not in imported:
                    continue
                if _REGISTERS_AT_IMPORT.get(m) != name:
                    found.append(f"{m}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert found == []


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def test_no_process_wide_optimizer_hook_outlives_a_step():
    """RoundPipe installs torch's global optimizer step pre-hook only while a step_fn runs."""
    import torch
    from torch import nn
    from torch.optim import optimizer as torch_optimizer

    from roundpipe import OptimizerCtx, RoundPipe, optim_thread

    before = dict(torch_optimizer._global_optimizer_pre_hooks)
    model = RoundPipe(nn.Linear(2, 2))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert dict(torch_optimizer._global_optimizer_pre_hooks) == before
    seen = []
    model.forward_backward(input_args=(torch.ones(2, 2),), loss_fn=lambda out, _: out.sum())
    model.step(lambda: (seen.append(len(torch_optimizer._global_optimizer_pre_hooks)), opt.step()))
    optim_thread.synchronize()
    assert seen == [len(before) + 1]
    assert dict(torch_optimizer._global_optimizer_pre_hooks) == before


def test_the_emulated_device_is_a_package_by_concern():
    """roundpipe.testing.emu: one module per concern, the public names where they were."""
    concerns = {"native", "memory", "streams", "kernels", "dispatch"}
    assert {f"roundpipe.testing.emu.{c}" for c in concerns} <= set(MODULES)
    assert "roundpipe.testing.emu" in MODULES  # the package's own module installs it
    tree = MODULES["roundpipe.testing.emu"]
    exported = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__"
    )
    assert {"EmuTensor", "install", "set_rules", "set_memory_capacity", "record_copies"} <= set(
        exported
    )


def test_memory_is_one_concern_findable_by_its_name():
    """'Will it fit' lives in roundpipe.memory (host terms, probes, tracing, the report, the
    checks); the pinned pools beside the devices; one typed device ledger (plan.memory's)
    for the lowering's budget and the reported peaks."""
    concern = {"host", "probe", "trace", "report", "checks"}
    assert {f"roundpipe.memory.{m}" for m in concern} <= set(MODULES)
    assert "roundpipe.devices.pinned" in MODULES
    gone = {
        "roundpipe.host_memory",
        "roundpipe.runtime.memory_plan",
        "roundpipe.runtime.memory_trace",
    }
    assert gone.isdisjoint(MODULES)
    assert "roundpipe.hf.plan" not in MODULES  # the memory CLI is named for what it is
    for name in ("HostMemoryError", "DeviceMemoryError", "HostTerms", "MemoryPlan"):
        owners = [
            m
            for m, tree in MODULES.items()
            for node in tree.body
            if isinstance(node, ast.ClassDef) and node.name == name
        ]
        assert owners and all(o.startswith("roundpipe.memory.") for o in owners), (name, owners)
    ledger_users = {
        m
        for m, tree in MODULES.items()
        for t, name, _ in _imports(m, tree)
        if t == "roundpipe.plan.memory" and name == "DeviceLedger"
    }
    assert "roundpipe.plan.build" in ledger_users


# The root of roundpipe/: the public faces and the small modules that every concern uses, each
# with what it holds. A new module goes into the folder of its concern; one that truly cuts
# across them is added here, with its reason.
_ROOT_MODULES = {
    "roundpipe": "the public face: re-exports only",
    "roundpipe.__main__": "python -m roundpipe: the self-check and the plan command",
    "roundpipe.optim_thread": "the optimizer thread's public face (launch, synchronize)",
    "roundpipe.autocast": "the caller's autocast state carried into the workers",
    "roundpipe.microbatch": "splitting a batch into microbatches, merging the outputs",
    "roundpipe.microbatch_context": "WithContext: the per-microbatch values every layer needs",
    "roundpipe.monitor": "TrainingMonitor, TrainingHistory",
    "roundpipe.layer_costs": "measure_layer_costs, the public timing of a model's layers",
    "roundpipe.main_thread": "check_main_thread (below the runtime, above threads and devices)",
    "roundpipe.step_check": "what a step function shares: above the scaler, below the runtime",
    "roundpipe.user_frame": "the stacklevel of a warning raised inside the library",
    "roundpipe.native_build": "building the C++ libraries: the emulated device's, the step's",
}


def test_the_root_holds_the_public_faces_and_cross_cutting_modules_only():
    root = {m for m in MODULES if m.count(".") <= 1 and not _is_package(m)} | {"roundpipe"}
    assert root == set(_ROOT_MODULES), (
        f"new at the root: {sorted(root - set(_ROOT_MODULES))}; "
        f"gone: {sorted(set(_ROOT_MODULES) - root)}"
    )


def _is_package(module):
    return (PACKAGE / "/".join(module.split(".")[1:]) / "__init__.py").exists()


def test_each_concern_is_a_folder_named_for_it():
    """Data parallelism, the scaler and the threads each read as one folder, one module per
    concern; the stage reducer is handed what it needs instead of importing DataParallel."""
    folders = {
        "roundpipe.distributed": {"group", "exchange", "buckets", "sharded", "data_parallel"},
        "roundpipe.scaler": {"grad_scaler", "rule", "finite_check", "host_copy"},
        "roundpipe.threads": {"workers", "optimizer_thread", "step_context"},
    }
    for package, modules in folders.items():
        assert {f"{package}.{m}" for m in modules} <= set(MODULES), package
    sharded = MODULES["roundpipe.distributed.sharded"]
    imported = {t for t, _, _ in _imports("roundpipe.distributed.sharded", sharded)}
    assert "roundpipe.distributed.data_parallel" not in imported
    # checkpoints use the byte exchange and the rank, not DataParallel
    for m in ("roundpipe.checkpoint.reader", "roundpipe.checkpoint.writer"):
        targets = {t for t, _, _ in _imports(m, MODULES[m])}
        assert "roundpipe.distributed.data_parallel" not in targets, m
        assert "roundpipe.distributed.exchange" in targets, m
    # the thin faces re-export; nothing is defined in the scaler's and threads' __init__
    for package in ("roundpipe.scaler", "roundpipe.threads"):
        body = [n for n in MODULES[package].body if not isinstance(n, ast.Expr)]
        assert body == [], package
