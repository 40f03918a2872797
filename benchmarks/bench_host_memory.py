"""Host RAM: the memory plan's host terms against what a training process holds.

Each case runs in a fresh process (``--child``): a transformers causal LM of about 30M
parameters built from a config (bf16), wrapped by ``roundpipe.hf.wrap`` on the emulated
accelerator (``devices="emu"``, fp32 masters), ``roundpipe.optim.AdamW`` built on its masters,
then ``--steps`` iterations of the documented loop (``forward_backward``, ``model.step(lambda:
(opt.step(), opt.zero_grad()))``, no wait between them), then ``model.synchronize()``. Measured
against the state before the wrap, each time after ``gc.collect()`` and glibc's
``malloc_trim(0)``:

* RSS growth: VmRSS after, less VmRSS before (the issue's measure); peak: VmHWM less VmRSS
  before; with ``--step held``, also the RSS growth at the moment the step is let go, after
  ``malloc_trim(0)``: both sets of gradients are alive then, the moment the plan is for (the
  RSS after the run misses the gradients a sharded rank copied out of the pinned downloads:
  its last ``zero_grad`` gave them back), held to the plan less the emulator's snapshots of
  the copies in flight (``emu.copies_in_flight_bytes()``: the downloads' sources, which are
  device memory on a GPU);
* malloc in use: glibc's ``mallinfo2`` (``uordblks + hblkhd``) growth: what is allocated and
  not freed, without the free memory the allocator keeps;
* the storages roundpipe holds, walked: the masters, their gradients, the optimizer's state,
  the pinned pool beyond the weights it replaced, the freed pinned blocks kept for reuse
  (CUDA's caching host allocator keeps them too; the emulated one counts them), the
  data-parallel buffers, the emulated devices' live bytes;
* the freed memory glibc keeps in the arenas of the threads that compute on the emulated
  device (its worker and autograd's device thread): on a GPU that memory is device memory,
  so it is the emulator's, as the emulated devices' live bytes are.

The plan is ``model.memory_plan(input_kwargs=batch)`` made after the wrap (and, on a
data-parallel rank, after ``DataParallel``), before the first iteration; its
``new_bytes`` (what the wrap and training add to the host) is what the RSS growth is held to.
``--dp SHAPE`` also runs two ranks (gloo over 127.0.0.1, one process each), replicated and with
``state_placement=ShardedState()``.

``--step held`` (the default) holds each step until the next call downloaded its first stage's
gradient sums (its last), as a step slower than the next iteration's forward and backward does,
which is the rule for models of billions of parameters: the asynchronous step's gradients and
the next call's are then alive at once, as the plan counts them (see [Note: the next call's
gradients] in roundpipe/memory/host.py). ``--step free`` runs the loop as it is: at these
sizes the step ends before the next call's first download, and the pool reuses one set.
``--mmap-threshold BYTES`` runs the cases with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed: the
emulated device's memory is the host heap here, and with the dynamic threshold each thread's
arena keeps the blocks its device work freed, which a GPU's memory would not put on the host.

    python benchmarks/bench_host_memory.py [--shapes llama,qwen3,qwen3_moe] [--dp llama]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# About 30M parameters each (per-parameter terms dominate the fixed costs), the embedding and
# head untied, as most checkpoints of these sizes are.
SHAPES = {
    "llama": dict(
        model_type="llama",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=16000,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=16000,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        hidden_size=384,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=16000,
    ),
}
BATCH, SEQ, NUM_MICROBATCH = 2, 64, 2


# -- what the process holds -------------------------------------------------------------------


_libc = ctypes.CDLL("libc.so.6")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


_libc.mallinfo2.restype = _MallInfo2
_libc.malloc.restype = ctypes.c_void_p
_libc.free.argtypes = [ctypes.c_void_p]
_libc.fopen.restype = ctypes.c_void_p
_libc.fclose.argtypes = [ctypes.c_void_p]
_libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]


def _settle():
    """Free what can be freed and hand the heap's free pages back to the OS: the emulator's
    buffers of settled copies (``pinned_memory_stats`` lets them go), garbage, glibc's free
    memory (``malloc_trim(0)``: the main heap's top and every free chunk's whole pages)."""
    from roundpipe.testing import emu

    emu.pinned_memory_stats()
    gc.collect()
    _libc.malloc_trim(0)


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _in_use():
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


# [glibc arenas] A thread allocates from an arena of its own (up to 8 per core); a non-main
# arena is a chain of 64 MiB-aligned heaps whose first word (heap_info.ar_ptr) names the arena,
# and malloc_trim cannot shrink such a heap below its top chunk, so memory a thread freed can
# stay resident there. To attribute it: the arena a thread allocates from (a malloc on that
# thread), each arena's resident heap bytes (/proc/self/smaps), and its bytes in use
# (malloc_info's heaps, in the order of glibc's arena list, which is walked from an arena by
# its ``next`` field). glibc-specific; the walk is checked (it must come back to where it
# started through the main arena), and everything reports None where a check fails.
_HEAP_MAX = 64 << 20


def _word(address):
    """The 8-byte word at ``address``, read through /proc/self/mem: a heap another thread
    unmaps meanwhile raises OSError instead of ending the process."""
    with open("/proc/self/mem", "rb", buffering=0) as mem:
        data = os.pread(mem.fileno(), 8, address)
    if len(data) != 8:
        raise OSError(f"no word at {address:#x}")
    return int.from_bytes(data, sys.byteorder)


def arena_of_this_thread():
    """The arena (address of its malloc_state) this thread allocates from; 0: the main one."""
    p = _libc.malloc(64)
    _libc.free(p)
    heap = p & ~(_HEAP_MAX - 1)
    for start, end, name, _, _ in _maps():
        if name == "[heap]" and start <= p < end:
            return 0
    return _word(heap)


def _maps():
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$", line)
            if m:
                cur = [int(m.group(1), 16), int(m.group(2), 16), m.group(4).strip(), 0, m.group(3)]
                out.append(cur)
            elif line.startswith("Rss:") and cur is not None:
                cur[3] = int(line.split()[1]) * 1024
    return out


def _malloc_info_heaps():
    """malloc_info's heaps in list order: (system bytes, free bytes) each."""
    path = f"/tmp/roundpipe_malloc_info_{os.getpid()}.xml"
    fp = _libc.fopen(path.encode(), b"w")
    _libc.malloc_info(0, fp)
    _libc.fclose(fp)
    xml = Path(path).read_text()
    os.unlink(path)
    heaps = []
    for body in re.findall(r'<heap nr="\d+">(.*?)</heap>', xml, re.S):
        system = int(re.search(r'<system type="current" size="(\d+)"', body).group(1))
        free = sum(
            int(s)
            for s in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', body)
        )
        heaps.append((system, free))
    return heaps


