"""Static GPU report of every Triton kernel, compiled for real GPUs on a machine without one.

Each codec path (``encode_triton`` / ``decode_triton`` / ``decode_many_triton`` of a kernels
module) is *run* on CPU tensors against a driver that only reports a CUDA target: every
``kernel[grid](...)`` the launcher makes is compiled by Triton exactly as on the GPU (same dtypes,
constexprs, integer and alignment specialisation, warps) and recorded instead of launched. The
torch glue between launches runs on the CPU tensors (on garbage: only shapes matter here).

Per kernel and per path it prints, for sm_80 and sm_90:

* registers per thread, spilled bytes (ptxas stack/local frame), shared memory;
* SASS warp-instructions per value: the SASS of the cubin counted as one pass over every
  instruction (both sides of every branch: an upper bound), plus each loop body (a backward
  branch) ``trips - 1`` more times, ``trips`` from the kernels module's ``REPORT_LOOP_TRIPS``
  (a kernel with an undeclared loop is an error, so no looping kernel is flattered); times
  warps per program times programs, over the shard's values;
* bytes moved per value: every tensor argument the kernel loads from counts its bytes once,
  every one it stores to once more (read and written: twice); the payload counts the wire bytes
  (``--ratio``), not its capacity. Which arguments are loaded or stored is read from the TTIR;
* the H200 ceilings these imply: issue-bound (132 SMs x 4 schedulers x 1.98 GHz warp-instructions
  per second) and bandwidth-bound (4.8 TB/s), in G values/s. Both ignore launch latency,
  occupancy and cache effects: they are upper bounds, not measurements.

``python tools/kernel_report.py`` (markdown on stdout; ``--json FILE`` for machines). The
(codec, dtype, arch) combinations compile in ``--jobs`` processes; ``--count-archs 90`` compiles
every arch but disassembles and counts only sm_90 (the CI test's setting: compile-everything at
half the disassembly).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib
import inspect
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("kernel_report compiles real cubins: run it without TRITON_INTERPRET=1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import ciera.codecs  # noqa: E402,F401  (registers the codecs)
from ciera.codecs.formats import as_bits  # noqa: E402
from ciera.codecs.registry import REGISTRY  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Peak rates of one GPU, for the ceilings."""

    name: str
    """Marketing name."""
    sms: int
    """Streaming multiprocessors."""
    schedulers: int
    """Warp schedulers per SM, each issuing one warp-instruction per cycle."""
    clock_ghz: float
    """Boost clock."""
    hbm_gbs: float
    """DRAM bandwidth, GB/s."""

    @property
    def issue_rate(self) -> float:
        """Warp-instructions per second over the whole GPU."""
        return self.sms * self.schedulers * self.clock_ghz * 1e9


H200 = Gpu("H200 SXM", sms=132, schedulers=4, clock_ghz=1.98, hbm_gbs=4800.0)
ARCHS = (80, 90)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CODECS = ("delta", "exponent_reuse", "delta_ans")
RATIO = {"delta": 0.18, "exponent_reuse": 0.56, "delta_ans": 0.12}
"""Default wire/raw ratios for the payload's traffic (the codecs' targets at lr 1e-4)."""


def _nvidia_tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


# -- recording launches ----------------------------------------------------------------------------
class _TargetOnlyDriver:
    """A driver that reports one CUDA target and nothing else: enough for Triton to compile."""

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self):
        return ("report", self.arch)  # a device cache of its own per arch

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


@dataclasses.dataclass
class Launch:
    """One recorded ``kernel[grid](...)``."""

    name: str
    grid: tuple
    compiled: object
    arguments: dict
    constants: dict