def _arena_list(start):
    """glibc's arena list from arena ``start`` (main arena included, as malloc_info orders it:
    main first), found by the offset of ``next`` in malloc_state; None if no offset checks."""
    for offset in (2160, 2152, 2168, 2144):  # x86_64 glibc 2.26+: 2160
        seen, a = [], start
        try:
            for _ in range(256):
                seen.append(a)
                a = _word(a + offset)
                if a == start:
                    break
            else:
                continue
        except (ValueError, OSError):
            continue
        mains = [x for x in seen if x % _HEAP_MAX != 0x30]
        if len(mains) == 1:  # exactly one arena outside the 64 MiB heaps: libc's main_arena
            i = seen.index(mains[0])
            return seen[i:] + seen[:i]
    return None


def arena_bytes(arenas):
    """For each arena in ``arenas`` (from :func:`arena_of_this_thread`, 0 the main one):
    (resident bytes of its heaps, bytes in use); None where glibc's structures do not check."""
    resident: dict[int, int] = {}
    for start, _, name, rss, perms in _maps():
        if name == "[heap]":
            resident[0] = resident.get(0, 0) + rss
        elif name == "" and start % _HEAP_MAX == 0 and perms.startswith("rw"):
            try:
                ar = _word(start)
            except OSError:  # unmapped since /proc/self/smaps was read
                continue
            resident[ar] = resident.get(ar, 0) + rss
    some = next((a for a in arenas if a), None)
    order = _arena_list(some) if some else None
    heaps = _malloc_info_heaps()
    out = {}
    for a in arenas:
        in_use = None
        if a == 0:
            in_use = heaps[0][0] - heaps[0][1]
        elif order is not None and a in order and len(order) == len(heaps):
            system, free = heaps[order.index(a)]
            in_use = system - free
        out[a] = (resident.get(a, 0), in_use)
    return out