class _GlueCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the torch ops between launches (each a kernel launch on a GPU) and their bytes:
    every tensor input and output, views and metadata-only ops excluded."""

    FREE = {"view", "_unsafe_view", "as_strided", "slice", "select", "expand", "reshape", "alias", "t",
            "unsqueeze", "squeeze", "permute", "detach", "empty", "empty_strided", "lift_fresh", "_to_copy_noop"}

    def __init__(self, launches):
        super().__init__()
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in self.FREE:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if tensors:
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                self.launches.append(Launch(f"torch.{name}", (1,), None, {}, {"bytes": nbytes}))
        return out


@contextlib.contextmanager
def recording(arch: int):
    """Inside: Triton launches compile for ``sm_<arch>`` and are recorded, not run; torch ops
    are recorded with their bytes."""
    launches: list[Launch] = []
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        compiled = original(self, *args, grid=grid, warmup=True, **kwargs)
        bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                                  if k in self.arg_names})
        constants = {p.name: bound.arguments[p.name] for p in self.params if p.is_constexpr
                     and p.name in bound.arguments}
        launches.append(Launch(self.__name__, tuple(grid), compiled, dict(bound.arguments), constants))
        return compiled

    previous = driver._active  # None on a machine without a GPU driver
    driver.set_active(_TargetOnlyDriver(arch))
    JITFunction.run = run
    try:
        with _GlueCounter(launches):
            yield launches
    finally:
        JITFunction.run = original
        driver._active = previous


# -- reading a cubin ------------------------------------------------------------------------------
@dataclasses.dataclass
class KernelStats:
    """What the compiled kernel costs, per program."""

    regs: int
    spill_bytes: int
    shared: int
    static_instructions: int
    dynamic_instructions: float
    """Per warp, one program: every instruction once, loop bodies once per trip."""
    loops: list
    """SASS instructions of each loop body, in address order."""
    ldg_widths: dict


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def _sass(cubin: bytes, disassemble: bool) -> tuple[str, str]:
    """(SASS or "", resource usage) of a cubin, from one cuobjdump run."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        flags = ["-sass", "-res-usage"] if disassemble else ["-res-usage"]
        out = subprocess.run([_nvidia_tool("cuobjdump"), *flags, f.name], capture_output=True, text=True,
                             check=True).stdout
    return (out if disassemble else ""), out


def kernel_stats(launch: Launch, trips_of, count: bool = True) -> KernelStats:
    """Resources and instruction counts of one compiled kernel; ``trips_of(launch)``: trips of
    each of its loops (None: the kernel declares none). ``count=False``: resources only (no
    disassembly; the instruction fields are None)."""
    sass, res = _sass(launch.compiled.asm["cubin"], count)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, shared, local = (int(x) for x in m.groups())
    if not count:
        return KernelStats(regs, stack + local, shared + launch.compiled.metadata.shared, None, None, [], {})
    instr = []  # (address, opcode, operands)
    for line in sass.splitlines():
        mm = _SASS_LINE.search(line)
        if mm:
            instr.append((int(mm.group(1), 16), mm.group(3), mm.group(4)))
    # Drop the trailing self-branch padding after the last EXIT, and NOPs.
    body = [(a, op, rest) for a, op, rest in instr if op != "NOP"]
    while body and body[-1][1] == "BRA" and int(re.search(r"0x([0-9a-f]+)", body[-1][2]).group(1), 16) == body[-1][0]:
        body.pop()
    loops = []
    for a, op, rest in body:
        if op.startswith("BRA") or op.startswith("BRX"):
            t = re.search(r"0x([0-9a-f]+)", rest)
            if t and int(t.group(1), 16) <= a:
                lo = int(t.group(1), 16)
                loops.append((lo, a, sum(1 for b, _, _ in body if lo <= b <= a)))
    dyn = float(len(body))
    if loops:
        trips_all = trips_of(launch)
        if trips_all is None:
            raise RuntimeError(f"{launch.name}: its SASS has {len(loops)} loop(s) but its kernels module declares "
                               "no trip count in REPORT_LOOP_TRIPS")
        if isinstance(trips_all, (list, tuple)) and len(trips_all) != len(loops):
            raise RuntimeError(f"{launch.name}: its SASS has {len(loops)} loop(s), REPORT_LOOP_TRIPS lists "
                               f"{len(trips_all)}")
        for i, (lo, hi, size) in enumerate(loops):
            trips = trips_all[i] if isinstance(trips_all, (list, tuple)) else trips_all
            # Nested loops: an inner body runs trips^depth times.
            depth = sum(1 for lo2, hi2, _ in loops if lo2 <= lo and hi <= hi2)
            dyn += size * (trips ** depth - 1) if depth == 1 else size * (trips ** depth - trips ** (depth - 1))
    widths: dict = {}
    for _, op, _ in body:
        if op.startswith(("LDG", "STG", "ATOMG", "RED")):
            widths[op] = widths.get(op, 0) + 1
    return KernelStats(regs, stack + local, shared + launch.compiled.metadata.shared, len(body), dyn,
                       [size for _, _, size in loops], widths)