# The threads that compute on the emulated device: its worker, autograd's device thread.
EMULATOR_THREADS = ("roundpipe-worker", "Dummy")


def _storage_bytes(tensors):
    seen = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


# -- one case, in a fresh process ---------------------------------------------------------------


def child(case):
    import threading

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import roundpipe
    from roundpipe import OptimizerCtx, RoundPipeRunConfig
    from roundpipe import distributed as rpd
    from roundpipe.testing import emu

    emu.install()
    ranks = case.get("ranks", 1)
    if ranks > 1:
        rpd.init_process_group("gloo", timeout=600)
    spec = dict(SHAPES[case["shape"]])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    numel = sum(p.numel() for p in hf.parameters())
    weights = _storage_bytes(list(hf.parameters()) + list(hf.buffers()))
    ids = torch.randint(
        0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )
    batch = {"input_ids": ids, "labels": ids}

    # Which arena each thread allocates from: the emulated device's worker runs the stages'
    # forward, autograd's device thread their backward (see [glibc arenas]).
    roles: dict[str, int] = {}
    layer = hf.model.layers[0]

    def note(args):
        roles.setdefault(threading.current_thread().name, arena_of_this_thread())

    def pre_hook(module, args):
        note(args)
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(lambda g: note(None))

    hook = layer.register_forward_pre_hook(pre_hook)

    _settle()
    rss0, in_use0 = _status("VmRSS"), _in_use()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts here
    model = roundpipe.hf.wrap(
        hf,
        optim_dtype=torch.float32,
        devices="emu",
        model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH),
        state_placement=rpd.ShardedState() if case.get("sharded") else None,
    )
    dp = rpd.DataParallel(model) if ranks > 1 else None
    plan = model.memory_plan(input_kwargs=batch)
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-4)
    _settle()
    wrapped_peak = _status("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts: the iterations' own peak
    downloaded = threading.Event()
    if case.get("held"):
        from roundpipe.runtime.grad_router import CallGrads

        download = CallGrads.download

        def download_and_tell(self, stages, backend):
            download(self, stages, backend)
            if 0 in stages:
                downloaded.set()

        CallGrads.download = download_and_tell

    both = {}

    def step(last):
        if case.get("held") and not last:
            if not downloaded.wait(timeout=600):
                raise TimeoutError("the next call never downloaded its first stage's sums")
            # Both sets of gradients are alive: the plan's moment (see the module's docstring)
            _libc.malloc_trim(0)
            masters = list(model.optim_parameters())
            pinned = emu.pinned_memory_stats()
            both.update(
                rss=_status("VmRSS") - rss0,
                held={
                    "the step's gradients (the masters' .grad)": _storage_bytes(
                        [m.grad for m in masters]
                    ),
                    "optimizer state": _storage_bytes(
                        [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
                    ),
                    "pinned pool beyond the weights": pinned.allocated_bytes - weights,
                    "freed pinned blocks kept for reuse": pinned.cached_bytes,
                    "emulated devices' live bytes": sum(
                        torch.get_device_module("emu").memory_allocated(d)
                        for d in range(len(plan.devices))
                    ),
                    "malloc in use (growth)": _in_use() - in_use0,
                    # device memory on a GPU: the sources of the downloads not landed yet
                    "of it, the emulator's snapshots of copies in flight": (
                        emu.copies_in_flight_bytes()
                    ),
                },
            )
            # the free memory glibc keeps in the emulator's threads' arenas now
            arenas = {a for name, a in roles.items() if name.startswith(EMULATOR_THREADS)}
            by_arena = arena_bytes(arenas)
            if arenas and all(used is not None for _, used in by_arena.values()):
                kept = sum(resident - used for resident, used in by_arena.values())
                both["held"]["freed memory glibc keeps for the emulator's threads"] = kept
                every = _arena_list(next(a for a in arenas if a)) or []
                others = arena_bytes({0 if a == every[0] else a for a in every} - arenas)
                if all(used is not None for _, used in others.values()):
                    both["held"]["freed memory glibc keeps for the other threads"] = sum(
                        resident - used for resident, used in others.values()
                    )
        opt.step()
        opt.zero_grad()

    for i in range(case["steps"]):
        model.forward_backward(input_kwargs=batch)
        downloaded.clear()  # this call's; the step waits for the next one's
        model.step(lambda last=i == case["steps"] - 1: step(last))
    model.synchronize()
    hook.remove()
    _settle()
    rss1, in_use1, training_peak = _status("VmRSS"), _in_use(), _status("VmHWM")

    box = {}
    roundpipe.optim_thread.launch(lambda: box.update(arena=arena_of_this_thread()))
    roundpipe.optim_thread.synchronize()
    roles["optimizer thread"] = box["arena"]
    roles["main thread"] = 0
    emulator = {name: a for name, a in roles.items() if name.startswith(EMULATOR_THREADS)}
    by_arena = arena_bytes(set(roles.values()))
    retained = None
    if all(by_arena[a][1] is not None for a in set(emulator.values())):
        retained = sum(by_arena[a][0] - by_arena[a][1] for a in set(emulator.values()))

    masters = list(model.optim_parameters())
    pinned = emu.pinned_memory_stats()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    dp_buffers = 0
    if dp is not None:
        dp_buffers = sum(t.untyped_storage().nbytes() for ring in dp._rings.values() for t in ring)
        if dp._reducer is not None:
            dp_buffers += sum(t.untyped_storage().nbytes() for t in dp._reducer._flats.values())
    device = sum(
        torch.get_device_module("emu").memory_allocated(d) for d in range(len(plan.devices))
    )
    held = {
        "master copies": _storage_bytes(masters),
        "gradients of the masters": _storage_bytes([m.grad for m in masters]),
        "optimizer state": _storage_bytes(state),
        "pinned pool beyond the weights": pinned.allocated_bytes - weights,
        "freed pinned blocks kept for reuse": pinned.cached_bytes,
        "data-parallel buffers": dp_buffers,
        "emulated devices' live bytes": device,
    }
    out = {
        "shape": case["shape"],
        "ranks": ranks,
        "sharded": bool(case.get("sharded")),
        "rank": int(os.environ.get("RANK", "0")),
        "numel": numel,
        "weights": weights,
        "plan": plan.host.rows(),
        "planned": plan.host.new_bytes,
        "rss": rss1 - rss0,
        "peak": max(wrapped_peak, training_peak) - rss0,
        "training_peak": training_peak - rss0,
        "both": both.get("rss"),
        "emulated_device": plan.host.emulated_device,
        "both_held": both.get("held", {}),
        "in_use": in_use1 - in_use0,
        "held": held,
        "emulator_retained": retained,
        "plan_text": str(plan),
    }
    if dp is not None:
        dp.close()
        torch.distributed.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


# -- the cases, and the report ------------------------------------------------------------------


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(case, ranks=1):
    port = _free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        if "mmap_threshold" in case:
            env["MALLOC_MMAP_THRESHOLD_"] = str(case["mmap_threshold"])
        if ranks > 1:
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--child", json.dumps({**case, "ranks": ranks})],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=3600)
        if p.returncode:
            raise RuntimeError(f"{case} failed: exit code {p.returncode}")
        line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line.removeprefix("RESULT ")))
    return results