_ACCESS = re.compile(r"(tt\.load|tt\.store|tt\.atomic_rmw|tt\.atomic_cas)\s+(?:\w+,\s*)*%([\w.]+)")
_DEF = re.compile(r"^\s*%([\w.]+)(?::\d+)?\s*=\s*([\w.]+)\s*(.*)$")
_PTR_OPS = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "tt.trans", "ttg.convert_layout",
            "tt.addptr", "arith.select")


def argument_access(ttir: str) -> dict[str, str]:
    """``{parameter: 'r' | 'w' | 'rw'}`` for every pointer parameter the kernel loads / stores."""
    header = re.search(r"tt\.func public @\w+\((.*?)\)\s*(attributes|\{)", ttir, re.S).group(1)
    params = set(re.findall(r"%([\w.]+): !tt\.ptr", header))
    sources: dict[str, list[str]] = {}
    for line in ttir.splitlines():
        d = _DEF.match(line)
        if d and d.group(2) in _PTR_OPS:
            ops = re.findall(r"%([\w.]+)", d.group(3).split(":")[0])
            if d.group(2) == "tt.addptr":
                ops = ops[:1]
            elif d.group(2) == "arith.select":
                ops = ops[1:3]
            sources[d.group(1)] = ops

    def roots(name, seen=()):
        if name in params:
            return {name}
        if name in seen or name not in sources:
            return set()
        return set().union(*(roots(s, seen + (name,)) for s in sources[name]))

    access: dict[str, set] = {}
    for line in ttir.splitlines():
        for op, ptr in _ACCESS.findall(line):
            mode = {"tt.load": "r", "tt.store": "w"}.get(op, "rw")
            for p in roots(ptr):
                access.setdefault(p, set()).update(mode)
    return {p: "".join(sorted(m, key="rw".index)) for p, m in access.items()}


# -- paths -----------------------------------------------------------------------------------------
def _loop_trips(module):
    declared = getattr(module, "REPORT_LOOP_TRIPS", {})

    def trips_of(launch):
        t = declared.get(launch.name)
        return t(launch.constants) if callable(t) else t
    return trips_of


def minimal_bytes(codec: str, path: str, itemsize: int, wire: float) -> tuple[float, float, str]:
    """(one-pass minimum, the format's minimum, which) DRAM bytes per value on this path, ``wire``
    the payload's bytes per value.

    One pass: every input read once, every output written once. delta's encoder cannot pack a
    value before the width table is known, and the table needs a histogram of the whole shard:
    any implementation of this format reads (new, previous) twice, so its format minimum is the
    two-pass one (a format that froze the table one step earlier would not). delta_ans likewise
    (its frequency tables are the whole shard's histogram). Every other path has format minimum =
    one-pass minimum."""
    if codec in ("delta", "delta_ans"):
        if path == "encode":  # read new + previous (twice for the format), write the state (= new), the payload
            return 3 * itemsize + wire, 5 * itemsize + wire, "2 reads of new+prev, state + payload written"
        return 2 * itemsize + wire, 2 * itemsize + wire, "previous read, values + payload: read/written once"
    if path == "encode":  # read new + previous exponents (1 B), write the state (1 B) and the payload
        return itemsize + 2 + wire, itemsize + 2 + wire, "new + state (1 B) read, state + payload written"
    return 2 * itemsize + wire, 2 * itemsize + wire, "previous read, values + payload: read/written once"


def wire_bytes(codec, ratio: float) -> float:
    """Payload bytes of one shard at wire/raw ``ratio``: the ratio already counts every section
    (exponent_reuse's sign|mantissa bytes too), never less than the fixed sections."""
    return max(ratio * codec.numel * codec.fmt.itemsize, codec.fixed_bytes)


def run_path(codec_name: str, dtype: torch.dtype, arch: int, numel: int, ratio: float, world: int,
             count: bool = True):
    """Record every launch of the encode, decode and batched decode of one codec and dtype
    (``count=False``: compile and read resources, but do not disassemble and count)."""
    cls = REGISTRY.get(codec_name)
    codec = cls(dtype=dtype, numel=numel, backend="triton")
    module = importlib.import_module(cls.kernels)
    shard = torch.zeros(numel, dtype=dtype)
    state = codec.new_state(shard=shard)
    cap = codec.clamp_capacity(codec.max_bytes)
    out = torch.zeros(cap, dtype=torch.uint8)
    wire = wire_bytes(codec, ratio)

    def steady(call):
        """Launches of the second call: scratch that a launcher allocates once is not counted."""
        with recording(arch):
            call()
        with recording(arch) as rec:
            call()
        return rec

    paths = {}
    rec = steady(lambda: module.encode_triton(layout=codec.layout, shard_bits=as_bits(shard), state=state, out=out))
    paths["encode"] = (rec, {id(out): wire}, numel)
    target = torch.zeros(numel, dtype=dtype)
    rec = steady(lambda: module.decode_triton(layout=codec.layout, payload=out, target_bits=as_bits(target)))
    paths["decode"] = (rec, {id(out): wire}, numel)
    if hasattr(module, "decode_many_triton") and world > 1:
        k = world - 1
        payloads = torch.zeros(k * cap, dtype=torch.uint8)
        rows = torch.arange(1, world, dtype=torch.int64)
        offsets = torch.arange(k, dtype=torch.int64) * cap
        targets = torch.zeros(world, numel, dtype=dtype)
        targets = as_bits(targets)  # the very tensor the kernel gets: its id keys the rows-only count
        rec = steady(lambda: module.decode_many_triton(layout=codec.layout, payloads=payloads, rows=rows,
                                                       offsets=offsets, targets_bits=targets))
        paths[f"decode_many(k={k})"] = (rec, {id(payloads): wire * k, id(targets): 2 * k * numel * codec.fmt.itemsize},
                                        k * numel)
    rows = []
    for path, (launches, special, values) in paths.items():
        for launch in launches:
            if launch.compiled is None:  # torch glue
                rows.append(dict(
                    codec=codec_name, dtype=str(dtype).replace("torch.", ""), arch=f"sm_{arch}", path=path,
                    kernel=launch.name, grid=1, warps=0, values_per_program=values, regs=0, spill_bytes=0,
                    shared=0, loops=0, sass_static=0, sass_per_program=0, instr_per_value=0.0,
                    bytes_per_value=launch.constants["bytes"] / values, access={}, mem_ops={}))
                continue
            st = kernel_stats(launch, _loop_trips(module), count)
            access = argument_access(launch.compiled.asm["ttir"])
            nbytes = 0.0
            for name, mode in access.items():
                t = launch.arguments.get(name)
                if isinstance(t, torch.Tensor):
                    size = special.get(id(t), t.numel() * t.element_size())
                    # a bucket of targets: only the decoded rows are touched (counted above, r+w)
                    nbytes += size if id(t) in special and t.dim() == 2 else size * len(mode)
            programs = math.prod(launch.grid)
            warps = launch.compiled.metadata.num_warps
            rows.append(dict(
                codec=codec_name, dtype=str(dtype).replace("torch.", ""), arch=f"sm_{arch}", path=path,
                kernel=launch.name, grid=programs, warps=warps, values_per_program=values / programs,
                regs=st.regs, spill_bytes=st.spill_bytes, shared=st.shared, loops=len(st.loops), loop_bodies=st.loops,
                sass_static=st.static_instructions,
                sass_per_program=None if st.dynamic_instructions is None else st.dynamic_instructions * warps,
                instr_per_value=None if st.dynamic_instructions is None else
                st.dynamic_instructions * warps * programs / values,
                bytes_per_value=nbytes / values, access=access, mem_ops=st.ldg_widths))
    for r in rows:
        r["wire_per_value"] = wire / numel
    return rows