def _mib(n):
    return "-" if n is None else f"{n / 2**20:8.1f}"


def report(r):
    n = r["numel"]
    title = f"{r['shape']}-shaped, {n / 1e6:.2f}M params"
    if r["ranks"] > 1:
        title += f", rank {r['rank']} of {r['ranks']}, " + (
            "sharded" if r["sharded"] else "replicated"
        )
    print(f"\n{title}: MiB (bytes per parameter)")
    for label, nbytes in r["plan"]:
        print(f"  plan: {label:<78} {_mib(nbytes)} ({nbytes / n:5.2f})")
    for label, nbytes in r["held"].items():
        print(f"  held: {label:<78} {_mib(nbytes)} ({nbytes / n:5.2f})")
    held = sum(r["held"].values())
    rows = [
        ("plan: new host memory (all but the weights)", r["planned"]),
        ("held by roundpipe (the storages above)", held),
        ("malloc in use (growth)", r["in_use"]),
        ("RSS growth", r["rss"]),
        ("  of it, freed memory glibc keeps for the emulator's threads", r["emulator_retained"]),
        ("peak RSS growth (VmHWM), the wrap's included", r["peak"]),
        ("peak RSS growth during the iterations (VmHWM reset after the wrap)", r["training_peak"]),
        ("RSS growth with both sets of gradients alive (after malloc_trim)", r["both"]),
    ]
    rows += [(f"    then: {label}", nbytes) for label, nbytes in r["both_held"].items()]
    for label, nbytes in rows:
        per = "" if nbytes is None else f" ({nbytes / n:5.2f})"
        print(f"  {label:<84} {_mib(nbytes)}{per}")
    both = gpu = None
    if r["both"]:  # less what a GPU holds in its own memory
        held = r["both_held"]
        both = r["planned"] / (
            r["both"] - held["of it, the emulator's snapshots of copies in flight"]
        )
        kept = held.get("freed memory glibc keeps for the emulator's threads")
        if kept is not None:
            emulator = (
                held["of it, the emulator's snapshots of copies in flight"]
                + held["emulated devices' live bytes"]
                + kept
            )
            gpu = (r["planned"] - r["emulated_device"]) / (r["both"] - emulator)
    print(
        f"  plan / RSS growth: {r['planned'] / r['rss']:.3f}; plan / peak RSS growth during "
        f"the iterations: {r['planned'] / r['training_peak']:.3f}"
        + (f"; plan / RSS growth with both sets alive, less the copies: {both:.3f}" if both else "")
    )
    if gpu:
        print(
            "  without the emulator (the plan less its emulated devices' term; the RSS with both "
            f"sets alive less the copies in flight, the devices' live bytes and the freed memory "
            f"glibc keeps for their threads): {gpu:.3f}"
        )
    return r["planned"] / r["rss"], r["planned"] / r["training_peak"], both, gpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama,qwen3,qwen3_moe")
    parser.add_argument("--dp", default="llama", help="the shape of the 2-rank runs ('' for none)")
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        help="iterations (the optimizer's state exists from the 2nd)",
    )
    parser.add_argument(
        "--step",
        choices=["held", "free"],
        default="held",
        help="held: each step waits for the next call's last download (a slow step); free: not",
    )
    parser.add_argument("--mmap-threshold", type=int, default=None, help="MALLOC_MMAP_THRESHOLD_")
    parser.add_argument("--plans", action="store_true", help="also print each plan's report")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    import torch
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} CPUs; "
        f"bf16 weights, fp32 masters, roundpipe.optim.AdamW, devices='emu', batch {BATCH} x {SEQ} "
        f"tokens, {NUM_MICROBATCH} microbatches, {args.steps} iterations, each step "
        + ("held until the next call's last download" if args.step == "held" else "free")
        + (
            f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}"
            if args.mmap_threshold is not None
            else ", glibc's default allocator settings"
        )
    )
    ratios = []
    common = {"steps": args.steps, "held": args.step == "held"}
    if args.mmap_threshold is not None:
        common["mmap_threshold"] = args.mmap_threshold
    cases = [({"shape": s, **common}, 1) for s in args.shapes.split(",") if s]
    if args.dp:
        for sharded in (False, True):
            cases.append(({"shape": args.dp, **common, "sharded": sharded}, 2))
    for case, ranks in cases:
        for r in _launch(case, ranks):
            ratios.append(report(r))
            if args.plans:
                print(r["plan_text"])
    after, peak, both, gpu = zip(*ratios)
    print(f"\nplan / RSS growth: {min(after):.3f} to {max(after):.3f}")
    print(f"plan / peak RSS growth during the iterations: {min(peak):.3f} to {max(peak):.3f}")
    if all(both):
        print(
            f"plan / RSS growth with both sets alive, less the copies in flight: "
            f"{min(both):.3f} to {max(both):.3f}"
        )
    if all(gpu):
        print(f"the same without the emulator: {min(gpu):.3f} to {max(gpu):.3f}")


if __name__ == "__main__":
    main()