def summarise(rows, itemsize_of, ratio_of):
    """Per (codec, dtype, arch, path): launches, totals and the H200 ceilings."""
    out = {}
    for r in rows:
        key = (r["codec"], r["dtype"], r["arch"], r["path"])
        s = out.setdefault(key, dict(launches=0, torch_ops=0, instr_per_value=0.0, bytes_per_value=0.0,
                                     glue_bytes_per_value=0.0, spills=0, max_regs=0))
        s["launches"] += 1
        if r["kernel"].startswith("torch."):
            s["torch_ops"] += 1
            s["glue_bytes_per_value"] += r["bytes_per_value"]
        s["instr_per_value"] = None if s["instr_per_value"] is None or r["instr_per_value"] is None else \
            s["instr_per_value"] + r["instr_per_value"]
        s["bytes_per_value"] += r["bytes_per_value"]
        s["spills"] = max(s["spills"], r["spill_bytes"])
        s["max_regs"] = max(s["max_regs"], r["regs"])
        s["wire_per_value"] = r["wire_per_value"]
    for (codec, dtype, arch, path), s in out.items():
        s["issue_gvals"] = None if s["instr_per_value"] is None else H200.issue_rate / s["instr_per_value"] / 1e9
        s["bw_gvals"] = H200.hbm_gbs / s["bytes_per_value"]
        s["min_bytes"], s["format_min_bytes"], s["min_which"] = minimal_bytes(
            codec, path.split("(")[0].replace("decode_many", "decode"), itemsize_of[dtype], s["wire_per_value"])
        s["bytes_vs_min"] = s["bytes_per_value"] / s["min_bytes"]
        s["bytes_vs_format_min"] = s["bytes_per_value"] / s["format_min_bytes"]
        s["ceiling_gbs"] = min(s["issue_gvals"] or math.inf, s["bw_gvals"]) * itemsize_of[dtype]
    return out


def _num(x, digits: int) -> str:
    """``x`` to ``digits`` decimals; "not counted" for an arch the run did not disassemble."""
    return "not counted" if x is None else f"{x:.{digits}f}"


def markdown(rows, summary, args) -> str:
    lines = [f"Static estimates, not measurements: `python tools/kernel_report.py --numel {args.numel}` "
             f"(wire ratios {args.ratio_delta} delta, {args.ratio_er} exponent_reuse, {args.ratio_ans} delta_ans; {H200.name}: "
             f"{H200.sms} SMs x {H200.schedulers} x {H200.clock_ghz} GHz, {H200.hbm_gbs / 1000:.1f} TB/s).", "",
             "### Per path (sm_90, all launches of the path together)", "",
             "| codec | dtype | path | launches (torch ops) | SASS warp-instr/value | bytes/value | one-pass min | "
             "vs one-pass | format min | vs format min | issue-bound Gval/s | bandwidth-bound Gval/s | ceiling GB/s | "
             "max regs | spills |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (codec, dtype, arch, path), s in sorted(summary.items()):
        if arch != "sm_90":
            continue
        lines.append(f"| {codec} | {dtype} | {path} | {s['launches']} ({s['torch_ops']}) | {_num(s['instr_per_value'], 2)} | "
                     f"{s['bytes_per_value']:.2f} | {s['min_bytes']:.2f} | {s['bytes_vs_min']:.2f}x | "
                     f"{s['format_min_bytes']:.2f} | {s['bytes_vs_format_min']:.2f}x | {_num(s['issue_gvals'], 0)} | {s['bw_gvals']:.0f} | {s['ceiling_gbs']:.0f} | {s['max_regs']} | "
                     f"{s['spills']} |")
    lines += ["", "SASS warp-instructions count the Triton kernels only (torch ops between them: their bytes "
              "count, their instructions do not). Bytes: each tensor a kernel loads from or stores to, once "
              "per direction (the payload: its wire bytes, ratio x raw, at least its fixed sections), plus the "
              "inputs and outputs of every torch op (steady state: a warm-up call first, so scratch allocated once "
              "is not counted).",
              "*One-pass min*: every input read once and every output written once (delta encode: new + previous "
              "read, state + payload written; exponent_reuse encode: new + previous exponents (1 B) read, state "
              "(1 B) + payload written; decodes: previous values read, new values + payload read/written once). "
              "*Format min*: the same, except delta and delta_ans encode, which must read new + previous twice (the "
              "width or frequency tables are a histogram of the whole shard and must be known before any value is "
              "coded).",
              "", "### Per kernel (sm_80 and sm_90)", "",
              "| codec | dtype | arch | path | kernel | programs | warps | values/program | regs | spill B | "
              "smem B | loops | SASS/program | warp-instr/value | bytes/value |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    glue: dict = {}
    for r in rows:
        if r["kernel"].startswith("torch."):
            g = glue.setdefault((r["codec"], r["dtype"], r["arch"], r["path"]), [0, 0.0])
            g[0] += 1
            g[1] += r["bytes_per_value"]
            continue
        lines.append(f"| {r['codec']} | {r['dtype']} | {r['arch']} | {r['path']} | `{r['kernel']}` | {r['grid']} | "
                     f"{r['warps']} | {r['values_per_program']:.0f} | {r['regs']} | {r['spill_bytes']} | "
                     f"{r['shared']} | {r['loops']} | {_num(r['sass_per_program'], 0)} | {_num(r['instr_per_value'], 2)} | "
                     f"{r['bytes_per_value']:.2f} |")
    for (codec, dtype, arch, path), (ops, b) in glue.items():
        lines.append(f"| {codec} | {dtype} | {arch} | {path} | torch glue ({ops} ops) | | | | | | | | | | {b:.2f} |")
    return "\n".join(lines) + "\n"


def _run_task(task) -> list:
    codec, dname, arch, numel, ratio, world, count = task
    torch.set_num_threads(1)  # the torch glue is tiny; the processes share the cores
    return run_path(codec, DTYPES[dname], arch, numel, ratio, world, count)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1 << 22, help="values of the shard every path is compiled for")
    p.add_argument("--world", type=int, default=8, help="ranks; decode_many decodes world - 1 shards")
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--archs", nargs="+", type=int, default=list(ARCHS))
    p.add_argument("--ratio-delta", type=float, default=RATIO["delta"])
    p.add_argument("--ratio-er", type=float, default=RATIO["exponent_reuse"])
    p.add_argument("--ratio-ans", type=float, default=RATIO["delta_ans"])
    p.add_argument("--json", type=Path, help="write rows and summary here")
    p.add_argument("--count-archs", nargs="+", type=int, default=None,
                   help="archs whose SASS is disassembled and counted (default: all of --archs); the others "
                        "are compiled and their registers, spills and shared memory read, nothing more")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="processes compiling (codec, dtype, arch) combinations side by side")
    args = p.parse_args(argv)
    ratio_of = {"delta": args.ratio_delta, "exponent_reuse": args.ratio_er, "delta_ans": args.ratio_ans}
    counted = set(args.archs if args.count_archs is None else args.count_archs)
    tasks = [(codec, dname, arch, args.numel, ratio_of[codec], args.world, arch in counted)
             for codec in args.codecs for dname in args.dtypes for arch in args.archs]
    rows = []
    if args.jobs > 1 and len(tasks) > 1:
        # spawn: a fresh interpreter per worker (no fork of a process holding torch's thread pools)
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(args.jobs, len(tasks)), mp_context=ctx) as pool:
            for part in pool.map(_run_task, tasks):
                rows += part
    else:
        for task in tasks:
            rows += _run_task(task)
    itemsize_of = {str(d).replace("torch.", ""): d.itemsize for d in DTYPES.values()}
    summary = summarise(rows, itemsize_of, ratio_of)
    print(markdown(rows, summary, args))
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows, summary={"|".join(k): v for k, v in summary.items()}),
                                        indent=1, default=str))


if __name__ == "__main__":
    main()
